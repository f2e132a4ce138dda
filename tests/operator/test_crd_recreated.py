"""The operator outlives its own CRDs: `kubectl delete crd queues.effectmq.io` (an
uninstall by hand, a GitOps tool pruning and re-applying, a CRD migration) is no
reason to exit. Before, the Queue watch's 404 (APINotFoundError) ended the process
with code 1 and the pod restarted, whenever the watch reconnected before kopf's CRD
observer had stopped it (a race: about one deletion in three here). Now the operator
keeps running, its /healthz stays 200 and names the resources it cannot watch, and
once the CRDs are back it watches and reconciles again without a restart.

Twice: kopf's own watcher against a loopback server that answers 404 and then lists
(the losing side of the race, every time), and the operator process on a real
control plane, its CRDs deleted and re-created. A second race: kopf re-reads API
discovery only when a CRD event arrives, and a busy API server may list a re-created
CRD in discovery after its last event (Established); kopf then never watched it
again (seen once in CI: /healthz named Schedules unserved for good). A loopback
server whose discovery lags that way shows the operator finds it anyway."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import kopf
from aiohttp import web
from kopf._cogs.clients import auth
from kopf._cogs.structs import credentials, references
from kopf._core.intents import registries
from kopf._core.reactor import observation, queueing

from effectmq_operator.runtime import watches as kopf_watches
from tests.fixtures.kube import CRDS_DIR
from tests.operator.test_operator_queues import apply, get, queue_manifest
from tests.support.operator import wait_for, wait_for_async

QUEUES, SCHEDULES = "queues.effectmq.io", "schedules.effectmq.io"
SCHEDULE = """
apiVersion: effectmq.io/v1alpha1
kind: Schedule
metadata: {name: %s}
spec:
  queueRef: {name: %s}
  schedule: "0 2 * * *"
  task: {name: send_report, payload: {report: daily}}
