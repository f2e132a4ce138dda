"""`effectmq scheduler ...`: run schedulers and manage schedules from the shell.

    effectmq scheduler add reports/nightly --queue reports --cron "0 2 * * *" \\
        --timezone Europe/Berlin --task send_report --payload '{"kind": "daily"}'
    effectmq scheduler run            # until SIGTERM / SIGINT
    effectmq scheduler list | status ID | tick | suspend ID | resume ID | remove ID

Options also read EFFECTMQ_REDIS_URL (or EFFECTMQ_REDIS_URL_FILE), EFFECTMQ_PREFIX,
EFFECTMQ_SCHEDULER_NAMESPACE and EFFECTMQ_SCHEDULER_INTERVAL.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
from typing import Any, Callable

from .model import ScheduleSpec, ScheduleStatus, TickReport
from .policy import MISSED_MODES
from .scheduler import Scheduler
from ..clitools import URL_HELP, emit, env

log = logging.getLogger("effectmq.scheduler")


def _scheduler(args) -> Scheduler:
    return Scheduler(args.url, namespace=args.namespace, prefix=args.prefix, batch=getattr(args, "batch", 500))


def _when(value: str | None) -> str:
    return value or "-"


def _human_status(s: dict) -> str:
    spec = s["spec"] or {}
    rows = [
        ("schedule", s["id"]), ("queue", spec.get("queue", "?")), ("task", spec.get("task", "?")),
        ("cron", f"{spec.get('cron', '?')} ({spec.get('timezone', '?')})"),
        ("missed ticks", spec.get("missed", "?")), ("suspended", s["suspended"]),
        ("next tick", _when(s["next_tick"])), ("last tick", _when(s["last_tick"])),
        ("last task id", _when(s["last_task_id"])), ("materialized", s["materialized"]),
        ("skipped", s["skipped"]), ("coalesced", s["coalesced"]), ("backfilled", s["backfilled"]),
        ("last error", _when(s["last_error"])),
    ]
    return "\n".join(f"{k:>14}: {v}" for k, v in rows)


def _human_list(rows: list[dict]) -> str:
    if not rows:
        return "no schedules"
    out = [f"{'SCHEDULE':<32} {'QUEUE':<16} {'CRON':<20} {'NEXT TICK':<21} {'LAST TICK':<21} STATE"]
    for s in rows:
        spec = s["spec"] or {}
        state = "error: " + s["last_error"] if s["last_error"] else "suspended" if s["suspended"] else "ok"
        out.append(f"{s['id']:<32} {spec.get('queue', '?'):<16} {spec.get('cron', '?'):<20} "
                   f"{_when(s['next_tick']):<21} {_when(s['last_tick']):<21} {state}")
    return "\n".join(out)


def _human_report(r: dict) -> str:
    lines = [f"{m['tick']} {m['task_id']} ({'created' if m['created'] else 'already known'})"
             for m in r["materialized"]]
    lines += [f"error: {k}: {v}" for k, v in r["errors"].items()]
    return "\n".join(lines) or f"nothing due (next: {_when(r['next_due'])})"


# -- commands ---------------------------------------------------------------------

async def cmd_add(args) -> int:
    try:
        payload = json.loads(args.payload) if args.payload is not None else None
    except ValueError as exc:
        print(f"effectmq: --payload is not valid JSON: {exc}", file=sys.stderr)
        return 2
    spec = ScheduleSpec(
        id=args.id, queue=args.queue, cron=args.cron, task=args.task, payload=payload, timezone=args.timezone,
        priority=args.priority, max_retries=args.max_retries, max_stalled_count=args.max_stalled_count,
        timeout=args.timeout, delay=args.delay, missed=args.missed, max_backfill=args.max_backfill,
        starting_deadline=args.starting_deadline, missed_after=args.missed_after, suspend=args.suspend,
    )
    async with _scheduler(args) as scheduler:
        status = await scheduler.put(spec)
    emit(args, status.to_json(), _human_status)
    return 0


async def cmd_remove(args) -> int:
    async with _scheduler(args) as scheduler:
        removed = await scheduler.remove(args.id)
    emit(args, {"id": args.id, "removed": removed},
          lambda v: f"removed {v['id']}" if v["removed"] else f"no schedule {v['id']!r}")
    return 0 if removed else 1


async def _show_status(args, status: ScheduleStatus | None) -> int:
    if status is None:
        print(f"effectmq: no schedule {args.id!r} in namespace {args.namespace!r}", file=sys.stderr)
        return 1
    emit(args, status.to_json(), _human_status)
    return 0


async def cmd_status(args) -> int:
    async with _scheduler(args) as scheduler:
        status = await scheduler.status(args.id)
    return await _show_status(args, status)


def _set_suspend(value: bool) -> Callable:
    async def run(args) -> int:
        async with _scheduler(args) as scheduler:
            status = await scheduler.status(args.id)
            if status is not None and status.spec is not None:
                status = await scheduler.put(dataclasses.replace(status.spec, suspend=value))
        return await _show_status(args, status)
    return run


async def cmd_list(args) -> int:
    async with _scheduler(args) as scheduler:
        statuses = await scheduler.list(limit=args.limit)
    emit(args, [s.to_json() for s in statuses], _human_list)
    return 0


async def cmd_tick(args) -> int:
    async with _scheduler(args) as scheduler:
        report = await scheduler.tick()
    emit(args, report.to_json(), _human_report)
    return 1 if report.errors else 0


async def serve(scheduler: Scheduler, *, interval: float, on_pass: Callable[[TickReport], Any] | None = None) -> None:
    """Run passes until SIGTERM or SIGINT; the pass in progress finishes first."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await scheduler.run(interval=interval, stop=stop, on_pass=on_pass)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def cmd_run(args) -> int:
    def on_pass(report: TickReport) -> None:
        if report.materialized or report.errors:
            if args.json:
                print(json.dumps(report.to_json()), flush=True)
            else:
                log.info("%d ticks offered (%d new), %d errors", len(report.materialized), report.created,
                         len(report.errors))

    async with _scheduler(args) as scheduler:
        await scheduler.ping()  # fail fast when Redis is unreachable
        log.info("scheduler running at %s (namespace %r, interval %.2fs)", scheduler.url, args.namespace,
                 args.interval)
        await serve(scheduler, interval=args.interval, on_pass=on_pass)
    log.info("scheduler stopped")
    return 0


