"""A worker's capacity in one place: the slot ledger (pure, no I/O).

A worker has `concurrency` handler slots and, with prefetch, places to hold leases
ahead of them (prefetch.Prefetch decides how many: `ahead`). Each slot is free, asked
for by a call now out (the acquire loop's, or a completion batch that takes leases
along), or taken by an attempt here (running, held, or settling):

    free = concurrency + ahead - attempts - asking

`free` is negative for a moment while the slots a completion batch frees are refilled
by its own reply (the new attempts come before the settled ones leave). Of the attempts,
at most `concurrency` run a handler; the rest are held, oldest first, until a handler
returns, or settling (their handler returned, their acknowledgement is out).
`SlotLedger.check` asserts what must hold between any two operations.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Callable, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from ..client.engine import Lease

A = TypeVar("A")  # what the worker keeps per attempt (the ledger only stores it)


class SlotLedger(Generic[A]):
    """The counters of a worker's capacity, changed only through these operations."""

    def __init__(self, concurrency: int, ahead: Callable[[], int], on_free: Callable[[], None] = lambda: None):
        self.concurrency = concurrency
        self._ahead = ahead  # leases to hold ahead now (prefetch.Prefetch.ahead)
        self._on_free = on_free  # told when slots may have become free (the acquire loop waits for it)
        self._attempts: dict[str, A] = {}  # by lease token: two attempts of one task may meet here
        self._newest: dict[str, A] = {}  # by task id: its newest attempt here (older ones are interrupted)
        self._held: collections.OrderedDict[str, A] = collections.OrderedDict()  # by token, oldest first
        self._running: set[str] = set()  # tokens of the attempts whose handler runs
        self._asking = 0  # slots the calls now out ask leases for

    # -- what is taken -----------------------------------------------------------

    def free(self) -> int:
        """Slots (and places to hold leases ahead) neither taken by an attempt nor asked
        for by a call now out; negative while a batch's reply refills the slots it frees."""
        return self.concurrency + self._ahead() - len(self._attempts) - self._asking

    @property
    def in_flight(self) -> int:
        """Attempts here not yet settled: running, held or settling."""
        return len(self._attempts)

    @property
    def running(self) -> int:
        """Attempts whose handler runs."""
        return len(self._running)

    @property
    def held_count(self) -> int:
        return len(self._held)

    @property
    def asking(self) -> int:
        return self._asking

    def attempts(self) -> list[A]:
        """Every attempt here (a copy: safe to read from another thread, or while leaving)."""
        return list(self._attempts.values())

    def held(self) -> list[A]:
        """The held attempts, oldest first (a copy)."""
        return list(self._held.values())

    def get(self, token: str) -> A | None:
        return self._attempts.get(token)

    def newest(self, task_id: str) -> A | None:
        """This task's newest attempt here, if any."""
        return self._newest.get(task_id)

    def is_running(self, token: str) -> bool:
        return token in self._running

    # -- calls that ask for leases -----------------------------------------------

    def ask(self) -> int:
        """Reserve every free slot for a call about to ask for leases; how many (0: none).
        The call gives them back with `answered` whatever happens to it."""
        free = max(0, self.free())
        self._asking += free
        return free

    def reserve(self, slots: int) -> None:
        """Keep `slots` more reserved for a call still out (until `answered`)."""
        self._asking += slots

    def answered(self, slots: int) -> None:
        """A call that reserved `slots` is back: its leases, if any, are admitted next, and
        the slots they do not fill are free again."""
        self._asking -= slots
        if slots:
            self._on_free()

    # -- attempts ------------------------------------------------------------------

    def admit(self, token: str, task_id: str, attempt: A) -> bool:
        """A lease given to this worker takes a slot: True when a handler slot is free (it
        runs now, counted as running), False when it is held until one is."""
        self._attempts[token] = attempt
        self._newest[task_id] = attempt
        if len(self._running) < self.concurrency:
            self._running.add(token)
            return True
        self._held[token] = attempt
        return False

    def returned(self, token: str) -> bool:
        """The attempt's handler returned (or never ran): its handler slot is free, its
        attempt stays until `leave`. False when it was not running (said already, held)."""
        if token not in self._running:
            return False
        self._running.remove(token)
        return True

    def next_held(self) -> A | None:
        """The oldest held attempt, taken out of the held ones and counted as running, when
        a handler slot is free; None otherwise."""
        if not self._held or len(self._running) >= self.concurrency:
            return None
        token, attempt = self._held.popitem(last=False)
        self._running.add(token)
        return attempt

    def leave(self, token: str, task_id: str) -> None:
        """The attempt is done here (settled, handed back, lost): its slot is free."""
        attempt = self._attempts.pop(token, None)
        if attempt is not None:
            self._running.discard(token)
            self._held.pop(token, None)
            if self._newest.get(task_id) is attempt:
                del self._newest[task_id]
        self._on_free()

    # -- the invariant -------------------------------------------------------------

    def check(self) -> None:
        """What holds between any two operations (the tests call it after every step)."""
        assert self._asking >= 0, f"more slots answered than asked for ({self._asking})"
        assert len(self._running) <= self.concurrency, (len(self._running), self.concurrency)
        assert self._running <= self._attempts.keys(), "a running attempt that is not in flight"
        assert self._held.keys() <= self._attempts.keys(), "a held attempt that is not in flight"
        assert not self._running & self._held.keys(), "an attempt both held and running"
        in_flight = {id(attempt) for attempt in self._attempts.values()}
        assert all(id(attempt) in in_flight for attempt in self._newest.values()), "a newest attempt not in flight"


class WorkerContext(Protocol):
    """What the worker's collaborators (the leases its completion batches take along,
    lease_keeper.LeaseKeeper) see of it: its slots, and the few things they may ask of it.
    BullMQ's LockManagerWorkerContext is the model: a narrow interface, not the worker."""

    @property
    def slots(self) -> SlotLedger[Any]: ...

    @property
    def stopping(self) -> bool:
        """The worker drains: no new attempts start."""

    @property
    def lock_timeout(self) -> float:
        """The lease length it asks for."""

    def run_leases(self, leases: list[Lease]) -> bool:
        """Start (or hold) the attempts of leases a call gave; False, and the leases handed
        back, when the worker stopped while the call was out."""

    def release_in_background(self, lease: Lease, why: str, level: int = logging.WARNING) -> None:
        """Hand a lease that will not run here back to the queue (no stall), logging why."""

    def hand_back(self, attempt: Any, why: str, level: int = logging.WARNING) -> None:
        """A held attempt will not start here: it goes back to the queue (no stall)."""

    def interrupt(self, attempt: Any, why: str, *, owned_elsewhere: bool = False) -> None:
        """Ownership of the attempt can no longer be confirmed (or is gone): stop it."""

    def loop_failed(self, loop: str, exc: BaseException, retry_in: float | None = None) -> None:
        """Judge a loop's error: logged and backed off from, or the worker stops with it."""
