"""Schedule resources: definitions handed to the scheduler library, its state
mirrored back into each Schedule's status.

Ticks are materialized by the same `effectmq.scheduler.Scheduler` as the
standalone CLI; tick task ids are deterministic, so two operator replicas (or a
leader handover mid-pass) never create a tick's task twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kubernetes.client.rest import ApiException

import effectmq
from effectmq.scheduler import Scheduler
from effectmq.scheduler.errors import InvalidSchedule
from effectmq.scheduler.model import ScheduleSpec

from . import builders, metrics, status as status_mod
from .connections import ConfigProblem, Connections
from .controller import Controller, key_of
from .kube import Kube

log = logging.getLogger("effectmq.operator.schedules")
SCHEDULER_NAMESPACE = "k8s"  # schedules live under {emq-sched:k8s} in each Queue's Redis
MIRROR_EVERY = 1.0  # seconds between status mirrors of all schedules


class ScheduleController:
    def __init__(self, kube: Kube, connections: Connections, queues: Controller):
        self.kube = kube
        self.connections = connections
        self.queues = queues
        self.schedules: dict[tuple[str, str], dict] = {}
        self.placed: dict[tuple[str, str], str] = {}  # schedule -> Redis URL holding it
        self._schedulers: dict[str, Scheduler] = {}
        self._mirrored: dict[tuple[str, str], dict] = {}
        self._next_mirror = 0.0

    def scheduler(self, url: str) -> Scheduler:
        if url not in self._schedulers:
            self._schedulers[url] = Scheduler(url, namespace=SCHEDULER_NAMESPACE)
        return self._schedulers[url]

    async def observe(self, event_type: str | None, body: dict) -> None:
        key = key_of(body)
        if event_type == "DELETED":
            self.schedules.pop(key, None)
            self._mirrored.pop(key, None)
            url = self.placed.pop(key, None)
            if url is not None:  # no finalizer: removal is best effort, on the delete event
                try:
                    await self.scheduler(url).remove(builders.schedule_id(*key))
                except effectmq.RedisUnavailable as exc:
                    log.warning("could not remove schedule %s/%s: %s", *key, exc)
            return
        self.schedules[key] = body

    async def _queue_body(self, namespace: str, name: str) -> dict | None:
        body = self.queues.queue_body(namespace, name)
        if body is not None:
            return body
        try:
            return await asyncio.to_thread(self.kube.custom.get_namespaced_custom_object, builders.GROUP,
                                           builders.VERSION, namespace, "queues", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def reconcile(self, body: dict) -> dict:
        """Validate a Schedule, find its Queue's Redis and hand the definition to the scheduler."""
        key = key_of(body)
        namespace, name = key
        spec = body.get("spec") or {}
        generation = body["metadata"].get("generation")
        self.schedules[key] = body
        checks: list[tuple[str, bool, str, str]] = []
        progress: dict[str, Any] = {}
        problem: tuple[str, str] | None = None
        try:
            definition = ScheduleSpec.from_json(builders.schedule_spec(namespace, name, spec))
            checks.append(("ScheduleValid", True, "Valid", f"{definition.cron} in {definition.timezone}"))
        except InvalidSchedule as exc:
            definition = None
            problem = ("InvalidSchedule", str(exc))
            checks.append(("ScheduleValid", False, *problem))
        queue_ref = (spec.get("queueRef") or {}).get("name", "")
        queue = await self._queue_body(namespace, queue_ref)
        if queue is None:
            problem = problem or ("QueueNotFound", f"Queue {namespace}/{queue_ref} not found")
            checks.append(("QueueFound", False, "QueueNotFound", f"Queue {namespace}/{queue_ref} not found"))
        else:
            checks.append(("QueueFound", True, "Found", f"Queue {namespace}/{queue_ref}"))
            try:
                url = await self.connections.redis_url(namespace, (queue.get("spec") or {}).get("redis") or {})
                if definition is not None:
                    old = self.placed.get(key)
                    if old is not None and old != url:
                        await self.scheduler(old).remove(definition.id)
                    state = await self.scheduler(url).put(definition)
                    self.placed[key] = url
                    progress = status_mod.schedule_progress(state)
                checks.append(("RedisReachable", True, "Connected", "schedule stored in the Queue's Redis"))
            except ConfigProblem as exc:
                problem = problem or (exc.reason, exc.message)
                checks.append(("RedisReachable", False, exc.reason, exc.message))
            except effectmq.RedisUnavailable as exc:
                problem = problem or ("RedisUnreachable", str(exc))
                checks.append(("RedisReachable", False, "RedisUnreachable", str(exc)))
        if definition is None and key in self.placed:  # an invalid edit stops the old definition
            await self.scheduler(self.placed.pop(key)).remove(builders.schedule_id(namespace, name))
        if problem:
            self.queues.post_event(body, type="Warning", reason=problem[0], message=problem[1])
        result = {**status_mod.schedule_status(generation=generation, previous=body.get("status") or {},
                                               checks=checks), **progress}
        await self._patch(key, result)
        return result

    async def _patch(self, key: tuple[str, str], patch: dict) -> None:
        try:
            await self.kube.patch_status("schedules", key[0], key[1], patch)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def tick(self) -> None:
        """Materialize due ticks in every Redis that holds schedules, then mirror status."""
        for url in set(self.placed.values()):
            try:
                report = await self.scheduler(url).tick()
            except effectmq.RedisUnavailable as exc:
                log.warning("schedule pass skipped for %s: %s", url, exc)
                continue
            for m in report.materialized:
                if m.created:
                    metrics.TICKS.labels(m.schedule_id).inc()
        if time.monotonic() >= self._next_mirror:
            self._next_mirror = time.monotonic() + MIRROR_EVERY
            await self.mirror()

    async def mirror(self) -> None:
        by_url: dict[str, list[tuple[str, str]]] = {}
        for key, url in self.placed.items():
            by_url.setdefault(url, []).append(key)
        for url, keys in by_url.items():
            try:
                states = await self.scheduler(url).store.statuses([builders.schedule_id(*k) for k in keys])
            except effectmq.RedisUnavailable:
                continue
            for key, state in zip(keys, states):
                if state is None:
                    continue
                progress = status_mod.schedule_progress(state)
                if self._mirrored.get(key) != progress:
                    await self._patch(key, progress)
                    self._mirrored[key] = progress

    async def close(self) -> None:
        for scheduler in self._schedulers.values():
            await scheduler.close()
        self._schedulers.clear()
