"""The operator outlives its own CRDs: `kubectl delete crd queues.effectmq.io` (an
uninstall by hand, a GitOps tool pruning and re-applying, a CRD migration) is no
reason to exit. Before, the Queue watch's 404 (APINotFoundError) ended the process
with code 1 and the pod restarted, whenever the watch reconnected before kopf's CRD
observer had stopped it (a race: about one deletion in three here). Now the operator
keeps running, its /healthz stays 200 and names the resources it cannot watch, and
once the CRDs are back it watches and reconciles again without a restart.

Twice: kopf's own watcher against a loopback server that answers 404 and then lists
(the losing side of the race, every time), and the operator process on a real
control plane, its CRDs deleted and re-created."""

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
from kopf._core.reactor import queueing

from effectmq_operator import handlers
from tests.fixtures.kube import CRDS_DIR
from tests.operator.test_operator_queues import apply, get, queue_manifest
from tests.support.operator import wait_for

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
    monkeypatch.setattr(handlers, "UNSERVED_RECHECK", 0.05)
    monkeypatch.setattr(queueing, "watcher", queueing.watcher)  # put back whatever install() wraps
    handlers.Watches().install()  # what the operator's startup does
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
