"""Queue resources parsed once into typed specs (no I/O).

The API server fills the CRD's schema defaults, but the local runner reads YAML
files that never went through it, so the defaults live here too, in one table
that a test holds against the CRD (`tests/operator/test_spec.py`). Everything
downstream (builders, scaling, the control core) takes these types instead of
`.get(...) or {}` chains.
"""

from __future__ import annotations

import builtins
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from effectmq.protocol import settings

from .scaling import ScalingSpec

# Schema defaults, minima and maxima of crds/queue.yaml by field path under spec, from
# the settings table (the CRD is written from it too), plus the objects defaulted to {}.
QUEUE_DEFAULTS: dict[str, Any] = {**settings.resource_defaults(), "retry": {}, "retention": {}, "scaling": {},
                                  "groups": {}}
QUEUE_MINIMA: dict[str, float] = settings.resource_minima()
# Every interval is bounded, so a typo (pollIntervalSeconds: 2147483647) is refused
# instead of silently never polling.
QUEUE_MAXIMA: dict[str, float] = settings.resource_maxima()

# spec.worker.tracing.otlpEndpoint, as the CRD's pattern has it (the local runner reads
# manifests that never went through the API server).
MAX_ENDPOINT = 2048
OTLP_ENDPOINT = re.compile(r"https?://[^\s,]+")

# A Queue's name is the value of its worker pods' app.kubernetes.io/instance label.
MAX_QUEUE_NAME = 63


class InvalidSpec(ValueError):
    """A spec the operator cannot act on; the message names the field."""


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str

    @classmethod
    def parse(cls, value: Any, where: str) -> "SecretKeyRef | None":
        if value is None:
            return None
        ref = value.get("secretKeyRef") if isinstance(value, Mapping) else None
        if not isinstance(ref, Mapping) or not ref.get("name") or not ref.get("key"):
            raise InvalidSpec(f"{where}.secretKeyRef needs name and key")
        return cls(str(ref["name"]), str(ref["key"]))


@dataclass(frozen=True)
class TlsSpec:
    enabled: bool = False
    insecure_skip_verify: bool = False
    ca_from: SecretKeyRef | None = None


@dataclass(frozen=True)
class RedisSpec:
    url: str | None = None
    url_from: SecretKeyRef | None = None
    tls: TlsSpec = TlsSpec()


PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True)
class TracingSpec:
    """spec.worker.tracing: the workers export their attempts' spans over OTLP/HTTP."""
    otlp_endpoint: str
    sample_ratio: float | None = None  # None: every trace the producer sampled (parent-based)
    links: bool = False  # each attempt a trace of its own, linked to its creation context

    @classmethod
    def parse(cls, value: Any, where: str = "spec.worker.tracing") -> "TracingSpec | None":
        if value is None:
            return None
        r = _Reader(value, where)
        endpoint = r.str("otlpEndpoint")
        if len(endpoint) > MAX_ENDPOINT or not OTLP_ENDPOINT.fullmatch(endpoint):
            raise InvalidSpec(f"{where}.otlpEndpoint: an http:// or https:// URL of at most "
                              f"{MAX_ENDPOINT} characters, got {endpoint[:80]!r}")
        ratio = r.raw("sampleRatio")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                                  or not 0 <= ratio <= 1):
            raise InvalidSpec(f"{where}.sampleRatio: a number from 0 to 1, got {ratio!r}")
        links = r.raw("links")
        if links is not None and not isinstance(links, bool):
            raise InvalidSpec(f"{where}.links: must be true or false")
        return cls(endpoint, None if ratio is None else float(ratio), bool(links))


@dataclass(frozen=True)
class WorkerSpec:
    image: str
    handlers: str
    concurrency: int = 10
    prefetch: int | None = None  # leases a pod holds ahead of its running attempts; None: the worker's auto
    env: tuple[dict[str, Any], ...] = ()
    env_from: tuple[dict[str, Any], ...] = ()  # core/v1 EnvFromSource, as written
    image_pull_policy: str | None = None  # None: the kubelet's default for the image's tag
    resources: dict[str, Any] = field(default_factory=dict)
    termination_grace_seconds: int = 60
    progress_deadline_seconds: int = 600
    pod_template: dict[str, Any] = field(default_factory=dict)  # core/v1 PodSpec fields, labels, annotations
    tracing: TracingSpec | None = None


def leases_per_pod(worker: WorkerSpec | None) -> int:
    """The leases one worker pod surely takes when busy: its running attempts and those
    it is told to hold ahead (auto holds none while handlers are long, so none counts:
    the in-flight floor then errs towards more pods, and maxActive's cap never halves
    the pods long handlers need)."""
    return worker.concurrency + (worker.prefetch or 0) if worker else 1


