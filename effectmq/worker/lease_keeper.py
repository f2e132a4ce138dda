"""The worker's heartbeat loop: every lease in flight renewed in one round trip.

heartbeat.py decides (pure) when a lease is renewed and when its ownership can no longer
be confirmed; this loop applies it to the worker's attempts, held ones included, and
hands back the leases auto prefetch held too long. It sees the worker through
slots.WorkerContext only: it asks the worker to interrupt or hand back an attempt, and
to judge an error, and never touches its fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Protocol

from . import heartbeat

if TYPE_CHECKING:
    from ..client.engine import Lease, LeaseEngine
    from .prefetch import Prefetch
    from .slots import WorkerContext

TIMER_SLACK = 0.005  # seconds: a timeout set for a window's close may fire a hair before it


class KeptAttempt(Protocol):
    """What the loop reads and writes of an attempt."""

    lease: "Lease"
    task: asyncio.Task | None  # None while held
    next_renew: float  # monotonic: when its lease is renewed next
    lost: bool  # ownership gone: no more renewals
    started: float  # monotonic: when leased (held: since when)


def renewable(attempt: KeptAttempt) -> bool:
    """Still ours and not settled: a held attempt (no task yet) is renewed like a running one."""
    return not attempt.lost and (attempt.task is None or not attempt.task.done())


class LeaseKeeper:
    def __init__(self, worker: "WorkerContext", engine: "LeaseEngine", prefetch: "Prefetch",
                 lock_refresh: float | None):
        self.worker = worker
        self.engine = engine
        self.prefetch = prefetch
        self.lock_refresh = lock_refresh
        self._new_lease = asyncio.Event()  # set when a new lease needs a faster tick
        self._sleep = 0.0  # the loop's current sleep (0: not asleep)

    def refresh_interval(self, lock_timeout: float) -> float:
        return heartbeat.refresh_interval(lock_timeout, self.lock_refresh)

    def noticed(self, refresh: float) -> None:
        """A new lease is renewed every `refresh`: wake the loop sooner when it must."""
        if heartbeat.tick(refresh) < self._sleep:
            self._new_lease.set()

    def tick(self) -> float:
        """A quarter of the shortest renewal interval in flight (the granted leases decide)."""
        leases = [a.lease.lock_timeout for a in self.worker.slots.attempts()] or [self.worker.lock_timeout]
        return heartbeat.tick(self.refresh_interval(min(leases)))

    async def run(self, closing: asyncio.Event) -> None:
        """Renew until `closing` is set; an error is the worker's to judge."""
        while not closing.is_set():
            self._sleep = self.tick()
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(self._sleep):  # a new lease may need a faster tick
                    await self._new_lease.wait()
            self._sleep = 0.0  # awake: new leases are seen by this pass or the next
            self._new_lease.clear()
            try:
                await self.once()
            except Exception as exc:  # the safety window alone interrupts handlers
                self.worker.loop_failed("heartbeat", exc)

    async def once(self) -> None:
        worker, now = self.worker, time.monotonic()
        for attempt in [a for a in worker.slots.held() if self.prefetch.hand_back(now - a.started)]:
            # routine for auto prefetch behind slow handlers: it adapts, nothing is wrong
            worker.hand_back(attempt, f"held {now - attempt.started:.1f} s without a free slot", logging.INFO)
        due: list[KeptAttempt] = []
        for attempt in worker.slots.attempts():
            if not renewable(attempt):
                continue
            lease = attempt.lease
            action = heartbeat.decide(now, attempt.next_renew, lease.confirmed_until,
                                      heartbeat.safety_margin(lease.lock_timeout))
            if action is heartbeat.Action.INTERRUPT:
                worker.interrupt(attempt, "lease could not be confirmed in time")
            elif action is heartbeat.Action.RENEW:
                due.append(attempt)
        if not due:
            return
        margin = min(heartbeat.safety_margin(a.lease.lock_timeout) for a in due)
        budget = max(0.01, min(a.lease.confirmed_until for a in due) - margin - now)
        # An error here is judged by run(); renewal is tried again on the next tick, until
        # the safety window closes.
        try:
            async with asyncio.timeout(budget):
                owned = await self.engine.renew([a.lease for a in due])
        except Exception:
            # The budget ends where the first safety window closes: interrupt now, not a
            # tick later (with a short lease a tick is most of the margin).
            closed_by = time.monotonic() + TIMER_SLACK
            for attempt in due:
                lease = attempt.lease
                if renewable(attempt) and heartbeat.spent(closed_by, lease.confirmed_until, lease.lock_timeout):
                    worker.interrupt(attempt, "lease could not be confirmed in time")
            raise
        for attempt, ok in zip(due, owned):
            if ok:
                attempt.next_renew = time.monotonic() + self.refresh_interval(attempt.lease.lock_timeout)
            else:
                worker.interrupt(attempt, "lease lost", owned_elsewhere=True)
