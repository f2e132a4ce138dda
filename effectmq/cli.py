"""The `effectmq` command: run a worker, offer tasks, inspect queues.

Every option also reads an environment variable (shown in --help), which is how
the operator configures the worker Deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import sys
from typing import Any, AsyncIterator, Callable, cast

from . import __version__
from .protocol import settings
from .client.app import App
from .clitools import (CAST_KINDS, FAILED, PROG, UNAVAILABLE, URL_HELP, USAGE, BadSetting, CommandError, Parser,
                       choice, deprecated, emit, env, env_flag, log_level_option, port_or_off, say, setup_logging)
from .transport.connection import RedisErrors, url_from_env
from .client.discovery import discover_queues, queue_exists
from .errors import EffectMQError, InvalidOption, RedisUnavailable
from .eventloop.loops import LOOPS, loop_factory
from .client.models import PodIdentity
from .client.queue import TaskQueue
from .worker.tracing import setup_sdk
from .worker.worker import Worker

log = logging.getLogger("effectmq.cli")


class StopSignals:
    """SIGTERM and SIGINT for `effectmq worker`, from the first line of main() on.

    Before, the worker's handler came only with Worker.run(), after the handler module
    was imported: a SIGTERM in between did what the default does, and in a container,
    where the worker is PID 1, the kernel drops a signal PID 1 has no handler for. A pod
    deleted in its first second went on taking tasks until the kubelet's SIGKILL.
    Now a signal before the worker exists is remembered and the worker, once made, is
    stopped before it serves: it never acquires. Once it exists, a signal stops it
    (drains). A second signal before it exists ends the process at once (an import that
    hangs must stay interruptible). Worker.run() puts in its own handlers and gives
    these back when it returns."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # main() called off the main thread: Worker.run() cannot either
                return

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def attach(self, worker: Worker) -> None:
        """From now on a signal stops `worker`; one that came before already has."""
        self._loop, self._worker = asyncio.get_running_loop(), worker
        if self.received is not None:
            log.info("%s before the worker started: stopping without serving", signal.Signals(self.received).name)
            worker.stop()

    def _handle(self, signum: int, _frame: Any) -> None:
        # Python runs this in the main thread, between two bytecodes of whatever runs.
        if self._worker is not None and self._loop is not None:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._worker.stop)
        elif self.received is None:
            self.received = signum
        else:
            raise SystemExit(128 + signum)


