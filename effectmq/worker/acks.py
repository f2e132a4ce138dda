"""Coalescing of completions: many finished attempts, one round trip.

While one batch is on its way to Redis, completions that finish meanwhile wait
for the next; an idle worker sends a lone completion at once, so batching adds
no latency. Every lease's token is still checked on its own by the script.

A worker also leases its next tasks in the same call (`along`): the slots the batch
frees are filled by its reply, so a busy worker makes one call per batch, not two.
Before the next batch goes, the attempts that reply started may join it, and a batch
waits for the rest of a wave (batch_timing.BatchTiming decides how long): otherwise each
call would carry a part of the slots for ever (a call's fixed cost is most of its cost),
and a wave split into two calls would stay split.

No completion waits past its own lease: a call is bounded by the earliest lease it
carries, and those waiting for the next call by one timer, set for the earliest of
theirs (a timeout per completion was a tenth of a busy worker's CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Protocol

from .batch_timing import JOIN_TURNS, BatchTiming

if TYPE_CHECKING:
    from ..client.engine import Lease, LeaseEngine
    from ..protocol.protocol import Outcome


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


class CompletionBatcher:
    def __init__(self, engine: "LeaseEngine", along: "LeasesAlong | None" = None):
        self.engine = engine
        self.along = along
        self._pending: list[tuple["Lease", str, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None
        self.timing = BatchTiming()
        self._joined = asyncio.Event()  # a completion arrived
        self._expiry: asyncio.TimerHandle | None = None  # for the earliest lease among those pending
        self._expiry_at = 0.0  # that lease's confirmed_until
        self._late: set[asyncio.Future] = set()  # calls whose batch stopped waiting, still out

    async def complete(self, lease: "Lease", result_json: str) -> int:
        """The Outcome the script gave this lease; raises RedisUnavailable or TimeoutError
        when the batch's outcome is unknown (safe to send again)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((lease, result_json, future))
        self.timing.completed(lease.token, time.monotonic())
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
        self.timing.started([lease.token for lease in leases], time.monotonic())

    async def _flush(self) -> None:
        while self._pending:
            await self._wait_for_wave()
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            self.timing.batch_went()
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
                    self.timing.replied(sent, time.monotonic(), [lease.token for lease in leases])
                else:
                    async with asyncio.timeout(left):
                        codes = await self.engine.complete_many(settled)
            except BaseException as exc:  # handed to every waiter
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
        """Let the attempts expected to finish soon join the batch about to go (BatchTiming)."""
        deadline = self.timing.wave_deadline(time.monotonic())
        if deadline is None:
            return
        while (left := deadline - time.monotonic()) > 0 and self.timing.expects_by(deadline):
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._joined.wait()

    async def _join_started(self) -> None:
        """Let the attempts the last reply started join the next batch (BatchTiming)."""
        for _ in range(JOIN_TURNS):
            if not self.timing.reply_started_unfinished():
                return
            await asyncio.sleep(0)
        deadline = self.timing.join_deadline()
        if deadline is None or self.along is None:
            return
        while len(self._pending) < self.along.in_flight and (left := deadline - time.monotonic()) > 0:
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._joined.wait()