"""


async def serve_queues(gone: int) -> tuple[web.AppRunner, str, list[str]]:
    """An API server for one namespace's Queues whose first `gone` requests answer 404
    (the CRD deleted); then the list has one Queue and a watch stays open, silent."""
    asked: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        asked.append(request.query_string)
        if len(asked) <= gone:
            return web.Response(status=404, text="404 page not found")
        if request.query.get("watch") == "true":
            stream = web.StreamResponse(headers={"Content-Type": "application/json"})
            await stream.prepare(request)
            await asyncio.sleep(60)
            return stream
        queue = {"apiVersion": "effectmq.io/v1alpha1", "kind": "Queue",
                 "metadata": {"name": "emails", "namespace": "shop", "uid": "u-1", "resourceVersion": "7"}}
        return web.json_response({"kind": "QueueList", "metadata": {"resourceVersion": "7"}, "items": [queue]})

    app = web.Application()
    app.router.add_get("/apis/effectmq.io/v1alpha1/namespaces/shop/queues", answer)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # the open watch need not end by itself
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", asked


async def test_a_watch_answered_404_waits_and_watches_again(monkeypatch):
    monkeypatch.setattr(kopf_watches, "UNSERVED_RECHECK", 0.05)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)  # put back whatever install() wraps
    kopf_watches.Watches().install()  # what the operator's startup does
    runner, server, asked = await serve_queues(gone=3)
    vault = credentials.Vault()
    await vault.populate({"test": credentials.ConnectionInfo(server=server)})
    auth.vault_var.set(vault)
    watches = queueing.watcher.__wrapped_by__
    events: asyncio.Queue = asyncio.Queue()

    async def processor(*, raw_event, **_) -> None:
        await events.put(raw_event)

    queues = references.Resource(group="effectmq.io", version="v1alpha1", plural="queues", namespaced=True,
                                 verbs=["list", "watch"])
    settings = kopf.OperatorSettings()
    watcher = asyncio.create_task(queueing.watcher(settings=settings, resource=queues, namespace="shop",
                                                   processor=processor))
    try:
        while len(asked) < 2 and not watcher.done():
            await asyncio.sleep(0.01)
        assert not watcher.done(), f"the watcher ended on a 404: {watcher.exception()!r}"
        assert watches.unserved() == ["queues.effectmq.io", "schedules.effectmq.io"]
        # served again: the watch lists afresh, and the Queue reaches the handlers
        event = await asyncio.wait_for(events.get(), 10)
        assert event["object"]["metadata"]["name"] == "emails"
        assert watches.unserved() == ["schedules.effectmq.io"]
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await runner.cleanup()
        await vault.close()
    assert watches.unserved() == ["queues.effectmq.io", "schedules.effectmq.io"]  # no watch left


async def serve_lagging_discovery(lagging: int) -> tuple[web.AppRunner, str, list[str]]:
    """An API server whose CRD watch sends one event (the effectmq.io CRDs re-created)
    and then stays silent, and whose discovery lists Schedules only after its first
    `lagging` answers for the group (the Queues from the start)."""
    discovered: list[str] = []
    watches: list[str] = []

    async def core(request: web.Request) -> web.Response:
        return web.json_response({"versions": ["v1"]} if request.path == "/api" else {"resources": []})

    async def groups(request: web.Request) -> web.Response:
        return web.json_response({"groups": [
            {"name": name, "versions": [{"version": version}], "preferredVersion": {"version": version}}
            for name, version in (("apiextensions.k8s.io", "v1"), ("effectmq.io", "v1alpha1"))]})

    async def extensions(request: web.Request) -> web.Response:
        return web.json_response({"resources": [{"name": "customresourcedefinitions", "kind":
                                                 "CustomResourceDefinition", "singularName": "", "namespaced": False,
                                                 "verbs": ["list", "watch"]}]})

    async def ours(request: web.Request) -> web.Response:
        discovered.append(request.path)
        kinds = [("queues", "Queue")] + ([("schedules", "Schedule")] if len(discovered) > lagging else [])
        return web.json_response({"resources": [{"name": plural, "kind": kind, "singularName": kind.lower(),
                                                 "namespaced": True, "verbs": ["list", "watch", "patch"]}
                                                for plural, kind in kinds]})

    async def crds(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "CustomResourceDefinitionList", "metadata": {"resourceVersion": "1"},
                                      "items": []})
        watches.append(request.query_string)
        stream = web.StreamResponse(headers={"Content-Type": "application/json"})
        await stream.prepare(request)
        crd = {"metadata": {"name": SCHEDULES, "resourceVersion": "2"}, "spec": {"group": "effectmq.io"}}
        if len(watches) == 1:  # the one event; a reconnected watch hears nothing new
            await stream.write(json.dumps({"type": "MODIFIED", "object": crd}).encode() + b"\n")
        await asyncio.sleep(60)
        return stream

    app = web.Application()
    app.router.add_get("/api", core)
    app.router.add_get("/api/v1", core)
    app.router.add_get("/apis", groups)
    app.router.add_get("/apis/apiextensions.k8s.io/v1", extensions)
    app.router.add_get("/apis/effectmq.io/v1alpha1", ours)
    app.router.add_get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crds)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", discovered


async def test_a_crd_discovered_after_its_last_event_is_watched_again(monkeypatch):
    monkeypatch.setattr(kopf_watches, "UNSERVED_RECHECK", 0.05)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)  # put back whatever install() wraps
    kopf_watches.Watches().install()
    # discovery's first two answers (kopf's scan at start, its rescan on the CRD event) lack Schedules
    runner, server, discovered = await serve_lagging_discovery(lagging=2)
    vault = credentials.Vault()
    await vault.populate({"test": credentials.ConnectionInfo(server=server)})
    auth.vault_var.set(vault)
    registry = registries.OperatorRegistry()
    for plural in ("queues", "schedules"):
        kopf.on.event("effectmq.io", "v1alpha1", plural, registry=registry)(lambda **_: None)
    insights = references.Insights()
    observer = asyncio.create_task(observation.resource_observer(settings=kopf.OperatorSettings(),
                                                                 registry=registry, insights=insights))

    def watched() -> set[str]:
        return {r.plural for r in insights.watched_resources if r.group == "effectmq.io"}

    try:
        while len(discovered) < 2 and not observer.done():  # kopf's scan at start and its rescan on the event
            await asyncio.sleep(0.01)
        assert not observer.done(), f"kopf's resource observer ended: {observer.exception()!r}"
        await wait_for_async(lambda: watched() == {"queues", "schedules"}, timeout=10,
                             what="Schedules, listed in discovery after the CRD's last event, watched")
    finally:
        observer.cancel()
        await asyncio.gather(observer, return_exceptions=True)
        await runner.cleanup()
        await vault.close()


def health(op) -> dict:
    """The probe's answer; fails with the log when the process is gone or the probe is not 200."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{op.port}/healthz", timeout=5) as r:
            assert r.status == 200
            return json.loads(r.read())["effectmq"]
    except (urllib.error.URLError, OSError) as exc:
        op.proc.poll()
        raise AssertionError(f"no health answer ({exc}); exit code {op.proc.returncode}:\n{op.log()}") from None


