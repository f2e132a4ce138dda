"""The Worker: runs handlers for leased tasks with heartbeats, timeouts and drain.

One asyncio loop per process runs up to `concurrency` attempts (slots.py keeps the
count). Idle, it blocks on the queue's wake signal (no polling floor). A single
heartbeat loop (lease_keeper.py) renews every in-flight lease in one round trip and
interrupts a handler whose ownership can no longer be confirmed. SIGTERM drains: no
new acquisitions, in-flight attempts get `drain_timeout` to finish, the rest are
released (not stalled).

A worker may also hold leases ahead of its running attempts (prefetch.py decides
how many): their tasks start the moment a handler returns. Held leases are renewed
like running ones and handed back (not stalled) on drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from ..errors import (
    DEFECT, TIMEOUT, AlreadySettled, CorruptValue, ErrorInfo, InvalidOption, LeaseLost, RateLimited, RedisRefused,
    RedisUnavailable,
)
from ..eventloop.aio import cancel_and_wait
from ..eventloop.loopwatch import LoopWatch
from ..protocol import codec, protocol, settings
from ..protocol.protocol import Outcome
from ..client.app import App, TaskDef
from ..client.checks import check_number, eviction_warning
from ..client.engine import Lease, RateLimitedFor
from ..client.models import MaintenanceReport, PodIdentity
from ..client.queue import TaskQueue
from . import heartbeat, maintenance, metrics
from .acks import CompletionBatcher
from .lease_keeper import LeaseKeeper
from .prefetch import Prefetch
from .slots import SlotLedger, WorkerContext
from .tracing import AttemptTracing

log = logging.getLogger("effectmq.worker")
UNKNOWN_TASK_LABEL = "<unknown>"
WORKER_BEAT_INTERVAL = 2.0  # seconds between announcements of this worker's load
BACKOFF_FIRST, BACKOFF_LIMIT = 0.1, 5.0  # seconds: a failing loop's first and longest wait
STARTUP_PING_TIMEOUT = 5.0  # seconds: a connection that accepts but never answers is retried
HELPER_STOP_TIMEOUT = 2.0  # seconds the helper loops get to end once the drain is over
RELEASE_AT_LEAST = 0.5  # seconds a hand-back may take past its lease's confirmed end (the server's is later)
# What a blocked loop costs a worker, and the usual cause: its async handlers
LOOP_BLOCK_CONSEQUENCE = ("no heartbeat can run until it returns, so the leases of this process may run out and "
                          "their tasks run again elsewhere")
LOOP_BLOCK_ADVICE = "Blocking code in an async handler belongs in a sync handler (a thread) or asyncio.to_thread. "
LOG_REPEAT_EVERY = 5.0  # seconds: one warning per loop and error class, the rest at debug level


class TaskContext:
    """What a handler may know and do about its own attempt."""

    def __init__(self, lease: Lease, loop: asyncio.AbstractEventLoop):
        self.lease = lease
        self.task_id = lease.task_id
        self.name = lease.name
        self.attempt = lease.attempt
        self.handler_failure_count = lease.handler_failure_count
        self.stalled_attempt_count = lease.stalled_attempt_count
        self.queue = lease.queue.name
        self._loop = loop
        self._progress_refused = False

    async def progress(self, value: Any) -> bool:
        """Report progress: True when stored, False when Redis refused it for now (full,
        unreachable, ...): a report is advice, and the handler goes on. Fenced: raises
        LeaseLost when this attempt lost the task."""
        try:
            await self.lease.progress(value)
        except RedisUnavailable as exc:
            report = log.debug if self._progress_refused else log.warning
            report("progress of task %s not stored: %s", self.task_id, exc)
            self._progress_refused = True  # one warning per attempt: a handler may report often
            return False
        return True

    def progress_sync(self, value: Any, timeout: float = 10.0) -> bool:
        """Report progress from a synchronous handler running in the thread pool (as progress)."""
        return asyncio.run_coroutine_threadsafe(self.progress(value), self._loop).result(timeout)


class _Attempt:
    """One lease's attempt here; the slot ledger says whether its handler runs, or it is held."""

    __slots__ = ("lease", "task", "definition", "next_renew", "lost", "releasing", "started", "span")

    def __init__(self, lease: Lease, definition: TaskDef | None, next_renew: float):
        self.lease = lease
        self.definition = definition
        self.task: asyncio.Task | None = None
        self.next_renew = next_renew
        self.lost = False  # ownership gone: do not settle
        self.releasing = False  # drain timeout hit: hand the task back
        self.started = time.monotonic()  # when leased; again when its handler begins
        self.span: Any = None  # its process span while traced (tracing.py)