def load_target(spec: str) -> App | dict:
    """Import `module:attr` and return the App (or dict of handlers) it names; a function
    that takes no arguments is called for it (an application factory)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CommandError(f"handlers must look like 'package.module:app', got {spec!r}")
    # The working directory after the standard library and the installed packages, never
    # ahead of them: a writable folder first on the path could shadow any module.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"cannot import handler module {module_name!r}: {exc}") from None
    try:
        target = getattr(module, attr)
    except AttributeError:
        raise CommandError(f"module {module_name!r} has no attribute {attr!r}") from None
    wanted = f"{spec} must name an effectmq.App, a dict of handlers, or a function without arguments that returns one"
    if callable(target) and not isinstance(target, (App, dict)):
        try:
            inspect.signature(target).bind()
        except TypeError:
            raise CommandError(f"{wanted}; {module_name}.{attr} takes arguments") from None
        except ValueError:  # a builtin without a signature: it is no factory of ours
            raise CommandError(f"{wanted}, got {type(target).__name__}") from None
        target = target()  # the factory's own errors are the application's: shown with their traceback
    if not isinstance(target, (App, dict)):
        raise CommandError(f"{wanted}, got {type(target).__name__}")
    return target


def _queue_args(p: argparse.ArgumentParser, *, json_help: str = "print JSON instead of text") -> None:
    p.add_argument("--queue", "-q", default=env("EFFECTMQ_QUEUE"), help="queue name [EFFECTMQ_QUEUE]")
    p.add_argument("--url", help=URL_HELP)
    p.add_argument("--prefix", default=env("EFFECTMQ_PREFIX"),
                   help="key prefix in Redis; default: emq (a worker: its App's, else emq) [EFFECTMQ_PREFIX]")
    p.add_argument("--json", action="store_true", help=json_help)
    log_level_option(p)


def _queue(args) -> TaskQueue:
    if not args.queue:
        raise CommandError("no queue given (--queue or EFFECTMQ_QUEUE)")
    return TaskQueue(args.queue, url=args.url, **_given(args, "prefix"))


@contextlib.asynccontextmanager
async def _known_queue(args, *, create: bool = False) -> AsyncIterator[TaskQueue]:
    """The queue, when it exists in that Redis (or `create`): a mistyped name is an error
    that names the queues there, never a read of nothing or a queue made by mistake."""
    async with _queue(args) as q:
        prefix = q.keys.prefix
        if not create:
            with RedisErrors(q.redis, f"at {q.url} (queue {q.name!r})"):
                if not await queue_exists(q.redis, prefix, q.name):
                    known = await discover_queues(q.redis, prefix)
                    raise CommandError(_unknown_queue(q, prefix, known, args.command))
        yield q


KNOWN_SHOWN = 20  # queue names a hint lists at most


def _unknown_queue(q: TaskQueue, prefix: str, known: list[str], command: str) -> str:
    if known:
        more = f" and {len(known) - KNOWN_SHOWN} more" if len(known) > KNOWN_SHOWN else ""
        hint = f"known queues: {', '.join(known[:KNOWN_SHOWN])}{more}"
    else:
        hint = f"no queue found under prefix {prefix!r} (check --url and --prefix)"
    if command == "pause":
        hint += "; pause --create pauses a queue before its first task"
    return f"no queue {q.name!r} at {q.url}; {hint}"


def _given(args, *names: str) -> dict[str, Any]:
    """The queue options given as flags or in the environment (the rest keep their defaults)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _human_task(info: dict) -> str:
    lines = [f"{k:>24}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}"
             for k, v in info.items() if v not in (None, {}, [])]
    # each stall in a line of its own: why the attempt's worker went (models.stall_cause_text)
    lines += [f"{'attempt ' + str(a.get('attempt')):>24}: stalled: {a['cause_text']}"
              for a in info.get("attempts") or [] if isinstance(a, dict) and a.get("cause_text")]
    return "\n".join(lines)


async def cmd_worker(args) -> int:
    target = load_target(args.handlers)
    queue_name = args.queue or (target.queue_name if isinstance(target, App) else None)
    if not queue_name:
        raise CommandError("no queue given (--queue, EFFECTMQ_QUEUE, or an App with a queue name)")
    # Flags and the environment win; what they leave unsaid comes from the App, then the defaults.
    app = target if isinstance(target, App) else None
    options = {**(app.queue_options if app else {}), **_given(args, "prefix", "lock_timeout")}
    queue = TaskQueue(queue_name, url=args.url or url_from_env() or (app.url if app else None), **options)
    if isinstance(target, App):
        target.use_queue(queue)
    if exporting := setup_sdk():
        log.info("exporting traces (OTEL_* variables): %s", exporting)
    worker = Worker(queue, target, concurrency=args.concurrency, prefetch=args.prefetch, lock_timeout=args.lock_timeout,
                    lock_refresh=args.lock_refresh, drain_timeout=args.drain_timeout,
                    maintenance_interval=args.maintenance_interval, maintenance_batch=args.maintenance_batch,
                    metrics_port=args.metrics_port, loop_block_warning=args.loop_block_warning or None,
                    name=env("EFFECTMQ_WORKER_NAME") or env("HOSTNAME"), trace_links=args.trace_links,
                    pod=PodIdentity.from_env(os.environ))
    stop_signals: StopSignals | None = getattr(args, "stop_signals", None)
    if stop_signals is not None:
        stop_signals.attach(worker)
    try:
        await worker.run()
    finally:
        await queue.close()
    return 0


def _stat_text(name: str, value: Any) -> str:
    if name == "rate_limit" and value:
        return f"{value[0]} per {value[1]:g}s"
    return str(value)


async def cmd_stats(args) -> int:
    async with _known_queue(args) as q:
        stats = await q.stats()
    emit(args, stats.to_json(), lambda s: "\n".join(f"{k:>24}: {_stat_text(k, v)}" for k, v in s.items()))
    return 0


async def cmd_task(args) -> int:
    async with _known_queue(args) as q:
        info = await q.get(args.task_id)
    if info is None:
        raise CommandError(f"no task {args.task_id!r} in queue {args.queue!r}", FAILED)
    emit(args, info.to_json(), _human_task)
    return 0


