"""Redis connections of Queues: the URL from the spec or its Secret, one client per URL."""

from __future__ import annotations

import effectmq

from .builders import queue_name
from .kube import Kube


class ConfigProblem(Exception):
    """Input the operator cannot act on; `reason` becomes the condition's reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class Connections:
    def __init__(self, kube: Kube):
        self.kube = kube
        self._queues: dict[tuple[str, str], effectmq.TaskQueue] = {}

    async def redis_url(self, namespace: str, redis_spec: dict) -> str:
        ref = (redis_spec.get("urlFrom") or {}).get("secretKeyRef")
        if ref:
            value = await self.kube.secret_value(namespace, ref["name"], ref["key"])
            if value is None:
                raise ConfigProblem("SecretNotFound",
                                    f"Secret {namespace}/{ref['name']} with key {ref['key']!r} not found")
            return value.strip()
        url = redis_spec.get("url")
        if not url:
            raise ConfigProblem("InvalidSpec", "spec.redis needs url or urlFrom.secretKeyRef")
        return url

    async def queue(self, namespace: str, name: str, spec: dict) -> effectmq.TaskQueue:
        """The TaskQueue of a Queue resource (cached per Redis URL and queue)."""
        url = await self.redis_url(namespace, spec.get("redis") or {})
        qname = queue_name(namespace, name)
        key = (url, qname)
        q = self._queues.get(key)
        if q is None:
            for (old_url, old_name), old in list(self._queues.items()):
                if old_name == qname:  # the URL changed: drop the old client
                    await old.close()
                    del self._queues[(old_url, old_name)]
            q = effectmq.TaskQueue(qname, url=url, socket_timeout=10)
            self._queues[key] = q
        return q

    async def close(self) -> None:
        for q in self._queues.values():
            await q.close()
        self._queues.clear()
