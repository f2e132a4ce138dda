"""Schedule resources: definitions handed to the scheduler library in their Queue's
Redis, ticks materialized there, the scheduler's state mirrored into each status.

Level-based, without a finalizer: the schedules stored in a Redis are kept equal
to the live Schedule resources whose Queue exists there. A Schedule deleted while
the operator was down, or whose Queue is gone, is removed by that comparison before
the first tick pass on that Redis, so it never fires again. (A finalizer would
block namespace deletion whenever the operator is not running.)

"There" is the Redis, not the URL: Queues may reach one Redis through several URLs
(a short and a fully qualified Service name, an IP, `:6379` and `:6379/0`, a Secret
rotated in one namespace first, other TLS options). Each URL has its own client and
tick loop, but the comparison keeps every schedule whose Queue's URL reaches the
same scheduler store (its identity, `Connections.identity`), and of the loops on one
store only one runs the tick passes while its passes succeed. A Schedule whose
record is gone all the same (removed by hand or by another operator, the Redis
flushed) is stored again: each tick loop notices a change in the number of
schedules stored and nudges those of its Schedules whose record is missing, and
every reconcile reads the record it would otherwise only report. While it cannot be
stored again the Schedule is Ready=False (ScheduleMissing), with a Warning.

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
from typing import Any, Callable, Sequence

import effectmq
from effectmq.scheduler.errors import InvalidSchedule
from effectmq.scheduler.model import ScheduleSpec

from . import builders, metrics
from .connections import Connections, RedisTarget
from . import control
from .controller import QueueController
from .kube import Kube, NotLeader, describe_failure
from .spec import InvalidSpec, QueueSpec
from .status import Check, Event, Problem, conditions, problem_event, schedule_progress
from .workqueue import Key, Registry, WorkQueue, backoff, key_of

log = logging.getLogger("effectmq.operator.schedules")
RESYNC_EVERY = 60.0  # seconds between full reconciles of an unchanged Schedule
MIRROR_EVERY = 30.0  # a Schedule that fires more often gets its status written at most this often
GC_EVERY = 60.0  # seconds between comparisons of a Redis' schedules with the live resources
MIRROR_RESYNC_EVERY = 300.0  # seconds between full mirror rounds
MIRROR_BATCH = 1000  # changes read, and schedules compared by a full round, per mirror round
MIRROR_WRITES_AT_ONCE = 16  # status patches in flight per mirror round (the API pool has 32 threads)
TICK_FAILURES_SHOWN = 2  # tick passes failed in a row before the Schedules there say so (one blip is not news)
IDENTITY_WAIT = 2.0  # seconds garbage collection waits for the store identity of another Queue's Redis


@dataclass
class ScheduleRuntime:
    placed: RedisTarget | None = None  # where the definition is stored
    stored: str | None = None  # the definition as last stored there (JSON)
    mirrored_at: float | None = None  # monotonic time its ticks were last copied into the status


class _Missing(Exception):
    """A Schedule's stored record is gone and storing it again failed (the cause)."""


@dataclass
class MirrorFeed:
    """Where the status mirror of one Redis stands in that Redis' change feed."""

    cursor: int | None = None  # the last change number mirrored; None: a full round is due
    full_at: float = 0.0  # monotonic time of the next full round
    resync: list[str] = field(default_factory=list)  # what the full round under way has still to compare
    held: set[str] = field(default_factory=set)  # changed, written once MIRROR_EVERY allows


