"""`effectmq scheduler ...`: run schedulers and manage schedules from the shell.

    effectmq scheduler add reports/nightly --queue reports --cron "0 2 * * *" \\
        --timezone Europe/Berlin --task send_report --payload '{"kind": "daily"}'
    effectmq scheduler run            # until SIGTERM / SIGINT
    effectmq scheduler list | status ID | tick | suspend ID | resume ID | remove ID

Schedules live in scheduler namespaces: those made here in `default` unless
--scheduler-namespace says otherwise, the operator's in its own, `effectmq local`'s in
its own. `list` shows every namespace found, and `status`, `suspend`, `resume` and
`remove` find a schedule in whichever holds it; `add`, `run` and `tick` use one.

Options also read EFFECTMQ_REDIS_URL (or EFFECTMQ_REDIS_URL_FILE), EFFECTMQ_PREFIX,
EFFECTMQ_SCHEDULER_NAMESPACE and EFFECTMQ_SCHEDULER_INTERVAL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
from typing import Any, AsyncIterator, Callable

from ..clitools import FAILED, URL_HELP, BadSetting, CommandError, deprecated, emit, env, log_level_option
from ..transport.connection import RedisErrors
from .model import ScheduleSpec, ScheduleStatus, TickReport
from .policy import MISSED_MODES
from .scheduler import Scheduler
from .store import DEFAULT_NAMESPACE, discover_scheduler_namespaces

log = logging.getLogger("effectmq.scheduler")

# How a Schedule resource spells the missed-tick modes (missedTicks: Skip); stored in lower case.
MISSED_SHOWN = {mode: mode.capitalize() for mode in MISSED_MODES}


def missed_mode(value: str) -> str:
    """--missed: the CRD's spelling (Skip), or any other case of it."""
    if value.lower() not in MISSED_MODES:
        raise BadSetting(f"must be {', '.join(list(MISSED_SHOWN.values())[:-1])} or "
                         f"{list(MISSED_SHOWN.values())[-1]}, got {value!r}")
    return value.lower()


def _scheduler(args, namespace: str) -> Scheduler:
    return Scheduler(args.url, namespace=namespace, prefix=args.prefix, batch=getattr(args, "batch", 500))


def _written(args) -> str:
    """The namespace `add`, `run` and `tick` use: the one given, else the default."""
    return args.scheduler_namespace or DEFAULT_NAMESPACE


@contextlib.asynccontextmanager
async def _namespaces(args) -> AsyncIterator[list[Scheduler]]:
    """A scheduler for the namespace given, else for each namespace that holds a schedule."""
    async with _scheduler(args, _written(args)) as first:
        if args.scheduler_namespace:
            yield [first]
            return
        with RedisErrors(first.redis, f"at {first.url} (scheduler namespaces)"):
            names = await discover_scheduler_namespaces(first.redis, args.prefix)
        found = [Scheduler(first.redis, namespace=n, prefix=args.prefix, url=first.url) for n in names]
        try:
            yield found
        finally:
            for scheduler in found:
                await scheduler.close()


@contextlib.asynccontextmanager
async def _holder(args) -> AsyncIterator[tuple[Scheduler, ScheduleStatus]]:
    """The scheduler whose namespace holds schedule `args.id`, and its status."""
    async with _namespaces(args) as schedulers:
        held = [(s, status) for s in schedulers if (status := await s.status(args.id)) is not None]
        if not held:
            searched = ", ".join(s.namespace for s in schedulers) or "none found"
            where = (f"scheduler namespace {args.scheduler_namespace!r}" if args.scheduler_namespace
                     else f"any scheduler namespace ({searched})")
            raise CommandError(f"no schedule {args.id!r} in {where}", FAILED)
        if len(held) > 1:
            raise CommandError(f"schedule {args.id!r} is in scheduler namespaces "
                               f"{', '.join(s.namespace for s, _ in held)}: give --scheduler-namespace")
        yield held[0]


def _with_namespace(namespace: str, status: ScheduleStatus) -> dict:
    return {"namespace": namespace, **status.to_json()}


def _when(value: str | None) -> str:
    return value or "-"


