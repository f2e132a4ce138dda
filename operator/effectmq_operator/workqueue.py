"""What the reconcilers share: the registry of watched objects and the per-key work queue.

The work queue schedules `work(key)` the way controller-runtime's does: one run at a
time per key, a bounded number at once, each under a deadline; again after the
key's interval when it succeeded, with backoff when it failed, and at once when the
key was nudged, also when the nudge came while a run was still reading the old state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

Key = tuple[str, str]
log = logging.getLogger("effectmq.operator")


def key_of(body: dict) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def newer(incoming: dict, known: dict | None) -> bool:
    """Whether a watched object is at least as new as the one we hold (resourceVersions
    are etcd revisions here; when they do not compare as numbers, trust arrival order)."""
    if known is None:
        return True
    a, b = incoming["metadata"].get("resourceVersion", ""), known["metadata"].get("resourceVersion", "")
    return not (a.isdigit() and b.isdigit()) or int(a) >= int(b)


def backoff(failures: int, cap: float) -> float:
    return min(cap, 0.5 * 2 ** min(failures, 10))


# The watch streams can start late: the API server answers a watch of a newly created
# CRD with 429 "storage is (re)initializing" until its watch cache is ready, and kopf
# retries after 1, 1, 2, 3, 5, 8, 13 and 21 s. Until a registry's watch has reported
# something, or STARTUP_WINDOW has passed, it lists every STARTUP_RELIST_EVERY seconds,
# so an object created meanwhile waits seconds, not a whole relist period.
STARTUP_WINDOW = 120.0
STARTUP_RELIST_EVERY = 2.0


class Registry:
    """The latest version of each watched object, by key; newer versions win. A full
    list every `relist_every` seconds (more often in the first STARTUP_WINDOW) heals
    whatever the watch stream missed or has not reported yet."""

    def __init__(self, lister: Callable[[], Awaitable[list[dict]]], *, relist_every: float = 60.0,
                 on_listed: Callable[[str, dict, dict | None], Any] | None = None):
        self.items: dict[Key, dict] = {}
        self.synced = asyncio.Event()  # set after the first full list
        self._lister = lister
        # Told of what a list found that the watch had not reported, as a watch event would
        # have: (ADDED or MODIFIED, the listed body, the one held before) or (DELETED, the
        # body held, None).
        self._on_listed = on_listed
        self._relist_every = relist_every
        self._startup_until = time.monotonic() + STARTUP_WINDOW
        self._next_list = 0.0
        self._gone: dict[str, float] = {}  # uids deleted recently: a stale list must not resurrect them
        self._stored_at: dict[Key, float] = {}  # when each held version was stored (monotonic)

    def watch_reported(self) -> None:
        """The watch stream runs: the lists go back to their usual period."""
        self._startup_until = 0.0

    def put(self, body: dict) -> dict | None:
        """Store a watched version; returns the one held before."""
        key = key_of(body)
        if body["metadata"].get("uid") in self._gone:
            return None
        old = self.items.get(key)
        if newer(body, old):
            self.items[key] = body
            self._stored_at[key] = time.monotonic()
        return old

    def drop(self, body: dict) -> dict | None:
        self._gone[body["metadata"].get("uid")] = time.monotonic()
        self._stored_at.pop(key_of(body), None)
        if len(self._gone) > 10_000:
            cutoff = time.monotonic() - 600
            self._gone = {u: t for u, t in self._gone.items() if t > cutoff}
        return self.items.pop(key_of(body), None)

    async def refresh(self, deadline: float, what: str) -> bool:
        """List everything when due; True once the registry has been in sync."""
        if time.monotonic() >= self._next_list:
            started = time.monotonic()
            try:
                listed = await asyncio.wait_for(self._lister(), deadline)
            except Exception as exc:
                log.warning("listing %s failed: %s", what, exc)
                self._next_list = time.monotonic() + 2.0
            else:
                self._replace_all(listed, started)
                now = time.monotonic()
                self._next_list = now + (STARTUP_RELIST_EVERY if now < self._startup_until else self._relist_every)
                self.synced.set()
        return self.synced.is_set()

    def _replace_all(self, bodies: list[dict], started: float) -> None:
        """Hold what a list that began at `started` found. One held but not listed is gone,
        unless it was stored after the list began: the list is a snapshot older than that
        (a watch event of a new object often beats the list it is missing from)."""
        listed = {key_of(b): b for b in bodies if b["metadata"].get("uid") not in self._gone}
        changes: list[tuple[str, dict, dict | None]] = []
        for key in [k for k in self.items if k not in listed and self._stored_at.get(k, 0.0) < started]:
            self._stored_at.pop(key, None)
            changes.append(("DELETED", self.items.pop(key), None))
        for key, body in listed.items():
            old = self.put(body)
            if self.items.get(key) is body:
                changes.append(("ADDED" if old is None else "MODIFIED", body, old))
        if self._on_listed:
            for change in changes:
                self._on_listed(*change)


@dataclass
class _Slot:
    due: float = 0.0
    failures: int = 0
    nudged: bool = False
    finished_at: float | None = None
    task: asyncio.Task | None = None


class WorkQueue:
    def __init__(self, work: Callable[[Key], Awaitable[bool]], *, interval: Callable[[Key], float],
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
        ok = False
        try:
            async with self._limit:
                ok = await asyncio.wait_for(self._work(key), self._deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            quiet = type(exc).__name__ == "NotLeader"  # leadership just ended: not a failure of this key
            log.log(logging.DEBUG if quiet else logging.WARNING, "%s/%s: reconcile failed: %s", *key,
                    self._describe(key, exc))
        finally:
            if self._slots.get(key) is slot:
                slot.failures = 0 if ok else slot.failures + 1
                wait = self._interval(key) if ok else backoff(slot.failures, min(self._retry_cap, self._interval(key)))
                slot.due = 0.0 if slot.nudged else time.monotonic() + wait
                slot.finished_at = time.monotonic()
                if self.on_finished:
                    self.on_finished(key, ok)

    async def stop(self) -> None:
        tasks = [s.task for s in self._slots.values() if s.task and not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