@dataclass(frozen=True)
class QueueSpec:
    redis: RedisSpec
    worker: WorkerSpec | None
    scaling: ScalingSpec
    paused: bool = False
    sensitive: bool = False
    max_active: int = 0
    lock_timeout: int = 30
    lock_refresh: int = 10
    max_retries: int | None = None
    max_stalled_count: int = 1
    retry: dict[str, Any] = field(default_factory=dict)
    retention_completed: int = 86400
    retention_failed: int = 604800
    rate_limit: tuple[int, float] | None = None  # (tasks, period seconds): starts allowed per window
    group_max_active: int = 0  # each task group's cap on attempts running at once (0: none)
    group_rate_limit: tuple[int, float] | None = None  # (tasks, period seconds): each group's starts per window

    @property
    def replica_cap(self) -> int | None:
        """maxActive bounds useful replicas: more pods than ceil(maxActive / leases per pod) would idle."""
        return self.scaling.replica_cap

    @classmethod
    def parse(cls, spec: Mapping[str, Any] | None, name: str = "") -> "QueueSpec":
        """Parse a Queue's spec (defaults filled in); InvalidSpec names what is wrong."""
        if name and len(name) > MAX_QUEUE_NAME:
            raise InvalidSpec(f"metadata.name: at most {MAX_QUEUE_NAME} characters "
                              f"(it is a label value of the worker pods), got {len(name)}")
        s = _Reader(spec or {}, "spec")
        redis = s.section("redis")
        tls = redis.section("tls")
        redis_spec = RedisSpec(
            url=redis.str("url") or None,
            url_from=SecretKeyRef.parse(redis.raw("urlFrom"), "spec.redis.urlFrom"),
            tls=TlsSpec(tls.bool("enabled"), tls.bool("insecureSkipVerify"),
                        SecretKeyRef.parse(tls.raw("caFrom"), "spec.redis.tls.caFrom")),
        )
        if (redis_spec.url is None) == (redis_spec.url_from is None):
            raise InvalidSpec("spec.redis: exactly one of url and urlFrom.secretKeyRef must be set")
        worker = None
        if s.raw("worker") is not None:
            w = s.section("worker")
            image, handlers = w.str("image"), w.str("handlers")
            if not image or not handlers:
                raise InvalidSpec("spec.worker needs image and handlers")
            env = w.raw("env") or []
            if not isinstance(env, list) or not all(isinstance(e, Mapping) and e.get("name") for e in env):
                raise InvalidSpec("spec.worker.env: a list of EnvVar objects, each with a name")
            pull_policy = w.raw("imagePullPolicy")
            if pull_policy is not None and pull_policy not in PULL_POLICIES:
                raise InvalidSpec(f"spec.worker.imagePullPolicy: one of {', '.join(PULL_POLICIES)}, "
                                  f"got {pull_policy!r}")
            worker = WorkerSpec(
                image=image, handlers=handlers, concurrency=w.int("concurrency"),
                prefetch=None if w.raw("prefetch") is None else w.int("prefetch", minimum=0),
                env=tuple(dict(e) for e in env), env_from=_env_from(w.raw("envFrom")),
                image_pull_policy=pull_policy, resources=dict(w.raw("resources") or {}),
                termination_grace_seconds=w.int("terminationGracePeriodSeconds"),
                progress_deadline_seconds=w.int("progressDeadlineSeconds"),
                pod_template=_pod_template(w.raw("podTemplate")),
                tracing=TracingSpec.parse(w.raw("tracing")),
            )
        sc = s.section("scaling")
        concurrency = leases_per_pod(worker)
        max_active = s.int("maxActive")
        rate_limit = None
        if s.raw("rateLimit") is not None:
            rate = s.section("rateLimit")
            rate_limit = (rate.int("tasks"), rate.number("periodSeconds"))
        groups = s.section("groups")
        group_rate_limit = None
        if groups.raw("rateLimit") is not None:
            group_rate = groups.section("rateLimit")
            group_rate_limit = (group_rate.int("tasks"), group_rate.number("periodSeconds"))
        scaling = ScalingSpec(
            min_replicas=sc.int("minReplicas"), max_replicas=sc.int("maxReplicas"),
            target_tasks_per_replica=sc.int("targetTasksPerReplica"),
            activation_tasks=sc.int("activationTasks"), poll_interval=float(sc.int("pollIntervalSeconds")),
            scale_down_stabilization=float(sc.int("scaleDownStabilizationSeconds")),
            cooldown=float(sc.int("cooldownSeconds")), concurrency=concurrency, paused=s.bool("paused"),
            replica_cap=math.ceil(max_active / concurrency) if max_active > 0 else None,
            has_rate_limit=rate_limit is not None,
        )
        if scaling.min_replicas > scaling.max_replicas:
            raise InvalidSpec("spec.scaling.minReplicas must be less than or equal to spec.scaling.maxReplicas")
        lock_timeout, lock_refresh = s.int("lockTimeoutSeconds"), s.int("lockRefreshSeconds")
        if lock_refresh >= lock_timeout:
            raise InvalidSpec("spec.lockRefreshSeconds must be less than spec.lockTimeoutSeconds")
        retention = s.section("retention")
        return cls(
            redis=redis_spec, worker=worker, scaling=scaling, paused=scaling.paused, sensitive=s.bool("sensitive"),
            max_active=max_active,
            lock_timeout=lock_timeout, lock_refresh=lock_refresh,
            max_retries=None if s.raw("maxRetries") is None else s.int("maxRetries"),
            max_stalled_count=s.int("maxStalledCount"), retry=s.section("retry").filled(),
            retention_completed=retention.int("completedSeconds"), retention_failed=retention.int("failedSeconds"),
            rate_limit=rate_limit, group_max_active=groups.int("maxActive"), group_rate_limit=group_rate_limit,
        )


