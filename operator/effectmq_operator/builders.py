"""Desired Kubernetes objects for a Queue (pure: typed spec in, manifests out)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .api import GROUP, VERSION
from .spec import QueueSpec, RedisSpec, TracingSpec

METRICS_PORT = 9100
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
SPEC_HASH = f"{GROUP}/spec-hash"  # on the Deployment: what the operator last applied
MANAGED_BY = {"app.kubernetes.io/managed-by": "effectmq-operator"}
CA_DIR = "/etc/effectmq/redis-ca"  # where worker pods mount spec.redis.tls.caFrom
URL_DIR = "/etc/effectmq/redis-url"  # where worker pods mount spec.redis.urlFrom
URL_FILE = f"{URL_DIR}/url"
URL_VARIABLES = ("EFFECTMQ_REDIS_URL", "EFFECTMQ_REDIS_URL_FILE")  # a worker refuses both set (url_from_env)
# The pod's fsGroup when it mounts the URL: the kubelet gives a Secret's files to root
# and this group, and adds the group to every process of the pod, so a 0440 file is
# read by the worker whatever user its image runs as. 10001: the worker image's group.
URL_FILE_GROUP = 10001


def queue_name(namespace: str, name: str) -> str:
    """The queue's name in Redis: namespaced, so two namespaces never share a queue."""
    return f"{namespace}/{name}"


def deployment_name(queue: str) -> str:
    return f"{queue}-worker"


def selector_labels(queue: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "effectmq-worker", "app.kubernetes.io/instance": queue}


def worker_labels(queue: str) -> dict[str, str]:
    return {
        **selector_labels(queue),
        "app.kubernetes.io/component": "worker",
        "app.kubernetes.io/part-of": "effectmq",
        "app.kubernetes.io/managed-by": "effectmq-operator",
        f"{GROUP}/queue": queue,
    }


