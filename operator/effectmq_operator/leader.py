"""Leader election on a coordination.k8s.io Lease, the way client-go does it.

Only the leader runs the periodic loop (scaling, maintenance, schedule ticks), so
two operator replicas never fight over replica counts. Expiry is judged by the
local monotonic clock since the record was last seen to change, never by
comparing wall clocks across machines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from datetime import datetime, timezone

from kubernetes.client.rest import ApiException

from .kube import Kube

log = logging.getLogger("effectmq.operator.leader")


class LeaderElector:
    def __init__(self, kube: Kube, *, namespace: str, name: str = "effectmq-operator",
                 identity: str | None = None, lease_seconds: float = 15.0, renew_every: float = 5.0):
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_seconds = lease_seconds
        self.renew_every = renew_every
        self.is_leader = False
        self._observed: tuple | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0

    def _body(self, transitions: int) -> dict:
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_seconds),
                         "renewTime": now, "acquireTime": now, "leaseTransitions": transitions}}

    async def try_acquire(self) -> bool:
        api = self.kube.coordination
        try:
            lease = await asyncio.to_thread(api.read_namespaced_lease, self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            try:
                await asyncio.to_thread(api.create_namespaced_lease, self.namespace, self._body(0))
                return True
            except ApiException as create_exc:
                if create_exc.status == 409:
                    return False
                raise
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        expired = time.monotonic() - self._observed_at > (spec.lease_duration_seconds or self.lease_seconds)
        if spec.holder_identity not in (self.identity, None, "") and not expired:
            return False
        transitions = (spec.lease_transitions or 0) + (spec.holder_identity != self.identity)
        body = self._body(transitions)
        body["metadata"]["resourceVersion"] = lease.metadata.resource_version  # optimistic concurrency
        try:
            await asyncio.to_thread(api.replace_namespaced_lease, self.name, self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # someone else renewed or took it first
                return False
            raise
        return True

    async def run(self) -> None:
        while True:
            try:
                leader = await self.try_acquire()
            except Exception as exc:  # API trouble: stop leading until we can renew again
                log.warning("leader election failed: %s", exc)
                leader = False
            if leader != self.is_leader:
                log.info("%s %s leadership", self.identity, "acquired" if leader else "lost")
            self.is_leader = leader
            await asyncio.sleep(self.renew_every)

    async def release(self) -> None:
        if not self.is_leader:
            return
        self.is_leader = False
        try:
            await asyncio.to_thread(self.kube.coordination.patch_namespaced_lease, self.name, self.namespace,
                                    {"spec": {"holderIdentity": ""}})
        except Exception as exc:
            log.warning("could not release the lease: %s", exc)