async def cmd_dead_letters(args) -> int:
    async with _known_queue(args) as q:
        if args.retry_all:
            tasks = await q.dead_letters(limit=args.limit)
            for t in tasks:
                await q.retry(t.task_id)
            emit(args, {"retried": [t.task_id for t in tasks]}, lambda v: f"retried {len(v['retried'])} tasks")
            return 0
        tasks = await q.dead_letters(limit=args.limit, offset=args.offset)
    rows = [t.to_json() for t in tasks]

    def table(rows: list[dict]) -> str:
        if not rows:
            return "no dead letters"
        out = [f"{'TASK ID':<36} {'NAME':<20} {'FAILURES':>8} {'STALLS':>6}  ERROR"]
        for r in rows:
            err = r["error"] or {}
            out.append(f"{r['task_id']:<36} {r['name']:<20} {r['handler_failure_count']:>8} "
                       f"{r['stalled_attempt_count']:>6}  {err.get('tag', '')}: {err.get('message', '')}")
        return "\n".join(out)

    emit(args, rows, table)
    return 0


async def cmd_offer(args) -> int:
    try:
        payload = json.loads(args.payload) if args.payload is not None else None
    except ValueError as exc:
        raise CommandError(f"payload is not valid JSON: {exc}") from None
    except RecursionError:
        raise CommandError("payload is nested too deep to decode") from None
    async with _queue(args) as q:  # offering is how a queue comes to be
        offered = await q.offer(args.name, payload, task_id=args.task_id, delay=args.delay, priority=args.priority,
                                group=args.group)
    emit(args, offered._asdict(), lambda o: f"{'offered' if o['created'] else 'already known'}: {o['task_id']}")
    return 0


def _simple(action: str) -> Callable:
    async def run(args) -> int:
        async with _known_queue(args, create=getattr(args, "create", False)) as q:
            if action in ("retry", "cancel"):
                was = await getattr(q, action)(args.task_id)
                emit(args, {"task_id": args.task_id, "was": was},
                       lambda v: f"{action}: {v['task_id']} (was {v['was'] or 'unknown'})")
                return 0 if was else 1
            if action == "maintain":
                report = await q.maintain(batch=args.maintenance_batch)
                emit(args, report.to_json(), lambda r: " ".join(f"{k}={v}" for k, v in r.items()))
                return 0
            await getattr(q, action)()
            emit(args, {"queue": q.name, action: True}, lambda v: f"{action}d queue {q.name}")
            return 0
    return run


def rate_limit_setting(value: str) -> tuple[int, float] | str:
    """rate-limit's argument: TASKS/PERIOD ("100/1s", "5/60", "2/0.5s"), or "off"."""
    text = value.strip().lower()
    if text == "off":
        return text
    tasks, slash, period = text.partition("/")
    try:
        if not slash:
            raise ValueError
        return int(tasks), float(period.removesuffix("s"))
    except ValueError:
        raise BadSetting(f"a rate limit is TASKS/PERIOD (100/1s: 100 starts in any second) or off, "
                         f"got {value!r}") from None


def group_rate_setting(value: str) -> tuple[int, float] | int:
    """group --rate-limit's argument: TASKS/PERIOD, "off" (none for this group: 0) or
    "default" (the queue's group_rate_limit: -1), as configure_group takes it."""
    text = value.strip().lower()
    if text == "default":
        return -1
    limit = rate_limit_setting(value)
    return 0 if limit == "off" else cast("tuple[int, float]", limit)


async def cmd_rate_limit(args) -> int:
    async with _known_queue(args) as q:
        if args.limit is not None:  # else only shown
            await q.configure(rate_limit=None if args.limit == "off" else args.limit)
        stats = await q.stats()
    limit = stats.rate_limit
    emit(args, {"queue": q.name, "rate_limit": list(limit) if limit else None,
                "window_starts": stats.rate_window_starts, "held_for": stats.starts_held_for},
         lambda v: (f"queue {q.name}: " + (f"at most {limit[0]} starts in any {limit[1]:g}s "
                                          f"({stats.rate_window_starts} in the current window)" if limit
                                          else "no rate limit")
                    + (f"; starts held for {stats.starts_held_for:g}s more" if stats.starts_held_for else "")))
    return 0


