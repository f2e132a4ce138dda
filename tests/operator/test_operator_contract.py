"""The operator contract, tried as a platform team would: delete what it owns, break
its inputs, stall its Redis, and read its status with kstatus (the library Flux uses).
Real control plane, real Redis, the operator as a process."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import pytest
import yaml

import effectmq
from tests.operator.test_operator_queues import (apply, condition, events, get, queue_manifest,
                                                 seconds_to_scale_from_zero)
from tests.support.operator import DeploymentWorker, wait_for

pytestmark = pytest.mark.kube
FAST = {"pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 2, "cooldownSeconds": 2}


def ready(plane, ns, kind, name):
    c = condition(get(plane, ns, kind, name), "Ready")
    return c and (c["status"], c["reason"])


def is_ready(plane, ns, kind, name):
    return (ready(plane, ns, kind, name) or ("",))[0] == "True"


def kubectl_wait_ready(plane, ns, what, timeout):
    return plane.kubectl("wait", "--for=condition=Ready", what, "-n", ns, f"--timeout={timeout}", check=False)


def test_a_deleted_deployment_comes_back_and_a_failed_apply_is_retried(kube_control_plane, kube_namespace,
                                                                       start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, scaling=FAST))
    first = wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    wait_for(lambda: is_ready(plane, ns, "queue", "emails"), what="Ready")

    plane.kubectl("delete", "deployment", "emails-worker", "-n", ns)
    back = wait_for(lambda: (d := get(plane, ns, "deployment", "emails-worker"))
                    and d["metadata"]["uid"] != first["metadata"]["uid"] and d, timeout=15, what="Deployment back")
    assert back["metadata"]["ownerReferences"][0]["name"] == "emails"
    wait_for(lambda: is_ready(plane, ns, "queue", "emails"), what="Ready again")

    # Now the API refuses the Deployment (a quota): the Queue must say so, and heal by itself.
    plane.kubectl("create", "quota", "no-deployments", "-n", ns, "--hard=count/deployments.apps=0")
    plane.kubectl("delete", "deployment", "emails-worker", "-n", ns)
    failed = wait_for(lambda: (c := condition(get(plane, ns, "queue", "emails"), "Ready"))
                      and c["status"] == "False" and c, timeout=15, what="Ready=False while the apply fails")
    assert failed["reason"] == "DeploymentFailed" and "exceeded quota" in failed["message"], failed
    stalled = condition(get(plane, ns, "queue", "emails"), "Stalled")
    assert stalled["status"] == "True"  # a refusal by the API does not heal by itself
    assert kubectl_wait_ready(plane, ns, "queue/emails", "3s").returncode != 0
    for _ in range(10):  # while it is gone, the Queue never says it is healthy
        assert get(plane, ns, "deployment", "emails-worker") is None
        assert ready(plane, ns, "queue", "emails")[0] == "False"
        time.sleep(0.3)
    assert ("Warning", "DeploymentFailed") in [(t, r) for t, r, _ in events(plane, ns, "emails")]
    plane.kubectl("delete", "quota", "no-deployments", "-n", ns)
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), timeout=15, what="apply retried")
    assert kubectl_wait_ready(plane, ns, "queue/emails", "15s").returncode == 0

    # The same problem again is the same Event, counted (not a new object per occurrence).
    plane.kubectl("create", "quota", "no-deployments", "-n", ns, "--hard=count/deployments.apps=0")
    plane.kubectl("delete", "deployment", "emails-worker", "-n", ns)
    counted = wait_for(lambda: [e for e in plane.kubectl_json("get", "events", "-n", ns)["items"]
                                if e["reason"] == "DeploymentFailed" and e.get("count", 1) >= 2], timeout=15,
                       what="the repeated Event counted")
    assert len([e for e in plane.kubectl_json("get", "events", "-n", ns)["items"]
                if e["reason"] == "DeploymentFailed"]) == 1, counted


def test_user_env_overrides_an_operator_variable(kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("emails", redis_url))
    manifest["spec"]["worker"]["env"] = [{"name": "EFFECTMQ_CONCURRENCY", "value": "3"}]
    apply(plane, ns, yaml.safe_dump(manifest))
    deployment = wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "EFFECTMQ_CONCURRENCY"] == [{"name": "EFFECTMQ_CONCURRENCY", "value": "3"}]
    assert kubectl_wait_ready(plane, ns, "queue/emails", "20s").returncode == 0


def test_a_stuck_rollout_is_not_ready_and_kstatus_says_failed(kube_control_plane, kube_namespace, start_operator,
                                                              redis_url, kstatus):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    # One replica always: this control plane has no kubelet, so the pod never becomes available.
    manifest = yaml.safe_load(queue_manifest("stuck", redis_url, scaling={**FAST, "minReplicas": 1}))
    manifest["spec"]["worker"]["progressDeadlineSeconds"] = 3
    apply(plane, ns, yaml.safe_dump(manifest))
    wait_for(lambda: get(plane, ns, "deployment", "stuck-worker"), what="worker Deployment")
    # Catching up (a rollout inside its deadline): InProgress, Reconciling, not Ready.
    apply(plane, ns, queue_manifest("rolling", redis_url, scaling={**FAST, "minReplicas": 1}))
    rolling = wait_for(lambda: (q := get(plane, ns, "queue", "rolling")) and condition(q, "Ready") and q,
                       what="first status of the rolling Queue")
    assert condition(rolling, "Ready")["reason"] == "RollingOut" and condition(rolling, "Reconciling")["status"] \
        == "True"
    assert kstatus(rolling).status == "InProgress"
    failed = wait_for(lambda: (q := get(plane, ns, "queue", "stuck"))
                      and condition(q, "Stalled")["status"] == "True" and q, timeout=30, what="Stalled")
    assert condition(failed, "Ready")["reason"] == "ProgressDeadlineExceeded"
    assert kstatus(failed).status == "Failed"
    assert kstatus(get(plane, ns, "deployment", "stuck-worker")).status == "Failed"  # the library agrees
    assert kubectl_wait_ready(plane, ns, "queue/stuck", "3s").returncode != 0

    # A missing Secret cannot heal by itself either: Failed, not an endless InProgress.
    manifest = yaml.safe_load(queue_manifest("nosecret", None, scaling=FAST))
    manifest["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "absent", "key": "url"}}}
    apply(plane, ns, yaml.safe_dump(manifest))
    missing = wait_for(lambda: (q := get(plane, ns, "queue", "nosecret")) and condition(q, "Ready") and q,
                       what="status of the Queue without its Secret")
    assert condition(missing, "Ready")["reason"] == "SecretNotFound" and kstatus(missing).status == "Failed"

    # Healthy: Current, for the Queue and for a Schedule; a Schedule with an invalid cron is Failed.
    apply(plane, ns, queue_manifest("fine", redis_url, scaling=FAST))
    # (kstatus calls a resource with no status at all Current: wait for the operator's first word.)
    fine = wait_for(lambda: (q := get(plane, ns, "queue", "fine")) and condition(q, "Ready") and q,
                    what="first status of a healthy Queue")
    fine = wait_for(lambda: (q := get(plane, ns, "queue", "fine")) and kstatus(q).status == "Current" and q,
                    what="a healthy Queue is Current")
    assert condition(fine, "Ready")["status"] == "True"
    for name, cron in (("good", "*/5 * * * * *"), ("bad", "61 * * * *")):
        plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule", "metadata": {"name": name},
            "spec": {"queueRef": {"name": "fine"}, "schedule": cron, "task": {"name": "send_report"}}}))
    wait_for(lambda: condition(get(plane, ns, "schedule", "good"), "Ready"), what="first Schedule status")
    wait_for(lambda: kstatus(get(plane, ns, "schedule", "good")).status == "Current", what="good Schedule Current")
    wait_for(lambda: kstatus(get(plane, ns, "schedule", "bad")).status == "Failed", what="bad Schedule Failed")

    # A Schedule whose Queue's Redis is down is catching up (InProgress); one without its Queue is Failed.
    apply(plane, ns, queue_manifest("offline", "redis://127.0.0.1:1/0", scaling=FAST))
    for name, queue in (("waiting", "offline"), ("orphan", "absent")):
        plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule", "metadata": {"name": name},
            "spec": {"queueRef": {"name": queue}, "schedule": "*/5 * * * * *", "task": {"name": "send_report"}}}))
    waiting = wait_for(lambda: (s := get(plane, ns, "schedule", "waiting")) and condition(s, "Ready") and s,
                       what="status of the Schedule whose Redis is down")
    assert condition(waiting, "Ready")["reason"] == "RedisUnreachable" and kstatus(waiting).status == "InProgress"
    wait_for(lambda: kstatus(get(plane, ns, "schedule", "orphan")).status == "Failed"
             and condition(get(plane, ns, "schedule", "orphan"), "Ready")["reason"] == "QueueNotFound",
             what="a Schedule without its Queue is Failed")


PASSWORD = "pl4nted-Op3rator-s3cret"


def test_a_planted_password_appears_nowhere(kube_control_plane, kube_namespace, start_operator, make_redis, tmp_path):
    plane, ns = kube_control_plane, kube_namespace
    server = make_redis(password=PASSWORD)
    wrong = server.url.replace(PASSWORD, PASSWORD + "-wrong")
    down = f"redis://:{PASSWORD}@127.0.0.1:1/0"  # nothing listens on port 1
    for secret, url in (("good", server.url), ("wrong", wrong), ("down", down), ("bare", PASSWORD)):
        plane.kubectl("create", "secret", "generic", secret, "-n", ns, f"--from-literal=url={url}")
    operator = start_operator()
    for name in ("good", "wrong", "down", "bare"):
        manifest = yaml.safe_load(queue_manifest(name, None, scaling=FAST))
        manifest["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": name, "key": "url"}}}
        apply(plane, ns, yaml.safe_dump(manifest))
    wait_for(lambda: is_ready(plane, ns, "queue", "good"), what="good Queue Ready")
    wait_for(lambda: ready(plane, ns, "queue", "wrong") == ("False", "RedisError")
             or ready(plane, ns, "queue", "wrong") == ("False", "RedisUnreachable"), what="wrong password reported")
    wait_for(lambda: ready(plane, ns, "queue", "down") == ("False", "RedisUnreachable"), what="down reported")
    wait_for(lambda: ready(plane, ns, "queue", "bare") == ("False", "InvalidRedisURL"), what="bare value reported")
    deployment = get(plane, ns, "deployment", "good-worker")
    worker = DeploymentWorker(plane, ns, deployment, "good-worker-0", tmp_path)
    bad_worker = DeploymentWorker(plane, ns, get(plane, ns, "deployment", "wrong-worker"), "wrong-worker-0",
                                  tmp_path)
    try:
        q = effectmq.SyncTaskQueue(f"{ns}/good", url=server.url)
        assert q.wait(q.offer("send_email", {"to": "a@b.c"}).task_id, timeout=30)["delivered_to"] == "a@b.c"
        q.close()
        time.sleep(3)  # a few polls of every broken Queue
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.env['EFFECTMQ_METRICS_PORT']}/metrics") as r:
            worker_metrics = r.read().decode()
        worker_environ = worker.environ()  # what child processes inherit and crash dumps hold
    finally:
        worker.stop()
        bad_worker.stop()
    surfaces = {
        "status": json.dumps([q.get("status") for q in plane.kubectl_json("get", "queues", "-n", ns)["items"]]),
        "events": json.dumps(plane.kubectl_json("get", "events", "-n", ns)["items"]),
        "operator log": operator.log_path.read_text(errors="replace"),
        "operator metrics": operator.metrics(),
        "worker log": worker.log_path.read_text(errors="replace"),
        "worker environment": worker_environ,
        "failing worker log": bad_worker.log_path.read_text(errors="replace"),
        "worker metrics": worker_metrics,
    }
    assert "Traceback" not in surfaces["operator log"]
    assert all(surfaces.values())
    for surface, text in surfaces.items():
        assert PASSWORD not in text, f"the password leaked into the {surface}"


def test_one_stalled_redis_does_not_delay_another_queue(kube_control_plane, kube_namespace, start_operator,
                                                        make_redis, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    stalled = make_redis()
    start_operator()
    # Its ticks must not scale it up: a worker pod stays Pending here, and Ready would never come.
    apply(plane, ns, queue_manifest("slow", stalled.url, scaling={**FAST, "activationTasks": 1_000_000}))
    plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump({
        "apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule", "metadata": {"name": "slow-ticks"},
        "spec": {"queueRef": {"name": "slow"}, "schedule": "* * * * * *", "task": {"name": "send_report"}}}))
    apply(plane, ns, queue_manifest("healthy", redis_url, scaling={**FAST, "pollIntervalSeconds": 2,
                                                                   "activationTasks": 1}))
    wait_for(lambda: is_ready(plane, ns, "queue", "slow"), what="slow Queue Ready")
    wait_for(lambda: is_ready(plane, ns, "queue", "healthy"), what="healthy Queue Ready")
    ticks = lambda: get(plane, ns, "schedule", "slow-ticks").get("status") or {}  # noqa: E731
    try:
        wait_for(lambda: ticks().get("lastTickTime"), what="ticks on the slow Redis")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the Schedule's status: {ticks()}") from None
    stalled.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3)  # the stalled Redis' polls and tick passes are now hanging
        took = seconds_to_scale_from_zero(plane, ns, "healthy", redis_url, tasks=5, timeout=15)
        assert took <= 2 + 2, f"scale-from-zero took {took:.1f}s with another Redis stalled"
        wait_for(lambda: ready(plane, ns, "queue", "slow")[0] == "False", timeout=40,
                 what="the stalled Redis reported")
    finally:
        stalled.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: is_ready(plane, ns, "queue", "slow"), timeout=40, what="slow Queue Ready again once healed")


def test_a_schedule_deleted_while_the_operator_is_down_never_fires(kube_control_plane, kube_namespace,
                                                                   start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    operator = start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, scaling=FAST))
    apply(plane, ns, queue_manifest("other", redis_url, scaling=FAST))
    for name, queue in (("every-second", "emails"), ("orphaned", "other")):
        plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump({
            "apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule", "metadata": {"name": name},
            "spec": {"queueRef": {"name": queue}, "schedule": "* * * * * *", "task": {"name": "send_report"}}}))
    emails = effectmq.SyncTaskQueue(f"{ns}/emails", url=redis_url)
    other = effectmq.SyncTaskQueue(f"{ns}/other", url=redis_url)
    wait_for(lambda: emails.stats().waiting >= 2 and other.stats().waiting >= 2, what="ticks firing")

    # The Queue of a Schedule goes: the Schedule stops and says why.
    plane.kubectl("delete", "queue", "other", "-n", ns)
    wait_for(lambda: ready(plane, ns, "schedule", "orphaned") == ("False", "QueueNotFound"), what="QueueNotFound")
    assert condition(get(plane, ns, "schedule", "orphaned"), "QueueFound")["status"] == "False"
    settled = other.stats().waiting
    time.sleep(2.5)
    assert other.stats().waiting == settled, "a Schedule whose Queue is gone kept firing"

    operator.stop()
    plane.kubectl("delete", "schedule", "every-second", "-n", ns)
    again = start_operator(name="operator-again")
    wait_for(lambda: 'effectmq_operator_reconciles_total{outcome="ok"}' in again.metrics(), what="operator back")
    time.sleep(1.5)  # the operator has had time for tick passes
    before = emails.stats().waiting
    time.sleep(2.5)
    assert emails.stats().waiting == before, "a Schedule deleted while the operator was down fired"
    emails.close()
    other.close()


def test_paused_and_max_active_bound_the_replicas(kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("bulk", redis_url, scaling={**FAST, "maxReplicas": 20,
                                                                "targetTasksPerReplica": 50}))
    replicas = lambda: get(plane, ns, "deployment", "bulk-worker")["spec"]["replicas"]  # noqa: E731
    wait_for(lambda: get(plane, ns, "deployment", "bulk-worker"), what="worker Deployment")
    q = effectmq.SyncTaskQueue(f"{ns}/bulk", url=redis_url)
    q.offer_many([("send_email", {"to": "a@b.c"})] * 615)
    wait_for(lambda: replicas() == 13, timeout=20, what="13 replicas for 615 tasks")

    plane.kubectl("patch", "queue", "bulk", "-n", ns, "--type=merge", "-p", '{"spec": {"paused": true}}')
    wait_for(lambda: replicas() == 0, timeout=15, what="paused: down to minReplicas")
    status = get(plane, ns, "queue", "bulk")["status"]
    assert status["lastScaleReason"].startswith("scale to zero: queue paused"), status["lastScaleReason"]

    # maxActive 40 at concurrency 16: never more than 3 replicas, whatever the backlog.
    plane.kubectl("patch", "queue", "bulk", "-n", ns, "--type=merge", "-p",
                  '{"spec": {"paused": false, "maxActive": 40}}')
    wait_for(lambda: replicas() == 3, timeout=15, what="maxActive caps the replicas")
    time.sleep(2)
    assert replicas() == 3
    status = get(plane, ns, "queue", "bulk")["status"]
    assert status["desiredReplicas"] == 3 and status["lastScaleReason"].startswith("scale up to 3")
    assert "capped at 3 by maxActive" in status["lastScaleReason"]
    scaled = [m for _, r, m in events(plane, ns, "bulk") if r == "Scaled"]
    assert scaled and all(m.split(":")[0] in ("scale up to 13", "scale up to 5", "scale up to 9", "scale to zero",
                                               "scale up to 3", "scale up to 1", "scale up to 4", "scale up to 8",
                                               "scale up to 12")
                          for m in scaled), scaled
    q.close()


def test_reconciling_twice_changes_nothing(kube_control_plane, kube_namespace, start_operator, redis_url,
                                           make_redis):
    """An idle Queue's status is not rewritten every poll, nor while its Redis is down."""
    plane, ns = kube_control_plane, kube_namespace
    down = make_redis()
    start_operator()
    apply(plane, ns, queue_manifest("idle", redis_url, scaling=FAST))
    apply(plane, ns, queue_manifest("broken", down.url, scaling=FAST))
    # generous: the first reconcile waits for the operator's start, slow on a loaded machine
    wait_for(lambda: is_ready(plane, ns, "queue", "idle"), timeout=90, what="idle Queue Ready")
    wait_for(lambda: is_ready(plane, ns, "queue", "broken"), timeout=90, what="broken Queue Ready")
    down.stop()
    failing = wait_for(lambda: (q := get(plane, ns, "queue", "broken"))
                       and condition(q, "Ready")["status"] == "False" and q, timeout=20, what="Redis down reported")
    time.sleep(2)  # let the first failure's writes settle
    idle_before = get(plane, ns, "queue", "idle")["metadata"]["resourceVersion"]
    broken_before = get(plane, ns, "queue", "broken")
    time.sleep(5)  # five poll intervals
    assert get(plane, ns, "queue", "idle")["metadata"]["resourceVersion"] == idle_before
    broken_after = get(plane, ns, "queue", "broken")
    assert broken_after["metadata"]["resourceVersion"] == broken_before["metadata"]["resourceVersion"]
    assert condition(broken_after, "Ready")["lastTransitionTime"] == condition(failing, "Ready")["lastTransitionTime"]
    warnings = [m for t, r, m in events(plane, ns, "broken") if t == "Warning"]
    assert len(warnings) == 1, warnings  # one Event for one problem, not one per poll