def served(plane) -> set[str]:
    return {n.split("/", 1)[1] for n in plane.kubectl("get", "crd", "-o", "name").stdout.split()} & {QUEUES, SCHEDULES}


def recreate_crds(plane) -> None:
    plane.kubectl("apply", "-f", str(CRDS_DIR))
    plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{QUEUES}", f"crd/{SCHEDULES}")


def without(plane, op, crds: tuple[str, ...], seconds: float = 5.0) -> None:
    """Delete `crds` and watch the operator: it stays up, /healthz answers 200 throughout,
    and (its answers are cached up to 10 s) soon names exactly what it cannot watch."""
    plane.kubectl("delete", "crd", *crds, "--wait=true", "--timeout=60s")
    wait_for(lambda: not served(plane) & set(crds), what=f"{crds} gone")
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert op.proc.poll() is None, f"the operator exited ({op.proc.returncode}):\n{op.log()}"
        health(op)
        time.sleep(0.25)
    wait_for(lambda: sorted(health(op)["unserved"]) == sorted(crds), timeout=20, interval=0.5,
             what=f"/healthz naming {crds} unserved")


def reconciled(plane, ns, name: str, redis_url: str) -> None:
    apply(plane, ns, queue_manifest(name, redis_url))
    wait_for(lambda: get(plane, ns, "deployment", f"{name}-worker"), timeout=60, what=f"Queue {name} reconciled")
    plane.kubectl("wait", "--for=condition=Ready", f"queue/{name}", "-n", ns, "--timeout=60s")


def test_operator_survives_its_crds_deleted_and_reconciles_after_they_return(kube_control_plane, kube_namespace,
                                                                              start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    op = start_operator()
    reconciled(plane, ns, "first", redis_url)
    try:
        # The Queue CRD alone, twice (the race went the old way about one time in three).
        for round in range(2):
            without(plane, op, (QUEUES,))
            recreate_crds(plane)
            reconciled(plane, ns, f"again-{round}", redis_url)
        # Both at once; back, Queues and Schedules are reconciled again.
        without(plane, op, (QUEUES, SCHEDULES))
    finally:
        recreate_crds(plane)
    reconciled(plane, ns, "last", redis_url)
    plane.kubectl("apply", "-n", ns, "-f", "-", input=SCHEDULE % ("nightly", "last"))
    wait_for(lambda: (get(plane, ns, "schedule", "nightly") or {}).get("status", {}).get("nextTickTime"), timeout=60,
             what="the Schedule reconciled")
    wait_for(lambda: health(op)["unserved"] == [], timeout=30, what="health with every CRD watched")
    assert op.proc.poll() is None and "Traceback" not in op.log_path.read_text(), op.log()
