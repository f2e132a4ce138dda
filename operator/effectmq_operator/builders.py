"""Desired Kubernetes objects for a Queue (pure: spec in, manifests out)."""

from __future__ import annotations

from typing import Any

GROUP = "effectmq.io"
VERSION = "v1alpha1"
METRICS_PORT = 9100
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


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


def redis_url_env(redis_spec: dict) -> dict[str, Any]:
    """The EFFECTMQ_REDIS_URL variable: a literal URL or a Secret reference."""
    ref = (redis_spec.get("urlFrom") or {}).get("secretKeyRef")
    if ref:
        return {"name": "EFFECTMQ_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}
    return {"name": "EFFECTMQ_REDIS_URL", "value": redis_spec.get("url", "")}


def worker_env(namespace: str, name: str, spec: dict) -> list[dict[str, Any]]:
    worker = spec.get("worker") or {}
    grace = int(worker.get("terminationGracePeriodSeconds", 60))
    env = [
        {"name": "EFFECTMQ_QUEUE", "value": queue_name(namespace, name)},
        redis_url_env(spec.get("redis") or {}),
        {"name": "EFFECTMQ_HANDLERS", "value": worker.get("handlers", "")},
        {"name": "EFFECTMQ_CONCURRENCY", "value": str(worker.get("concurrency", 10))},
        {"name": "EFFECTMQ_LOCK_TIMEOUT", "value": str(spec.get("lockTimeoutSeconds", 30))},
        {"name": "EFFECTMQ_LOCK_REFRESH", "value": str(spec.get("lockRefreshSeconds", 10))},
        {"name": "EFFECTMQ_DRAIN_TIMEOUT", "value": str(drain_timeout(grace))},
        {"name": "EFFECTMQ_METRICS_PORT", "value": str(METRICS_PORT)},
        {"name": "EFFECTMQ_WORKER_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    tls = (spec.get("redis") or {}).get("tls") or {}
    if tls.get("enabled"):
        env.append({"name": "EFFECTMQ_REDIS_TLS", "value": "true"})
        if tls.get("insecureSkipVerify"):
            env.append({"name": "EFFECTMQ_REDIS_TLS_INSECURE", "value": "true"})
        if (tls.get("caFrom") or {}).get("secretKeyRef"):
            env.append({"name": "EFFECTMQ_REDIS_CA_FILE", "value": "/etc/effectmq/redis-ca/ca.crt"})
    return env + list(worker.get("env") or [])  # user variables last: they win on duplicates


RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def worker_deployment(namespace: str, name: str, spec: dict, replicas: int, owner: dict | None = None) -> dict:
    """The Deployment that runs `effectmq worker` for a Queue."""
    worker = spec.get("worker") or {}
    template = worker.get("podTemplate") or {}
    queue = name
    labels = worker_labels(queue)
    container: dict[str, Any] = {
        "name": "worker",
        "image": worker.get("image", ""),
        "command": ["effectmq", "worker"],
        "args": [worker.get("handlers", "")],
        "env": worker_env(namespace, name, spec),
        "ports": [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": worker.get("resources") or {},
        "securityContext": RESTRICTED_CONTAINER,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    ca_ref = (((spec.get("redis") or {}).get("tls") or {}).get("caFrom") or {}).get("secretKeyRef")
    if ca_ref:
        volumes.append({"name": "redis-ca", "secret": {"secretName": ca_ref["name"],
                                                       "items": [{"key": ca_ref["key"], "path": "ca.crt"}]}})
        container["volumeMounts"].append({"name": "redis-ca", "mountPath": "/etc/effectmq/redis-ca", "readOnly": True})
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": int(worker.get("terminationGracePeriodSeconds", 60)),
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    for key in ("nodeSelector", "tolerations", "affinity", "serviceAccountName", "imagePullSecrets"):
        if template.get(key):
            pod_spec[key] = template[key]
    body: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment_name(queue), "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(queue)},
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
    return body


def owner_reference(owner: dict) -> dict:
    return {
        "apiVersion": owner.get("apiVersion", f"{GROUP}/{VERSION}"),
        "kind": owner.get("kind", "Queue"),
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def queue_settings(spec: dict) -> dict[str, Any]:
    """Queue-level settings written to Redis, so they apply without a redeploy."""
    from effectmq import retry as retry_policies

    retention = spec.get("retention") or {}
    settings: dict[str, Any] = {
        "paused": bool(spec.get("paused", False)),
        "max_active": int(spec.get("maxActive", 0)),
        "max_stalled_count": int(spec.get("maxStalledCount", 1)),
        "lock_timeout": float(spec.get("lockTimeoutSeconds", 30)),
        "retention_completed": float(retention.get("completedSeconds", 86400)),
        "retention_failed": float(retention.get("failedSeconds", 604800)),
        "max_retries": int(spec["maxRetries"]) if spec.get("maxRetries") is not None else None,
        "retry": retry_policies.from_json(spec.get("retry")) if spec.get("retry") else None,
    }
    return settings


def schedule_id(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def schedule_spec(namespace: str, name: str, spec: dict) -> dict:
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
        "suspend": bool(spec.get("suspend", False)),
    }
    return out
