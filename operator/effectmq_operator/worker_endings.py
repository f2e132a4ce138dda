"""How worker pods ended, recorded on their Queue's Redis (the I/O around `pod_endings`).

The worker pod watch (handlers.py; the API server filters it by
pod_endings.WORKER_POD_SELECTOR) hands every event to `observe`, which classifies the
pod at once and keeps the endings not recorded yet. The leader's loop records them with
`TaskQueue.record_worker_ending` on the Redis of each Queue (as its reconcile resolved it),
within a second of the kubelet's report, so that maintenance, when the lease of an attempt
that pod's worker held runs out (lockTimeoutSeconds later), names its cause.

Standbys classify too and keep what is pending, so a new leader records what ended just
before it took over; a watch that restarts lists every pod again, and each run already
recorded is recorded again at most once per process (Redis keeps one record per run
and cause). An ending waits while its Queue's Redis is unknown or unreachable, for at
most PENDING_FOR seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Callable

import effectmq

from . import builders, metrics
from .pod_endings import PodEnding, pod_endings
from .queue_controller import QueueController
from .redis_pool import Connections
from .runtime.cancellation import raise_if_cancelled
from .runtime.kube import NotLeader, describe_failure

log = logging.getLogger("effectmq.operator")
# Seconds an ending may wait to be recorded: the runtime forgets endings after about an
# hour, and no attempt stalls that long after its worker's end (its lease runs out first).
PENDING_FOR = 3600.0
PENDING_MAX = 10_000  # endings waiting at once (an unreachable Redis, many pods); beyond, the oldest go
RECORDED_MAX = 50_000  # runs recorded, remembered so each watch event of a pod does not record them again
RECORD_EVERY = 0.5  # seconds between the leader's passes, at most (an event wakes it sooner)
RECORD_DEADLINE = 5.0  # seconds for one Queue's records

EndingKey = tuple[str, int, str]


class WorkerEndings:
    def __init__(self, queues: QueueController, connections: Connections, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.queues = queues
        self.connections = connections
        self.clock = clock
        self.pending: OrderedDict[EndingKey, tuple[PodEnding, float]] = OrderedDict()
        self.recorded: OrderedDict[EndingKey, None] = OrderedDict()
        self._wake = asyncio.Event()

    # -- fed by the watch (every replica) --------------------------------------------

    def observe(self, event_type: str | None, pod: dict) -> None:
        for ending in pod_endings(pod, deleted=event_type == "DELETED"):
            if ending.key in self.recorded or ending.key in self.pending:
                continue
            self.pending[ending.key] = (ending, self.clock())
            if len(self.pending) > PENDING_MAX:
                (_, (dropped, _)) = self.pending.popitem(last=False)
                log.warning("%s/%s: too many worker endings waiting to be recorded; the oldest (pod %s) is dropped",
                            dropped.namespace, dropped.queue, dropped.ending.pod)
            self._wake.set()

    # -- the loop (records only while leading) -----------------------------------------

    async def run(self, is_leader: Callable[[], bool]) -> None:
        while True:
            raise_if_cancelled()
            try:
                async with asyncio.timeout(RECORD_EVERY):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if not self.pending:
                continue
            if not is_leader():  # a standby keeps them for when it leads, but not for ever
                self._forget_stale()
                continue
            try:
                await self.record_pending()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop outlives any one pass (the probe checks it runs)
                log.warning("recording worker endings failed: %s", describe_failure(exc))

    async def record_pending(self) -> None:
        """Record what is pending, a Queue at a time and the Queues at once; what cannot be
        recorded now stays pending."""
        self._forget_stale()
        by_queue: dict[tuple[str, str], list[PodEnding]] = {}
        for ending, _ in self.pending.values():
            by_queue.setdefault((ending.namespace, ending.queue), []).append(ending)
        await asyncio.gather(*(self._record(key, endings) for key, endings in by_queue.items()))

    def _forget_stale(self) -> None:
        now = self.clock()
        for key, (ending, seen) in list(self.pending.items()):
            gone = self.queues.listed() and self.queues.queue((ending.namespace, ending.queue)) is None
            if gone or now - seen > PENDING_FOR:
                del self.pending[key]
                log.debug("%s/%s: the ending of pod %s is not recorded: %s", ending.namespace, ending.queue,
                          ending.ending.pod, "its Queue is gone" if gone else "its Redis was not reached in time")

    async def _record(self, key: tuple[str, str], endings: list[PodEnding]) -> None:
        target = self.queues.redis_of(key)
        if target is None:  # the Queue's reconcile has not resolved its Redis yet
            return
        name = builders.queue_name(*key)
        q = self.connections.queue(target, name)

        async def write() -> None:
            for ending in endings:
                self.queues.kube.check_leader()  # a Redis write too: never from a deposed leader
                try:
                    await q.record_worker_ending(ending.ending)
                except effectmq.InvalidOption as exc:  # a field the runtime refuses: trying again cannot help
                    self.pending.pop(ending.key, None)
                    log.warning("%s/%s: the ending of pod %s is not recorded: %s", *key, ending.ending.pod, exc)
                    continue
                self._recorded(ending)
                metrics.WORKER_ENDINGS.labels(name, ending.ending.cause).inc()

        try:
            await self.connections.poll(target, write, RECORD_DEADLINE)
        except asyncio.CancelledError:
            raise
        except NotLeader:
            return
        except Exception as exc:  # kept pending: tried again on the next pass
            log.debug("%s/%s: worker endings not recorded yet: %s", *key, describe_failure(exc, target.secrets))

    def _recorded(self, ending: PodEnding) -> None:
        self.pending.pop(ending.key, None)
        self.recorded[ending.key] = None
        while len(self.recorded) > RECORDED_MAX:
            self.recorded.popitem(last=False)
        code = ending.ending.exit_code
        log.info("%s/%s: worker pod %s ended: %s%s", ending.namespace, ending.queue, ending.ending.pod,
                 ending.ending.cause, f" (exit {code})" if code is not None else "")