def drain_timeout(grace_seconds: int) -> int:
    """Workers must finish draining before the kubelet's SIGKILL: keep a margin."""
    return max(1, grace_seconds - max(5, grace_seconds // 6))


def redis_url_env(redis: RedisSpec) -> dict[str, Any]:
    """How the worker learns its Redis: a literal URL (no credentials, by a CRD rule) as
    EFFECTMQ_REDIS_URL; one from a Secret as the file the Secret's key is mounted at
    (EFFECTMQ_REDIS_URL_FILE), never a variable, which child processes, /proc/<pid>/environ
    and crash dumps would show."""
    if redis.url_from:
        return {"name": "EFFECTMQ_REDIS_URL_FILE", "value": URL_FILE}
    return {"name": "EFFECTMQ_REDIS_URL", "value": redis.url or ""}


# The worker's pod, from the downward API: a stall of an attempt it held is then blamed on
# how this pod ended (the operator records that in Redis).
POD_IDENTITY_ENV = (
    {"name": "EFFECTMQ_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "EFFECTMQ_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    {"name": "EFFECTMQ_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
)


def tracing_env(namespace: str, name: str, tracing: TracingSpec) -> list[dict[str, Any]]:
    """The OpenTelemetry SDK's standard variables, which `effectmq worker` reads. The
    resource names the pod through the kubelet's $(VAR) expansion of POD_IDENTITY_ENV."""
    resource = (f"k8s.namespace.name={namespace},k8s.deployment.name={deployment_name(name)},"
                "k8s.pod.name=$(EFFECTMQ_POD_NAME),k8s.pod.uid=$(EFFECTMQ_POD_UID),k8s.node.name=$(EFFECTMQ_NODE_NAME)")
    env = [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": tracing.otlp_endpoint},
        {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": "http/protobuf"},
        {"name": "OTEL_SERVICE_NAME", "value": deployment_name(name)},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": resource},
    ]
    if tracing.sample_ratio is not None:
        env += [{"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
                {"name": "OTEL_TRACES_SAMPLER_ARG", "value": repr(tracing.sample_ratio)}]
    if tracing.links:
        env.append({"name": "EFFECTMQ_TRACE_LINKS", "value": "true"})
    return env


def worker_env(namespace: str, name: str, spec: QueueSpec) -> list[dict[str, Any]]:
    """The worker container's env: the operator's variables, then the user's. A user
    variable with an operator variable's name replaces it in place (one entry, the
    user's value), because duplicate names make server-side apply fail."""
    worker = spec.worker
    assert worker is not None
    env = [
        {"name": "EFFECTMQ_QUEUE", "value": queue_name(namespace, name)},
        redis_url_env(spec.redis),
        {"name": "EFFECTMQ_HANDLERS", "value": worker.handlers},
        {"name": "EFFECTMQ_CONCURRENCY", "value": str(worker.concurrency)},
        {"name": "EFFECTMQ_LOCK_TIMEOUT", "value": str(spec.lock_timeout)},
        {"name": "EFFECTMQ_LOCK_REFRESH", "value": str(spec.lock_refresh)},
        {"name": "EFFECTMQ_DRAIN_TIMEOUT", "value": str(drain_timeout(worker.termination_grace_seconds))},
        {"name": "EFFECTMQ_METRICS_PORT", "value": str(METRICS_PORT)},
        {"name": "EFFECTMQ_WORKER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *POD_IDENTITY_ENV,
    ]
    if worker.tracing is not None:  # only when set: a new variable would roll every existing Deployment
        env += tracing_env(namespace, name, worker.tracing)
    if worker.prefetch is not None:  # only when set: a new variable would roll every existing Deployment
        env.append({"name": "EFFECTMQ_PREFETCH", "value": str(worker.prefetch)})
    tls = spec.redis.tls
    if tls.enabled:
        env.append({"name": "EFFECTMQ_REDIS_TLS", "value": "true"})
    if tls.insecure_skip_verify:
        env.append({"name": "EFFECTMQ_REDIS_TLS_INSECURE", "value": "true"})
    if tls.ca_from:
        env.append({"name": "EFFECTMQ_REDIS_CA_FILE", "value": f"{CA_DIR}/ca.crt"})
    user = {}
    for var in worker.env:  # the last of repeated user names wins, as the kubelet would resolve them
        user[var["name"]] = var
    users_url = [user.pop(name) for name in URL_VARIABLES if name in user]
    merged = []
    for var in env:
        if var["name"] in URL_VARIABLES and users_url:  # the user's URL, by either name, replaces ours
            merged += users_url
        else:
            merged.append(user.pop(var["name"], var))
    return merged + list(user.values())


RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def worker_deployment(namespace: str, name: str, spec: QueueSpec, replicas: int,
                      owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Deployment that runs `effectmq worker` for a Queue, with the hash of
    everything but the replica count in an annotation (drift shows as a mismatch)."""
    worker = spec.worker
    assert worker is not None, "a Queue without spec.worker runs no Deployment"
    template = worker.pod_template
    labels = worker_labels(name)
    container: dict[str, Any] = {
        "name": "worker",
        "image": worker.image,
        "command": ["effectmq", "worker"],
        "args": [worker.handlers],
        "env": worker_env(namespace, name, spec),
        **({"envFrom": list(worker.env_from)} if worker.env_from else {}),
        **({"imagePullPolicy": worker.image_pull_policy} if worker.image_pull_policy else {}),
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        # /livez: the process answers; /readyz: Redis reachable and not draining
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "metrics"},
                          "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"},
                           "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "resources": worker.resources,
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        # A worker that dies at start (a wrong handler module) leaves no termination
        # message file: the last lines of its log say why (the Queue's status shows them).
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    ca_ref = spec.redis.tls.ca_from
    if ca_ref:
        volumes.append({"name": "redis-ca", "secret": {"secretName": ca_ref.name,
                                                       "items": [{"key": ca_ref.key, "path": "ca.crt"}]}})
        container["volumeMounts"].append({"name": "redis-ca", "mountPath": CA_DIR, "readOnly": True})
    pod_security: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    url_ref = spec.redis.url_from
    if url_ref:
        volumes.append({"name": "redis-url", "secret": {"secretName": url_ref.name, "defaultMode": 0o440,
                                                        "items": [{"key": url_ref.key, "path": "url"}]}})
        container["volumeMounts"].append({"name": "redis-url", "mountPath": URL_DIR, "readOnly": True})
        pod_security["fsGroup"] = URL_FILE_GROUP
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": worker.termination_grace_seconds,
        "securityContext": pod_security,
    }
    # Only those set: a new key in the template would roll every existing Deployment.
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName",
                "serviceAccountName", "imagePullSecrets"):
        if template.get(key):
            pod_spec[key] = template[key]
    if not template.get("serviceAccountName"):  # the worker never calls the API server: no token
        pod_spec["automountServiceAccountToken"] = False
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment_name(name), "namespace": namespace, "labels": labels, "annotations": {}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "progressDeadlineSeconds": worker.progress_deadline_seconds,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {**(template.get("labels") or {}), **labels},
                    "annotations": {**(template.get("annotations") or {}),
                                    "prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)},
                },
                "spec": pod_spec,
            },
        },
    }
    if owner:
        body["metadata"]["ownerReferences"] = [owner_reference(owner)]
    body["metadata"]["annotations"][SPEC_HASH] = spec_hash(body)
    return body


def spec_hash(deployment: dict[str, Any]) -> str:
    """Hash of a desired Deployment without its replica count and this annotation."""
    meta = {k: v for k, v in deployment["metadata"].items() if k != "annotations"}
    spec = {k: v for k, v in deployment["spec"].items() if k != "replicas"}
    return hashlib.sha256(json.dumps([meta, spec], sort_keys=True).encode()).hexdigest()[:16]


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner.get("apiVersion", f"{GROUP}/{VERSION}"),
        "kind": owner.get("kind", "Queue"),
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def queue_settings(spec: QueueSpec) -> dict[str, Any]:
    """Queue-level settings written to Redis, so they apply without a redeploy."""
    from effectmq.client import retry as retry_policies

    return {
        "paused": spec.paused,
        "sensitive": spec.sensitive,
        "max_active": spec.max_active,
        "max_stalled_count": spec.max_stalled_count,
        "lock_timeout": float(spec.lock_timeout),
        "retention_completed": float(spec.retention_completed),
        "retention_failed": float(spec.retention_failed),
        "max_retries": spec.max_retries,
        "retry": retry_policies.from_json(spec.retry) if spec.retry else None,
        "rate_limit": spec.rate_limit,
        "group_max_active": spec.group_max_active,
        "group_rate_limit": spec.group_rate_limit,
    }


def schedule_id(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def schedule_spec(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's definition of a Schedule resource (validated by ScheduleSpec)."""
    task = spec.get("task") or {}
    out = {
        "id": schedule_id(namespace, name),
        "queue": queue_name(namespace, (spec.get("queueRef") or {}).get("name", "")),
        "cron": spec.get("schedule", ""),
        "timezone": spec.get("timeZone") or "UTC",
        "task": task.get("name", ""),
        "payload": task.get("payload"),
        "priority": int(task.get("priority", 0)),
        "max_retries": task.get("maxRetries"),
        "delay": task.get("delaySeconds"),
        "missed": str(spec.get("missedTicks", "Coalesce")).lower(),
        "max_backfill": int(spec.get("maxBackfill", 10)),
        "starting_deadline": spec.get("startingDeadlineSeconds"),
        # how late a tick still runs as on time (a restart, a leader change); 60: the CRD's default
        "missed_after": float(spec.get("missedAfterSeconds", 60)),
        "suspend": bool(spec.get("suspend", False)),
    }
    return out