async def cmd_group(args) -> int:
    async with _known_queue(args) as q:
        if args.max_active is not None or args.rate_limit is not None:
            await q.configure_group(args.group, max_active=args.max_active, rate_limit=args.rate_limit)
        if args.pause or args.resume:
            await (q.pause_group if args.pause else q.resume_group)(args.group)
        stats = await q.group_stats(args.group)

    def human(v: dict) -> str:
        cap = f"at most {v['max_active']}" if v["max_active"] else "no cap"
        rate = v["rate_limit"]
        return (f"group {v['group']} of queue {q.name}: {v['active']} running ({cap})"
                f"{', paused' if v['paused'] else ''}, {v['waiting']} waiting, {v['parked']} parked"
                + (f"; at most {rate[0]} starts in any {rate[1]:g}s" if rate else ""))

    emit(args, stats.to_json(), human)
    return 0


async def cmd_parked(args) -> int:
    async with _known_queue(args) as q:
        tasks = await q.parked_tasks(args.group, limit=args.limit, offset=args.offset)
    rows = [t.to_json() for t in tasks]

    def table(rows: list[dict]) -> str:
        if not rows:
            return "no parked tasks" + (f" of group {args.group}" if args.group is not None else "")
        out = [f"{'TASK ID':<36} {'GROUP':<20} {'NAME':<20} {'PRIORITY':>8}  CREATED"]
        out += [f"{r['task_id']:<36} {r['group']:<20} {r['name']:<20} {r['priority']:>8}  {r['created_at']}"
                for r in rows]
        return "\n".join(out)

    emit(args, rows, table)
    return 0


async def cmd_hold(args) -> int:
    async with _known_queue(args) as q:
        held_for = await q.hold_starts(args.seconds)
    emit(args, {"queue": q.name, "held_for": held_for},
         lambda v: f"queue {q.name}: no task starts for {v['held_for']:g}s (by Redis time)")
    return 0



def prefetch_setting(value: str) -> int | None:
    """--prefetch: "auto" (None) or a non-negative integer."""
    if value.strip().lower() == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise BadSetting(f"prefetch must be auto or a non-negative integer, got {value!r}")
    return number


