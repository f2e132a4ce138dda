"""Every Kubernetes API call of the operator (the only module that talks to the API server).

The kubernetes client is synchronous; calls run on a bounded pool of daemon
threads (see threads.py), sized for latency rather than CPU and with as many
kept-alive connections, each call with a client-side timeout, so a hung connection
fails fast instead of wedging the operator. The Lease of the leader election
has a client and a pool of its own, so renewals never queue behind other work.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Callable

import kubernetes
import urllib3
from kubernetes.client.rest import ApiException

from effectmq.transport.redaction import scrub

from .. import metrics
from ..api import FIELD_MANAGER, GROUP, MESSAGE_LIMIT, VERSION, Event
from .threads import DaemonThreadPool

REQUEST_TIMEOUT = (3.0, 10.0)  # connect, read: seconds
# Calls in flight at once. Each waits mostly on the API server's round trip, so a pass
# over 1,000 Queues at 20 ms latency needs far more than a CPU-sized pool.
API_THREADS = 32
EVENT_SERIES_WINDOW = 600.0  # a repeated Event within this window bumps the count of the first
log = logging.getLogger("effectmq.operator.kube")


class NotLeader(Exception):
    """A write was refused because this replica no longer leads (a deposed leader never writes)."""


def load_config() -> None:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


def disable_client_retries(api_client: kubernetes.client.ApiClient) -> None:
    """urllib3 retries a failed request three times by default, which would multiply
    every client-side timeout by four; the reconcilers retry on their own schedule."""
    pool = getattr(getattr(api_client, "rest_client", None), "pool_manager", None)
    kwargs = getattr(pool, "connection_pool_kw", None)
    if isinstance(kwargs, dict) and pool is not None:
        kwargs["retries"] = urllib3.Retry(total=False)
        pool.clear()


def _status_of(exc: ApiException) -> dict:
    """The Status object the API server answered a failed call with ({} when there is none)."""
    try:
        status = json.loads(exc.body or "{}")
    except (ValueError, TypeError):
        return {}
    return status if isinstance(status, dict) else {}


def api_error(exc: ApiException) -> str:
    """The API server's own message of a failed call (not the whole response body)."""
    message = _status_of(exc).get("message")
    return f"{exc.status} {exc.reason}: {message}" if message else f"{exc.status} {exc.reason}"


# A 500 that is the object's fault, not the server's: server-side apply answers a value of
# the wrong type (an env value 5) with 500 "failed to create typed patch object ...:
# expected string"; decoding errors read alike. Retrying the same object cannot help.
CONTENT_ERROR = re.compile(r"failed to create typed (patch )?object|expected (string|map|list|bool|boolean|numeric|"
                           r"int|integer|float|number)\b|cannot unmarshal|unable to decode|cannot convert|"
                           r"invalid type for", re.IGNORECASE)


def refused_for_content(exc: BaseException) -> bool:
    """The API server refused a write for what the object says: 400, 422, or a 500 whose
    message shows a decoding or type error. Sending it again changes nothing."""
    if not isinstance(exc, ApiException):
        return False
    if exc.status in (400, 422):
        return True
    return exc.status == 500 and bool(CONTENT_ERROR.search(str(_status_of(exc).get("message") or exc.body or "")))


def permanent_refusal(exc: BaseException) -> bool:
    """A refused write that only a change from outside can cure: the object's content, or
    a 4xx other than a timeout, a conflict or throttling (a quota, a policy, RBAC)."""
    if refused_for_content(exc):
        return True
    return isinstance(exc, ApiException) and 400 <= exc.status < 500 and exc.status not in (408, 409, 429)


def namespace_terminating(exc: BaseException) -> bool:
    """The API refused a create because the namespace is being deleted: nothing to repair."""
    if not isinstance(exc, ApiException) or exc.status != 403:
        return False
    causes = (_status_of(exc).get("details") or {}).get("causes") or []
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


def describe_failure(exc: BaseException, secrets: tuple[str, ...] = ()) -> str:
    """A failure for the log: the API server's message or the exception, without credentials."""
    text = api_error(exc) if isinstance(exc, ApiException) else (str(exc) or type(exc).__name__)
    return scrub(text, *secrets)


