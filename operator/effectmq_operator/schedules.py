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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
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


@dataclass
class ScheduleRuntime:
    placed: RedisTarget | None = None  # where the definition is stored
    stored: str | None = None  # the definition as last stored there (JSON)
    mirrored_at: float | None = None  # monotonic time its ticks were last copied into the status


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
                                  relist_every=RESYNC_EVERY)
        self.runtime: dict[Key, ScheduleRuntime] = {}
        self.work = WorkQueue(self._reconcile_key, interval=lambda key: RESYNC_EVERY, concurrency=concurrency,
                              deadline=deadline, describe=lambda key, exc: describe_failure(exc, _secrets(self._placed(key))))
        self._tickers: dict[RedisTarget, asyncio.Task] = {}
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
        key = key_of(body)
        if event_type == "DELETED":
            self.schedules.drop(body)
            self.work.forget(key)
            rt = self.runtime.pop(key, None)
            if rt is not None and rt.placed is not None:
                self._remove_soon(rt.placed, key)  # if this fails, the next GC pass removes it
            return
        old = self.schedules.put(body)
        if old is None or old["metadata"].get("generation") != body["metadata"].get("generation"):
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
                else:
                    state = await scheduler.status(definition.id)
                if state is not None:
                    progress = schedule_progress(state)
                checks.append(Check.of("RedisReachable", True, "Connected", "schedule stored in the Queue's Redis"))
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
            try:
                self.kube.check_leader()
                if time.monotonic() >= next_gc:  # always before the first pass
                    await asyncio.wait_for(self.collect_garbage(target), self.deadline)
                    next_gc = time.monotonic() + GC_EVERY
                report = await asyncio.wait_for(self.connections.scheduler(target).tick(), self.deadline)
                failures = 0
                touched = {m.schedule_id for m in report.materialized} | set(report.errors)
                for m in report.materialized:
                    if m.created:
                        metrics.TICKS.labels(m.schedule_id).inc()
                if touched:
                    await self._mirror(target, sorted(touched))
                await asyncio.sleep(0 if report.more else self.tick_every)
            except asyncio.CancelledError:
                raise
            except NotLeader:
                await asyncio.sleep(self.tick_every)  # the loop is stopped when leadership ends
            except Exception as exc:
                failures += 1
                if failures in (1, 10) or failures % 60 == 0:
                    log.warning("schedule pass on %r failed: %s", target, describe_failure(exc, target.secrets))
                await asyncio.sleep(backoff(failures, 10.0))

    async def _mirror(self, target: RedisTarget, schedule_ids: list[str]) -> None:
        """Copy the scheduler's state of the schedules a pass touched into their status."""
        now = time.monotonic()
        due = [i for i in schedule_ids if (rt := self.runtime.get(tuple(i.split("/", 1)))) is not None
               and (rt.mirrored_at is None or now - rt.mirrored_at >= MIRROR_EVERY)]
        if not due:
            return
        states = await self.connections.scheduler(target).statuses(due)
        for schedule_id, state in zip(due, states):
            key = tuple(schedule_id.split("/", 1))
            body = self.schedules.items.get(key)
            if state is None or body is None:
                continue
            progress = schedule_progress(state)
            if any((body.get("status") or {}).get(k) != v for k, v in progress.items()):
                written = await self.kube.patch_status("schedules", key[0], key[1], progress)
                self.runtime[key].mirrored_at = time.monotonic()
                if written is not None:
                    self.schedules.put(written)

    async def _stop(self) -> None:
        tasks = list(self._tickers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tickers.clear()
        await self.work.stop()


def _queue_ref(body: dict) -> str:
    return ((body.get("spec") or {}).get("queueRef") or {}).get("name", "")


def _secrets(target: RedisTarget | None) -> tuple[str, ...]:
    return target.secrets if target else ()