def _env_from(value: Any, where: str = "spec.worker.envFrom") -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, Mapping) for s in value):
        raise InvalidSpec(f"{where}: a list of EnvFromSource objects")
    for i, source in enumerate(value):
        refs = [source[k] for k in ("configMapRef", "secretRef") if k in source]
        if len(refs) != 1 or not isinstance(refs[0], Mapping) or not refs[0].get("name"):
            raise InvalidSpec(f"{where}[{i}]: one of configMapRef and secretRef, with a name")
    return tuple(dict(s) for s in value)


# What each field of spec.worker.podTemplate must be, short of its full core/v1 schema (the
# CRD holds that, and local runs check manifests against it): enough that the Deployment
# built from it is well-formed, with the field named when it is not.
_POD_OBJECTS = ("nodeSelector", "affinity", "labels", "annotations")
_POD_LISTS = ("tolerations", "topologySpreadConstraints", "imagePullSecrets")
_POD_STRINGS = ("priorityClassName", "serviceAccountName")
_SPREAD_REQUIRED = ("maxSkew", "topologyKey", "whenUnsatisfiable")


def _pod_template(value: Any, where: str = "spec.worker.podTemplate") -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidSpec(f"{where}: must be an object")
    for key in _POD_OBJECTS:
        if key in value and not isinstance(value[key], Mapping):
            raise InvalidSpec(f"{where}.{key}: must be an object")
    for key in _POD_STRINGS:
        if key in value and not isinstance(value[key], str):
            raise InvalidSpec(f"{where}.{key}: must be a string")
    for key in _POD_LISTS:
        if key in value and not (isinstance(value[key], list) and all(isinstance(v, Mapping) for v in value[key])):
            raise InvalidSpec(f"{where}.{key}: must be a list of objects")
    for i, spread in enumerate(value.get("topologySpreadConstraints") or ()):
        if any(spread.get(k) in (None, "") for k in _SPREAD_REQUIRED):
            raise InvalidSpec(f"{where}.topologySpreadConstraints[{i}]: needs {', '.join(_SPREAD_REQUIRED[:-1])} "
                              f"and {_SPREAD_REQUIRED[-1]}")
    for i, secret in enumerate(value.get("imagePullSecrets") or ()):
        if not secret.get("name"):
            raise InvalidSpec(f"{where}.imagePullSecrets[{i}].name: must not be empty")
    return dict(value)


class _Reader:
    """Reads one section of a spec, with the defaults of QUEUE_DEFAULTS and errors naming the field."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise InvalidSpec(f"{path}: must be an object")
        self.data = data
        self.path = path
        self.prefix = path.removeprefix("spec").removeprefix(".")

    def _default_key(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def raw(self, key: str) -> Any:
        value = self.data.get(key)
        return QUEUE_DEFAULTS.get(self._default_key(key)) if value is None else value

    def section(self, key: str) -> "_Reader":
        value = self.raw(key)
        return _Reader({} if value is None else value, f"{self.path}.{key}")

    def filled(self) -> dict[str, Any]:
        """This section with its defaults filled in."""
        out = {k.rsplit(".", 1)[1]: v for k, v in QUEUE_DEFAULTS.items()
               if k.startswith(self.prefix + ".") and k.count(".") == self.prefix.count(".") + 1}
        out.update(self.data)
        return out

    def str(self, key: str) -> str:
        value = self.raw(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise InvalidSpec(f"{self.path}.{key}: must be a string")
        return value

    def bool(self, key: builtins.str) -> builtins.bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise InvalidSpec(f"{self.path}.{key}: must be true or false")
        return value

    def int(self, key: builtins.str, minimum: builtins.float | None = None) -> builtins.int:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise InvalidSpec(f"{self.path}.{key}: must be an integer")
        return int(self._bounded(key, value, minimum))

    def number(self, key: builtins.str) -> float:
        value = self.raw(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidSpec(f"{self.path}.{key}: must be a number")
        return float(self._bounded(key, value, None))

    def _bounded(self, key: builtins.str, value: float, minimum: float | None) -> float:
        if minimum is None:
            minimum = QUEUE_MINIMA.get(self._default_key(key), 0)
        if value < minimum:
            raise InvalidSpec(f"{self.path}.{key}: must be >= {minimum}")
        maximum = QUEUE_MAXIMA.get(self._default_key(key))
        if maximum is not None and value > maximum:
            raise InvalidSpec(f"{self.path}.{key}: must be <= {maximum}")
        return value
