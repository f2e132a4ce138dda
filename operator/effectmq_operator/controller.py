"""The operator's reconcilers: thin I/O around the pure builders, scaling and status.

`reconcile_queue` runs on spec changes (kopf handlers). `poll_queue` runs on each
Queue's poll interval from the leader's loop: bounded maintenance, stats, a scaling
decision, status, Events, metrics and pod deletion costs. A failure in one Queue
is recorded on that Queue and never stops the loop for the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from kubernetes.client.rest import ApiException

import effectmq

from . import builders, metrics, scaling, status as status_mod
from .connections import ConfigProblem, Connections
from .kube import Kube

log = logging.getLogger("effectmq.operator")
MAINTENANCE_BATCH = 200
MAINTENANCE_ROUNDS = 5  # at most this many batches per poll: bounded whatever the backlog


def key_of(body: dict) -> tuple[str, str]:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def scaling_spec(spec: dict) -> scaling.ScalingSpec:
    return scaling.ScalingSpec.from_crd(spec.get("scaling") or {}, (spec.get("worker") or {}).get("concurrency", 10))


class Controller:
    def __init__(self, kube: Kube, connections: Connections, *, clock: Callable[[], float] = time.time):
        self.kube = kube
        self.connections = connections
        self.clock = clock
        self.queues: dict[tuple[str, str], dict] = {}
        self.scaling_states: dict[tuple[str, str], scaling.ScalingState] = {}
        self.next_poll: dict[tuple[str, str], float] = {}
        self.applied_settings: dict[tuple[str, str], dict] = {}
        self.problems: dict[tuple[str, str], str] = {}  # last problem reported, to post each Event once
        self._polling: dict[tuple[str, str], asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self.extra_passes: list[Callable[[], Any]] = []  # e.g. schedule ticks, run by the leader too

    # -- registry (fed by watch events) ------------------------------------

    def observe_queue(self, event_type: str | None, body: dict) -> None:
        key = key_of(body)
        if event_type == "DELETED" or body["metadata"].get("deletionTimestamp"):
            self.queues.pop(key, None)
            self.scaling_states.pop(key, None)
            self.next_poll.pop(key, None)
            self.applied_settings.pop(key, None)
            return
        self.queues[key] = body

    def queue_body(self, namespace: str, name: str) -> dict | None:
        return self.queues.get((namespace, name))

    def post_event(self, body: dict, *, type: str, reason: str, message: str) -> None:
        """Fire and forget: an Event that cannot be posted is logged, never fatal."""
        async def post() -> None:
            try:
                await self.kube.post_event(body, type=type, reason=reason, message=message)
            except Exception as exc:
                log.warning("could not post Event %s on %s: %s", reason, body["metadata"]["name"], exc)
        task = asyncio.get_running_loop().create_task(post())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _report(self, body: dict, key: tuple[str, str], reason: str, message: str) -> None:
        """Post a Warning Event once per distinct problem (not on every poll)."""
        if self.problems.get(key) != message:
            self.problems[key] = message
            self.post_event(body, type="Warning", reason=reason, message=message)
            log.warning("%s/%s: %s: %s", *key, reason, message)

    def _resolved(self, key: tuple[str, str]) -> None:
        self.problems.pop(key, None)

    # -- spec reconciliation -------------------------------------------------

    async def apply_settings(self, key: tuple[str, str], spec: dict, q: effectmq.TaskQueue) -> None:
        settings = builders.queue_settings(spec)
        if self.applied_settings.get(key) != settings:
            await q.configure(**settings)
            self.applied_settings[key] = settings

    async def reconcile_queue(self, body: dict) -> dict:
        """Apply a Queue's spec: settings in Redis and the worker Deployment. Returns its status."""
        key = key_of(body)
        namespace, name = key
        spec = body.get("spec") or {}
        generation = body["metadata"].get("generation")
        self.observe_queue(None, body)
        redis_ok, redis_reason, redis_message = True, "Connected", "queue settings written to Redis"
        try:
            q = await self.connections.queue(namespace, name, spec)
            await self.apply_settings(key, spec, q)
        except ConfigProblem as problem:
            redis_ok, redis_reason, redis_message = False, problem.reason, problem.message
        except effectmq.RedisUnavailable as exc:
            redis_ok, redis_reason, redis_message = False, "RedisUnreachable", str(exc)
        except effectmq.InvalidOption as exc:
            redis_ok, redis_reason, redis_message = False, "InvalidSpec", str(exc)

        existing = await self.kube.get_deployment(namespace, builders.deployment_name(name))
        replicas = (existing or {}).get("spec", {}).get("replicas")
        if replicas is None:
            replicas = scaling_spec(spec).min_replicas
        deploy_ok, deploy_message = True, f"Deployment {builders.deployment_name(name)} applied"
        try:
            await self.kube.apply(builders.worker_deployment(namespace, name, spec, replicas, owner=body))
        except ApiException as exc:
            deploy_ok, deploy_message = False, f"applying the worker Deployment failed: {exc.reason}: {exc.body}"

        if not redis_ok:
            self._report(body, key, redis_reason, redis_message)
        elif not deploy_ok:
            self._report(body, key, "DeploymentFailed", deploy_message)
        else:
            self._resolved(key)
        result = status_mod.queue_status(
            generation=generation, previous=body.get("status") or {}, redis_ok=redis_ok, redis_reason=redis_reason,
            redis_message=redis_message, deployment_ok=deploy_ok, deployment_message=deploy_message,
        )
        await self.kube.patch_status("queues", namespace, name, result)
        self.next_poll[key] = 0  # poll soon: the new spec may change the desired replicas
        return result

    # -- periodic work (leader only) ----------------------------------------

    async def poll_queue(self, key: tuple[str, str]) -> None:
        body = self.queues.get(key)
        if body is None:
            return
        namespace, name = key
        spec = body.get("spec") or {}
        sspec = scaling_spec(spec)
        self.next_poll[key] = self.clock() + sspec.poll_interval
        previous = (body.get("status") or {}).get("conditions") or []
        generation = body["metadata"].get("generation")
        try:
            q = await self.connections.queue(namespace, name, spec)
            await self.apply_settings(key, spec, q)
            for _ in range(MAINTENANCE_ROUNDS):
                report = await q.maintain(batch=MAINTENANCE_BATCH)
                metrics.record_maintenance(q.name, report)
                if not report.more:
                    break
            stats = await q.stats()
            workers = await q.workers()
        except (ConfigProblem, effectmq.RedisUnavailable, effectmq.InvalidOption) as exc:
            reason = getattr(exc, "reason", "RedisUnreachable")
            message = getattr(exc, "message", str(exc))
            self._report(body, key, reason, message)
            cond = status_mod.condition("RedisReachable", False, reason, message, generation, previous)
            await self._patch_status(key, {"conditions": status_mod.replace_condition(previous, cond, generation)})
            metrics.POLL_ERRORS.labels(f"{namespace}/{name}").inc()
            return

        deployment_name = builders.deployment_name(name)
        deployment = await self.kube.get_deployment(namespace, deployment_name)
        if deployment is None:  # not reconciled yet (or deleted by hand): the spec handler recreates it
            return
        dstatus = deployment.get("status") or {}
        current = int(deployment["spec"].get("replicas") or 0)
        now = self.clock()
        state = self.scaling_states.get(key)
        if state is None:
            last = (body.get("status") or {}).get("lastScaleTime")
            state = scaling.restore_state(None if last is None else now, now, current)
        busy = sum(1 for in_flight, _ in workers.values() if in_flight > 0)
        decision = scaling.decide(sspec, scaling.Observation(stats.waiting, stats.active, current, busy), state, now)
        self.scaling_states[key] = decision.state
        patch = status_mod.backlog_status(stats, int(dstatus.get("replicas") or 0),
                                          int(dstatus.get("readyReplicas") or 0), decision.replicas)
        if decision.replicas != current:
            await self.kube.scale(namespace, deployment_name, decision.replicas)
            patch["lastScaleTime"] = status_mod.now_iso()
            patch["lastScaleReason"] = decision.reason
            self.post_event(body, type="Normal", reason="Scaled", message=decision.reason)
            log.info("%s/%s: %s", namespace, name, decision.reason)
            metrics.SCALE_DECISIONS.labels(q.name, "up" if decision.replicas > current else "down").inc()
        metrics.record_poll(q.name, stats, decision.replicas)
        if self.problems.get(key):
            self._resolved(key)
            cond = status_mod.condition("RedisReachable", True, "Connected", "Redis answered", generation, previous)
            patch["conditions"] = status_mod.replace_condition(previous, cond, generation)
        await self._patch_status(key, patch)
        await self._protect_busy_pods(namespace, name, workers)

    async def _patch_status(self, key: tuple[str, str], patch: dict) -> None:
        try:
            await self.kube.patch_status("queues", key[0], key[1], patch)
        except ApiException as exc:
            if exc.status != 404:  # a Queue deleted meanwhile is not an error
                raise

    async def _protect_busy_pods(self, namespace: str, name: str, workers: dict[str, tuple[int, int]]) -> None:
        """Pods with attempts in flight get a higher deletion cost, so a scale-in
        removes idle pods first (the ReplicaSet controller reads this annotation)."""
        selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(name).items())
        for pod in await self.kube.worker_pods(namespace, selector):
            pod_name = pod["metadata"]["name"]
            cost = str(workers.get(pod_name, (0, 0))[0])
            current = (pod["metadata"].get("annotations") or {}).get(builders.DELETION_COST)
            if current != cost:
                try:
                    await self.kube.annotate_pod(namespace, pod_name, {builders.DELETION_COST: cost})
                except ApiException as exc:
                    if exc.status != 404:
                        raise

    async def run_once(self) -> None:
        """Start the polls that are due (one at a time per Queue) and the extra passes."""
        now = self.clock()
        for key in list(self.queues):
            running = self._polling.get(key)
            if running is not None and not running.done():
                continue
            if now >= self.next_poll.get(key, 0):
                self._polling[key] = asyncio.create_task(self._guarded(self.poll_queue, key))
        for extra in self.extra_passes:
            await self._guarded(extra)

    async def _guarded(self, fn: Callable, *args: Any) -> None:
        try:
            await fn(*args)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s%s failed", getattr(fn, "__name__", fn), args)

    async def run(self, is_leader: Callable[[], bool], interval: float = 0.5) -> None:
        while True:
            if is_leader():
                await self.run_once()
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        for task in self._polling.values():
            task.cancel()
        await asyncio.gather(*self._polling.values(), return_exceptions=True)
        await self.connections.close()
