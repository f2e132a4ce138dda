"""The status mirror: the scheduler's state of each schedule copied into its Schedule's status.

It reads only the schedules whose state changed: the scheduler numbers every change
in its change feed, and the mirror reads the feed after its cursor (whoever made the
change: this operator's pass, another scheduler, an earlier leader). A full round
(each term's first, then every MIRROR_RESYNC_EVERY) compares every schedule, so a
change missed (a failed write, a feed that was reset) heals. Each tick loop runs one
mirror round per pass on its Redis.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from . import builders
from .redis_pool import Connections, RedisTarget
from .runtime.kube import Kube
from .runtime.registry import Key, Registry
from .schedule_plan import due_mirror, progress_differs, schedule_key
from .status import schedule_progress

MIRROR_RESYNC_EVERY = 300.0  # seconds between full mirror rounds
MIRROR_BATCH = 1000  # changes read, and schedules compared by a full round, per mirror round
MIRROR_WRITES_AT_ONCE = 16  # status patches in flight per mirror round (the API pool has 32 threads)


@dataclass
class ScheduleRuntime:
    """What the leader remembers about one Schedule between reconciles."""

    placed: RedisTarget | None = None  # where the definition is stored
    stored: str | None = None  # the definition as last stored there (JSON)
    mirrored_at: float | None = None  # monotonic time its ticks were last copied into the status


@dataclass
class MirrorFeed:
    """Where the status mirror of one Redis stands in that Redis' change feed."""

    cursor: int | None = None  # the last change number mirrored; None: a full round is due
    full_at: float = 0.0  # monotonic time of the next full round
    resync: list[str] = field(default_factory=list)  # what the full round under way has still to compare
    held: set[str] = field(default_factory=set)  # changed, written once MIRROR_EVERY allows


class StatusMirror:
    def __init__(self, kube: Kube, connections: Connections, schedules: Registry, runtime: dict[Key, ScheduleRuntime]):
        self.kube = kube
        self.connections = connections
        self.schedules = schedules
        self.runtime = runtime
        self.feeds: dict[RedisTarget, MirrorFeed] = {}

    def forget(self) -> None:
        """A new term starts with a full round on every Redis."""
        self.feeds.clear()

    async def round(self, target: RedisTarget) -> None:
        """Copy the scheduler's state of the schedules that changed into their status:
        a page of the changes after the feed's cursor, and a slice of a full round
        while one is under way (MIRROR_BATCH each: a round never holds up the ticks
        for long). The cursor moves only once the statuses are written: a round that
        fails is read again."""
        store = self.connections.scheduler(target).store
        feed = self.feeds.setdefault(target, MirrorFeed())
        if feed.cursor is None or time.monotonic() >= feed.full_at:
            last = await store.last_change()
            if feed.cursor is None or last < feed.cursor:
                feed.cursor = last  # first round, or the feed was reset: the full round covers what came before
            feed.resync = [builders.schedule_id(*key) for key, rt in self.runtime.items() if rt.placed == target]
            feed.full_at = time.monotonic() + MIRROR_RESYNC_EVERY
        if feed.resync:
            resync = feed.resync[:MIRROR_BATCH]
            await self._write_progress(target, resync, throttled=False)
            del feed.resync[:len(resync)]
        changes = await store.changes(after=feed.cursor, limit=MIRROR_BATCH)
        await self._mirror_changes(target, feed, [i for i, _ in changes])
        if changes:
            feed.cursor = changes[-1][1]

    async def _mirror_changes(self, target: RedisTarget, feed: MirrorFeed, schedule_ids: list[str]) -> None:
        """Write the status of schedules that changed (and of those held back) where it
        differs; one whose change was written less than MIRROR_EVERY ago is held back."""
        ours = {}
        for schedule_id in (*schedule_ids, *feed.held):
            rt = self.runtime.get(schedule_key(schedule_id))
            if rt is not None and rt.placed == target:
                ours[schedule_id] = rt.mirrored_at
        due, feed.held = due_mirror(schedule_ids, sorted(feed.held), ours, time.monotonic())
        await self._write_progress(target, due, throttled=True)

    async def _write_progress(self, target: RedisTarget, schedule_ids: list[str], *, throttled: bool) -> None:
        """Write the scheduler's state of these schedules into their status where it
        differs. A write of a change (`throttled`) that shows a new tick starts the
        MIRROR_EVERY hold; one of a full round does not (a change right after it is
        written at once), nor one without a new tick: the first tick after a change
        that placed or edited the Schedule is shown at once, not 30 s later."""
        scheduler = self.connections.scheduler(target)
        writes = asyncio.Semaphore(MIRROR_WRITES_AT_ONCE)

        async def write(key: Key, rt: ScheduleRuntime, progress: dict, ticked: bool) -> None:
            async with writes:
                written = await self.kube.patch_status("schedules", key[0], key[1], progress)
            if throttled and ticked:
                rt.mirrored_at = time.monotonic()
            if written is not None:
                self.schedules.put(written)

        for start in range(0, len(schedule_ids), MIRROR_BATCH):
            chunk = schedule_ids[start:start + MIRROR_BATCH]
            pending = []
            for schedule_id, state in zip(chunk, await scheduler.statuses(chunk)):
                key = schedule_key(schedule_id)
                body, rt = self.schedules.items.get(key), self.runtime.get(key)
                if state is None or body is None or rt is None or rt.placed != target:
                    continue  # gone, or moved to another Redis meanwhile
                progress, shown = schedule_progress(state), body.get("status") or {}
                if progress_differs(progress, shown):
                    pending.append(write(key, rt, progress, progress["lastTickTime"] != shown.get("lastTickTime")))
            # side by side: one after another, 1,000 changed schedules at 20 ms API latency
            # took 20 s, past the pass's deadline
            results = await asyncio.gather(*pending, return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            if failures:
                raise failures[0]  # the cursor stays: the round is taken again
