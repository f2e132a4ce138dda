"""Schedule resources: definitions handed to the scheduler library in their Queue's
Redis, ticks materialized there, the scheduler's state mirrored into each status.

Level-based, without a finalizer: the schedules stored in a Redis are kept equal
to the live Schedule resources whose Queue exists. A Schedule deleted while the
operator was down, or whose Queue is gone, is removed by that comparison before
the first tick pass on that Redis, so it never fires again. (A finalizer would
block namespace deletion whenever the operator is not running.)

Tick task ids are deterministic, so two operator replicas (or a leader handover
mid-pass) never create a tick's task twice. Each Redis has its own tick loop with
a deadline per pass: a paused Redis delays nothing else.

The status mirror reads only the schedules whose state changed: the scheduler
numbers every change in its change feed, and the mirror reads the feed after its
cursor (whoever made the change: this operator's pass, another scheduler, an
earlier leader). A full round (each term's first, then every MIRROR_RESYNC_EVERY)
compares every schedule, so a change missed (a failed write, a feed that was
reset) heals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from effectmq.scheduler.errors import InvalidSchedule
from effectmq.scheduler.model import ScheduleSpec

from . import builders, metrics
from .connections import Connections, RedisTarget
from . import control
from .controller import QueueController
from .kube import Kube, NotLeader, describe_failure
from .spec import InvalidSpec, QueueSpec
from .status import Check, Problem, conditions, problem_event, schedule_progress
from .workqueue import Key, Registry, WorkQueue, backoff, key_of

log = logging.getLogger("effectmq.operator.schedules")
RESYNC_EVERY = 60.0  # seconds between full reconciles of an unchanged Schedule
MIRROR_EVERY = 30.0  # a Schedule that fires more often gets its status written at most this often
GC_EVERY = 60.0  # seconds between comparisons of a Redis' schedules with the live resources
MIRROR_RESYNC_EVERY = 300.0  # seconds between full mirror rounds
MIRROR_BATCH = 1000  # changes read, and schedules compared by a full round, per mirror round
MIRROR_WRITES_AT_ONCE = 16  # status patches in flight per mirror round (the API pool has 32 threads)
TICK_FAILURES_SHOWN = 2  # tick passes failed in a row before the Schedules there say so (one blip is not news)


@dataclass
class ScheduleRuntime:
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


class ScheduleController:
    def __init__(self, kube: Kube, connections: Connections, queues: QueueController, *,
                 namespaces: list[str] = (), tick_every: float = 1.0, deadline: float = 10.0,
                 concurrency: int = 16):
        self.kube = kube
        self.connections = connections
        self.queues = queues
        self.namespaces = list(namespaces)
        self.tick_every = tick_every
        self.deadline = deadline
        self.schedules = Registry(lambda: kube.list_resources("schedules", self.namespaces),
                                  relist_every=RESYNC_EVERY, on_listed=self._schedule_seen)
        self.runtime: dict[Key, ScheduleRuntime] = {}
        self.work = WorkQueue(self._reconcile_key, interval=lambda key: RESYNC_EVERY, concurrency=concurrency,
                              deadline=deadline, describe=lambda key, exc: describe_failure(exc, _secrets(self._placed(key))))
        self._tickers: dict[RedisTarget, asyncio.Task] = {}
        self._feeds: dict[RedisTarget, MirrorFeed] = {}
        self._tick_problems: dict[RedisTarget, Problem] = {}  # why a Redis' tick passes fail, while they do
        self._removals: set[asyncio.Task] = set()
        queues.listeners.append(self._queue_changed)

    @property
    def synced(self) -> asyncio.Event:
        return self.schedules.synced

    def _placed(self, key: Key) -> RedisTarget | None:
        rt = self.runtime.get(key)
        return rt.placed if rt else None

    # -- registry ----------------------------------------------------------------------

    def observe(self, event_type: str | None, body: dict) -> None:
        self.schedules.watch_reported()
        old = self.schedules.drop(body) if event_type == "DELETED" else self.schedules.put(body)
        self._schedule_seen(event_type, body, old)

    def _schedule_seen(self, event_type: str | None, body: dict, old: dict | None) -> None:
        """A Schedule as its watch reported it or a list found it."""
        key = key_of(body)
        if event_type == "DELETED":
            self.work.forget(key)
            rt = self.runtime.pop(key, None)
            if rt is not None and rt.placed is not None:
                self._remove_soon(rt.placed, key)  # if this fails, the next GC pass removes it
        elif old is None or old["metadata"].get("generation") != body["metadata"].get("generation"):
            self.work.nudge(key)

    def _queue_changed(self, queue_key: Key) -> None:
        for key, body in self.schedules.items.items():
            if key[0] == queue_key[0] and _queue_ref(body) == queue_key[1]:
                self.work.nudge(key)

    def _remove_soon(self, target: RedisTarget, key: Key) -> None:
        async def remove() -> None:
            try:
                await asyncio.wait_for(self.connections.scheduler(target).remove(builders.schedule_id(*key)),
                                       self.deadline)
            except Exception as exc:
                log.warning("could not remove schedule %s/%s yet: %s", *key, describe_failure(exc, target.secrets))
        task = asyncio.get_running_loop().create_task(remove())
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    # -- the loop (leader only; driven by the Queue loop's leadership) -------------------

    async def run(self, is_leader: Callable[[], bool], interval: float = 0.2) -> None:
        leading = False
        try:
            while True:
                if is_leader():
                    if not leading:
                        leading = True
                        for rt in self.runtime.values():
                            rt.stored = None  # put each definition once per term
                        self.work.reset()
                    await self.step()
                elif leading:
                    leading = False
                    await self._stop()
                await asyncio.sleep(interval)
        finally:
            await self._stop()

    async def step(self) -> None:
        if not (await self.schedules.refresh(self.deadline, "Schedules") and self.queues.synced.is_set()):
            return
        self.work.start_due(list(self.schedules.items))
        for target in set(self.queues.targets.values()) | {rt.placed for rt in self.runtime.values() if rt.placed}:
            ticker = self._tickers.get(target)
            if ticker is None or ticker.done():
                log.info("tick passes on %r %s", target, "started" if ticker is None else "restarted")
                self._tickers[target] = asyncio.create_task(self._tick_loop(target), name=f"ticks {target!r}")

    async def _reconcile_key(self, key: Key) -> bool:
        body = self.schedules.items.get(key)
        return True if body is None else await self.reconcile(key, body)

    async def reconcile(self, key: Key, body: dict) -> bool:
        """Validate a Schedule, place it in its Queue's Redis (or take it out), write its status."""
        namespace, name = key
        rt = self.runtime.setdefault(key, ScheduleRuntime())
        spec = body.get("spec") or {}
        checks: list[Check] = []
        problem: Problem | None = None
        progress: dict[str, Any] = {}
        target: RedisTarget | None = None
        definition = None
        try:
            definition = ScheduleSpec.from_json(builders.schedule_spec(namespace, name, spec))
            checks.append(Check.of("ScheduleValid", True, "Valid", f"{definition.cron} in {definition.timezone}"))
        except InvalidSchedule as exc:
            problem = Problem("InvalidSchedule", str(exc), permanent=True)
            checks.append(Check.of("ScheduleValid", False, problem.reason, problem.message))
        queue_name = _queue_ref(body)
        queue = self.queues.queues.items.get((namespace, queue_name))
        if queue is None or queue["metadata"].get("deletionTimestamp"):
            found = Problem("QueueNotFound", f"Queue {namespace}/{queue_name} not found", permanent=True)
            checks.append(Check.of("QueueFound", False, found.reason, found.message))
            problem = problem or found
        else:
            checks.append(Check.of("QueueFound", True, "Found", f"Queue {namespace}/{queue_name}"))
            try:
                target = await self.connections.target(namespace, QueueSpec.parse(queue.get("spec"), queue_name).redis)
            except InvalidSpec as exc:
                unusable = Problem("QueueInvalid", f"Queue {namespace}/{queue_name}: {exc}", permanent=True)
                checks.append(Check.of("RedisReachable", False, unusable.reason, unusable.message))
                problem = problem or unusable
            except Exception as exc:
                unusable = self.connections.problem(exc)
                checks.append(Check.of("RedisReachable", False, unusable.reason, unusable.message))
                problem = problem or unusable
        retry = False
        self.kube.check_leader()
        try:
            if rt.placed is not None and (definition is None or target is None or rt.placed != target):
                await self.connections.scheduler(rt.placed).remove(builders.schedule_id(*key))
                rt.placed, rt.stored = None, None
            if definition is not None and target is not None:
                stored = json.dumps(definition.to_json(), sort_keys=True)
                scheduler = self.connections.scheduler(target)
                if rt.stored != stored:
                    state = await scheduler.put(definition)
                    rt.placed, rt.stored = target, stored
                    log.info("schedule %s/%s stored in %r", namespace, name, target)
                else:
                    state = await scheduler.status(definition.id)
                if state is not None:
                    progress = schedule_progress(state)
                checks.append(Check.of("RedisReachable", True, "Connected", "schedule stored in the Queue's Redis"))
                failing = self._tick_problems.get(target)
                checks.append(Check.of("TicksMaterialized", failing is None, failing.reason if failing else "Materializing",
                                       failing.message if failing else "the tick passes on its Redis succeed"))
                problem = problem or failing
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            unreachable = self.connections.problem(exc, target or rt.placed)
            checks.append(Check.of("RedisReachable", False, unreachable.reason, unreachable.message))
            problem = problem or unreachable
            retry = True
        await self._write(key, body, checks, problem, progress)
        return not retry

    async def _write(self, key: Key, body: dict, checks: list[Check], problem: Problem | None,
                     progress: dict[str, Any]) -> None:
        generation = body["metadata"].get("generation")
        previous = body.get("status") or {}
        status = {**progress, "observedGeneration": generation,
                  "conditions": conditions(checks, problem, generation, previous.get("conditions"))}
        if control.needs_write(previous, status, None):
            written = await self.kube.patch_status("schedules", key[0], key[1], status)
            if written is not None:
                self.schedules.put(written)
        warning = problem_event(problem, previous.get("conditions"))
        await self.kube.post_events(body, [warning] if warning else [])

    # -- ticks, per Redis ------------------------------------------------------------------

    def _wanted(self, target: RedisTarget) -> set[str]:
        """Ids of schedules that may live in this Redis: live resources whose Queue exists
        there (or whose Queue's Redis is not resolved yet, so nothing valid is removed)."""
        wanted = set()
        for (namespace, name), body in self.schedules.items.items():
            queue_key = (namespace, _queue_ref(body))
            if queue_key in self.queues.queues.items and self.queues.targets.get(queue_key, target) == target:
                wanted.add(builders.schedule_id(namespace, name))
        return wanted

    def _ours(self, schedule_id: str) -> bool:
        return not self.namespaces or schedule_id.split("/", 1)[0] in self.namespaces

    async def collect_garbage(self, target: RedisTarget) -> int:
        """Remove stored schedules that no live resource wants; returns how many."""
        scheduler = self.connections.scheduler(target)
        wanted = self._wanted(target)
        removed, after = 0, None
        while True:
            ids = await scheduler.store.ids(after=after, limit=1000)
            if not ids:
                return removed
            for schedule_id in ids:
                if self._ours(schedule_id) and schedule_id not in wanted:
                    await scheduler.remove(schedule_id)
                    removed += 1
                    log.info("removed schedule %s: no live Schedule resource wants it in %r", schedule_id, target)
            after = ids[-1]

    async def _tick_loop(self, target: RedisTarget) -> None:
        next_gc = 0.0
        failures = 0
        while True:
            step = "the leadership check"  # named in a failure: "TimeoutError" alone says nothing
            try:
                self.kube.check_leader()
                if time.monotonic() >= next_gc:  # always before the first pass
                    step = "garbage collection"
                    await asyncio.wait_for(self.collect_garbage(target), self.deadline)
                    next_gc = time.monotonic() + GC_EVERY
                step = "the tick pass"
                report = await asyncio.wait_for(self.connections.scheduler(target).tick(), self.deadline)
                failures = 0
                self._ticks_failing(target, None)
                for m in report.materialized:
                    if m.created:
                        metrics.TICKS.labels(m.schedule_id).inc()
                step = "the status mirror"
                await asyncio.wait_for(self._mirror(target), self.deadline)
                await asyncio.sleep(0 if report.more else self.tick_every)
            except asyncio.CancelledError:
                raise
            except NotLeader:
                await asyncio.sleep(self.tick_every)  # the loop is stopped when leadership ends
            except Exception as exc:
                failures += 1
                why = (f"took longer than {self.deadline:g} s" if isinstance(exc, asyncio.TimeoutError)
                       else describe_failure(exc, target.secrets))
                if failures in (1, 10) or failures % 60 == 0:
                    log.warning("schedule pass on %r failed in %s: %s", target, step, why)
                if failures >= TICK_FAILURES_SHOWN and step == "the tick pass":
                    self._ticks_failing(target, Problem("TicksFailing", f"ticks are not materialized: {why}"))
                await asyncio.sleep(backoff(failures, 10.0))

    def _ticks_failing(self, target: RedisTarget, problem: Problem | None) -> None:
        """Record why the tick passes on `target` fail (None: they succeed); on a change,
        the Schedules stored there are reconciled, so their status says it."""
        if self._tick_problems.get(target) == problem:
            return
        if problem is None:
            del self._tick_problems[target]
        else:
            self._tick_problems[target] = problem
        for key, rt in self.runtime.items():
            if rt.placed == target:
                self.work.nudge(key)

    async def _mirror(self, target: RedisTarget) -> None:
        """Copy the scheduler's state of the schedules that changed into their status:
        a page of the changes after the feed's cursor, and a slice of a full round
        while one is under way (MIRROR_BATCH each: a round never holds up the ticks
        for long). The cursor moves only once the statuses are written: a round that
        fails is read again."""
        store = self.connections.scheduler(target).store
        feed = self._feeds.setdefault(target, MirrorFeed())
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
        now = time.monotonic()
        due, held = [], set()
        for schedule_id in dict.fromkeys([*schedule_ids, *feed.held]):
            rt = self.runtime.get(_key(schedule_id))
            if rt is None or rt.placed != target:
                continue  # not one of ours (another namespace, a standalone schedule), or gone
            if rt.mirrored_at is not None and now - rt.mirrored_at < MIRROR_EVERY:
                held.add(schedule_id)
            else:
                due.append(schedule_id)
        feed.held = held
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
                key = _key(schedule_id)
                body, rt = self.schedules.items.get(key), self.runtime.get(key)
                if state is None or body is None or rt is None or rt.placed != target:
                    continue  # gone, or moved to another Redis meanwhile
                progress, shown = schedule_progress(state), body.get("status") or {}
                if any(shown.get(k) != v for k, v in progress.items()):
                    pending.append(write(key, rt, progress, progress["lastTickTime"] != shown.get("lastTickTime")))
            # side by side: one after another, 1,000 changed schedules at 20 ms API latency
            # took 20 s, past the pass's deadline
            failures = [r for r in await asyncio.gather(*pending, return_exceptions=True) if isinstance(r, BaseException)]
            if failures:
                raise failures[0]  # the cursor stays: the round is taken again

    async def _stop(self) -> None:
        tasks = list(self._tickers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tickers.clear()
        self._feeds.clear()  # the next term starts with a full mirror round
        self._tick_problems.clear()  # the next term's passes tell
        await self.work.stop()


def _key(schedule_id: str) -> Key:
    """The resource of an operator schedule id "<namespace>/<name>" (a foreign id finds none)."""
    namespace, _, name = schedule_id.partition("/")
    return namespace, name


def _queue_ref(body: dict) -> str:
    return ((body.get("spec") or {}).get("queueRef") or {}).get("name", "")


def _secrets(target: RedisTarget | None) -> tuple[str, ...]:
    return target.secrets if target else ()