def _human_status(s: dict) -> str:
    spec = s["spec"] or {}
    rows = [
        ("schedule", s["id"]), ("namespace", s["namespace"]), ("queue", spec.get("queue", "?")),
        ("task", spec.get("task", "?")), ("cron", f"{spec.get('cron', '?')} ({spec.get('timezone', '?')})"),
        ("missed ticks", MISSED_SHOWN.get(spec.get("missed") or "", "?")), ("suspended", s["suspended"]),
        ("next tick", _when(s["next_tick"])), ("last tick", _when(s["last_tick"])),
        ("last task id", _when(s["last_task_id"])), ("materialized", s["materialized"]),
        ("skipped", s["skipped"]), ("coalesced", s["coalesced"]), ("backfilled", s["backfilled"]),
        ("last error", _when(s["last_error"])),
    ]
    return "\n".join(f"{k:>14}: {v}" for k, v in rows)


def _human_list(rows: list[dict]) -> str:
    if not rows:
        return "no schedules"
    out = [f"{'NAMESPACE':<12} {'SCHEDULE':<32} {'QUEUE':<16} {'CRON':<20} {'NEXT TICK':<21} {'LAST TICK':<21} STATE"]
    for s in rows:
        spec = s["spec"] or {}
        state = "error: " + s["last_error"] if s["last_error"] else "suspended" if s["suspended"] else "ok"
        out.append(f"{s['namespace']:<12} {s['id']:<32} {spec.get('queue', '?'):<16} {spec.get('cron', '?'):<20} "
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
        raise CommandError(f"--payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise CommandError("--payload is nested too deep to decode") from None
    spec = ScheduleSpec(
        id=args.id, queue=args.queue, cron=args.cron, task=args.task, payload=payload, timezone=args.timezone,
        priority=args.priority, max_retries=args.max_retries, max_stalled_count=args.max_stalled_count,
        timeout=args.timeout, delay=args.delay, missed=args.missed, max_backfill=args.max_backfill,
        starting_deadline=args.starting_deadline, missed_after=args.missed_after, suspend=args.suspend,
        group=args.group,
    )
    async with _scheduler(args, _written(args)) as scheduler:
        status = await scheduler.put(spec)
    emit(args, _with_namespace(scheduler.namespace, status), _human_status)
    return 0


async def cmd_remove(args) -> int:
    async with _holder(args) as (scheduler, _):
        removed = await scheduler.remove(args.id)
    emit(args, {"id": args.id, "removed": removed}, lambda v: f"removed {v['id']} ({scheduler.namespace})")
    return 0 if removed else FAILED


async def cmd_status(args) -> int:
    async with _holder(args) as (scheduler, status):
        emit(args, _with_namespace(scheduler.namespace, status), _human_status)
    return 0


def _set_suspend(value: bool) -> Callable:
    async def run(args) -> int:
        async with _holder(args) as (scheduler, status):
            if status.spec is None:
                raise CommandError(f"schedule {args.id!r} has an unreadable definition: {status.last_error}",
                                   FAILED)
            status = await scheduler.put(dataclasses.replace(status.spec, suspend=value))
            emit(args, _with_namespace(scheduler.namespace, status), _human_status)
        return 0
    return run


async def cmd_list(args) -> int:
    rows: list[dict] = []
    async with _namespaces(args) as schedulers:
        for scheduler in schedulers:
            statuses = await scheduler.list(limit=args.limit - len(rows))
            rows += [_with_namespace(scheduler.namespace, s) for s in statuses]
            if len(rows) >= args.limit:
                break
    emit(args, rows, _human_list)
    return 0


async def cmd_tick(args) -> int:
    async with _scheduler(args, _written(args)) as scheduler:
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

    async with _scheduler(args, _written(args)) as scheduler:
        await scheduler.ping()  # fail fast when Redis is unreachable
        log.info("scheduler running at %s (scheduler namespace %r, interval %.2fs)", scheduler.url,
                 scheduler.namespace, args.interval)
        await serve(scheduler, interval=args.interval, on_pass=on_pass)
    log.info("scheduler stopped")
    return 0


# -- parser -----------------------------------------------------------------------

def _common(p: argparse.ArgumentParser, *, finds: bool) -> None:
    p.add_argument("--url", help=URL_HELP)
    if finds:
        namespace_help = ("the scheduler namespace to look in; default: every namespace that holds a schedule "
                          "(docs/cli.md, Scheduler namespaces)")
    else:
        namespace_help = f"the scheduler namespace to use; default: {DEFAULT_NAMESPACE}"
    p.add_argument("--scheduler-namespace", default=env("EFFECTMQ_SCHEDULER_NAMESPACE"),
                   help=namespace_help + " [EFFECTMQ_SCHEDULER_NAMESPACE]")
    deprecated(p, "--namespace", "-n", replacement="--scheduler-namespace", dest="scheduler_namespace")
    p.add_argument("--prefix", default=env("EFFECTMQ_PREFIX", "emq"), help="key prefix in Redis [EFFECTMQ_PREFIX]")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    log_level_option(p)


def _optional(cast: Callable) -> Callable:
    return lambda value: None if value.lower() in ("", "none") else cast(value)


def register(subparsers) -> None:
    """Add `effectmq scheduler ...` to the main command's subparsers."""
    top = subparsers.add_parser("scheduler", help="cron schedules that offer tasks",
                                description=__doc__.split("\n\n")[0])
    sub = top.add_subparsers(dest="scheduler_command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="materialize due ticks until SIGTERM/SIGINT")
    _common(run, finds=False)
    run.add_argument("--interval", type=float, default=env("EFFECTMQ_SCHEDULER_INTERVAL", 1.0, float),
                     help="seconds between passes at most; passes also wake at each next tick "
                          "[EFFECTMQ_SCHEDULER_INTERVAL]")
    run.add_argument("--batch", type=int, default=500, help="schedules read per round trip")
    run.set_defaults(run=cmd_run)

    tick = sub.add_parser("tick", help="run one pass and print what it offered")
    _common(tick, finds=False)
    tick.set_defaults(run=cmd_tick)

    add = sub.add_parser("add", help="create or replace a schedule")
    add.add_argument("id", help="schedule id, e.g. reports/nightly (tick task ids are <id>/<UTC instant>)")
    add.add_argument("--queue", "-q", required=True, help="the queue that receives the tasks")
    add.add_argument("--cron", required=True, help="5 fields, 6 with seconds first, or @hourly, @daily, ...")
    add.add_argument("--task", required=True, help="task name the workers handle")
    add.add_argument("--payload", help="JSON object passed to the task (plus 'tick'); default: none")
    add.add_argument("--timezone", "--tz", default="UTC", help="IANA zone, e.g. Europe/Berlin")
    add.add_argument("--priority", type=int, default=0, help="the tasks' priority, -1000 to 1000")
    add.add_argument("--group", help="the tasks' group (groups take turns); default: none")
    add.add_argument("--max-retries", type=int, help="the tasks' retries; default: the queue's")
    add.add_argument("--max-stalled-count", type=int, help="the tasks' stalls allowed; default: the queue's")
    add.add_argument("--timeout", type=float, help="handler time limit, seconds; default: none")
    add.add_argument("--delay", type=float, help="tasks become ready this many seconds after their tick; default: 0")
    add.add_argument("--missed", type=missed_mode, default=MISSED_SHOWN["coalesce"],
                     metavar="{" + ",".join(MISSED_SHOWN.values()) + "}",
                     help="what to do with missed ticks, as a Schedule's missedTicks (any case): Skip to the next "
                     "future tick, Coalesce into one task for the latest, Backfill the latest --max-backfill")
    add.add_argument("--max-backfill", type=int, default=10, help="how many missed ticks Backfill offers")
    add.add_argument("--starting-deadline", type=_optional(float),
                     help="seconds; older ticks never run; default: none")
    add.add_argument("--missed-after", type=float, default=60.0,
                     help="seconds late before a tick counts as missed: the grace for a restart "
                          "(ticks due while suspended are missed whatever their age)")
    add.add_argument("--suspend", action="store_true", help="create it suspended")
    _common(add, finds=False)
    add.set_defaults(run=cmd_add)

    for name, handler, help_text in (
        ("status", cmd_status, "show one schedule"),
        ("remove", cmd_remove, "delete a schedule (its tasks stay)"),
        ("suspend", _set_suspend(True), "stop materializing a schedule's ticks"),
        ("resume", _set_suspend(False), "resume a schedule (missed ticks follow its policy)"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("id", help="the schedule's id")
        _common(p, finds=True)
        p.set_defaults(run=handler)

    ls = sub.add_parser("list", help="list schedules")
    ls.add_argument("--limit", type=int, default=1000, help="schedules listed at most")
    _common(ls, finds=True)
    ls.set_defaults(run=cmd_list)