CAST_KINDS[prefetch_setting] = "auto or a non-negative integer"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0],
                    epilog="Every command's options, defaults and exit codes: docs/cli.md")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    w = sub.add_parser("worker", help="run handlers for a queue", description="Run handlers for a queue until "
                       "SIGTERM or SIGINT, which drain: running attempts get --drain-timeout to finish.")
    w.add_argument("handlers", nargs="?", default=env("EFFECTMQ_HANDLERS"),
                   help="module:attr of an effectmq.App, a dict of handlers, or a function without arguments "
                   "that returns one [EFFECTMQ_HANDLERS]")
    _queue_args(w, json_help="write the log as JSON objects, one a line (time, level, logger, message)")
    w.add_argument("--concurrency", "-c", type=int,
                   default=env("EFFECTMQ_CONCURRENCY", settings.default("concurrency"), int),
                   help="attempts in flight per process [EFFECTMQ_CONCURRENCY]")
    w.add_argument("--prefetch", type=prefetch_setting, default=env("EFFECTMQ_PREFETCH", None, prefetch_setting),
                   help="leases held ahead per process, started as handlers return: auto (the default: as many "
                   "as --concurrency while handlers are short), or a number (0: none) [EFFECTMQ_PREFETCH]")
    w.add_argument("--lock-timeout", type=float, default=env("EFFECTMQ_LOCK_TIMEOUT", None, float),
                   help="lease length in seconds; default: the App's, else 30 [EFFECTMQ_LOCK_TIMEOUT]")
    w.add_argument("--lock-refresh", type=float, default=env("EFFECTMQ_LOCK_REFRESH", None, float),
                   help="seconds between lease renewals; default: a third of the lease [EFFECTMQ_LOCK_REFRESH]")
    w.add_argument("--drain-timeout", type=float, default=env("EFFECTMQ_DRAIN_TIMEOUT", 30.0, float),
                   help="seconds in-flight attempts get on SIGTERM before release [EFFECTMQ_DRAIN_TIMEOUT]")
    w.add_argument("--maintenance-interval", type=float, default=env("EFFECTMQ_MAINTENANCE_INTERVAL", 5.0, float),
                   help="longest gap between bounded maintenance passes, seconds; shorter while work falls due "
                   "[EFFECTMQ_MAINTENANCE_INTERVAL]")
    _maintenance_batch(w)
    w.add_argument("--metrics-port", type=port_or_off, default=env("EFFECTMQ_METRICS_PORT", None, port_or_off),
                   help="serve Prometheus metrics and the probes /livez and /readyz on this port; default: "
                   "none (0: none) [EFFECTMQ_METRICS_PORT]")
    w.add_argument("--loop-block-warning", type=float, default=env("EFFECTMQ_LOOP_BLOCK_WARNING", 1.0, float),
                   help="warn, with the stuck stack, when the event loop runs nothing for this many seconds "
                   "(0 = off) [EFFECTMQ_LOOP_BLOCK_WARNING]")
    w.add_argument("--loop", choices=LOOPS, default=env("EFFECTMQ_LOOP", "asyncio", choice(*LOOPS)),
                   help="event loop: asyncio's, uvloop (pip install 'effectmq[uvloop]'), or auto = uvloop "
                   "when installed [EFFECTMQ_LOOP]")
    w.add_argument("--trace-links", action="store_true", default=env_flag("EFFECTMQ_TRACE_LINKS"),
                   help="traced, each attempt is a trace of its own linked to the task's creation context, "
                   "not a span in the producer's trace (for fan-outs of many tasks) [EFFECTMQ_TRACE_LINKS]")
    w.set_defaults(run=cmd_worker)

    s = sub.add_parser("stats", help="counts per state of a queue")
    _queue_args(s)
    s.set_defaults(run=cmd_stats)

    t = sub.add_parser("task", help="show one task")
    t.add_argument("task_id", help="the task's id")
    _queue_args(t)
    t.set_defaults(run=cmd_task)

    d = sub.add_parser("dead-letters", help="list (or retry) tasks that failed for good")
    _queue_args(d)
    d.add_argument("--limit", type=int, default=50, help="dead letters listed (or retried) at most")
    d.add_argument("--offset", type=int, default=0, help="dead letters skipped first, newest first")
    d.add_argument("--retry-all", action="store_true", help="send the listed dead letters back to waiting")
    d.set_defaults(run=cmd_dead_letters)

    o = sub.add_parser("offer", help="offer one task (payload as JSON)",
                       description="Offer one task; the queue is made by its first task.")
    o.add_argument("name", help="the task's name, as its handler is registered")
    o.add_argument("payload", nargs="?", help="the payload as JSON, e.g. '{\"to\": \"a@example.com\"}'; default: null")
    o.add_argument("--task-id", help="the task's id: offering one id again leaves the task untouched; default: "
                   "a new random id")
    o.add_argument("--delay", type=float, help="seconds before the task may start; default: none")
    o.add_argument("--priority", type=int, default=0, help="higher runs first, -1000 to 1000")
    o.add_argument("--group", help="the task's group (a tenant, a customer): groups take turns; default: none")
    _queue_args(o)
    o.set_defaults(run=cmd_offer)

    for action, help_text in (("retry", "send a failed or canceled task back to waiting"),
                              ("cancel", "cancel a task that has not settled")):
        p = sub.add_parser(action, help=help_text)
        p.add_argument("task_id", help="the task's id")
        _queue_args(p)
        p.set_defaults(run=_simple(action))
    for action in ("pause", "resume"):
        p = sub.add_parser(action, help=f"{action} acquisition on a queue")
        _queue_args(p)
        if action == "pause":
            p.add_argument("--create", action="store_true",
                           help="pause a queue that does not exist yet, so that workers find it paused (without "
                           "it, an unknown queue is an error: a mistyped name makes nothing)")
        p.set_defaults(run=_simple(action))
    r = sub.add_parser("rate-limit", help="show or set a queue's rate limit (starts in any window, all workers)")
    r.add_argument("limit", nargs="?", type=rate_limit_setting,
                   help="TASKS/PERIOD, e.g. 100/1s (at most 100 starts in any second) or 5/60s; off removes it; "
                   "none: show it")
    _queue_args(r)
    r.set_defaults(run=cmd_rate_limit)
    g = sub.add_parser("group", help="show or set a task group's cap on running attempts and its rate limit, "
                       "pause or resume it",
                       description="Show a task group's counts, cap, rate limit and pause; with an option, change "
                       "them first. A group's tasks beyond its cap or its rate limit, or while it is paused, wait "
                       "parked while other groups run.")
    g.add_argument("group", help="the group's name (1 to 128 bytes of UTF-8)")
    g.add_argument("--max-active", type=int, help="its attempts running at once across all workers: N > 0 a cap, "
                   "0 no cap, -1 the queue's group_max_active")
    g.add_argument("--rate-limit", type=group_rate_setting, help="its starts in any window across all workers: "
                   "TASKS/PERIOD (5/1s: 5 starts in any second), off (none for this group), default (the "
                   "queue's group_rate_limit)")
    pause = g.add_mutually_exclusive_group()
    pause.add_argument("--pause", action="store_true", help="start none of its tasks (those running finish)")
    pause.add_argument("--resume", action="store_true", help="start its tasks again")
    _queue_args(g)
    g.set_defaults(run=cmd_group)
    k = sub.add_parser("parked", help="list the tasks held back by their group's cap, rate limit or pause",
                       description="List parked tasks (state waiting, held back by their group's cap, rate limit "
                       "or pause) by group name, each group's in the order they go back to waiting.")
    k.add_argument("--group", help="only this group's; default: every group's")
    k.add_argument("--limit", type=int, default=50, help="tasks listed at most")
    k.add_argument("--offset", type=int, default=0, help="tasks skipped first")
    _queue_args(k)
    k.set_defaults(run=cmd_parked)
    h = sub.add_parser("hold", help="start no task of a queue for a while (a downstream service said 429)")
    h.add_argument("seconds", type=float, help="how long, by Redis time; a hold is only ever extended, at most a day")
    _queue_args(h)
    h.set_defaults(run=cmd_hold)
    m = sub.add_parser("maintain", help="run one bounded maintenance pass")
    _queue_args(m)
    _maintenance_batch(m)
    deprecated(m, "--batch", replacement="--maintenance-batch", dest="maintenance_batch", type=int)
    m.set_defaults(run=_simple("maintain"))

    for extension in ("effectmq.scheduler.cli", "effectmq.dashboard.cli", "effectmq_operator.local.cli"):
        try:
            module = importlib.import_module(extension)
        except ModuleNotFoundError as exc:
            if exc.name != extension.split(".")[0]:
                raise  # a broken extension must show, not vanish from the command list
            continue  # that package is not installed
        module.register(sub)
    return parser