def _handlers_from(source: App | Mapping[str, Any] | None) -> dict[str, TaskDef]:
    if source is None:
        return {}
    if isinstance(source, App):
        return dict(source.tasks)
    out: dict[str, TaskDef] = {}
    for name, handler in source.items():
        out[name] = handler if isinstance(handler, TaskDef) else TaskDef(name, handler)
    return out


class _TakeAlong:
    """The leases a worker's completion batches ask for (acks.LeasesAlong): the slots
    the batch frees, and any free already; none while the worker stops. It sees the
    worker through WorkerContext only."""

    def __init__(self, worker: WorkerContext):
        self.worker = worker
        self.slots = worker.slots

    @property
    def lock_timeout(self) -> float | None:
        return self.worker.lock_timeout

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight - self.slots.held_count  # held leases complete nothing soon

    def wanted(self, completing: int) -> int:
        # The slots this batch frees (its attempts leave once their outcomes are read),
        # and any free now; attempts of an earlier batch that have not left yet were
        # replaced by that batch's leases.
        if self.worker.stopping:
            return 0
        return completing + self.slots.ask()

    def returned(self, reserved: int) -> None:
        self.slots.answered(reserved)

    def reserve(self, slots: int) -> None:
        self.slots.reserve(slots)

    def start(self, leases: list[Lease]) -> None:
        self.worker.run_leases(leases)

    def start_late(self, leases: list[Lease]) -> list[Lease]:
        room = max(0, self.slots.free())
        for lease in leases[room:]:
            self.worker.release_in_background(lease, "its slot was filled while the call that leased it was late")
        self.worker.run_leases(leases[:room])
        return leases[:room]


