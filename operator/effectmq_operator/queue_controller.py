"""The Queue reconciler: thin, level-based I/O around the pure plan (`queue_plan`).

The registry holds the live Queues and their worker Deployments as the watch
streams report them (plus a periodic full list, so a missed event heals). The
leader reconciles each Queue on its poll interval, at once when the Queue or its
Deployment changes, and again after a failure with backoff. A reconcile computes
everything from the live object: spec -> Redis settings, maintenance, stats and the
recent stalls -> scaling decision -> Deployment (applied only when it drifted; its
replicas set on their own when the full apply is refused) -> its pods, only while it is
not fully available -> status (written only when it changed; the stalls make its
Stalling condition) and Events. Each reconcile runs as its own task with a
deadline, a bounded number at a time, so one slow Redis never delays another Queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import effectmq
from kubernetes.client.rest import ApiException

from . import api, builders, metrics, queue_plan, scaling, stalls
from .redis_pool import Connections, RedisTarget
from .runtime.cancellation import raise_if_cancelled
from .runtime.kube import Kube, api_error, describe_failure, namespace_terminating, permanent_refusal
from .runtime.registry import Key, Registry, key_of, newer
from .runtime.workqueue import DONE, Reconciled, WorkQueue
from .spec import QUEUE_MAXIMA, InvalidSpec, QueueSpec
from .status import Problem

log = logging.getLogger("effectmq.operator")
MAINTENANCE_BATCH = 200
# Refusals of a write by a Redis that answers: full (noeviction), a failing RDB save, a
# read-only replica, too few replicas. Other errors mean it cannot be used at all.
WRITE_REFUSALS = frozenset({"OOM", "MISCONF", "READONLY", "NOREPLICAS"})
# Seconds of sweeping per poll while calls report more: a Queue whose workers are gone
# still sheds its expired records, and one backlog cannot hold a poll for long.
MAINTENANCE_BUDGET = 0.5
# Reconciles in flight at once. Mostly waiting: on the API server (the Kube pool bounds
# those calls) or on a Redis (redis_pool.py bounds each Redis' polls).
RECONCILES_AT_ONCE = 64
REDIS_SHARE = 0.4  # of a reconcile's deadline, for its Redis calls: the rest writes status and Events
SETTINGS_EVERY = 300.0  # queue settings are written when they change, and again this often
# Worker pods are listed only while a Queue's Deployment is not fully available (a rollout,
# a scale-up, a crash loop), at most this often per Queue; and such a Queue is polled at
# least this often, so a crash loop is judged within seconds whatever its poll interval.
POD_LIST_EVERY = 2.0
UNAVAILABLE_POLL = 10.0


@dataclass
class QueueRuntime:
    """What the leader remembers about one Queue between reconciles (forgotten on a new term)."""

    scaling: scaling.ScalingState | None = None
    applied_generation: int | None = None  # the Deployment's generation after our last apply
    settings: tuple | None = None  # (Redis, settings) last written there
    settings_at: float = 0.0
    status_at: float = field(default_factory=time.monotonic)  # our last status write (or the term's start)
    pods: tuple[queue_plan.PodFacts, ...] | None = None  # the worker pods, as last listed
    pods_at: float = float("-inf")
    pods_for: queue_plan.DeploymentFacts | None = None  # what the Deployment said when they were listed
    unavailable: bool = False  # the Deployment was not fully available at the last reconcile


class QueueController:
    def __init__(self, kube: Kube, connections: Connections, *, namespaces: Sequence[str] = (),
                 clock: Callable[[], float] = time.time, concurrency: int = RECONCILES_AT_ONCE, deadline: float = 20.0,
                 relist_every: float = 60.0):
        self.kube = kube
        self.connections = connections
        self.namespaces = list(namespaces)
        self.clock = clock
        self.deadline = deadline
        self.redis_deadline = deadline * REDIS_SHARE
        self.queues = Registry(lambda: kube.list_resources("queues", self.namespaces), relist_every=relist_every,
                               on_listed=self._queue_seen)
        self.deployments: dict[Key, dict] = {}
        self.runtime: dict[Key, QueueRuntime] = {}
        self.targets: dict[Key, RedisTarget] = {}  # the Redis of each Queue, as last resolved
        self.listeners: list[Callable[[Key], None]] = []  # told when a Queue appears, changes or goes
        self.work = WorkQueue(self._reconcile_key, interval=self._poll_interval, concurrency=concurrency,
                              deadline=deadline, describe=lambda key, exc: describe_failure(exc, self._secrets(key)))
        self.work.on_finished = self._finished

    @property
    def synced(self) -> asyncio.Event:
        return self.queues.synced

    # -- what the Schedule side reads (queue_view.QueueView) ----------------------------

    def listed(self) -> bool:
        return self.queues.synced.is_set()

    def queue(self, key: Key) -> dict | None:
        return self.queues.items.get(key)

    def redis_of(self, key: Key) -> RedisTarget | None:
        return self.targets.get(key)

    def redis_targets(self) -> set[RedisTarget]:
        return set(self.targets.values())

    def on_change(self, listener: Callable[[Key], None]) -> None:
        self.listeners.append(listener)

    # -- registry (fed by watch events and full lists) ------------------------------

    def observe_queue(self, event_type: str | None, body: dict) -> None:
        self.queues.watch_reported()
        old = self.queues.drop(body) if event_type == "DELETED" else self.queues.put(body)
        self._queue_seen(event_type, body, old)

    def _queue_seen(self, event_type: str | None, body: dict, old: dict | None) -> None:
        """A Queue as its watch reported it or a list found it: its reconcile and its
        Schedules hear when it appeared, its spec changed, its deletion began or it went
        (a status write alone changes nothing they read)."""
        key = key_of(body)
        if event_type == "DELETED":
            self.runtime.pop(key, None)
            self.targets.pop(key, None)
            self.work.forget(key)
        elif spec_changed(old, body):
            self.work.nudge(key)
        else:
            return
        for listener in self.listeners:
            listener(key)

    def observe_deployment(self, event_type: str | None, body: dict) -> None:
        queue = (body["metadata"].get("labels") or {}).get(f"{api.GROUP}/queue")
        if not queue:
            return
        key = (body["metadata"]["namespace"], queue)
        old = self.deployments.get(key)
        if event_type == "DELETED":
            self.deployments.pop(key, None)
            self.work.nudge(key)  # recreate it
            return
        if not newer(body, old):
            return
        self.deployments[key] = body
        rt = self.runtime.get(key)
        drifted = rt is not None and body["metadata"].get("generation") != rt.applied_generation
        if old is None or drifted or queue_plan.DeploymentFacts.of(body) != queue_plan.DeploymentFacts.of(old):
            self.work.nudge(key)

    # -- the loop (leader only) -------------------------------------------------------

    async def run(self, is_leader: Callable[[], bool], interval: float = 0.2) -> None:
        leading = False
        try:
            while True:
                raise_if_cancelled()
                if is_leader():
                    if not leading:  # a new term: decisions start from the live objects, not old memory
                        leading = True
                        self.runtime.clear()
                        self.work.reset()
                    await self.step()
                elif leading:
                    leading = False
                    await self.work.stop()  # a former leader's reconciles must not write any more
                await asyncio.sleep(interval)
        finally:
            await self.work.stop()

    async def step(self) -> None:
        if await self.queues.refresh(self.deadline, "Queues"):
            self.work.start_due(list(self.queues.items))
            metrics.OLDEST_RECONCILE.set(self.work.oldest_age())

    def _secrets(self, key: Key) -> tuple[str, ...]:
        target = self.targets.get(key)
        return target.secrets if target else ()

    def _poll_interval(self, key: Key) -> float:
        """The Queue's poll interval, within the CRD's bounds (a Queue stored before they
        existed is polled at least hourly, and its reconcile says the value is invalid)."""
        try:
            interval = float((((self.queues.items.get(key) or {}).get("spec") or {}).get("scaling") or {})
                             .get("pollIntervalSeconds") or 10)
        except (TypeError, ValueError):
            return 10.0
        return min(max(interval, 1.0), float(QUEUE_MAXIMA["scaling.pollIntervalSeconds"]))

    def _requeue(self, key: Key, rt: QueueRuntime, *, failed: bool) -> Reconciled:
        """Again after the poll interval, or with backoff when `failed`; while the Deployment
        is not fully available, within UNAVAILABLE_POLL seconds either way."""
        soon = rt.unavailable and UNAVAILABLE_POLL < self._poll_interval(key)
        return Reconciled(requeue_after=UNAVAILABLE_POLL if soon else None, retry=failed)

    def _finished(self, key: Key, ok: bool) -> None:
        metrics.RECONCILES.labels("ok" if ok else "retry").inc()

    async def _reconcile_key(self, key: Key) -> Reconciled:
        body = self.queues.items.get(key)
        return DONE if body is None else await self.reconcile(key, body)

    # -- one reconcile ----------------------------------------------------------------

    async def reconcile(self, key: Key, body: dict) -> Reconciled:
        """Bring one Queue to its desired state; says when to look again."""
        namespace, name = key
        if body["metadata"].get("deletionTimestamp"):  # going away: its Deployment goes by garbage collection
            return self._requeue(key, self.runtime.get(key) or QueueRuntime(), failed=False)
        rt = self.runtime.setdefault(key, QueueRuntime())
        generation = body["metadata"].get("generation")
        previous = body.get("status") or {}
        try:
            spec = QueueSpec.parse(body.get("spec"), name)
        except InvalidSpec as exc:
            facts = queue_plan.QueueFacts(spec_problem=Problem("InvalidSpec", str(exc), permanent=True),
                                          deployment=self._facts(key))
            await self._write(key, body, queue_plan.plan(facts, generation=generation, previous=previous,
                                                         decision=None, replicas_before=None))
            return self._requeue(key, rt, failed=True)

        stats, workers, recent_stalls, redis_problem, write_problem = await self._observe_redis(key, spec)
        live = self.deployments.get(key)
        decision = None
        replicas_before = None
        apply_problem = None
        if spec.worker is None:
            if live is not None:  # the worker section was removed: its Deployment goes too
                await self.kube.delete_deployment(namespace, builders.deployment_name(name))
                self.deployments.pop(key, None)
            live = None
        else:
            current = int(live["spec"].get("replicas") or 0) if live else None
            replicas = current if current is not None else spec.scaling.lower
            if stats is not None:
                state = rt.scaling or scaling.restore_state(None, self.clock(), replicas)
                decision = queue_plan.scale(spec, stats, workers, replicas, state, self.clock())
                rt.scaling, replicas_before, replicas = decision.state, replicas, decision.replicas
            desired = builders.worker_deployment(namespace, name, spec, replicas, owner=body)
            if live is not None and not queue_plan.needs_apply(live, desired, rt.applied_generation):
                rt.applied_generation = live["metadata"].get("generation")  # as we want it: adopt it
            else:
                if live is not None and current is not None and replicas < current:
                    await self._protect_busy_pods(namespace, name, workers)
                try:
                    applied = await self.kube.apply(desired)
                    rt.applied_generation = applied["metadata"].get("generation")
                    if newer(applied, self.deployments.get(key)):  # the watch may have brought a newer one
                        self.deployments[key] = applied
                    live = self.deployments.get(key, applied)
                except ApiException as exc:
                    if namespace_terminating(exc):
                        log.debug("%s/%s: namespace is being deleted", namespace, name)
                        return self._requeue(key, rt, failed=False)
                    apply_problem, live, scaled = await self._apply_refused(key, exc, live, replicas)
                    if decision is not None and not scaled:
                        replicas_before = None  # nothing was scaled
        deployment = queue_plan.DeploymentFacts.of(live) if live else None
        rt.unavailable = deployment is not None and not deployment.rolled_out
        if deployment is not None and rt.unavailable:
            pods = await self._worker_pods(key, rt, deployment)
        else:  # available: the pods are not read, and what was read of them is stale
            pods = rt.pods = rt.pods_for = None
        facts = queue_plan.QueueFacts(redis_problem=redis_problem, write_problem=write_problem, stats=stats,
                                      has_worker=spec.worker is not None, deployment=deployment,
                                      apply_problem=apply_problem, pods=pods, stalls=recent_stalls)
        plan = queue_plan.plan(facts, generation=generation, previous=previous, decision=decision,
                               replicas_before=replicas_before)
        await self._write(key, body, plan)
        if stats is not None:
            metrics.record_poll(builders.queue_name(namespace, name), stats,
                                decision.replicas if decision else facts.deployment.replicas if facts.deployment else 0)
        if decision is not None and replicas_before is not None and decision.replicas != replicas_before:
            log.info("%s/%s: %s", namespace, name, decision.reason)
            metrics.SCALE_DECISIONS.labels(builders.queue_name(namespace, name),
                                           "up" if decision.replicas > replicas_before else "down").inc()
        return self._requeue(key, rt, failed=redis_problem is not None or apply_problem is not None)

    async def _apply_refused(self, key: Key, exc: ApiException, live: dict | None,
                             replicas: int) -> tuple[Problem, dict | None, bool]:
        """The problem of a refused apply; and the replicas set on their own meanwhile (a
        mistake elsewhere in the spec must not stop scaling). Returns the problem, the
        Deployment as it is now, and whether its replicas were changed."""
        namespace, name = key
        message = f"applying the worker Deployment failed: {api_error(exc)}"
        scaled = False
        if live is None:
            message += "; no worker runs until it can be created"
        else:
            message += "; the Deployment keeps its last applied template, and its replicas still follow the backlog"
            if int((live.get("spec") or {}).get("replicas") or 0) != replicas:
                try:
                    result = await self.kube.scale(namespace, builders.deployment_name(name), replicas)
                    scaled = True
                    if newer(result, self.deployments.get(key)):
                        self.deployments[key] = result
                    live = self.deployments.get(key, result)
                    log.info("%s/%s: replicas set to %d on their own: the full apply is refused", namespace, name,
                             replicas)
                except ApiException as scale_exc:
                    message += f" (but scaling it failed too: {api_error(scale_exc)})"
        return Problem("DeploymentFailed", message, permanent=permanent_refusal(exc)), live, scaled

    async def _worker_pods(self, key: Key, rt: QueueRuntime,
                           deployment: queue_plan.DeploymentFacts) -> tuple[queue_plan.PodFacts, ...] | None:
        """The Queue's worker pods (a list by its Deployment's selector): again when the
        Deployment's status moved, else at most every POD_LIST_EVERY seconds (a crash loop
        moves only the pods); None when they cannot be listed (status then says less)."""
        if deployment == rt.pods_for and time.monotonic() - rt.pods_at < POD_LIST_EVERY:
            return rt.pods
        selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(key[1]).items())
        try:
            pods = await self.kube.worker_pods(key[0], selector)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("%s/%s: worker pods not listed: %s", *key, describe_failure(exc))
            return None
        rt.pods, rt.pods_at, rt.pods_for = tuple(queue_plan.PodFacts.of(p) for p in pods), time.monotonic(), deployment
        return rt.pods

    async def _observe_redis(self, key: Key, spec: QueueSpec):
        """Settings, bounded maintenance, stats, workers, the recent stalls by cause and
        whether Redis takes new writes (offers); or the problem that stopped them."""
        target = None
        self.kube.check_leader()  # maintenance and settings are writes too
        try:
            target = await self.connections.target(key[0], spec.redis)
            self.targets[key] = target
            # The deadline leaves part of the reconcile's own for writing the condition that says so.
            stats, workers, recent_stalls, refusal = await self.connections.poll(
                target, lambda: self._poll(key, target, spec), self.redis_deadline)
            write_problem = self._write_problem(refusal, target)
            accepting = metrics.ACCEPTING_TASKS.labels(f"{key[0]}/{key[1]}")
            if write_problem is None or write_problem.reason != queue_plan.NOT_CHECKED:
                accepting.set(0 if write_problem else 1)
            return stats, workers, recent_stalls, None, write_problem
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            metrics.POLL_ERRORS.labels(f"{key[0]}/{key[1]}").inc()
            return None, {}, None, self.connections.problem(exc, target), None

    def _write_problem(self, refusal: Exception | None, target: RedisTarget) -> Problem | None:
        """What the write probe's refusal says about offers (None: Redis took the write)."""
        if refusal is None:
            return None
        message = self.connections.problem(refusal, target).message.rstrip(". ")
        if isinstance(refusal, effectmq.RedisRefused):  # an ACL without SET: the probe cannot tell
            return Problem(queue_plan.NOT_CHECKED, f"the write probe was refused: {message}")
        return Problem("RedisRefusesWrites", f"offers are refused: {message}; workers still settle the tasks they hold")

    async def _poll(self, key: Key, target: RedisTarget, spec: QueueSpec):
        q = self.connections.queue(target, builders.queue_name(*key))
        settings = builders.queue_settings(spec)
        rt = self.runtime.setdefault(key, QueueRuntime())
        if rt.settings != (target, settings) or time.monotonic() - rt.settings_at > SETTINGS_EVERY:
            await q.configure(**settings)  # it also wakes idle workers: not on every poll
            rt.settings, rt.settings_at = (target, settings), time.monotonic()
        report = await q.sweep(batch=MAINTENANCE_BATCH, budget=MAINTENANCE_BUDGET)
        metrics.record_maintenance(q.name, report)
        stats, workers = await q.stats(), await q.workers()
        recent = await q.recent_stalls(stalls.WINDOW_SECONDS)
        try:
            await q.check_writes()
        except effectmq.RedisUnavailable as exc:
            if exc.code not in WRITE_REFUSALS:
                raise
            return stats, workers, recent, exc
        except effectmq.RedisRefused as exc:
            return stats, workers, recent, exc
        return stats, workers, recent, None

    def _facts(self, key: Key) -> queue_plan.DeploymentFacts | None:
        live = self.deployments.get(key)
        return queue_plan.DeploymentFacts.of(live) if live else None

    async def _write(self, key: Key, body: dict, plan: queue_plan.Plan) -> None:
        """Status only when it changed; then the plan's Events."""
        rt = self.runtime.setdefault(key, QueueRuntime())
        if queue_plan.needs_write(body.get("status") or {}, plan.status, time.monotonic() - rt.status_at):
            written = await self.kube.patch_status("queues", key[0], key[1], plan.status)
            rt.status_at = time.monotonic()
            if written is not None:
                self.queues.put(written)
        await self.kube.post_events(body, plan.events)
        for event in plan.events:
            if event.type == "Warning":
                log.warning("%s/%s: %s: %s", *key, event.reason, event.message)

    async def _protect_busy_pods(self, namespace: str, name: str, workers: dict[str, tuple[int, int]]) -> None:
        """Before a scale-in: pods with attempts in flight get a higher deletion cost,
        so the ReplicaSet controller removes idle pods first."""
        selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(name).items())
        pods = await self.kube.worker_pods(namespace, selector)
        costs = queue_plan.pod_costs(workers, [p["metadata"]["name"] for p in pods])
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if (pod["metadata"].get("annotations") or {}).get(builders.DELETION_COST) != costs[pod_name]:
                await self.kube.annotate_pod(namespace, pod_name, {builders.DELETION_COST: costs[pod_name]})


def spec_changed(old: dict | None, new: dict) -> bool:
    """Whether a Queue's watch event changed what its reconcile and its Schedules read
    (it appeared, its spec changed, or its deletion began), not only its status."""
    if old is None:
        return True
    before, after = old["metadata"], new["metadata"]
    return (before.get("generation") != after.get("generation")
            or before.get("deletionTimestamp") != after.get("deletionTimestamp"))