class ScheduleController:
    def __init__(self, kube: Kube, connections: Connections, queues: QueueController, *,
                 namespaces: Sequence[str] = (), tick_every: float = 1.0, deadline: float = 10.0,
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
                              deadline=deadline,
                              describe=lambda key, exc: describe_failure(exc, _secrets(self._placed(key))))
        self._tickers: dict[RedisTarget, asyncio.Task] = {}
        self._feeds: dict[RedisTarget, MirrorFeed] = {}
        self._tick_problems: dict[RedisTarget, Problem] = {}  # why a Redis' tick passes fail, while they do
        self._stored_counts: dict[RedisTarget, int] = {}  # schedules stored there when its records were last checked
        self._last_pass: dict[str, tuple[RedisTarget, float]] = {}  # store identity -> who last passed there, when
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
        notices: list[Event] = []
        self.kube.check_leader()
        try:
            if rt.placed is not None and (definition is None or target is None or rt.placed != target):
                if definition is not None and target is not None and await self._same_store(rt.placed, target):
                    rt.placed = target  # another URL of the same Redis: the record stays as it is
                else:
                    await self.connections.scheduler(rt.placed).remove(builders.schedule_id(*key))
                    rt.placed, rt.stored = None, None
            if definition is not None and target is not None:
                stored = json.dumps(definition.to_json(), sort_keys=True)
                scheduler = self.connections.scheduler(target)
                state = await scheduler.status(definition.id) if rt.stored == stored else None
                if state is None:
                    missing = rt.stored == stored  # stored this term, unchanged, and gone since
                    try:
                        state = await scheduler.put(definition)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        if missing:
                            raise _Missing() from exc
                        raise
                    rt.placed, rt.stored = target, stored
                    if missing:
                        log.warning("schedule %s/%s was missing from %r: stored again", namespace, name, target)
                        notices.append(Event("Warning", "ScheduleRestored", (
                            "the schedule was missing from its Queue's Redis (removed outside this Schedule: by hand, "
                            "by another operator, or the Redis lost its data) and was stored again; ticks due "
                            "while it was missing were not materialized")))
                    else:
                        log.info("schedule %s/%s stored in %r", namespace, name, target)
                if state is not None:
                    progress = schedule_progress(state)
                checks.append(Check.of("RedisReachable", True, "Connected", "schedule stored in the Queue's Redis"))
                failing = self._tick_problems.get(target)
                checks.append(Check.of("TicksMaterialized", failing is None,
                                       failing.reason if failing else "Materializing",
                                       failing.message if failing else "the tick passes on its Redis succeed"))
                problem = problem or failing
        except asyncio.CancelledError:
            raise
        except _Missing as exc:
            why = self.connections.problem(exc.__cause__ or exc, target)
            checks.append(Check.of("RedisReachable", False, why.reason, why.message))
            problem = problem or Problem("ScheduleMissing", "the schedule is missing from its Queue's Redis (removed "
                                         f"outside this Schedule) and could not be stored again: {why.message}")
            retry = True
        except Exception as exc:
            unreachable = self.connections.problem(exc, target or rt.placed)
            checks.append(Check.of("RedisReachable", False, unreachable.reason, unreachable.message))
            problem = problem or unreachable
            retry = True
        await self._write(key, body, checks, problem, progress, notices)
        return not retry

    async def _same_store(self, a: RedisTarget, b: RedisTarget) -> bool:
        """Whether two targets reach one scheduler store (False when either cannot tell)."""
        try:
            return len(set(await asyncio.gather(self.connections.identity(a), self.connections.identity(b)))) == 1
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def _write(self, key: Key, body: dict, checks: list[Check], problem: Problem | None,
                     progress: dict[str, Any], notices: Sequence[Event] = ()) -> None:
        generation = body["metadata"].get("generation")
        previous = body.get("status") or {}
        status = {**progress, "observedGeneration": generation,
                  "conditions": conditions(checks, problem, generation, previous.get("conditions") or ())}
        if control.needs_write(previous, status, None):
            written = await self.kube.patch_status("schedules", key[0], key[1], status)
            if written is not None:
                self.schedules.put(written)
        warning = problem_event(problem, previous.get("conditions") or ())
        await self.kube.post_events(body, [*notices, *([warning] if warning else [])])

    # -- ticks, per Redis ------------------------------------------------------------------

    def _unwanted(self, schedule_id: str, target: RedisTarget) -> str | RedisTarget | None:
        """Why a schedule stored through `target` should go (None: it stays; a target:
        it stays if that target, its Queue's, reaches the same store). It stays when
        its Queue's Redis is not resolved yet: nothing valid is removed on a guess."""
        key = _key(schedule_id)
        body = self.schedules.items.get(key)
        if body is None:
            return "no live Schedule resource"
        queue_key = (key[0], _queue_ref(body))
        if queue_key not in self.queues.queues.items:
            return f"its Queue {queue_key[0]}/{queue_key[1]} does not exist"
        there = self.queues.targets.get(queue_key)
        return None if there is None or there == target else there

    async def _identity_or_none(self, target: RedisTarget, wait: float | None = None, *,
                                own: bool = False) -> str | None:
        """The store identity of `target`, or None when it cannot be read. For the Redis
        being collected (`own`) only a refusal (an ACL without SET, a read-only replica)
        is None: if it does not answer, neither would the collection."""
        try:
            return await asyncio.wait_for(self.connections.identity(target), wait)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if own and not isinstance(exc, effectmq.RedisRefused):
                raise
            why = ("no answer in time" if isinstance(exc, asyncio.TimeoutError)
                   else describe_failure(exc, target.secrets))
            log.warning("cannot tell which Redis %r is (its store identity: %s): the schedules of its Queues are kept",
                        target, why)
            return None

    def _ours(self, schedule_id: str) -> bool:
        return not self.namespaces or schedule_id.split("/", 1)[0] in self.namespaces

    async def collect_garbage(self, target: RedisTarget) -> int:
        """Remove the stored schedules no live resource wants in this Redis; returns how many.

        Wanted: a live Schedule whose Queue exists and whose Queue's URL reaches this
        Redis, whichever URL that is (the store identities are compared, read afresh
        by each collection), or whose Queue's Redis cannot be told (not resolved yet,
        not answering): those are kept."""
        scheduler = self.connections.scheduler(target)
        stores = {target: await self._identity_or_none(target, own=True)}  # also what the tick loops compare
        removed, after = 0, None
        while True:
            ids = await scheduler.store.ids(after=after, limit=1000)
            if not ids:
                return removed
            verdicts = {i: self._unwanted(i, target) for i in ids if self._ours(i)}
            unknown = list({t for t in verdicts.values() if isinstance(t, RedisTarget) and t not in stores})
            for other, found in zip(unknown, await asyncio.gather(*(self._identity_or_none(t, IDENTITY_WAIT)
                                                                    for t in unknown))):
                stores[other] = found
            for schedule_id, why in verdicts.items():
                if isinstance(why, RedisTarget):
                    if None in (stores[target], stores[why]) or stores[target] == stores[why]:
                        continue
                    why = f"its Queue's Redis is another one ({why!r})"
                if why is None:
                    continue
                await scheduler.remove(schedule_id)
                removed += 1
                log.info("removed schedule %s from %r: %s", schedule_id, target, why)
            after = ids[-1]

    async def check_stored(self, target: RedisTarget) -> list[Key]:
        """Nudge the reconcile of each Schedule stored through `target` whose record is
        gone (it is stored again at once, or says why it cannot be); returns their keys.
        One ZCARD a pass: the records are read only when the number of schedules in
        this Redis changed since the last check (a removal and a creation between two
        passes leave it equal: the reconcile of each Schedule, every RESYNC_EVERY,
        reads its record too)."""
        store = self.connections.scheduler(target).store
        count = await store.client.zcard(store.index_key)
        if self._stored_counts.get(target) == count:
            return []
        placed = [key for key, rt in self.runtime.items() if rt.placed == target and rt.stored is not None]
        missing = []
        for start in range(0, len(placed), MIRROR_BATCH):
            chunk = placed[start:start + MIRROR_BATCH]
            async with store.client.pipeline(transaction=False) as pipe:
                for key in chunk:
                    pipe.exists(store.key(builders.schedule_id(*key)))
                found = await pipe.execute()
            missing += [key for key, exists in zip(chunk, found) if not exists]
        self._stored_counts[target] = count
        for key in missing:
            log.warning("schedule %s/%s is missing from %r", *key, target)
            self.work.nudge(key)
        return missing

    def _ticked_elsewhere(self, target: RedisTarget) -> bool:
        """Whether another URL of this Redis had a tick pass succeed just now: then this
        loop's pass would only repeat it (harmless, tick ids are deterministic, but twice
        the work). The one whose passes succeed keeps them; if they fail, this one takes over."""
        same = self.connections.known_identity(target)
        last = self._last_pass.get(same) if same is not None else None
        return last is not None and last[0] != target and time.monotonic() - last[1] < 2 * self.tick_every

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
                more = False
                if not self._ticked_elsewhere(target):
                    report = await asyncio.wait_for(self.connections.scheduler(target).tick(), self.deadline)
                    if (same := self.connections.known_identity(target)) is not None:
                        self._last_pass[same] = (target, time.monotonic())
                    more = report.more
                    for m in report.materialized:
                        if m.created:
                            metrics.TICKS.labels(m.schedule_id).inc()
                failures = 0
                self._ticks_failing(target, None)
                # After the pass: while passes fail, the state change reconciles every Schedule
                # stored here (which reads its record), and a failure here hides none of theirs.
                step = "the check of the stored records"
                await asyncio.wait_for(self.check_stored(target), self.deadline)
                step = "the status mirror"
                await asyncio.wait_for(self._mirror(target), self.deadline)
                await asyncio.sleep(0 if more else self.tick_every)
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
            results = await asyncio.gather(*pending, return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
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
        self._stored_counts.clear()  # the next term's loops check every record once
        self._last_pass.clear()
        await self.work.stop()


def _key(schedule_id: str) -> Key:
    """The resource of an operator schedule id "<namespace>/<name>" (a foreign id finds none)."""
    namespace, _, name = schedule_id.partition("/")
    return namespace, name


def _queue_ref(body: dict) -> str:
    return ((body.get("spec") or {}).get("queueRef") or {}).get("name", "")


def _secrets(target: RedisTarget | None) -> tuple[str, ...]:
    return target.secrets if target else ()
