"""The Queue reconciler: thin, level-based I/O around the pure control core.

The registry holds the live Queues and their worker Deployments as the watch
streams report them (plus a periodic full list, so a missed event heals). The
leader reconciles each Queue on its poll interval, at once when the Queue or its
Deployment changes, and again after a failure with backoff. A reconcile computes
everything from the live object: spec -> Redis settings, maintenance, stats ->
scaling decision -> Deployment (applied only when it drifted) -> status (written
only when it changed) and Events. Each reconcile runs as its own task with a
deadline, a bounded number at a time, so one slow Redis never delays another Queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes.client.rest import ApiException

from effectmq.redaction import scrub

from . import builders, control, metrics, scaling
from .connections import Connections, RedisTarget
from .kube import Kube, api_error
from .spec import InvalidSpec, QueueSpec
from .status import Problem

log = logging.getLogger("effectmq.operator")
MAINTENANCE_BATCH = 200
MAINTENANCE_ROUNDS = 5  # at most this many batches per poll: bounded whatever the backlog
Key = tuple[str, str]


def key_of(body: dict) -> Key:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def newer(incoming: dict, known: dict | None) -> bool:
    """Whether a watched object is at least as new as the one we hold (resourceVersions
    are etcd revisions here; when they do not compare as numbers, trust arrival order)."""
    if known is None:
        return True
    a, b = incoming["metadata"].get("resourceVersion", ""), known["metadata"].get("resourceVersion", "")
    return not (a.isdigit() and b.isdigit()) or int(a) >= int(b)


def backoff(failures: int, cap: float) -> float:
    return min(cap, 0.5 * 2 ** min(failures, 10))


@dataclass
class QueueRuntime:
    """What the leader remembers about one Queue between reconciles."""

    due: float = 0.0
    failures: int = 0
    reconciled_at: float | None = None  # monotonic time the last reconcile finished
    nudged: bool = False  # something changed: reconcile again, also when it changed during a reconcile
    scaling: scaling.ScalingState | None = None
    applied_generation: int | None = None  # the Deployment's generation after our last apply
    settings: tuple | None = None  # (target, settings) last written to Redis


class Registry:
    """The latest version of each watched object, by key; newer versions win."""

    def __init__(self) -> None:
        self.items: dict[Key, dict] = {}
        self.gone: dict[str, float] = {}  # uids deleted recently: a stale list must not resurrect them

    def put(self, body: dict) -> dict | None:
        key = key_of(body)
        if body["metadata"].get("uid") in self.gone:
            return None
        old = self.items.get(key)
        if newer(body, old):
            self.items[key] = body
        return old

    def drop(self, body: dict) -> dict | None:
        self.gone[body["metadata"].get("uid")] = time.monotonic()
        if len(self.gone) > 10_000:
            cutoff = time.monotonic() - 600
            self.gone = {u: t for u, t in self.gone.items() if t > cutoff}
        return self.items.pop(key_of(body), None)

    def replace_all(self, bodies: list[dict]) -> None:
        """A full list: objects missing from it are gone, newer watched versions are kept."""
        listed = {key_of(b): b for b in bodies if b["metadata"].get("uid") not in self.gone}
        for key in [k for k in self.items if k not in listed]:
            del self.items[key]
        for body in listed.values():
            self.put(body)


class QueueController:
    def __init__(self, kube: Kube, connections: Connections, *, namespaces: list[str] = (),
                 clock: Callable[[], float] = time.time, concurrency: int = 32, deadline: float = 20.0,
                 relist_every: float = 60.0):
        self.kube = kube
        self.connections = connections
        self.namespaces = list(namespaces)
        self.clock = clock
        self.deadline = deadline
        self.relist_every = relist_every
        self.queues = Registry()
        self.deployments: dict[Key, dict] = {}
        self.runtime: dict[Key, QueueRuntime] = {}
        self.targets: dict[Key, RedisTarget] = {}  # the Redis of each Queue, as last resolved
        self.synced = asyncio.Event()
        self.listeners: list[Callable[[Key], None]] = []  # told when a Queue appears, changes or goes
        self._limit = asyncio.Semaphore(concurrency)
        self._running: dict[Key, asyncio.Task] = {}
        self._next_list = 0.0
        self._term_started = time.monotonic()

    # -- registry (fed by watch events and full lists) ------------------------------

    def nudge(self, key: Key) -> None:
        rt = self.runtime.setdefault(key, QueueRuntime())
        rt.due, rt.nudged = 0.0, True

    def observe_queue(self, event_type: str | None, body: dict) -> None:
        key = key_of(body)
        if event_type == "DELETED":
            self.queues.drop(body)
            self.runtime.pop(key, None)
            self.targets.pop(key, None)
        else:
            old = self.queues.put(body)
            if old is None or old["metadata"].get("generation") != body["metadata"].get("generation"):
                self.nudge(key)
        for listener in self.listeners:
            listener(key)

    def observe_deployment(self, event_type: str | None, body: dict) -> None:
        queue = (body["metadata"].get("labels") or {}).get(f"{builders.GROUP}/queue")
        if not queue:
            return
        key = (body["metadata"]["namespace"], queue)
        old = self.deployments.get(key)
        if event_type == "DELETED":
            self.deployments.pop(key, None)
            self.nudge(key)  # recreate it
            return
        if not newer(body, old):
            return
        self.deployments[key] = body
        rt = self.runtime.get(key)
        drifted = rt is not None and body["metadata"].get("generation") != rt.applied_generation
        if old is None or drifted or control.DeploymentFacts.of(body) != control.DeploymentFacts.of(old):
            self.nudge(key)

    async def relist(self) -> None:
        self.queues.replace_all(await self.kube.list_resources("queues", self.namespaces))
        for key in self.queues.items:
            self.runtime.setdefault(key, QueueRuntime())
        for key in [k for k in self.runtime if k not in self.queues.items]:
            self.runtime.pop(key, None)
        self.synced.set()

    # -- the loop (leader only) -------------------------------------------------------

    async def run(self, is_leader: Callable[[], bool], interval: float = 0.2) -> None:
        leading = False
        try:
            while True:
                if is_leader():
                    if not leading:  # a new term: decisions start from the live objects, not old memory
                        leading = True
                        self._term_started = time.monotonic()
                        for rt in self.runtime.values():
                            rt.scaling, rt.applied_generation, rt.settings, rt.due = None, None, None, 0.0
                            rt.reconciled_at = None
                    await self.step()
                elif leading:
                    leading = False
                    await self.stop()  # a former leader's reconciles must not write any more
                await asyncio.sleep(interval)
        finally:
            await self.stop()

    async def step(self) -> None:
        if time.monotonic() >= self._next_list:
            try:
                await asyncio.wait_for(self.relist(), self.deadline)
                self._next_list = time.monotonic() + self.relist_every
            except Exception as exc:
                log.warning("listing Queues failed: %s", _describe(exc))
                self._next_list = time.monotonic() + 2.0
            if not self.synced.is_set():
                return
        now = self.clock()
        for key in list(self.queues.items):
            rt = self.runtime.setdefault(key, QueueRuntime())
            running = self._running.get(key)
            if rt.due <= now and (running is None or running.done()):
                self._running[key] = asyncio.create_task(self._reconcile_bounded(key), name=f"queue {key[0]}/{key[1]}")
        for key in [k for k, t in self._running.items() if t.done()]:
            del self._running[key]
        finished = [rt.reconciled_at for rt in self.runtime.values()]
        if finished:
            oldest = None if None in finished else min(finished)
            metrics.OLDEST_RECONCILE.set(time.monotonic() - (oldest if oldest is not None else self._term_started))

    async def _reconcile_bounded(self, key: Key) -> None:
        rt = self.runtime.setdefault(key, QueueRuntime())
        rt.due, rt.nudged = float("inf"), False  # not again until this one is done
        interval = 10.0
        ok = False
        try:
            async with self._limit:
                body = self.queues.items.get(key)
                if body is None:
                    return
                interval = _poll_interval(body)
                ok = await asyncio.wait_for(self.reconcile(key, body), self.deadline)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s/%s: reconcile failed: %s", *key, _describe(exc, self.targets.get(key)))
            metrics.POLL_ERRORS.labels(f"{key[0]}/{key[1]}").inc()
        finally:
            if key in self.runtime:
                rt.failures = 0 if ok else rt.failures + 1
                rt.due = self.clock() + (interval if ok else backoff(rt.failures, interval))
                if rt.nudged:  # changed while this reconcile read the old state
                    rt.due = 0.0
                rt.reconciled_at = time.monotonic()
                metrics.RECONCILES.labels("ok" if ok else "retry").inc()

    # -- one reconcile ----------------------------------------------------------------

    async def reconcile(self, key: Key, body: dict) -> bool:
        """Bring one Queue to its desired state; True when nothing is left to retry."""
        namespace, name = key
        rt = self.runtime.setdefault(key, QueueRuntime())
        generation = body["metadata"].get("generation")
        previous = body.get("status") or {}
        try:
            spec = QueueSpec.parse(body.get("spec"), name)
        except InvalidSpec as exc:
            facts = control.QueueFacts(spec_problem=Problem("InvalidSpec", str(exc), permanent=True),
                                       deployment=self._facts(key))
            await self._write(key, body, control.plan(facts, generation=generation, previous=previous,
                                                      decision=None, replicas_before=None))
            return False

        stats, workers, redis_problem = await self._observe_redis(key, rt, spec)
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
                decision = control.scale(spec, stats, workers, replicas, state, self.clock())
                rt.scaling, replicas_before, replicas = decision.state, replicas, decision.replicas
            desired = builders.worker_deployment(namespace, name, spec, replicas, owner=body)
            if _needs_apply(live, desired, rt):
                if live is not None and current is not None and replicas < current:
                    await self._protect_busy_pods(namespace, name, workers)
                try:
                    applied = await self.kube.apply(desired)
                    rt.applied_generation = applied["metadata"].get("generation")
                    if newer(applied, self.deployments.get(key)):  # the watch may have brought a newer one
                        self.deployments[key] = applied
                    live = self.deployments.get(key, applied)
                except ApiException as exc:
                    apply_problem = Problem("DeploymentFailed", f"applying the worker Deployment failed: "
                                            f"{api_error(exc)}", permanent=400 <= exc.status < 500
                                            and exc.status not in (408, 409, 429))
                    if decision is not None:
                        replicas_before = None  # nothing was scaled
        facts = control.QueueFacts(redis_problem=redis_problem, stats=stats, has_worker=spec.worker is not None,
                                   deployment=control.DeploymentFacts.of(live) if live else None,
                                   apply_problem=apply_problem)
        plan = control.plan(facts, generation=generation, previous=previous, decision=decision,
                            replicas_before=replicas_before)
        await self._write(key, body, plan)
        if stats is not None:
            metrics.record_poll(builders.queue_name(namespace, name), stats,
                                decision.replicas if decision else facts.deployment.replicas if facts.deployment else 0)
        if decision is not None and replicas_before is not None and decision.replicas != replicas_before:
            log.info("%s/%s: %s", namespace, name, decision.reason)
            metrics.SCALE_DECISIONS.labels(builders.queue_name(namespace, name),
                                           "up" if decision.replicas > replicas_before else "down").inc()
        return redis_problem is None and apply_problem is None

    async def _observe_redis(self, key: Key, rt: QueueRuntime, spec: QueueSpec):
        """Settings, bounded maintenance, stats and workers; or the problem that stopped them."""
        target = None
        try:
            target = await self.connections.target(key[0], spec.redis)
            self.targets[key] = target
            q = self.connections.queue(target, builders.queue_name(*key))
            settings = builders.queue_settings(spec)
            await q.configure(**settings)
            for _ in range(MAINTENANCE_ROUNDS):
                report = await q.maintain(batch=MAINTENANCE_BATCH)
                metrics.record_maintenance(q.name, report)
                if not report.more:
                    break
            return await q.stats(), await q.workers(), None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            problem = self.connections.problem(exc, target)
            metrics.POLL_ERRORS.labels(f"{key[0]}/{key[1]}").inc()
            return None, {}, problem

    def _facts(self, key: Key) -> control.DeploymentFacts | None:
        live = self.deployments.get(key)
        return control.DeploymentFacts.of(live) if live else None

    async def _write(self, key: Key, body: dict, plan: control.Plan) -> None:
        """Status only when it changed; then the plan's Events."""
        live = body.get("status") or {}
        if any(live.get(k) != v for k, v in plan.status.items()):
            written = await self.kube.patch_status("queues", key[0], key[1], plan.status)
            if written is not None:
                self.queues.put(written)
        for event in plan.events:
            try:
                await self.kube.post_event(body, type=event.type, reason=event.reason, message=event.message)
            except Exception as exc:  # an Event that cannot be posted is logged, never fatal
                log.warning("could not post Event %s on %s/%s: %s", event.reason, *key, _describe(exc))
            if event.type == "Warning":
                log.warning("%s/%s: %s: %s", *key, event.reason, event.message)

    async def _protect_busy_pods(self, namespace: str, name: str, workers: dict[str, tuple[int, int]]) -> None:
        """Before a scale-in: pods with attempts in flight get a higher deletion cost,
        so the ReplicaSet controller removes idle pods first."""
        selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(name).items())
        pods = await self.kube.worker_pods(namespace, selector)
        costs = control.pod_costs(workers, [p["metadata"]["name"] for p in pods])
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if (pod["metadata"].get("annotations") or {}).get(builders.DELETION_COST) != costs[pod_name]:
                await self.kube.annotate_pod(namespace, pod_name, {builders.DELETION_COST: costs[pod_name]})

    async def stop(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()


def _poll_interval(body: dict) -> float:
    try:
        return float(((body.get("spec") or {}).get("scaling") or {}).get("pollIntervalSeconds") or 10)
    except (TypeError, ValueError):
        return 10.0


def _needs_apply(live: dict | None, desired: dict, rt: QueueRuntime) -> bool:
    if live is None:
        return True
    annotations = live["metadata"].get("annotations") or {}
    return (annotations.get(builders.SPEC_HASH) != desired["metadata"]["annotations"][builders.SPEC_HASH]
            or live["spec"].get("replicas") != desired["spec"]["replicas"]
            or live["metadata"].get("generation") != rt.applied_generation)


def _describe(exc: BaseException, target: RedisTarget | None = None) -> str:
    """A failure for the log: the API server's message or the exception, without credentials."""
    text = api_error(exc) if isinstance(exc, ApiException) else (str(exc) or type(exc).__name__)
    return scrub(text, *(target.secrets if target else ()))