def test_queue_without_worker_and_a_name_too_long(kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("settings-only", redis_url, scaling=FAST))
    del manifest["spec"]["worker"]
    apply(plane, ns, yaml.safe_dump(manifest))
    wait_for(lambda: is_ready(plane, ns, "queue", "settings-only"), what="Ready without workers")
    workers = condition(get(plane, ns, "queue", "settings-only"), "WorkersDeployed")
    assert workers["reason"] == "NoWorkers" and "runs no Deployment" in workers["message"]
    assert get(plane, ns, "deployment", "settings-only-worker") is None

    long_name = "q" * 64
    result = plane.kubectl("apply", "-n", ns, "-f", "-", input=queue_manifest(long_name, redis_url), check=False)
    assert result.returncode != 0 and "at most 63 characters" in result.stderr, result.stderr
    columns = plane.kubectl("get", "queue", "settings-only", "-n", ns).stdout.split("\n")[0].split()
    assert {"READY", "DESIRED"} <= set(columns), columns


def test_a_drained_queue_shows_it_within_seconds(kube_control_plane, kube_namespace, start_operator, redis_url):
    """Found by hand on the one-node cluster: a burst ran out and the Queue said 153
    waiting and 208 active for half a minute; backlog figures alone were written once
    a minute. A queue that drained (or got work) now says so within FIGURES_SOON."""
    from effectmq_operator.queue_plan import FIGURES_EVERY, FIGURES_SOON

    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("figures", redis_url, scaling=FAST))
    del manifest["spec"]["worker"]  # no Deployment: no scaling write carries the figures along
    apply(plane, ns, yaml.safe_dump(manifest))
    wait_for(lambda: is_ready(plane, ns, "queue", "figures"), timeout=60, what="Ready")
    backlog = lambda: get(plane, ns, "queue", "figures")["status"].get("backlog") or {}  # noqa: E731
    async def drain(q: effectmq.TaskQueue) -> None:
        leases, _ = await q.acquire_many(10)
        assert len(leases) == 3
        for lease in leases:
            await lease.complete("done")

    loop = asyncio.new_event_loop()
    q = effectmq.TaskQueue(f"{ns}/figures", url=redis_url)
    try:
        loop.run_until_complete(q.offer_many([("send_email", {"to": "a@b.c"})] * 3))
        wait_for(lambda: backlog().get("waiting") == 3, timeout=FIGURES_SOON + 10, what="the work shown")
        loop.run_until_complete(drain(q))
        drained = time.monotonic()
        wait_for(lambda: backlog().get("waiting") == 0 and backlog().get("active") == 0,
                 timeout=FIGURES_EVERY, interval=0.2, what="the drained queue shown")
        took = time.monotonic() - drained
        assert took < FIGURES_SOON + 5, f"the drained queue showed after {took:.1f}s"
    finally:
        loop.run_until_complete(q.close())
        loop.close()