class Kube:
    def __init__(self, *, threads: int = API_THREADS, request_timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        config = kubernetes.client.Configuration.get_default_copy()
        config.connection_pool_maxsize = threads  # a kept-alive connection per thread, none opened and dropped
        self.api = kubernetes.client.ApiClient(config)
        disable_client_retries(self.api)
        self.apps = kubernetes.client.AppsV1Api(self.api)
        self.core = kubernetes.client.CoreV1Api(self.api)
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.timeout = request_timeout
        self.pool = DaemonThreadPool(threads, "effectmq-kube")
        self.requests = 0  # API calls made, for the fan-out bench and metrics
        self.may_write: Callable[[], bool] = lambda: True  # the leader election's verdict, checked per write
        self._events: OrderedDict[tuple, tuple[str, int, float]] = OrderedDict()

    async def _call(self, fn, *args, **kwargs) -> Any:
        """One API call on the pool; its reply as plain JSON, parsed on the pool's thread.
        The client's typed models are skipped: building one and converting it back
        cost about 4 ms of the event loop per Deployment, seconds in a pass over 1,000."""
        self.requests += 1
        metrics.API_REQUESTS.inc()

        def call() -> Any:
            reply = fn(*args, _request_timeout=self.timeout, _preload_content=False, **kwargs)
            return json.loads(reply.data) if reply.data else None

        return await self.pool.run(call)

    def check_leader(self) -> None:
        """Raise NotLeader unless this replica still leads (before any write, to Kubernetes or Redis)."""
        if not self.may_write():
            raise NotLeader("not the leader any more: write skipped")

    async def _write(self, fn, *args, **kwargs) -> Any:
        self.check_leader()
        return await self._call(fn, *args, **kwargs)

    # -- custom resources ------------------------------------------------------

    async def list_resources(self, plural: str, namespaces: list[str]) -> list[dict]:
        """Every Queue or Schedule in the watched namespaces (all when the list is empty)."""
        if not namespaces:
            result = await self._call(self.custom.list_cluster_custom_object, GROUP, VERSION, plural)
            return result.get("items", [])
        items: list[dict] = []
        for namespace in namespaces:
            result = await self._call(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, plural)
            items.extend(result.get("items", []))
        return items

    async def patch_status(self, plural: str, namespace: str, name: str, status: dict) -> dict | None:
        """Merge-patch a resource's status; returns the object after the write, None when it is gone."""
        try:
            return await self._write(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace,
                                    plural, name, {"status": status})
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- worker Deployments -------------------------------------------------------

    async def apply(self, body: dict) -> dict:
        """Server-side apply of a Deployment we own (our field manager, conflicts forced)."""
        meta = body["metadata"]
        return await self._write(
            self.apps.patch_namespaced_deployment, meta["name"], meta["namespace"], body,
            field_manager=FIELD_MANAGER, force=True, _content_type="application/apply-patch+yaml",
        )

    async def scale(self, namespace: str, name: str, replicas: int) -> dict:
        """Set only a Deployment's replicas (a merge patch under our manager name), for when
        the full apply is refused: scaling never waits on an unrelated field's mistake.
        The next full apply takes the field back."""
        return await self._write(
            self.apps.patch_namespaced_deployment, name, namespace, {"spec": {"replicas": replicas}},
            field_manager=FIELD_MANAGER, _content_type="application/merge-patch+json",
        )

    async def delete_deployment(self, namespace: str, name: str) -> None:
        try:
            await self._write(self.apps.delete_namespaced_deployment, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def worker_pods(self, namespace: str, selector: str) -> list[dict]:
        """The pods of one Queue's workers (a label selector of its Deployment)."""
        pods = await self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
        return pods.get("items") or []

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        try:
            await self._write(self.core.patch_namespaced_pod, name, namespace,
                              {"metadata": {"annotations": annotations}})
        except ApiException as exc:
            if exc.status != 404:  # the pod went away meanwhile
                raise

    # -- Secrets -------------------------------------------------------------------

    async def secret(self, namespace: str, name: str) -> dict | None:
        """A Secret as {"metadata", "data"} (as a watch event has them), None when it does not exist."""
        try:
            secret = await self._call(self.core.read_namespaced_secret, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return {"metadata": secret.get("metadata") or {}, "data": secret.get("data") or {}}

    # -- Events --------------------------------------------------------------------

    async def post_event(self, obj: dict, *, type: str, reason: str, message: str) -> None:
        """A core/v1 Event about one of our resources (what `kubectl describe` shows).
        The same Event again within the series window bumps the first one's count."""
        meta = obj["metadata"]
        message = message[:MESSAGE_LIMIT]
        key = (meta.get("uid"), type, reason, message)
        now = time.time()
        stamp = datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        seen = self._events.get(key)
        if seen is not None and now - seen[2] < EVENT_SERIES_WINDOW:
            name, count, _ = seen
            try:
                await self._write(self.core.patch_namespaced_event, name, meta["namespace"],
                                 {"count": count + 1, "lastTimestamp": stamp})
                self._events[key] = (name, count + 1, now)
                self._events.move_to_end(key)
                return
            except ApiException as exc:
                if exc.status != 404:
                    raise
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": type, "reason": reason, "message": message,
            "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
            "reportingInstance": socket.gethostname(), "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        created = await self._write(self.core.create_namespaced_event, meta["namespace"], body)
        self._events[key] = (created["metadata"]["name"], 1, now)
        while len(self._events) > 4096:
            self._events.popitem(last=False)

    async def post_events(self, obj: dict, events: list[Event]) -> None:
        """Post each Event; one that cannot be posted is logged, never fatal."""
        for event in events:
            try:
                await self.post_event(obj, type=event.type, reason=event.reason, message=event.message)
            except Exception as exc:
                # the namespace going away takes the object with it: nothing is missing
                level = logging.DEBUG if namespace_terminating(exc) else logging.WARNING
                log.log(level, "could not post Event %s on %s/%s: %s", event.reason, obj["metadata"]["namespace"],
                        obj["metadata"]["name"], describe_failure(exc))
