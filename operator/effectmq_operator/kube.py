"""Thin Kubernetes API access (the only module here that talks to the API server).

The kubernetes client is synchronous; every call runs in a worker thread so the
operator's event loop never blocks.
"""

from __future__ import annotations

import asyncio
import base64
import socket
from datetime import datetime, timezone
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from .builders import GROUP, VERSION

FIELD_MANAGER = "effectmq-operator"


def load_config() -> None:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class Kube:
    def __init__(self) -> None:
        self.api = kubernetes.client.ApiClient()
        self.apps = kubernetes.client.AppsV1Api(self.api)
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.coordination = kubernetes.client.CoordinationV1Api(self.api)

    @staticmethod
    async def _run(fn, *args, **kwargs) -> Any:
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def apply(self, body: dict) -> dict:
        """Server-side apply of a Deployment we own (our field manager, conflicts forced)."""
        meta = body["metadata"]
        result = await self._run(
            self.apps.patch_namespaced_deployment, meta["name"], meta["namespace"], body,
            field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
        )
        return self.api.sanitize_for_serialization(result)

    async def get_deployment(self, namespace: str, name: str) -> dict | None:
        try:
            result = await self._run(self.apps.read_namespaced_deployment, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.api.sanitize_for_serialization(result)

    async def scale(self, namespace: str, name: str, replicas: int) -> None:
        await self._run(self.apps.patch_namespaced_deployment_scale, name, namespace, {"spec": {"replicas": replicas}})

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """A Secret's value, or None when the Secret or the key does not exist."""
        try:
            secret = await self._run(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        raw = (secret.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw is not None else None

    async def patch_status(self, plural: str, namespace: str, name: str, status: dict) -> None:
        await self._run(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, plural, name,
                        {"status": status})

    async def worker_pods(self, namespace: str, selector: str) -> list[dict]:
        pods = await self._run(self.core.list_namespaced_pod, namespace, label_selector=selector)
        return [self.api.sanitize_for_serialization(p) for p in pods.items]

    async def post_event(self, obj: dict, *, type: str, reason: str, message: str) -> None:
        """A core/v1 Event about one of our resources (what `kubectl describe` shows)."""
        meta = obj["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": type, "reason": reason, "message": message[:1024],
            "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
            "reportingInstance": socket.gethostname(), "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        await self._run(self.core.create_namespaced_event, meta["namespace"], body)

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        await self._run(self.core.patch_namespaced_pod, name, namespace, {"metadata": {"annotations": annotations}})
