"""Coalescing of completions: many finished attempts, one round trip.

While one batch is on its way to Redis, completions that finish meanwhile wait
for the next; an idle worker sends a lone completion at once, so batching adds
no latency. Every lease's token is still checked on its own by the script.

A worker also leases its next tasks in the same call (`along`): the slots the batch
frees are filled by its reply, so a busy worker makes one call per batch, not two.
Before the next batch goes, the attempts that reply started may join it: those that
finish within a few turns of the loop, and, while handlers are short (under
JOIN_WAIT), every attempt in flight that finishes within twice their usual time and
one round trip of a batch. Otherwise each call would carry a part of the slots for
ever, and a call's fixed cost is most of its cost.

Longer handlers finish in waves: the leases of one reply start together and, when
their handlers are alike, finish within a fraction of a millisecond of each other.
A batch waits for the attempts expected to finish within WAVE_SHARE of the usual
handler time (at most one round trip), since any that finished just after it would
wait for its reply anyway; without this, a wave split into two calls and stayed split.

No completion waits past its own lease: a call is bounded by the earliest lease it
carries, and those waiting for the next call by one timer, set for the earliest of
theirs (a timeout per completion was a tenth of a busy worker's CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .engine import Lease, LeaseEngine
    from .protocol import Outcome


class LeasesAlong(Protocol):
    """What a worker takes along with its completions."""

    @property
    def lock_timeout(self) -> float | None:
        """The lease length to ask for (None: the queue's)."""

    @property
    def in_flight(self) -> int:
        """Attempts not yet settled (running, or waiting for their batch)."""

    def wanted(self, completing: int) -> int:
        """How many leases to ask for while `completing` attempts settle (0: none); the
        free slots among them stay reserved until `returned`."""

    def returned(self, reserved: int) -> None:
        """The call that asked for `reserved` free slots is back (whatever happened)."""

    def reserve(self, slots: int) -> None:
        """Keep `slots` more reserved (until `returned`) for a call still out."""

    def start(self, leases: list["Lease"]) -> None:
        """Run (or hold, with prefetch) the leases the call gave; it tells `started`
        when each attempt's handler begins."""

    def start_late(self, leases: list["Lease"]) -> list["Lease"]:
        """Run the leases of a call its batch stopped waiting for, as far as free slots
        allow (the batch's attempts may have sent their completions again, and been
        given leases for the same slots); hand back the rest. Returns those it runs."""

MAX_BATCH = 256
JOIN_TURNS = 3  # a handler with no I/O reaches complete() in two turns of the loop
JOIN_WAIT = 0.004  # seconds: handlers shorter than this are waited for, at most twice their time
WAVE_SHARE = 0.125  # of the usual handler time: how long a batch waits for the rest of a wave


class CompletionBatcher:
    def __init__(self, engine: "LeaseEngine", along: "LeasesAlong | None" = None):
        self.engine = engine
        self.along = along
        self._pending: list[tuple["Lease", str, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self._started: set[str] = set()  # tokens of the attempts the last reply started
        self._started_at = 0.0
        # token -> when its attempt started (monotonic), oldest first: insertion order
        self._running: dict[str, float] = {}
        self._joined = asyncio.Event()  # a completion arrived
        self.handler_time = JOIN_WAIT  # a moving average of their time to completion
        self._pending_time = 0.0  # the longest time to completion among those pending
        self.call_time = 0.0  # a moving average of a batch's round trip
        self._expiry: asyncio.TimerHandle | None = None  # for the earliest lease among those pending
        self._expiry_at = 0.0  # that lease's confirmed_until
        self._late: set[asyncio.Future] = set()  # calls whose batch stopped waiting, still out

    async def complete(self, lease: "Lease", result_json: str) -> int:
        """The Outcome the script gave this lease; raises RedisUnavailable or TimeoutError
        when the batch's outcome is unknown (safe to send again)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((lease, result_json, future))
        self._started.discard(lease.token)
        started = self._running.pop(lease.token, None)
        if started is not None:
            took = time.monotonic() - started
            self._pending_time = max(self._pending_time, took)
            self.handler_time += (took - self.handler_time) / 8
        self._joined.set()
        if self._expiry is None or lease.confirmed_until < self._expiry_at:
            self._expire_at(lease.confirmed_until)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    def _expire_at(self, confirmed_until: float) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        loop = asyncio.get_running_loop()
        self._expiry_at = confirmed_until
        self._expiry = loop.call_at(loop.time() + confirmed_until - time.monotonic(), self._expire)

    def _expire(self) -> None:
        """Completions still pending whose lease ran out get TimeoutError (their outcome is
        unknown to them: a resend may follow while they may); the timer moves on."""
        self._expiry = None
        now, kept = time.monotonic(), []
        for entry in self._pending:
            lease, _, future = entry
            if lease.confirmed_until > now:
                kept.append(entry)
            elif not future.done():
                future.set_exception(TimeoutError(f"task {lease.task_id}: its lease ran out before its batch went"))
        self._pending = kept
        if kept:
            self._expire_at(min(lease.confirmed_until for lease, _, _ in kept))

    def started(self, leases: list["Lease"]) -> None:
        """Attempts that began now (their handlers' time is measured from here)."""
        now = time.monotonic()
        self._forget_overdue(now)
        for lease in leases:
            self._running[lease.token] = now

    def _wave_window(self) -> float:
        return min(self.call_time, WAVE_SHARE * self.handler_time)

    def _forget_overdue(self, now: float) -> None:
        """Attempts far past the usual time are not expected soon (or ended otherwise:
        failed, released, never started)."""
        oldest = now - self._wave_window() - self._expected_time()
        while self._running and self._first_start() < oldest:
            del self._running[next(iter(self._running))]

    def _first_start(self) -> float:
        return next(iter(self._running.values()))

    def _expected_time(self) -> float:
        """How long an attempt in flight is expected to take: the usual time, or that of
        the completions about to go when longer (a wave late as a whole is still one)."""
        return max(self.handler_time, self._pending_time)

    async def _flush(self) -> None:
        while self._pending:
            await self._wait_for_wave()
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            self._pending_time = 0.0
            # Bounded by the batch's earliest lease: a hung connection must not hold every
            # later completion (the waiters resend, with the same tokens, while they may).
            left = max(0.01, min(lease.confirmed_until for lease, _, _ in batch) - time.monotonic())
            settled = [(lease, result) for lease, result, _ in batch]
            along = self.along
            want = along.wanted(len(batch)) if along else 0
            leases: list["Lease"] = []
            try:
                if along and want > 0:
                    sent = time.monotonic()
                    codes, leases = await self._complete_and_acquire(along, settled, want, left)
                    self._started = {lease.token for lease in leases}
                    self._started_at = time.monotonic()
                    self.call_time += (self._started_at - sent - self.call_time) / 8
                else:
                    async with asyncio.timeout(left):
                        codes = await self.engine.complete_many(settled)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiter
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, _, future), code in zip(batch, codes):
                if not future.done():
                    future.set_result(code)
            if leases:
                await self._join_started()

    async def _complete_and_acquire(self, along: LeasesAlong, settled: list, want: int,
                                    left: float) -> tuple[list["Outcome"], list["Lease"]]:
        """Settle a batch and lease `want` tasks for the slots it frees. When the batch's
        earliest lease runs out first, its waiters get TimeoutError, but the call is not
        cancelled: Redis may have run it, and the leases its reply brings are started
        (or handed back by the worker, when late) rather than left to stall. The batch's
        slots stay reserved until then."""
        call = asyncio.ensure_future(self.engine.complete_and_acquire(settled, want, lock_timeout=along.lock_timeout))
        try:
            done, _ = await asyncio.wait((call,), timeout=left)
        except asyncio.CancelledError:
            call.cancel()
            along.returned(want - len(settled))
            raise
        if not done:
            along.reserve(len(settled))
            self._late.add(call)
            call.add_done_callback(lambda _: self._late_reply(call, along, want))
            raise TimeoutError(f"no reply within the batch's earliest lease ({left:.2f}s)")
        along.returned(want - len(settled))
        codes, leases = call.result()
        along.start(leases)
        return codes, leases

    def _late_reply(self, call: asyncio.Future, along: LeasesAlong, reserved: int) -> None:
        self._late.discard(call)
        along.returned(reserved)
        if call.cancelled() or call.exception() is not None:
            return  # no reply, so no lease known: the engine hands back what the call took (reclaim)
        _codes, leases = call.result()
        along.start_late(leases)

    async def wait_late(self, timeout: float) -> None:
        """Wait (a drain) for the calls whose batch stopped waiting: the leases their replies
        bring are handed back by `start_late`. Those still out after `timeout` are given up
        (cancelled: the engine counts them lost, and reclaims what they leased)."""
        late = list(self._late)
        if not late:
            return
        _done, pending = await asyncio.wait(late, timeout=timeout)
        for call in pending:
            call.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)

    async def _wait_for_wave(self) -> None:
        """Let the attempts expected to finish soon join the batch about to go (module docstring)."""
        window = self._wave_window()
        if window <= 0 or not self._running:
            return
        now = time.monotonic()
        self._forget_overdue(now)
        deadline = now + window
        # The attempt that started first is the first expected.
        while (left := deadline - time.monotonic()) > 0 and self._running and \
                self._first_start() + self._expected_time() <= deadline:
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._joined.wait()

    async def _join_started(self) -> None:
        """Let the attempts the last reply started join the next batch (module docstring)."""
        for _ in range(JOIN_TURNS):
            if not self._started:
                return
            await asyncio.sleep(0)
        if self.handler_time >= JOIN_WAIT or self.along is None:
            return
        # At most one more round trip's time: when Redis is busy, batches grow.
        deadline = self._started_at + min(2 * self.handler_time, self.call_time)
        while len(self._pending) < self.along.in_flight and (left := deadline - time.monotonic()) > 0:
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._joined.wait()
