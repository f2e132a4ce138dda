"""Coalescing of completions: many finished attempts, one round trip.

While one batch is on its way to Redis, completions that finish meanwhile wait
for the next; an idle worker sends a lone completion at once, so batching adds
no latency. Every lease's token is still checked on its own by the script.

A worker also leases its next tasks in the same call (`along`): the slots the batch
frees are filled by its reply, so a busy worker makes one call per batch, not two.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .engine import Lease, LeaseEngine


class LeasesAlong(Protocol):
    """What a worker takes along with its completions."""

    @property
    def lock_timeout(self) -> float | None:
        """The lease length to ask for (None: the queue's)."""

    def wanted(self, completing: int) -> int:
        """How many leases to ask for while `completing` attempts settle (0: none); the
        free slots among them stay reserved until `returned`."""

    def returned(self, reserved: int) -> None:
        """The call that asked for `reserved` free slots is back (whatever happened)."""

    def start(self, leases: list["Lease"]) -> None:
        """Run the leases the call gave."""

MAX_BATCH = 256
JOIN_TURNS = 3  # a handler with no I/O reaches complete() in two turns of the loop


class CompletionBatcher:
    def __init__(self, engine: "LeaseEngine", along: "LeasesAlong | None" = None):
        self.engine = engine
        self.along = along
        self._pending: list[tuple["Lease", str, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    async def complete(self, lease: "Lease", result_json: str) -> int:
        """The Outcome the script gave this lease; raises RedisUnavailable or TimeoutError
        when the batch's outcome is unknown (safe to send again)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((lease, result_json, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            # Bounded by the batch's earliest lease: a hung connection must not hold every
            # later completion (the waiters resend, with the same tokens, while they may).
            left = max(0.01, min(lease.confirmed_until for lease, _, _ in batch) - time.monotonic())
            settled = [(lease, result) for lease, result, _ in batch]
            along = self.along
            want = along.wanted(len(batch)) if along else 0
            leases: list["Lease"] = []
            try:
                if along and want > 0:
                    call = self.engine.complete_and_acquire(settled, want, lock_timeout=along.lock_timeout)
                    try:
                        async with asyncio.timeout(left):
                            codes, leases = await call
                    finally:
                        along.returned(want - len(batch))
                    along.start(leases)
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
            # A few turns of the loop before the next batch, so that attempts just started
            # which finish at once join it: else each call carries half the slots, and the
            # other half rides the next one (twice the calls per task, for ever).
            before = len(self._pending)
            for _ in range(JOIN_TURNS if leases else 0):
                if len(self._pending) - before >= len(leases):
                    break
                await asyncio.sleep(0)