def _maintenance_batch(p: argparse.ArgumentParser) -> None:
    default = inspect.signature(Worker).parameters["maintenance_batch"].default
    p.add_argument("--maintenance-batch", type=int, default=env("EFFECTMQ_MAINTENANCE_BATCH", default, int),
                   help="items per sweep of one maintenance call (at most 5000: one Lua script each) "
                   "[EFFECTMQ_MAINTENANCE_BATCH]")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # A worker handles SIGTERM before anything else it does (parsing imports the CLI
    # extensions, then the handler module is imported): see StopSignals.
    stop_signals = StopSignals() if argv[:1] == ["worker"] else None
    if stop_signals is not None:
        stop_signals.install()
    try:
        return _run(argv, stop_signals)
    finally:
        if stop_signals is not None:
            stop_signals.uninstall()


def _run(argv: list[str], stop_signals: StopSignals | None) -> int:
    """Parse, run, and turn what went wrong into one line on stderr and an exit code
    (clitools.EXIT_CODES); a traceback is shown only for what is a bug."""
    try:
        args = build_parser().parse_args(argv)
        setup_logging(args.log_level, as_json=args.command == "worker" and args.json)
        if args.command == "worker" and not args.handlers:
            raise CommandError("worker needs handlers (module:attr or EFFECTMQ_HANDLERS)")
        args.stop_signals = stop_signals
        with asyncio.Runner(loop_factory=loop_factory(getattr(args, "loop", "asyncio"))) as runner:
            return runner.run(args.run(args))
    except CommandError as exc:
        message, code = str(exc), exc.code
    except InvalidOption as exc:  # a value the library refused (a bad URL, a negative delay, a cron field)
        message, code = str(exc), USAGE
    except RedisUnavailable as exc:
        message, code = str(exc), UNAVAILABLE
    except EffectMQError as exc:
        message, code = str(exc), FAILED
    except KeyboardInterrupt:
        return 130
    say("error", message)
    return code


if __name__ == "__main__":
    sys.exit(main())