def test_the_operator_uses_tls_like_the_workers(kube_control_plane, kube_namespace, start_operator, tmp_path):
    """spec.redis.tls reaches the operator's own connections: a CA from a Secret, insecureSkipVerify."""
    import subprocess

    from tests.fixtures.redis import free_port, require_binary

    plane, ns = kube_control_plane, kube_namespace
    certs = plane.ca_file.parent  # the API server's serving certificate covers 127.0.0.1
    port = free_port()
    server = subprocess.Popen([require_binary("redis-server", "install redis-server"), "--port", "0",
                               "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--tls-cert-file", str(certs / "apiserver.crt"),
                               "--tls-key-file", str(certs / "apiserver.key"),
                               "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        plane.kubectl("create", "secret", "generic", "redis-ca", "-n", ns, f"--from-file=ca.crt={plane.ca_file}")
        start_operator()
        url = f"redis://127.0.0.1:{port}/0"
        for name, tls in (("verified", {"enabled": True, "caFrom": {"secretKeyRef": {"name": "redis-ca",
                                                                                      "key": "ca.crt"}}}),
                          ("unverified", {"enabled": True, "insecureSkipVerify": True}),
                          ("untrusted", {"enabled": True}),
                          ("plain", {})):
            manifest = yaml.safe_load(queue_manifest(name, url, scaling=FAST))
            manifest["spec"]["redis"]["tls"] = tls
            apply(plane, ns, yaml.safe_dump(manifest))
        wait_for(lambda: is_ready(plane, ns, "queue", "verified"), what="TLS with the CA")
        wait_for(lambda: is_ready(plane, ns, "queue", "unverified"), what="TLS without checks")
        for name in ("untrusted", "plain"):  # an unknown CA, or plain text to a TLS port: refused
            wait_for(lambda: (ready(plane, ns, "queue", name) or ("",))[0] == "False", what=f"{name} refused")
        env = {e["name"]: e for e in get(plane, ns, "deployment", "verified-worker")["spec"]["template"]["spec"]
               ["containers"][0]["env"]}
        assert env["EFFECTMQ_REDIS_TLS"]["value"] == "true" and "EFFECTMQ_REDIS_CA_FILE" in env
    finally:
        server.terminate()
        server.wait(10)


def test_edits_to_the_deployment_are_repaired(kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    operator = start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, scaling=FAST))
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    image = lambda: get(plane, ns, "deployment", "emails-worker")["spec"]["template"]["spec"]["containers"][0][  # noqa
        "image"]
    wanted = image()
    plane.kubectl("set", "image", "deployment/emails-worker", "worker=someone/else:1", "-n", ns)
    wait_for(lambda: image() == wanted, timeout=15, what="image edit reverted")
    plane.kubectl("scale", "deployment/emails-worker", "--replicas=5", "-n", ns)
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker")["spec"]["replicas"] == 0, timeout=15,
             what="hand scaling reverted to the scaling decision")

    # An edit made while the operator is down is repaired when it is back; an unedited
    # Deployment is left alone (no apply: its generation stays).
    operator.stop()
    plane.kubectl("set", "image", "deployment/emails-worker", "worker=someone/else:2", "-n", ns)
    again = start_operator(name="operator-again")
    wait_for(lambda: image() == wanted, timeout=15, what="an edit made while the operator was down reverted")
    generation = get(plane, ns, "deployment", "emails-worker")["metadata"]["generation"]
    again.stop()
    third = start_operator(name="operator-third")  # a third term: nothing to repair
    wait_for(lambda: 'effectmq_operator_reconciles_total{outcome="ok"}' in third.metrics(), what="reconciled")
    time.sleep(2)
    assert get(plane, ns, "deployment", "emails-worker")["metadata"]["generation"] == generation