# -- parser -----------------------------------------------------------------------

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help=URL_HELP)
    p.add_argument("--namespace", "-n", default=env("EFFECTMQ_SCHEDULER_NAMESPACE", "default"),
                   help="scheduler namespace [EFFECTMQ_SCHEDULER_NAMESPACE]")
    p.add_argument("--prefix", default=env("EFFECTMQ_PREFIX", "emq"), help="key prefix [EFFECTMQ_PREFIX]")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--log-level", default=env("EFFECTMQ_LOG_LEVEL", "INFO"), help="[EFFECTMQ_LOG_LEVEL]")


def _optional(cast: Callable) -> Callable:
    return lambda value: None if value.lower() in ("", "none") else cast(value)


def register(subparsers) -> None:
    """Add `effectmq scheduler ...` to the main command's subparsers."""
    top = subparsers.add_parser("scheduler", help="cron schedules that offer tasks",
                                description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="scheduler_command", required=True)

    run = sub.add_parser("run", help="materialize due ticks until SIGTERM/SIGINT")
    _common(run)
    run.add_argument("--interval", type=float, default=float(env("EFFECTMQ_SCHEDULER_INTERVAL", 1.0)),
                     help="seconds between passes at most; passes also wake at each next tick "
                          "[EFFECTMQ_SCHEDULER_INTERVAL]")
    run.add_argument("--batch", type=int, default=500, help="schedules read per round trip")
    run.set_defaults(run=cmd_run)

    tick = sub.add_parser("tick", help="run one pass and print what it offered")
    _common(tick)
    tick.set_defaults(run=cmd_tick)

    add = sub.add_parser("add", help="create or replace a schedule")
    add.add_argument("id", help="schedule id, e.g. reports/nightly (tick task ids are <id>/<UTC instant>)")
    add.add_argument("--queue", "-q", required=True)
    add.add_argument("--cron", required=True, help="5 fields, 6 with seconds first, or @hourly, @daily, ...")
    add.add_argument("--task", required=True, help="task name the workers handle")
    add.add_argument("--payload", help="JSON object passed to the task (plus 'tick')")
    add.add_argument("--timezone", "--tz", default="UTC", help="IANA zone, e.g. Europe/Berlin")
    add.add_argument("--priority", type=int, default=0)
    add.add_argument("--max-retries", type=int)
    add.add_argument("--max-stalled-count", type=int)
    add.add_argument("--timeout", type=float, help="handler time limit, seconds")
    add.add_argument("--delay", type=float, help="tasks become ready this many seconds after their tick")
    add.add_argument("--missed", choices=MISSED_MODES, default="coalesce", help="what to do with missed ticks")
    add.add_argument("--max-backfill", type=int, default=10)
    add.add_argument("--starting-deadline", type=_optional(float), help="seconds; older ticks never run")
    add.add_argument("--missed-after", type=float, default=60.0,
                     help="seconds late before a tick counts as missed: the grace for a restart "
                          "(ticks due while suspended are missed whatever their age)")
    add.add_argument("--suspend", action="store_true")
    _common(add)
    add.set_defaults(run=cmd_add)

    for name, handler, help_text in (
        ("status", cmd_status, "show one schedule"),
        ("remove", cmd_remove, "delete a schedule (its tasks stay)"),
        ("suspend", _set_suspend(True), "stop materializing a schedule's ticks"),
        ("resume", _set_suspend(False), "resume a schedule (missed ticks follow its policy)"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("id")
        _common(p)
        p.set_defaults(run=handler)

    ls = sub.add_parser("list", help="list schedules")
    ls.add_argument("--limit", type=int, default=1000)
    _common(ls)
    ls.set_defaults(run=cmd_list)