class Worker:
    def __init__(self, queue_or_app: TaskQueue | App, handlers: App | Mapping[str, Any] | None = None, *,
                 concurrency: int = settings.default("concurrency"), prefetch: int | None = None,
                 lock_timeout: float | None = None, lock_refresh: float | None = None,
                 drain_timeout: float = 30.0, maintenance_interval: float = 5.0, maintenance_batch: int = 100,
                 idle_poll: float = 5.0, metrics_port: int | None = None, install_signal_handlers: bool = True,
                 name: str | None = None, loop_block_warning: float | None = 1.0, trace_links: bool = False,
                 pod: PodIdentity | None = None):
        """trace_links: traced (a TracerProvider installed), each attempt's span is the root
        of its own trace, linked to the task's creation context, instead of its child.
        pod: the pod this process runs in (PodIdentity.from_env): announced with the
        worker, so that a stall of its attempts names the pod and how it ended."""
        if isinstance(queue_or_app, App):
            self.app: App | None = queue_or_app
            self.queue = queue_or_app.queue
            handlers = handlers if handlers is not None else queue_or_app
        elif isinstance(queue_or_app, TaskQueue):
            self.app = None
            self.queue = queue_or_app
        else:
            # the type only: a repr could be a URL with its password
            raise InvalidOption(f"Worker needs a TaskQueue or an App, got {type(queue_or_app).__name__}")
        self.handlers = _handlers_from(handlers)
        if not self.handlers:
            raise InvalidOption("Worker needs at least one handler")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise InvalidOption(f"concurrency must be a positive integer, got {concurrency!r}")
        self.concurrency = concurrency
        if prefetch is not None and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
            raise InvalidOption(f"prefetch must be None (auto) or a non-negative integer, got {prefetch!r}")
        self.prefetch = prefetch
        self._prefetch = Prefetch(prefetch, concurrency, groups_counted=lambda: self.queue.engine.scripts.group_keys)
        self._prefetch.rate_limited = self.queue.config.rate_limit is not None
        self.lock_timeout = lock_timeout if lock_timeout is not None else self.queue.config.lock_timeout
        self.lock_refresh = lock_refresh
        if lock_refresh is not None and lock_refresh >= self.lock_timeout:
            raise InvalidOption(
                f"lock_refresh ({lock_refresh}) must be shorter than lock_timeout ({self.lock_timeout})")
        self.drain_timeout = drain_timeout
        check_number("maintenance_interval", maintenance_interval, minimum=0.001, allow_none=False)
        check_number("maintenance_batch", maintenance_batch, minimum=1, integer=True, allow_none=False,
                     maximum=protocol.MAX_MAINTAIN_BATCH)
        self.maintenance_interval = maintenance_interval
        self.maintenance_batch = maintenance_batch
        self.idle_poll = idle_poll
        check_number("loop_block_warning", loop_block_warning, minimum=0.05)
        self.loop_block_warning = loop_block_warning  # seconds; None: no watchdog
        self.metrics_port = metrics_port
        self.install_signal_handlers = install_signal_handlers
        self.trace_links = trace_links
        if pod is not None and not isinstance(pod, PodIdentity):
            raise InvalidOption(f"pod must be a PodIdentity or None, got {type(pod).__name__}")
        self.pod = pod
        self._tracing: AttemptTracing | None = None  # while a TracerProvider is installed
        self.name = name or f"worker-{random.getrandbits(32):08x}"
        self._slot_free = asyncio.Event()
        self.slots: SlotLedger[_Attempt] = SlotLedger(concurrency, self._prefetch.ahead, self._slot_free.set)
        self._background: set[asyncio.Task] = set()
        self._fatal: BaseException | None = None
        self._last_warning: dict[tuple[str, str], float] = {}
        self._stopping = asyncio.Event()
        self._closing = asyncio.Event()  # the drain is over: helper loops end
        self._executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="effectmq-handler")
        self._q = self.queue.name
        self._completions = CompletionBatcher(self.queue.engine, _TakeAlong(self))
        self._keeper = LeaseKeeper(self, self.queue.engine, self._prefetch, lock_refresh)
        self._metrics = metrics.AttemptMetrics(self._q)
        self._ready_gauge = metrics.REDIS_READY.labels(self._q)
        self._rate_limited_replies = metrics.RATE_LIMITED.labels(self._q)  # series from 0
        self._rate_limited_seconds = metrics.RATE_LIMITED_SECONDS.labels(self._q)
        self.ready = False  # the last Redis call worked: /readyz answers 200
        self.processed = 0

    # -- lifecycle ----------------------------------------------------------

    def stop(self) -> None:
        """Begin a graceful drain (what SIGTERM and SIGINT do)."""
        if not self._stopping.is_set():
            log.info("worker %s draining (%d in flight)", self.name, self.slots.in_flight)
        self._stopping.set()
        self._slot_free.set()  # an acquire loop waiting for a slot ends now

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight

    @property
    def running(self) -> int:
        """Attempts whose handler was started (in flight, held leases not counted)."""
        return self.slots.in_flight - self.slots.held_count

    async def run(self) -> None:
        """Serve until stop() (or SIGTERM); raises the error that made a loop give up, if any."""
        loop = asyncio.get_running_loop()
        replaced: dict[signal.Signals, Any] = {}  # the handlers there before ours (the CLI's), put back at the end
        if self.install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    before = signal.getsignal(sig)
                    loop.add_signal_handler(sig, self.stop)
                    replaced[sig] = before
        if self.metrics_port is not None:
            metrics.start_server(self.metrics_port, ready=lambda: self.ready and not self._stopping.is_set())
        helpers: list[asyncio.Task] = []
        wake = None
        watch = None
        self._metrics.track(lambda: (self.running, self.slots.held_count))
        if self.loop_block_warning is not None:
            watch = LoopWatch(self.loop_block_warning, lag=metrics.LOOP_LAG.labels(self._q), logger=log,
                              consequence=LOOP_BLOCK_CONSEQUENCE, advice=LOOP_BLOCK_ADVICE,
                              describe=self._describe_leases)
            watch.start(loop)
        try:
            if await self._wait_for_redis():
                await self._check_eviction()
                await self._read_settings()
                self._tracing = AttemptTracing.resolve(self._q, self.trace_links, self._tracing)
                wake = await self.queue.wake_signal().start()
                helpers = [
                    asyncio.create_task(self._keeper.run(self._closing), name="effectmq-heartbeat"),
                    asyncio.create_task(self._maintenance_loop(), name="effectmq-maintenance"),
                    asyncio.create_task(self._announce_loop(), name="effectmq-announce"),
                ]
                log.info("worker %s serving queue %r at %s with %d handlers, concurrency %d, prefetch %s, on %s",
                         self.name, self._q, self.queue.url, len(self.handlers), self.concurrency,
                         self._prefetch.describe(),
                         type(asyncio.get_running_loop()).__module__)
                await self._acquire_loop(wake)
                await self._drain()
        finally:
            self._metrics.untrack()
            self._closing.set()  # helpers end their loops; a lost cancel cannot keep them going
            if watch is not None:
                watch.stop()
            await cancel_and_wait(helpers + list(self._background), HELPER_STOP_TIMEOUT)
            if wake is not None:
                await wake.close(HELPER_STOP_TIMEOUT)
            self._executor.shutdown(wait=False, cancel_futures=True)
            for sig, before in replaced.items():
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)
                    if before is not None:
                        signal.signal(sig, before)
            log.info("worker %s stopped after %d attempts", self.name, self.processed)
        if self._fatal is not None:
            raise self._fatal

    async def _wait_for_redis(self) -> bool:
        """Wait with backoff until Redis answers (a service starts before its Redis does);
        False when stopped meanwhile."""
        backoff = BACKOFF_FIRST
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self.queue.ping(), STARTUP_PING_TIMEOUT)
                self._set_ready(True)
                return True
            except asyncio.TimeoutError:
                self._set_ready(False)
                log.warning("worker %s: Redis did not answer within %.0fs, retrying in %.1fs",
                            self.name, STARTUP_PING_TIMEOUT, backoff)
            except RedisUnavailable as exc:
                self._set_ready(False)
                if not exc.retryable:
                    raise
                log.warning("worker %s: Redis not reachable yet, retrying in %.1fs: %s", self.name, backoff, exc)
            await self._until(self._stopping, backoff)
            backoff = min(backoff * 2, BACKOFF_LIMIT)
        return False

    async def _check_eviction(self) -> None:
        """Warn once at start when Redis may evict what it accepted (as BullMQ does)."""
        try:
            policy = await asyncio.wait_for(self.queue.eviction_policy(), STARTUP_PING_TIMEOUT)
        except asyncio.TimeoutError:
            return
        warning = eviction_warning(policy)
        if warning:
            log.warning("worker %s, queue %r at %s: %s", self.name, self._q, self.queue.url, warning)

    async def _read_settings(self) -> None:
        """The queue's stored settings before the first lease (maintenance refreshes them)."""
        try:
            self._adopt(await asyncio.wait_for(self.queue.refresh_settings(), STARTUP_PING_TIMEOUT))
        except (asyncio.TimeoutError, RedisUnavailable, RedisRefused) as exc:
            log.debug("queue settings not read at start: %s", exc)

    def _adopt(self, settings: Mapping[str, Any]) -> None:
        # Under maxActive a held lease would take the budget of one that could run; under a
        # rate limit it would start later than the limit counted it (groups: Prefetch.groups_counted).
        self._prefetch.capped = bool(settings.get("max_active"))
        self._prefetch.rate_limited = (bool(settings.get("rate_limit")) or bool(settings.get("group_rate_limit"))
                                       or self.queue.config.rate_limit is not None)

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        self._ready_gauge.set(1 if ready else 0)

    def loop_failed(self, loop: str, exc: BaseException, retry_in: float | None = None) -> None:
        """One place judges a loop's error: retryable ones are logged and backed off from;
        any other makes the worker drain and run() raise it (a non-zero exit)."""
        code = getattr(exc, "code", None) or type(exc).__name__
        metrics.LOOP_ERRORS.labels(self._q, loop, code).inc()
        if isinstance(exc, asyncio.TimeoutError) or (isinstance(exc, RedisUnavailable) and exc.retryable):
            self._set_ready(False)
            reason = str(exc) or "no reply in time"
            now = time.monotonic()
            if self._last_warning.get((loop, code), -LOG_REPEAT_EVERY) > now - LOG_REPEAT_EVERY:
                log.debug("%s failed (%s): %s", loop, code, reason)  # counted in LOOP_ERRORS
                return
            self._last_warning[(loop, code)] = now
            if retry_in is None:
                log.warning("%s failed (%s): %s", loop, code, reason)
            else:
                log.warning("%s failed (%s), retrying in %.1fs: %s", loop, code, retry_in, reason)
            return
        if self._fatal is None:
            self._fatal = exc
            log.error("%s failed with an error retrying cannot fix; worker %s stops: %s", loop, self.name, exc,
                      exc_info=not isinstance(exc, RedisRefused))
        self.stop()

    async def _acquire_loop(self, wake) -> None:
        backoff = BACKOFF_FIRST
        while not self._stopping.is_set():
            free = self.slots.ask()  # reserved until answered
            if not free:
                self._slot_free.clear()
                await self._until(self._slot_free, self.idle_poll)
                continue
            wake.event.clear()  # cleared before acquiring: a later offer sets it again
            try:
                leases, next_due = await self.queue.acquire_many(free, lock_timeout=self.lock_timeout)
                backoff = BACKOFF_FIRST
                self._set_ready(True)
            except Exception as exc:  # judged in one place
                self.slots.answered(free)
                self.loop_failed("acquire", exc, backoff)
                await self._until(self._stopping, backoff)
                backoff = min(backoff * 2, BACKOFF_LIMIT)
                continue
            self.slots.answered(free)
            if not self.run_leases(leases):
                break
            if isinstance(next_due, RateLimitedFor):
                # No start is allowed before then, whatever is offered: no wake signal is
                # listened to (idle_poll still bounds it: a limit lifted meanwhile is seen).
                self._rate_limited_replies.inc()
                began = time.monotonic()
                await self._until(self._stopping, min(self.idle_poll, next_due + 0.001))
                self._rate_limited_seconds.inc(time.monotonic() - began)
            elif len(leases) < free:
                sleep = self.idle_poll if next_due is None else min(self.idle_poll, next_due + 0.001)
                await self._until_any(wake.event, self._stopping, timeout=sleep)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        for attempt in self.slots.held():
            self.hand_back(attempt, "the worker is stopping", logging.INFO)  # routine: a drain
        if self.slots.in_flight:
            pending = [a.task for a in self.slots.attempts() if a.task]
            _done, still = await asyncio.wait(pending, timeout=self.drain_timeout) if pending else ((), set())
            for attempt in self.slots.attempts():
                if attempt.task in still:
                    attempt.releasing = True
                    attempt.task.cancel()
            if still:
                await asyncio.wait(still, timeout=max(5.0, self.lock_timeout))
        # A completion call whose batch stopped waiting may still bring leases: they are
        # handed back when it comes back; one that does not come back in time is given up
        # and what it leased is reclaimed (the engine's lost calls).
        await self._completions.wait_late(max(HELPER_STOP_TIMEOUT, deadline - time.monotonic()))
        if self.queue.engine.lost_calls():
            try:
                async with asyncio.timeout(HELPER_STOP_TIMEOUT):
                    await self.queue.engine.reclaim_lost()
            except Exception as exc:  # best effort: those leases run out instead
                log.warning("worker %s: leases of calls whose reply was lost not handed back: %s", self.name,
                            str(exc) or type(exc).__name__)
        if self._background:  # hand-backs under way finish before the connections close
            await asyncio.wait(list(self._background), timeout=HELPER_STOP_TIMEOUT)

    @staticmethod
    async def _until(event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(timeout):  # no task per wait, unlike wait_for
                await event.wait()

    @staticmethod
    async def _until_any(*events: asyncio.Event, timeout: float) -> None:
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # -- attempts -------------------------------------------------------------

    def run_leases(self, leases: list[Lease]) -> bool:
        """Start the attempts of leases a call gave; False (and the leases handed back)
        when the worker stopped while the call was out."""
        if self._stopping.is_set():
            for lease in leases:
                self.release_in_background(lease, "the worker is stopping")
            return False
        for lease in leases:
            self._start(lease)
        return True

    def _start(self, lease: Lease) -> None:
        if self._spent(lease):  # the reply came late (a held network, a paused process)
            self.release_in_background(lease, "its lease ran out before it could start")
            return
        other = self.slots.newest(lease.task_id)
        if other is not None:
            if other.lease.attempt >= lease.attempt:  # this delivery is the stale one
                log.warning("task %s: attempt %d delivered after attempt %d; not started",
                            lease.task_id, lease.attempt, other.lease.attempt)
                return
            self.interrupt(other, f"attempt {lease.attempt} of this task now owns it", owned_elsewhere=True)
        definition = self.handlers.get(lease.name)
        refresh = self._keeper.refresh_interval(lease.lock_timeout)
        attempt = _Attempt(lease, definition, time.monotonic() + refresh)
        self._keeper.noticed(refresh)  # the heartbeat may have to wake sooner
        if self.slots.admit(lease.token, lease.task_id, attempt):
            self._begin(attempt)
        # else held: renewed by the heartbeat until a handler returns

    @staticmethod
    def _spent(lease: Lease) -> bool:
        """Never run on a lease that cannot be confirmed for a safety margin more."""
        return heartbeat.spent(time.monotonic(), lease.confirmed_until, lease.lock_timeout)

    def _begin(self, attempt: _Attempt) -> None:
        """Run the handler of an attempt the ledger counts as running."""
        lease = attempt.lease
        attempt.started = time.monotonic()
        self._completions.started([lease])  # its handler's time counts from here
        attempt.task = asyncio.create_task(self._run_attempt(attempt))
        self._metrics.started(lease.name if attempt.definition else UNKNOWN_TASK_LABEL)

    def _handler_returned(self, attempt: _Attempt) -> None:
        """Its slot runs the oldest held lease at once (its acknowledgement is still out)."""
        if not self.slots.returned(attempt.lease.token):
            return
        self._prefetch.returned(time.monotonic() - attempt.started)
        while not self._stopping.is_set() and (held := self.slots.next_held()) is not None:
            if self._spent(held.lease):  # the heartbeat could not renew it
                self.hand_back(held, "its lease ran out while it was held")
            else:
                self._begin(held)

    def _forget(self, attempt: _Attempt) -> None:
        """Its slot is free (held, running or settling: it is done here)."""
        self.slots.leave(attempt.lease.token, attempt.lease.task_id)

    def hand_back(self, attempt: _Attempt, why: str, level: int = logging.WARNING) -> None:
        """A held attempt that will not start here goes back to the queue (no stall). It is
        done with here: a renewal still out for it is not taken for a lost lease."""
        attempt.lost = True
        self._forget(attempt)
        self.release_in_background(attempt.lease, why, level)

    def release_in_background(self, lease: Lease, why: str, level: int = logging.WARNING) -> None:
        log.log(level, "task %s (attempt %d) not started: %s; releasing it", lease.task_id, lease.attempt, why)

        async def release() -> None:
            # No longer than the lease may last: after that the release cannot land (the
            # task stalled, or another attempt owns it), and a hung connection must not hold it.
            with contextlib.suppress(LeaseLost, RedisUnavailable, RedisRefused, TimeoutError):
                async with asyncio.timeout(max(RELEASE_AT_LEAST, lease.confirmed_until - time.monotonic())):
                    await lease.release(ran=False)

        task = asyncio.create_task(release(), name=f"effectmq-release-{lease.task_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run_attempt(self, attempt: _Attempt) -> None:
        lease, definition = attempt.lease, attempt.definition
        label = lease.name if definition else UNKNOWN_TASK_LABEL
        outcome = "failed"
        tracing = self._tracing
        if tracing is not None:
            attempt.span = tracing.start(lease)
            activation = tracing.activate(attempt.span)
        try:
            outcome = await self._execute(attempt)
        except asyncio.CancelledError:
            if tracing is not None:
                tracing.interrupted(attempt.span, attempt.releasing)
            if attempt.releasing:
                outcome = await self._settle(lease, "release", lease.release)
            else:
                outcome = "lease_lost"
        except Exception:  # never let one attempt take the worker down
            log.exception("unexpected error settling task %s", lease.task_id)
        finally:
            self._handler_returned(attempt)  # when it never ran (bad input, no handler, interrupted)
            self._forget(attempt)
            self.processed += 1
            exemplar = tracing.exemplar(attempt.span) if tracing is not None else None
            self._metrics.settled(label, outcome, time.monotonic() - attempt.started, exemplar)
            if tracing is not None:
                tracing.end(attempt.span, outcome, activation)

    async def _execute(self, attempt: _Attempt) -> str:
        lease, definition = attempt.lease, attempt.definition
        if lease.corrupt:  # a stored value that cannot be read never runs, and never will
            problems = "; ".join(f"{name}: {why}" for name, why in sorted(lease.corrupt.items()))
            data = {"raw": protocol.raw_json(lease.raw)}
            error = ErrorInfo(DEFECT, f"stored values of task {lease.task_id!r} cannot be read ({problems})",
                              data if lease.raw else None)
            return await self._fail(lease, error, definition, retryable=False)
        if definition is None:
            known = ", ".join(sorted(self.handlers))
            error = ErrorInfo(DEFECT, f"no handler for task {lease.name!r} in this worker (known: {known})")
            return await self._fail(lease, error, None)
        try:
            payload = lease.payload
            definition.validate(payload)
        except (CorruptValue, ValueError) as exc:  # bad data never runs, and never will
            return await self._fail(lease, ErrorInfo(DEFECT, str(exc)), definition, retryable=False)
        timeout = lease.options.get("timeout") or definition.timeout
        try:
            if timeout is None:
                result = await self._call(attempt, definition, payload)
            else:
                async with asyncio.timeout(timeout) as deadline:
                    result = await self._call(attempt, definition, payload)
        except asyncio.CancelledError:
            raise
        except RateLimited as exc:
            return await self._hold_starts(lease, exc, definition)
        except TimeoutError as exc:
            if timeout is not None and deadline.expired():
                metrics.FAILURES.labels(self._q, lease.name, "timeout").inc()
                info = ErrorInfo(TIMEOUT, f"handler exceeded its time limit of {timeout}s")
                return await self._fail(lease, info, definition)
            return await self._fail(lease, exc, definition)
        except Exception as exc:
            return await self._fail(lease, exc, definition)
        try:
            encoded = codec.dumps(result, f"result of {lease.name!r}")
        except ValueError as exc:  # a handler returning non-JSON is a defect of the handler
            return await self._fail(lease, ErrorInfo(DEFECT, str(exc)), definition, retryable=False)
        return await self._settle(lease, "complete", self._complete, lease, encoded)

    async def _hold_starts(self, lease: Lease, limited: RateLimited, definition: TaskDef) -> str:
        """A handler raised RateLimited: the queue's starts are held (first, so that no
        worker takes the task again before the hold is in force), then its task goes back
        to waiting, no handler failure counted. A retry_after out of bounds is a Defect."""
        try:
            check_number("RateLimited.retry_after", limited.retry_after, maximum=protocol.MAX_HOLD,
                         allow_none=False)
        except InvalidOption as exc:
            return await self._fail(lease, ErrorInfo(DEFECT, str(exc)), definition)
        log.info("task %s (%s): rate limited downstream, starts held for %ss", lease.task_id, lease.name,
                 limited.retry_after)
        try:  # no longer than the lease: the release after it must still land
            async with asyncio.timeout(max(0.01, lease.confirmed_until - time.monotonic())):
                await self.queue.hold_starts(limited.retry_after)
        except (RedisUnavailable, RedisRefused, asyncio.TimeoutError) as exc:
            log.warning("task %s: the hold of the queue's starts was not recorded (the task is released "
                        "anyway): %s", lease.task_id, str(exc) or "no reply in time")
        return await self._settle(lease, "release", lease.release)

    async def _complete(self, lease: Lease, encoded: str) -> None:
        lease._settled("complete", await self._completions.complete(lease, encoded), (Outcome.COMPLETED,))

    async def _call(self, attempt: _Attempt, definition: TaskDef, payload: Any) -> Any:
        """Run the handler; once it returns or raises, its slot may start a held lease."""
        args: tuple = ()
        if definition.arity >= 1:
            args = (payload,)
        if definition.arity >= 2:
            args = (payload, TaskContext(attempt.lease, asyncio.get_running_loop()))
        try:
            if definition.is_async:
                return await definition.fn(*args)
            # Sync handlers run in the pool; they cannot be interrupted, only abandoned.
            call = functools.partial(contextvars.copy_context().run, definition.fn, *args)
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        finally:
            self._handler_returned(attempt)

    async def _fail(self, lease: Lease, error: Any, definition: TaskDef | None, *,
                    retryable: bool | None = None) -> str:
        declared = definition.errors if definition else ()
        if isinstance(error, BaseException):
            kind = "handler" if isinstance(error, tuple(declared)) or hasattr(error, "error_tag") else "defect"
            metrics.FAILURES.labels(self._q, lease.name if definition else UNKNOWN_TASK_LABEL, kind).inc()
            log.warning("task %s (%s) attempt %d failed: %r", lease.task_id, lease.name, lease.attempt, error)
        retry = definition.retry if definition else None
        if self._tracing is not None:
            self._tracing.failed(error, declared)
        outcome = await self._settle(lease, "fail", lease.fail, error, retryable=retryable, retry=retry,
                                     declared=declared)
        if outcome == "retry" and self._tracing is not None:
            self._tracing.retry_scheduled(lease)
        return outcome

    async def _settle(self, lease: Lease, operation: str, call: Callable, *args: Any, **kwargs: Any) -> Any:
        """Send an acknowledgement; retryable errors are retried with the same token (a
        resend is answered with how it settled) until the lease can no longer be ours.
        Returns the true outcome, for metrics and logs."""
        backoff = 0.05
        bounded = operation == "complete"  # by CompletionBatcher, to its lease
        while True:
            try:  # a hung connection must not hold an acknowledgement past the lease
                if bounded:
                    result = await call(*args, **kwargs)
                else:
                    async with asyncio.timeout(max(0.01, lease.confirmed_until - time.monotonic())):
                        result = await call(*args, **kwargs)
                if operation == "fail":
                    return "retry" if result else "failed"
                return "completed" if operation == "complete" else "released"
            except AlreadySettled as exc:
                log.warning("task %s: %s answered: this attempt already settled as %s",
                            lease.task_id, operation, exc.outcome)
                return exc.outcome
            except LeaseLost:
                log.warning("task %s: %s rejected, lease lost (another attempt owns it now)", lease.task_id, operation)
                if self._tracing is not None:
                    self._tracing.stale_ack_rejected(operation)
                return "lease_lost"
            except (RedisUnavailable, asyncio.TimeoutError) as exc:
                if time.monotonic() + backoff >= lease.confirmed_until:
                    log.error("task %s: %s not confirmed before the lease ran out: %s", lease.task_id, operation,
                              str(exc) or "no reply in time")
                    return "lease_lost"
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            except RedisRefused as exc:
                log.error("task %s: %s refused; the lease will run out: %s", lease.task_id, operation, exc)
                return "lease_lost"

    # -- announcements and maintenance ------------------------------------------

    async def _announce_loop(self) -> None:
        """Tell the operator how busy this process is (it protects busy pods on scale-in).
        Separate from the heartbeat, so a slow announcement never delays a renewal."""
        backoff = BACKOFF_FIRST
        try:
            while not self._closing.is_set():
                if await self._announce(self.slots.in_flight):
                    backoff = BACKOFF_FIRST
                    await asyncio.sleep(WORKER_BEAT_INTERVAL)
                else:  # soon again: after an outage the announcement may be about to expire
                    await asyncio.sleep(min(backoff, WORKER_BEAT_INTERVAL))
                    backoff = min(backoff * 2, WORKER_BEAT_INTERVAL)
        finally:
            await self._announce(-1)

    async def _announce(self, in_flight: int) -> bool:
        try:
            beat = self.queue.worker_beat(self.name, in_flight, self.concurrency, ttl=3 * WORKER_BEAT_INTERVAL,
                                          pod=self.pod)
            await asyncio.wait_for(beat, WORKER_BEAT_INTERVAL)
            return True
        except (RedisUnavailable, asyncio.TimeoutError) as exc:
            log.debug("announcement skipped: %s", exc)
        except Exception as exc:  # judged in one place
            self.loop_failed("announce", exc)
        return False

    def _describe_leases(self) -> str:
        """What a blocked loop risks (read from the watchdog's thread: reads only)."""
        attempts = self.slots.attempts()
        if not attempts:
            return ""
        nearest = min(a.lease.confirmed_until for a in attempts) - time.monotonic()
        names = sorted({a.lease.name for a in attempts})
        return (f"; {len(attempts)} attempts in flight ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}),"
                f" the nearest lease confirmed for {max(0.0, nearest):.1f} s more")

    def interrupt(self, attempt: _Attempt, why: str, *, owned_elsewhere: bool = False) -> None:
        """Ownership can no longer be confirmed (or is gone: `owned_elsewhere`): stop the
        attempt. A held one never started: it is released (no stall) unless another owns it.
        One whose handler returned is left to its acknowledgement, which tells how it
        settled (a renewal that raced its completion answers "not owned" for a task that
        completed) and gives up at its lease's end by itself."""
        if attempt.lost:
            return
        attempt.lost = True  # no more renewals
        lease = attempt.lease
        if attempt.span is not None:
            AttemptTracing.lease_lost(attempt.span, why, owned_elsewhere)
        if attempt.task is None:  # held, never started: nothing runs, the lease is let go
            self._forget(attempt)
            if owned_elsewhere:
                log.warning("dropping held task %s (%s): %s", lease.task_id, lease.name, why)
            else:
                self.release_in_background(lease, f"held, {why}")
            return
        if not self.slots.is_running(lease.token):
            log.debug("task %s (%s): %s while its outcome is being sent; its acknowledgement tells how it settled",
                      lease.task_id, lease.name, why)
            return
        log.warning("interrupting task %s (%s): %s", lease.task_id, lease.name, why)
        attempt.task.cancel()

    async def _maintenance_loop(self) -> None:
        """Sweeps paced by what they find (maintenance.Pacing): every interval on a quiet
        queue, as often as a batch falls due under load, so deletion keeps up with completion."""
        pacing = maintenance.Pacing(self.maintenance_interval, self.maintenance_batch)
        backoff = BACKOFF_FIRST
        gap, last_end, bookkeeping_due = pacing.interval, time.monotonic(), 0.0
        while not self._stopping.is_set():
            # Jitter keeps a fleet of workers from sweeping in lockstep.
            await self._until(self._stopping, gap * random.uniform(0.5, 1.5))
            if self._stopping.is_set():
                return
            try:
                start = time.monotonic()
                bookkeeping = start >= bookkeeping_due  # settings and stats: once an interval, not per pass
                report = await self._maintain_once(pacing.budget, bookkeeping)
                end = time.monotonic()
                gap = pacing.gap(report.touched, end - last_end, end - start, report.more)
                last_end = end
                if bookkeeping:
                    bookkeeping_due = start + pacing.interval
                backoff = BACKOFF_FIRST
            except Exception as exc:  # judged in one place
                self.loop_failed("maintenance", exc, backoff)
                await self._until(self._stopping, backoff)
                backoff = min(backoff * 2, BACKOFF_LIMIT)

    async def _maintain_once(self, budget: float, bookkeeping: bool) -> MaintenanceReport:
        if bookkeeping:
            self._adopt(await self.queue.refresh_settings())
            self._tracing = AttemptTracing.resolve(self._q, self.trace_links, self._tracing)
        report = await self.queue.sweep(batch=self.maintenance_batch, budget=budget)
        if report.recovered:
            metrics.STALLS.labels(self._q, "recovered").inc(report.recovered)
        if report.stalled_failed:
            metrics.STALLS.labels(self._q, "failed").inc(report.stalled_failed)
        for cause, count in report.stall_causes.items():
            metrics.STALL_CAUSES.labels(self._q, cause).inc(count)
        metrics.MAINTENANCE_LAST.labels(self._q).set(time.time())
        if bookkeeping:
            metrics.record_stats(await self.queue.stats())
        return report
