"""The Schedule reconciler: thin I/O around the pure plan (`schedule_plan`).

Schedule resources become definitions handed to the scheduler library in their
Queue's Redis; the tick loops (`schedule_ticks`) materialize their ticks there, and
the status mirror (`schedule_status`) copies the scheduler's state into each status.
The Queue side is read through `queue_view.QueueView` only.

Level-based, without a finalizer: the schedules stored in a Redis are kept equal
to the live Schedule resources whose Queue exists there. A Schedule deleted while
the operator was down, or whose Queue is gone, is removed by that comparison before
the first tick pass on that Redis, so it never fires again. (A finalizer would
block namespace deletion whenever the operator is not running.)

"There" is the Redis, not the URL: Queues may reach one Redis through several URLs
(a short and a fully qualified Service name, an IP, `:6379` and `:6379/0`, a Secret
rotated in one namespace first, other TLS options); a Schedule whose Queue moved to
another URL of the same store keeps its record. A Schedule whose record is gone all
the same (removed by hand or by another operator, the Redis flushed) is stored
again: each tick loop notices a change in the number of schedules stored and nudges
those of its Schedules whose record is missing, and every reconcile reads the record
it would otherwise only report. While it cannot be stored again the Schedule is
Ready=False (ScheduleMissing), with a Warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Sequence

from effectmq.scheduler.errors import InvalidSchedule
from effectmq.scheduler.model import ScheduleSpec

from . import builders
from .queue_view import QueueView
from .redis_pool import Connections, RedisTarget
from .runtime.cancellation import raise_if_cancelled
from .runtime.kube import Kube, describe_failure
from .runtime.registry import Key, Registry, key_of
from .runtime.workqueue import DONE, Reconciled, WorkQueue
from .schedule_plan import Missing, Outcome, ScheduleFacts, Stored, Unreachable, definition, plan, queue_ref
from .schedule_status import ScheduleRuntime, StatusMirror
from .schedule_ticks import TickLoops
from .spec import InvalidSpec, QueueSpec
from .status import Problem, schedule_progress

log = logging.getLogger("effectmq.operator.schedules")
RESYNC_EVERY = 60.0  # seconds between full reconciles of an unchanged Schedule


class ScheduleController:
    def __init__(self, kube: Kube, connections: Connections, queues: QueueView, *,
                 namespaces: Sequence[str] = (), tick_every: float = 1.0, deadline: float = 10.0,
                 concurrency: int = 16):
        self.kube = kube
        self.connections = connections
        self.queues = queues
        self.namespaces = list(namespaces)
        self.deadline = deadline
        self.schedules = Registry(lambda: kube.list_resources("schedules", self.namespaces),
                                  relist_every=RESYNC_EVERY, on_listed=self._schedule_seen)
        self.runtime: dict[Key, ScheduleRuntime] = {}
        self.work = WorkQueue(self._reconcile_key, interval=lambda key: RESYNC_EVERY, concurrency=concurrency,
                              deadline=deadline,
                              describe=lambda key, exc: describe_failure(exc, _secrets(self._placed(key))))
        self.mirror = StatusMirror(kube, connections, self.schedules, self.runtime)
        self.ticks = TickLoops(kube, connections, queues, self.schedules, self.runtime, self.mirror, self.work.nudge,
                               namespaces=namespaces, tick_every=tick_every, deadline=deadline)
        self._removals: set[asyncio.Task] = set()
        queues.on_change(self._queue_changed)

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
            if key[0] == queue_key[0] and queue_ref(body) == queue_key[1]:
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
                raise_if_cancelled()
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
        if not (await self.schedules.refresh(self.deadline, "Schedules") and self.queues.listed()):
            return
        self.work.start_due(list(self.schedules.items))
        self.ticks.ensure(self.queues.redis_targets() | {rt.placed for rt in self.runtime.values() if rt.placed})

    async def _reconcile_key(self, key: Key) -> Reconciled:
        body = self.schedules.items.get(key)
        return DONE if body is None else await self.reconcile(key, body)

    # -- one reconcile ----------------------------------------------------------------

    async def reconcile(self, key: Key, body: dict) -> Reconciled:
        """Validate a Schedule, place it in its Queue's Redis (or take it out), write its status."""
        namespace, name = key
        rt = self.runtime.setdefault(key, ScheduleRuntime())
        wanted = definition(namespace, name, body.get("spec") or {})
        queue_name = queue_ref(body)
        queue = self.queues.queue((namespace, queue_name))
        found = queue is not None and not queue["metadata"].get("deletionTimestamp")
        target: RedisTarget | None = None
        queue_problem: Problem | None = None
        if queue is not None and found:
            try:
                target = await self.connections.target(namespace, QueueSpec.parse(queue.get("spec"), queue_name).redis)
            except InvalidSpec as exc:
                queue_problem = Problem("QueueInvalid", f"Queue {namespace}/{queue_name}: {exc}", permanent=True)
            except Exception as exc:
                queue_problem = self.connections.problem(exc)
        self.kube.check_leader()
        outcome = await self._place(key, rt, None if isinstance(wanted, InvalidSchedule) else wanted, target)
        facts = ScheduleFacts(definition=wanted, queue=f"{namespace}/{queue_name}", queue_found=found,
                              queue_problem=queue_problem, outcome=outcome,
                              ticks_problem=self.ticks.problem(target) if target else None)
        result = plan(facts, generation=body["metadata"].get("generation"), previous=body.get("status") or {})
        if result.write:
            written = await self.kube.patch_status("schedules", namespace, name, result.status)
            if written is not None:
                self.schedules.put(written)
        await self.kube.post_events(body, result.events)
        return Reconciled(retry=result.retry)

    async def _place(self, key: Key, rt: ScheduleRuntime, wanted: ScheduleSpec | None,
                     target: RedisTarget | None) -> Outcome | None:
        """Store the definition through `target`, its Queue's Redis, or read it there when
        stored already this term; remove it from where it was, if that is elsewhere."""
        namespace, name = key
        try:
            if rt.placed is not None and (wanted is None or target is None or rt.placed != target):
                if wanted is not None and target is not None and await self._same_store(rt.placed, target):
                    rt.placed = target  # another URL of the same Redis: the record stays as it is
                else:
                    await self.connections.scheduler(rt.placed).remove(builders.schedule_id(*key))
                    rt.placed, rt.stored = None, None
            if wanted is None or target is None:
                return None
            stored = json.dumps(wanted.to_json(), sort_keys=True)
            scheduler = self.connections.scheduler(target)
            state = await scheduler.status(wanted.id) if rt.stored == stored else None
            restored = False
            if state is None:
                missing = rt.stored == stored  # stored this term, unchanged, and gone since
                try:
                    state = await scheduler.put(wanted)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if missing:
                        return Missing(self.connections.problem(exc, target))
                    raise
                rt.placed, rt.stored = target, stored
                if missing:
                    log.warning("schedule %s/%s was missing from %r: stored again", namespace, name, target)
                    restored = True
                else:
                    log.info("schedule %s/%s stored in %r", namespace, name, target)
            return Stored(progress=schedule_progress(state) if state is not None else {}, restored=restored)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return Unreachable(self.connections.problem(exc, target or rt.placed))

    async def _same_store(self, a: RedisTarget, b: RedisTarget) -> bool:
        """Whether two targets reach one scheduler store (False when either cannot tell)."""
        try:
            return len(set(await asyncio.gather(self.connections.identity(a), self.connections.identity(b)))) == 1
        except asyncio.CancelledError:
            raise
        except Exception:
            return False

    async def _stop(self) -> None:
        await self.ticks.stop()
        self.mirror.forget()  # the next term starts with a full mirror round
        await self.work.stop()


def _secrets(target: RedisTarget | None) -> tuple[str, ...]:
    return target.secrets if target else ()
