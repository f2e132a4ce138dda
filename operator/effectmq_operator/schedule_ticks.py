"""The tick loops: one per Redis, materializing due ticks, collecting garbage, checking
the stored records and running the status mirror.

Tick task ids are deterministic, so two operator replicas (or a leader handover
mid-pass) never create a tick's task twice. Each Redis has its own loop with a
deadline per pass: a paused Redis delays nothing else. Queues may reach one Redis
through several URLs; each URL has its own loop, but of the loops on one store only
one runs the tick passes while its passes succeed (`Connections.identity` tells the
store), and garbage collection keeps every schedule whose Queue's URL reaches the
same store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

import effectmq

from . import builders, metrics
from .queue_view import QueueView
from .redis_pool import Connections, RedisTarget
from .runtime.cancellation import raise_if_cancelled
from .runtime.kube import Kube, NotLeader, describe_failure
from .runtime.registry import Key, Registry
from .runtime.workqueue import backoff
from .schedule_plan import OtherRedis, queue_ref, schedule_key, unwanted
from .schedule_status import MIRROR_BATCH, ScheduleRuntime, StatusMirror
from .status import Problem

log = logging.getLogger("effectmq.operator.schedules")
GC_EVERY = 60.0  # seconds between comparisons of a Redis' schedules with the live resources
TICK_FAILURES_SHOWN = 2  # tick passes failed in a row before the Schedules there say so (one blip is not news)
IDENTITY_WAIT = 2.0  # seconds garbage collection waits for the store identity of another Queue's Redis


class TickLoops:
    def __init__(self, kube: Kube, connections: Connections, queues: QueueView, schedules: Registry,
                 runtime: dict[Key, ScheduleRuntime], mirror: StatusMirror, nudge: Callable[[Key], None], *,
                 namespaces: Sequence[str] = (), tick_every: float = 1.0, deadline: float = 10.0):
        self.kube = kube
        self.connections = connections
        self.queues = queues
        self.schedules = schedules
        self.runtime = runtime
        self.mirror = mirror
        self.nudge = nudge  # reconcile a Schedule soon
        self.namespaces = list(namespaces)
        self.tick_every = tick_every
        self.deadline = deadline
        self._loops: dict[RedisTarget, asyncio.Task] = {}
        self._problems: dict[RedisTarget, Problem] = {}  # why a Redis' tick passes fail, while they do
        self._stored_counts: dict[RedisTarget, int] = {}  # schedules stored there when its records were last checked
        self._last_pass: dict[str, tuple[RedisTarget, float]] = {}  # store identity -> who last passed there, when

    def problem(self, target: RedisTarget) -> Problem | None:
        """Why the tick passes on `target` fail, while they do."""
        return self._problems.get(target)

    def ensure(self, targets: set[RedisTarget]) -> None:
        """A loop on each of `targets` (again if one ended)."""
        for target in targets:
            loop = self._loops.get(target)
            if loop is None or loop.done():
                log.info("tick passes on %r %s", target, "started" if loop is None else "restarted")
                self._loops[target] = asyncio.create_task(self.loop(target), name=f"ticks {target!r}")

    async def stop(self) -> None:
        """End every loop and forget what they learnt: the next term's loops tell again."""
        loops = list(self._loops.values())
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        self._loops.clear()
        self._problems.clear()
        self._stored_counts.clear()  # the next term's loops check every record once
        self._last_pass.clear()

    async def loop(self, target: RedisTarget) -> None:
        next_gc = 0.0
        failures = 0
        while True:
            raise_if_cancelled()
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
                self._failing(target, None)
                # After the pass: while passes fail, the state change reconciles every Schedule
                # stored here (which reads its record), and a failure here hides none of theirs.
                step = "the check of the stored records"
                await asyncio.wait_for(self.check_stored(target), self.deadline)
                step = "the status mirror"
                await asyncio.wait_for(self.mirror.round(target), self.deadline)
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
                    self._failing(target, Problem("TicksFailing", f"ticks are not materialized: {why}"))
                await asyncio.sleep(backoff(failures, 10.0))

    def _failing(self, target: RedisTarget, problem: Problem | None) -> None:
        """Record why the tick passes on `target` fail (None: they succeed); on a change,
        the Schedules stored there are reconciled, so their status says it."""
        if self._problems.get(target) == problem:
            return
        if problem is None:
            del self._problems[target]
        else:
            self._problems[target] = problem
        for key, rt in self.runtime.items():
            if rt.placed == target:
                self.nudge(key)

    def _ticked_elsewhere(self, target: RedisTarget) -> bool:
        """Whether another URL of this Redis had a tick pass succeed just now: then this
        loop's pass would only repeat it (harmless, tick ids are deterministic, but twice
        the work). The one whose passes succeed keeps them; if they fail, this one takes over."""
        same = self.connections.known_identity(target)
        last = self._last_pass.get(same) if same is not None else None
        return last is not None and last[0] != target and time.monotonic() - last[1] < 2 * self.tick_every

    # -- garbage collection ------------------------------------------------------------

    def _unwanted(self, schedule_id: str, target: RedisTarget) -> str | OtherRedis[RedisTarget] | None:
        key = schedule_key(schedule_id)
        body = self.schedules.items.get(key)
        queue_key = (key[0], queue_ref(body or {}))
        return unwanted(body, f"{queue_key[0]}/{queue_key[1]}", self.queues.queue(queue_key) is not None,
                        self.queues.redis_of(queue_key), target)

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
            unknown = list({v.queue_redis for v in verdicts.values()
                            if isinstance(v, OtherRedis) and v.queue_redis not in stores})
            for other, found in zip(unknown, await asyncio.gather(*(self._identity_or_none(t, IDENTITY_WAIT)
                                                                    for t in unknown))):
                stores[other] = found
            for schedule_id, verdict in verdicts.items():
                if isinstance(verdict, OtherRedis):
                    there = verdict.queue_redis
                    if None in (stores[target], stores[there]) or stores[target] == stores[there]:
                        continue
                    verdict = f"its Queue's Redis is another one ({there!r})"
                if verdict is None:
                    continue
                await scheduler.remove(schedule_id)
                removed += 1
                log.info("removed schedule %s from %r: %s", schedule_id, target, verdict)
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
            self.nudge(key)
        return missing
