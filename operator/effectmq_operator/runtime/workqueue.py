"""The per-key work queue of the reconcilers.

It schedules `work(key)` the way controller-runtime's does: one run at a time per
key, a bounded number at once, each under a deadline; again when its result
(`Reconciled`, controller-runtime's `Result`) asks, with backoff when it failed,
and at once when the key was nudged, also when the nudge came while a run was
still reading the old state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from .registry import Key

log = logging.getLogger("effectmq.operator")


def backoff(failures: int, cap: float) -> float:
    return min(cap, 0.5 * 2 ** min(failures, 10))


@dataclass(frozen=True)
class Reconciled:
    """What a reconcile asks of the work queue: when to run the key again."""

    requeue_after: float | None = None  # seconds until the next run; None: the key's usual interval
    retry: bool = False  # it failed: again with backoff (from 0.5 s, doubling, up to requeue_after)


DONE = Reconciled()
RETRY = Reconciled(retry=True)


def next_run(result: Reconciled | None, failures: int, interval: float, retry_cap: float) -> tuple[float, int]:
    """Seconds until a key runs again after `result` (None: the run raised), and its
    failures in a row since."""
    if result is not None and not result.retry:
        return (interval if result.requeue_after is None else result.requeue_after), 0
    latest = interval if result is None or result.requeue_after is None else result.requeue_after
    return backoff(failures + 1, min(retry_cap, latest)), failures + 1


@dataclass
class _Slot:
    due: float = 0.0
    failures: int = 0
    nudged: bool = False
    finished_at: float | None = None
    task: asyncio.Task | None = None


class WorkQueue:
    def __init__(self, work: Callable[[Key], Awaitable[Reconciled]], *, interval: Callable[[Key], float],
                 retry_cap: float = 30.0, concurrency: int = 32, deadline: float = 20.0,
                 describe: Callable[[Key, BaseException], str] = lambda key, exc: str(exc)):
        self._work = work
        self._interval = interval
        self._retry_cap = retry_cap
        self._deadline = deadline
        self._describe = describe
        self._limit = asyncio.Semaphore(concurrency)
        self._slots: dict[Key, _Slot] = {}
        self._term_started = time.monotonic()
        self.on_finished: Callable[[Key, bool], Any] | None = None

    def nudge(self, key: Key) -> None:
        slot = self._slots.setdefault(key, _Slot())
        slot.due, slot.nudged = 0.0, True

    def forget(self, key: Key) -> None:
        slot = self._slots.pop(key, None)
        if slot and slot.task and not slot.task.done():
            slot.task.cancel()

    def reset(self) -> None:
        """A new leadership term: everything is due now, nothing has been done yet."""
        self._term_started = time.monotonic()
        for slot in self._slots.values():
            slot.due, slot.finished_at = 0.0, None

    def start_due(self, keys) -> None:
        now = time.monotonic()
        for key in keys:
            slot = self._slots.setdefault(key, _Slot())
            if slot.due <= now and (slot.task is None or slot.task.done()):
                slot.task = asyncio.create_task(self._run(key, slot), name=f"reconcile {key[0]}/{key[1]}")

    def due(self, key: Key) -> float | None:
        """When the key runs next (monotonic seconds; 0: at once, inf: running now)."""
        slot = self._slots.get(key)
        return slot.due if slot else None

    async def run_due(self, keys) -> None:
        """Start what is due and wait for it (tests and one-shot tools)."""
        self.start_due(keys)
        await asyncio.gather(*[s.task for k, s in self._slots.items() if k in keys and s.task])

    def oldest_age(self) -> float:
        """Seconds since the least recently finished key finished (in a steady state, one full pass)."""
        if not self._slots:
            return 0.0
        finished = [s.finished_at for s in self._slots.values()]
        done = [f for f in finished if f is not None]
        oldest = self._term_started if len(done) < len(finished) else min(done)
        return time.monotonic() - oldest

    async def _run(self, key: Key, slot: _Slot) -> None:
        slot.due, slot.nudged = float("inf"), False  # not again until this run is done
        result: Reconciled | None = None
        try:
            async with self._limit:
                result = await asyncio.wait_for(self._work(key), self._deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            quiet = type(exc).__name__ == "NotLeader"  # leadership just ended: not a failure of this key
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s/%s: reconcile failed: %s", *key,
                    self._describe(key, exc))
        finally:
            if self._slots.get(key) is slot:
                wait, slot.failures = next_run(result, slot.failures, self._interval(key), self._retry_cap)
                slot.due = 0.0 if slot.nudged else time.monotonic() + wait
                slot.finished_at = time.monotonic()
                if self.on_finished:
                    self.on_finished(key, slot.failures == 0)

    async def stop(self) -> None:
        tasks = [s.task for s in self._slots.values() if s.task and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
