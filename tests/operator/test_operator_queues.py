"""The operator on a real control plane with real Redis: Deployments, end to end,
scaling, maintenance with zero workers, and bad input."""

from __future__ import annotations

import asyncio
import copy
import json
import signal
import time
from pathlib import Path

import pytest
import yaml

import effectmq
from tests.operator.endpoints import endpoints
from tests.support.operator import DeploymentWorker, controllers_fed_by_lists, wait_for, wait_for_async
from tests.support.processes import ROOT

EXAMPLE = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())


def queue_manifest(name: str, redis_url: str | None, **spec_overrides) -> str:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": name}
    if redis_url is not None:
        body["spec"]["redis"] = {"url": redis_url}
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(body["spec"].get(key), dict):
            body["spec"][key] = {**body["spec"][key], **value}
        else:
            body["spec"][key] = value
    return yaml.safe_dump(body)


def apply(plane, namespace, manifest: str) -> None:
    plane.kubectl("apply", "-n", namespace, "-f", "-", input=manifest)


def get(plane, namespace, kind, name):
    result = plane.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def seconds_to_scale_from_zero(plane, ns, name, redis_url, *, tasks, timeout):
    """Offer `tasks` tasks to a Queue at zero replicas: the seconds until its Deployment
    asks for one replica."""
    q = effectmq.SyncTaskQueue(f"{ns}/{name}", url=redis_url)
    try:
        q.offer_many([("send_email", {"to": "a@b.c"})] * tasks)
        offered = time.monotonic()
        wait_for(lambda: get(plane, ns, "deployment", f"{name}-worker")["spec"]["replicas"] == 1, timeout=timeout,
                 interval=0.1, what="scale from zero")
        return time.monotonic() - offered
    finally:
        q.close()


def condition(body, type_):
    return next((c for c in (body or {}).get("status", {}).get("conditions", []) if c["type"] == type_), None)


def events(plane, namespace, name):
    items = plane.kubectl_json("get", "events", "-n", namespace)["items"]
    return [(e["type"], e["reason"], e["message"]) for e in items if e["involvedObject"]["name"] == name]


def test_queue_gets_its_worker_deployment_and_loses_it_on_delete(kube_control_plane, kube_namespace,
                                                                    start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url))
    deployment = wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["effectmq", "worker"] and container["args"] == ["shop.tasks:app"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EFFECTMQ_QUEUE"] == f"{ns}/emails" and env["EFFECTMQ_REDIS_URL"] == redis_url
    assert env["EFFECTMQ_CONCURRENCY"] == "16" and env["EFFECTMQ_LOG_LEVEL"] == "info"
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    owner = deployment["metadata"]["ownerReferences"][0]
    queue = get(plane, ns, "queue", "emails")
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Queue", "emails", queue["metadata"]["uid"])
    plane.kubectl("wait", "--for=condition=Ready", "queue/emails", "-n", ns, "--timeout=30s")

    # A spec change rolls out; queue-level settings reach Redis without a redeploy.
    plane.kubectl("patch", "queue", "emails", "-n", ns, "--type=merge", "-p",
                  '{"spec": {"paused": true, "maxActive": 3, "sensitive": true, "worker": {"concurrency": 4}}}')
    wait_for(lambda: {e["name"]: e.get("value") for e in get(plane, ns, "deployment", "emails-worker")["spec"]
                      ["template"]["spec"]["containers"][0]["env"]}["EFFECTMQ_CONCURRENCY"] == "4",
             what="concurrency rolled out")
    q = effectmq.SyncTaskQueue(f"{ns}/emails", url=redis_url)
    wait_for(lambda: q.settings().get("paused") is True and q.settings().get("max_active") == 3
             and q.settings().get("sensitive") is True, what="settings in Redis")
    q.close()

    plane.kubectl("delete", "queue", "emails", "-n", ns)
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker") is None, timeout=60,
             what="Deployment garbage-collected")


def leased(redis_url: str, queue: str, tries: int) -> list[bool]:
    """Whether each of `tries` acquire calls got a lease (the leases are left to expire)."""
    async def run():
        q = effectmq.TaskQueue(queue, url=redis_url)
        try:
            return [await q.acquire() is not None for _ in range(tries)]
        finally:
            await q.close()
    return asyncio.run(run())


def test_a_rate_limit_reaches_redis_and_the_status_says_why_tasks_wait(kube_control_plane, kube_namespace,
                                                                      start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("api-calls", redis_url, rateLimit={"tasks": 2, "periodSeconds": 60},
                                             scaling={"pollIntervalSeconds": 1}))
    del manifest["spec"]["worker"]  # no pods here: Ready is the queue's own verdict
    apply(plane, ns, yaml.safe_dump(manifest))
    q = effectmq.SyncTaskQueue(f"{ns}/api-calls", url=redis_url)
    try:
        wait_for(lambda: q.settings().get("rate_limit") == (2, 60.0), what="the limit in Redis")
        wait_for(lambda: (condition(get(plane, ns, "queue", "api-calls"), "RateLimited") or {}).get("reason")
                 == "BelowLimit", what="RateLimited=False below the limit")
        for i in range(5):
            q.offer("send_email", {"to": f"user{i}@example.com"}, task_id=f"t{i}")
        assert leased(redis_url, f"{ns}/api-calls", 3) == [True, True, False]  # the limit, as workers meet it
        limited = wait_for(lambda: (lambda c: c if c and c["status"] == "True" else None)(
            condition(get(plane, ns, "queue", "api-calls"), "RateLimited")), what="RateLimited=True")
        assert limited["reason"] == "LimitReached"
        assert limited["message"] == ("3 waiting: the rate limit of 2 starts per 60s is reached (2 started in the "
                                      "last 60s)")
        assert condition(get(plane, ns, "queue", "api-calls"), "Ready")["status"] == "True"  # works as asked

        # The field removed: the limit is lifted in Redis, and the condition goes.
        plane.kubectl("patch", "queue", "api-calls", "-n", ns, "--type=json",
                      "-p", '[{"op": "remove", "path": "/spec/rateLimit"}]')
        wait_for(lambda: q.settings().get("rate_limit") is None, what="the limit lifted")
        wait_for(lambda: condition(get(plane, ns, "queue", "api-calls"), "RateLimited") is None,
                 what="no RateLimited without a limit")
        assert leased(redis_url, f"{ns}/api-calls", 1) == [True]

        # A handler's hold (a 429's Retry-After) says so, limit or not.
        q.hold_starts(120)
        held = wait_for(lambda: (lambda c: c if c and c["status"] == "True" else None)(
            condition(get(plane, ns, "queue", "api-calls"), "RateLimited")), what="RateLimited=True by a hold")
        assert held["reason"] == "StartsHeld" and held["message"].startswith("2 waiting: a handler held")
    finally:
        q.close()


def test_a_queue_wide_group_cap_reaches_redis_and_the_status_counts_the_parked(kube_control_plane, kube_namespace,
                                                                               start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("tenants", redis_url, groups={"maxActive": 1},
                                             scaling={"pollIntervalSeconds": 1}))
    del manifest["spec"]["worker"]  # no pods here: Ready is the queue's own verdict
    apply(plane, ns, yaml.safe_dump(manifest))
    q = effectmq.SyncTaskQueue(f"{ns}/tenants", url=redis_url)
    try:
        wait_for(lambda: q.settings().get("group_max_active") == 1, what="the group cap in Redis")
        q.offer_many([("send_email", {"to": f"user{i}@example.com"}, {"group": "acme"}) for i in range(4)])
        assert leased(redis_url, f"{ns}/tenants", 2) == [True, False]  # the cap, as workers meet it
        capped = wait_for(lambda: (lambda c: c if c and c["status"] == "True" else None)(
            condition(get(plane, ns, "queue", "tenants"), "GroupCapped")), what="GroupCapped=True")
        assert capped["reason"] == "TasksParked"
        assert capped["message"] == ("3 of 3 waiting tasks wait for their group's cap, rate limit or resume; more "
                                     "replicas would not start them")
        body = get(plane, ns, "queue", "tenants")
        assert condition(body, "Ready")["status"] == "True"  # works as asked
        assert body["status"]["backlog"]["parked"] == 3 and body["status"]["backlog"]["waiting"] == 0

        # The field removed: no cap in Redis, the parked tasks go back, and the condition says so.
        plane.kubectl("patch", "queue", "tenants", "-n", ns, "--type=json",
                      "-p", '[{"op": "remove", "path": "/spec/groups"}]')
        wait_for(lambda: q.settings().get("group_max_active") == 0, what="the cap lifted")
        assert q.stats().parked == 0 and q.group_stats("acme").waiting == 3
        wait_for(lambda: (condition(get(plane, ns, "queue", "tenants"), "GroupCapped") or {}).get("reason")
                 == "NoneParked", what="GroupCapped=False")
    finally:
        q.close()


def test_a_group_rate_limit_reaches_redis_and_parks_what_its_window_cannot_start(kube_control_plane, kube_namespace,
                                                                                 start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    manifest = yaml.safe_load(queue_manifest("per-tenant", redis_url,
                                             groups={"rateLimit": {"tasks": 1, "periodSeconds": 60}},
                                             scaling={"pollIntervalSeconds": 1}))
    del manifest["spec"]["worker"]  # no pods here
    apply(plane, ns, yaml.safe_dump(manifest))  # the CRD's schema takes the field (the API server prunes unknown ones)
    q = effectmq.SyncTaskQueue(f"{ns}/per-tenant", url=redis_url)
    try:
        wait_for(lambda: q.settings().get("group_rate_limit") == (1, 60.0), what="the group rate limit in Redis")
        q.offer_many([("send_email", {"to": f"user{i}@example.com"}, {"group": g}) for g in ("acme", "beta")
                      for i in range(2)])
        assert leased(redis_url, f"{ns}/per-tenant", 3) == [True, True, False]  # one start a group in the window
        assert q.stats().parked == 2 and q.group_stats("acme").rate_limit == (1, 60.0)
        capped = wait_for(lambda: (lambda c: c if c and c["status"] == "True" else None)(
            condition(get(plane, ns, "queue", "per-tenant"), "GroupCapped")), what="GroupCapped=True")
        assert "rate limit" in capped["message"], capped

        # The field removed: no limit in Redis and the parked tasks go back.
        plane.kubectl("patch", "queue", "per-tenant", "-n", ns, "--type=json",
                      "-p", '[{"op": "remove", "path": "/spec/groups"}]')
        wait_for(lambda: q.settings().get("group_rate_limit") is None, what="the limit lifted")
        assert q.stats().parked == 0
    finally:
        q.close()


def test_end_to_end_with_workers_run_from_the_deployment(kube_control_plane, kube_namespace, start_operator,
                                                         redis_url, tmp_path):
    plane, ns = kube_control_plane, kube_namespace
    plane.kubectl("create", "secret", "generic", "redis", "-n", ns, f"--from-literal=url={redis_url}")
    start_operator()
    manifest = yaml.safe_load(queue_manifest("emails", None))
    manifest["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "redis", "key": "url"}}}
    apply(plane, ns, yaml.safe_dump(manifest))
    deployment = wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    workers = [DeploymentWorker(plane, ns, deployment, f"emails-worker-{i}", tmp_path) for i in range(2)]
    try:
        q = effectmq.SyncTaskQueue(f"{ns}/emails", url=redis_url)
        ids = [q.offer("send_email", {"to": f"user{i}@example.com"}).task_id for i in range(20)]
        results = [q.wait(tid, timeout=60) for tid in ids]
        assert [r["delivered_to"] for r in results] == [f"user{i}@example.com" for i in range(20)]
        q.close()
        # The URL from the Secret reached them as a file, not in the environment
        # that child processes, /proc/<pid>/environ and crash dumps show.
        environ = workers[0].environ()
        assert redis_url not in environ and "EFFECTMQ_REDIS_URL=" not in environ
        assert f"EFFECTMQ_REDIS_URL_FILE={workers[0].env['EFFECTMQ_REDIS_URL_FILE']}" in environ
    finally:
        for w in workers:
            w.stop()
    assert Path(workers[0].env["EFFECTMQ_REDIS_URL_FILE"]).read_text() == redis_url  # the Secret's key, mounted


def test_scaling_follows_the_backlog(kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    operator = start_operator()
    apply(plane, ns, queue_manifest("bulk", redis_url, scaling={
        "minReplicas": 0, "maxReplicas": 20, "targetTasksPerReplica": 100, "activationTasks": 5,
        "pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 4, "cooldownSeconds": 6}))
    wait_for(lambda: get(plane, ns, "deployment", "bulk-worker"), what="worker Deployment")
    replicas = lambda: get(plane, ns, "deployment", "bulk-worker")["spec"]["replicas"]  # noqa: E731
    q = effectmq.SyncTaskQueue(f"{ns}/bulk", url=redis_url)

    # Below the activation threshold nothing starts; at it, one replica.
    q.offer_many([("send_email", {"to": "a@b.c"})] * 3)
    with pytest.raises(AssertionError):
        wait_for(lambda: replicas() > 0, timeout=3)
    q.offer_many([("send_email", {"to": "a@b.c"})] * 2)
    wait_for(lambda: replicas() == 1, timeout=10, what="0 -> 1 at the activation threshold")

    # 1,000 tasks at 100 per replica: 10 replicas, in bounded steps (1 -> 5 -> 10).
    q.offer_many([("send_email", {"to": "a@b.c"})] * 995)
    wait_for(lambda: replicas() == 10, timeout=10, what="scale up to 10")
    status = wait_for(lambda: (s := get(plane, ns, "queue", "bulk")["status"]).get("desiredReplicas") == 10 and s,
                      timeout=5, what="status after scaling")
    assert status["backlog"]["waiting"] == 1000
    assert "scale up to 10" in status["lastScaleReason"]
    assert any(r == "Scaled" and "scale up to 10" in m for _, r, m in events(plane, ns, "bulk"))
    metrics = operator.metrics()
    assert f'effectmq_operator_desired_replicas{{queue="{ns}/bulk"}} 10.0' in metrics
    assert f'effectmq_operator_scale_decisions_total{{direction="up",queue="{ns}/bulk"}}' in metrics

    # Busy pods are protected on scale-in: before scaling in, the pod whose worker announces
    # work in flight gets a higher deletion cost (pods exist, Pending: no kubelet here).
    pods = wait_for(lambda: plane.kubectl_json("get", "pods", "-n", ns, "-l",
                                               "app.kubernetes.io/instance=bulk")["items"], what="worker pods")
    busy_pod = pods[0]["metadata"]["name"]
    beat = asyncio.new_event_loop()
    announcer = effectmq.TaskQueue(f"{ns}/bulk", url=redis_url)
    beat.run_until_complete(announcer.worker_beat(busy_pod, 7, 16, ttl=60))
    cost = lambda: (get(plane, ns, "pod", busy_pod)["metadata"].get("annotations") or {}).get(  # noqa: E731
        "controller.kubernetes.io/pod-deletion-cost")

    # Drain the queue, but keep 25 tasks leased by a worker process that announces them.
    leased = []
    async def drain():
        aq = effectmq.TaskQueue(f"{ns}/bulk", url=redis_url, lock_timeout=120)
        leases, _ = await aq.acquire_many(25)
        leased.extend(leases)
        while True:
            batch, _ = await aq.acquire_many(200)
            if not batch:
                break
            for lease in batch:
                await lease.complete()
        await aq.worker_beat("bulk-worker-busy", 25, 16, ttl=120)
        return aq
    loop = asyncio.new_event_loop()
    aq = loop.run_until_complete(drain())
    drained_at = __import__("time").monotonic()
    wait_for(lambda: replicas() == 2, timeout=15, what="scale down to what in-flight work needs")
    assert __import__("time").monotonic() - drained_at >= 3  # not before the stabilization window
    status = wait_for(lambda: (s := get(plane, ns, "queue", "bulk")["status"]).get("desiredReplicas") == 2 and s,
                      timeout=5, what="status after scaling down")
    assert status["backlog"]["active"] == 25 and "scale down to 2" in status["lastScaleReason"]
    assert cost() == "7"  # set before the scale-in, so the ReplicaSet removed idle pods first
    beat.run_until_complete(announcer.worker_beat(busy_pod, -1, 16, ttl=60))
    beat.run_until_complete(announcer.close())
    beat.close()

    # Work done, worker gone: to zero only after the cooldown.
    async def finish():
        for lease in leased:
            await lease.complete()
        await aq.worker_beat("bulk-worker-busy", -1, 16, ttl=1)
        await aq.close()
    loop.run_until_complete(finish())
    loop.close()
    wait_for(lambda: replicas() == 0, timeout=20, what="scale to zero after the cooldown")
    assert "scale to zero" in get(plane, ns, "queue", "bulk")["status"]["lastScaleReason"]
    q.offer_many([("send_email", {"to": "a@b.c"})] * 5)
    wait_for(lambda: replicas() == 1, timeout=10, what="back from zero")
    q.close()


def test_operator_recovers_leases_when_no_worker_is_left(kube_control_plane, kube_namespace, start_operator,
                                                         redis_url, tmp_path):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("solo", redis_url, lockTimeoutSeconds=2, lockRefreshSeconds=1,
                                    maxStalledCount=3, scaling={"pollIntervalSeconds": 1}))
    deployment = wait_for(lambda: get(plane, ns, "deployment", "solo-worker"), what="worker Deployment")
    q = effectmq.SyncTaskQueue(f"{ns}/solo", url=redis_url)
    ids = [q.offer("send_report", {"report": f"r{i}", "seconds": 600}).task_id for i in range(4)]
    # A worker whose handler hangs, then is killed with its tasks in flight.
    worker = DeploymentWorker(plane, ns, deployment, "solo-worker-0", tmp_path,
                              overrides={"EFFECTMQ_MAINTENANCE_INTERVAL": "3600"})
    wait_for(lambda: q.stats().active == 4, what="tasks in flight")
    worker.stop(signal.SIGKILL)
    # Nobody else runs maintenance: the operator must hand the tasks back.
    wait_for(lambda: q.stats().waiting == 4, timeout=20, what="leases recovered by the operator")
    assert all(q.get(t).stalled_attempt_count == 1 for t in ids)
    # A worker returns: the recovered tasks run again (a second attempt each).
    again = DeploymentWorker(plane, ns, deployment, "solo-worker-1", tmp_path,
                             overrides={"EFFECTMQ_DRAIN_TIMEOUT": "1"})
    try:
        wait_for(lambda: q.stats().active == 4, what="tasks running again on the returned worker")
        assert [q.get(t).attempt for t in ids] == [2, 2, 2, 2]
    finally:
        again.stop()  # SIGTERM: drains, then releases what is left
    assert q.stats().waiting == 4 and all(q.get(t).stalled_attempt_count == 1 for t in ids)
    q.close()


def test_status_does_not_tell_a_closed_port_from_an_open_one(kube_control_plane, kube_namespace, start_operator):
    """Was: the status said "Connection refused" for a closed port, "Protocol error,
    got 'H'" for an HTTP server and a timeout for one that never answers: a Queue's author
    could scan the network as the operator sees it. Now the conditions and the Events say
    the same of all three (their URLs aside)."""
    plane, ns = kube_control_plane, kube_namespace
    operator = start_operator()
    with endpoints("closed", "garbage", "silent") as at:
        for kind, endpoint in at.items():
            apply(plane, ns, queue_manifest(kind, endpoint.url()))

        def told(kind):
            queue = get(plane, ns, "queue", kind)
            reachable, ready = condition(queue, "RedisReachable"), condition(queue, "Ready")
            if not reachable or reachable["status"] != "False":
                return None
            warnings = [m for t, r, m in events(plane, ns, kind) if t == "Warning" and r == "RedisUnreachable"]
            if not warnings:
                return None
            url = at[kind].url()
            return (reachable["reason"], *(m.replace(url, "<URL>") for m in (reachable["message"], ready["message"],
                                                                              warnings[0])))

        seen = {kind: wait_for(lambda kind=kind: told(kind), timeout=60, what=f"the {kind} Queue's status")
                for kind in at}
    assert len(set(seen.values())) == 1, seen
    reason, message, *_ = seen["closed"]
    assert reason == "RedisUnreachable" and "did not answer as a Redis server" in message, message
    log = operator.log_path.read_text(errors="replace")
    assert "Traceback" not in log


def test_bad_input_becomes_conditions_and_events(kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    broken = yaml.safe_load(queue_manifest("nosecret", None))
    broken["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "missing", "key": "url"}}}
    apply(plane, ns, yaml.safe_dump(broken))
    apply(plane, ns, queue_manifest("noredis", "redis://127.0.0.1:1/0"))
    apply(plane, ns, queue_manifest("fine", redis_url))

    def reason(name, type_="RedisReachable"):
        cond = condition(get(plane, ns, "queue", name), type_)
        return cond and (cond["status"], cond["reason"], cond["message"])

    status, why, message = wait_for(lambda: reason("nosecret"), what="condition on nosecret")
    assert (status, why) == ("False", "SecretNotFound") and f"Secret {ns}/missing" in message
    status, why, message = wait_for(lambda: reason("noredis"), what="condition on noredis")
    assert (status, why) == ("False", "RedisUnreachable") and "127.0.0.1:1" in message
    assert reason("nosecret", "Ready")[0] == "False"
    wait_for(lambda: reason("fine", "Ready") and reason("fine", "Ready")[0] == "True", what="the good queue ready")
    wait_for(lambda: any(r == "SecretNotFound" for _, r, _ in events(plane, ns, "nosecret")), what="Event")
    wait_for(lambda: any(t == "Warning" and r == "RedisUnreachable" for t, r, _ in events(plane, ns, "noredis")),
             what="Event")
    # The good queue keeps being served: its backlog shows up in its status.
    q = effectmq.SyncTaskQueue(f"{ns}/fine", url=redis_url)
    q.offer("send_email", {"to": "a@b.c"})
    wait_for(lambda: (get(plane, ns, "queue", "fine")["status"].get("backlog") or {}).get("waiting") == 1,
             timeout=30, what="status of the good queue")
    q.close()
    # Fixing the Secret heals the broken queue.
    plane.kubectl("create", "secret", "generic", "missing", "-n", ns, f"--from-literal=url={redis_url}")
    plane.kubectl("annotate", "queue", "nosecret", "-n", ns, "retry=1")
    wait_for(lambda: reason("nosecret") and reason("nosecret")[0] == "True", timeout=40, what="healed")


def test_a_queue_whose_redis_refuses_writes_says_so_and_recovers(kube_control_plane, kube_namespace,
                                                                start_operator, redis_url):
    """Was: with its Redis full (maxmemory, noeviction) every offer failed with OOM while
    the Queue said Ready=True: its settings, maintenance and status reads still worked."""
    import redis

    plane, ns = kube_control_plane, kube_namespace
    operator = start_operator()
    gauge = f'effectmq_operator_accepting_tasks{{queue="{ns}/orders"}}'

    def accepting() -> float | None:  # the alert's metric, as scraped
        line = next((line for line in operator.metrics().splitlines() if line.startswith(gauge + " ")), None)
        return float(line.split()[1]) if line else None

    body = yaml.safe_load(queue_manifest("orders", redis_url))
    del body["spec"]["worker"], body["spec"]["scaling"]  # no pods here: Ready says only what Redis does
    apply(plane, ns, yaml.safe_dump(body))

    def state(type_="Ready"):
        c = condition(get(plane, ns, "queue", "orders"), type_)
        return c and (c["status"], c["reason"], c["message"])

    wait_for(lambda: (state() or ("",))[0] == "True", timeout=30, what="Ready")
    assert state("AcceptingTasks")[:2] == ("True", "Accepting") and accepting() == 1
    server = redis.Redis.from_url(redis_url)
    q = effectmq.SyncTaskQueue(f"{ns}/orders", url=redis_url)
    try:
        q.offer("send_email", {"to": "a@b.c"})
        server.config_set("maxmemory", 1)
        with pytest.raises(effectmq.RedisUnavailable, match="OOM"):
            q.offer("send_email", {"to": "d@e.f"})  # what producers meet
        status, reason, message = wait_for(lambda: (r := state()) and r[0] == "False" and r, timeout=20,
                                           what="Ready=False while Redis refuses writes")
        assert reason == "RedisRefusesWrites" and "OOM" in message and "offers" in message, (reason, message)
        assert state("AcceptingTasks")[:2] == ("False", "RedisRefusesWrites") and accepting() == 0
        assert state("RedisReachable")[0] == "True"
        assert state("Reconciling")[0] == "True" and state("Stalled")[0] == "False"
        assert get(plane, ns, "queue", "orders")["status"]["backlog"]["waiting"] == 1  # still observed
        wait_for(lambda: any(t == "Warning" and r == "RedisRefusesWrites" for t, r, _ in events(plane, ns, "orders")),
                 what="a Warning Event")
    finally:
        server.config_set("maxmemory", 0)
        server.close()
    wait_for(lambda: (state() or ("",))[0] == "True", timeout=20, what="Ready again once Redis takes writes")
    assert state("AcceptingTasks")[:2] == ("True", "Accepting") and accepting() == 1
    q.offer("send_email", {"to": "d@e.f"})
    q.close()
    warnings = [m for t, r, m in events(plane, ns, "orders") if r == "RedisRefusesWrites"]
    assert len(warnings) == 1, warnings  # one per outage


async def test_a_queue_the_watch_reports_while_a_list_is_in_flight_is_not_dropped_by_that_list(
        kube_control_plane, kube_namespace, effectmq_crds, redis_url):
    """A full list is a snapshot: a Queue created after it was taken, and reported by the
    watch before it returned, is not in it. That list took the Queue for deleted and
    forgot its reconcile; with the watch running, nothing looked again for a minute (two
    CI runs: a Queue of a freshly started operator never reconciled within 30 and 60 s)."""
    plane, ns = kube_control_plane, kube_namespace
    async with controllers_fed_by_lists(plane, ns) as (queues, _):
        await asyncio.wait_for(queues.synced.wait(), 10)
        kube, staged = queues.kube, []
        real_list = kube.list_resources

        async def list_then_create(plural, namespaces):
            items = await real_list(plural, namespaces)  # the snapshot: no "late" in it
            if plural == "queues" and not staged:
                staged.append(True)
                apply(plane, ns, queue_manifest("late", redis_url))
                queues.observe_queue("ADDED", get(plane, ns, "queue", "late"))  # the watch is quicker
            return items

        kube.list_resources = list_then_create
        queues.queues._next_list = 0.0  # the next step lists
        await wait_for_async(lambda: staged, timeout=10, what="the staged list")
        await wait_for_async(lambda: get(plane, ns, "deployment", "late-worker"), timeout=15,
                             what="the late Queue's worker Deployment")
        assert (ns, "late") in queues.queues.items


async def test_a_queue_the_watch_has_not_reported_is_reconciled_within_seconds(kube_control_plane, kube_namespace,
                                                                               effectmq_crds, redis_url):
    """The watch streams can start late: the API server answers a watch of a newly created
    CRD with 429 "storage is (re)initializing" until its watch cache is ready, and kopf
    retries after 1, 1, 2, 3, 5, 8, 13 and 21 s. A Queue created meanwhile is found only by
    the controller's own list; here no watch event reaches the controller at all (a CI run
    saw no Deployment for 30 s after the operator started, its watch of queues in backoff,
    while the next list was a minute away)."""
    plane, ns = kube_control_plane, kube_namespace
    async with controllers_fed_by_lists(plane, ns) as (queues, _):
        await asyncio.wait_for(queues.synced.wait(), 10)  # its first list: no Queue yet
        apply(plane, ns, queue_manifest("unreported", redis_url))
        await wait_for_async(lambda: get(plane, ns, "deployment", "unreported-worker"), timeout=15,
                             what="a worker Deployment")


def test_a_spec_the_api_server_refuses_is_stalled_and_scaling_goes_on(kube_control_plane, kube_namespace,
                                                                      start_operator, redis_url, kstatus):
    """Was: an env value of the wrong type passed the CRD (env items kept
    unknown fields) and the Deployment's apply was answered 500 "expected string": it read
    DeploymentFailed with Reconciling=True, Stalled=False, kstatus InProgress for ever; and
    as replicas travel in that apply, the Queue never scaled (300 tasks at 1 replica).
    Since env has core's schema, which refuses that value at apply
    (tests/k8s/test_crd_fields.py); a name with '=' is what the schema lets through and
    the Deployment's own validation refuses."""
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    fast = {"pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 60, "cooldownSeconds": 60}
    apply(plane, ns, queue_manifest("emails", redis_url, scaling=fast))
    wait_for(lambda: get(plane, ns, "deployment", "emails-worker"), what="worker Deployment")
    plane.kubectl("wait", "--for=condition=Ready", "queue/emails", "-n", ns, "--timeout=30s")
    replicas = lambda: get(plane, ns, "deployment", "emails-worker")["spec"]["replicas"]  # noqa: E731
    assert replicas() == 0

    plane.kubectl("patch", "queue", "emails", "-n", ns, "--type=merge",
                  "-p", json.dumps({"spec": {"worker": {"env": [{"name": "NUM=5", "value": "5"}]}}}))

    def ready():
        c = condition(get(plane, ns, "queue", "emails"), "Ready")
        return c if c and c["status"] == "False" and c["reason"] == "DeploymentFailed" else None

    refused = wait_for(ready, timeout=20, what="the refused apply reported")
    assert "a valid environment variable name" in refused["message"] and "NUM=5" in refused["message"], refused
    queue = wait_for(lambda: (q := get(plane, ns, "queue", "emails")) and condition(q, "Stalled")["status"] == "True"
                     and q, timeout=10, what="Stalled")
    assert condition(queue, "Reconciling")["status"] == "False" and kstatus(queue).status == "Failed"
    assert ("Warning", "DeploymentFailed") in [(t, r) for t, r, _ in events(plane, ns, "emails")]

    # Work arrives: the Deployment (its last good template) is scaled all the same.
    q = effectmq.SyncTaskQueue(f"{ns}/emails", url=redis_url)
    try:
        q.offer_many([("send_email", {"to": "a@b.c"})] * 200)  # 4 replicas at 50 per replica
    finally:
        q.close()
    wait_for(lambda: replicas() == 4, timeout=20, what="scaled while the template is refused")
    deployment = get(plane, ns, "deployment", "emails-worker")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "NUM=5" not in [e["name"] for e in env]  # the refused template is not there
    status = wait_for(lambda: (s := get(plane, ns, "queue", "emails")["status"]).get("desiredReplicas") == 4 and s,
                      timeout=10, what="the scaling decision in status")
    assert condition({"status": status}, "Ready")["reason"] == "DeploymentFailed"
    assert "replicas still follow the backlog" in condition({"status": status}, "Ready")["message"]

    # Fixed: the template goes out and the Queue heals.
    plane.kubectl("patch", "queue", "emails", "-n", ns, "--type=merge",
                  "-p", json.dumps({"spec": {"worker": {"env": [{"name": "NUM", "value": "5"}]}}}))
    wait_for(lambda: "NUM" in [e["name"] for e in get(plane, ns, "deployment", "emails-worker")["spec"]["template"]
                               ["spec"]["containers"][0]["env"]], timeout=20, what="the fixed template applied")
    wait_for(lambda: condition(get(plane, ns, "queue", "emails"), "Ready")["reason"] != "DeploymentFailed",
             timeout=20, what="DeploymentFailed cleared")
    assert replicas() == 4

    # A Queue whose Deployment can never be created says that no worker runs.
    broken = yaml.safe_load(queue_manifest("billing", redis_url, scaling=fast))
    broken["spec"]["worker"]["env"] = [{"name": "NUM=5", "value": "5"}]
    apply(plane, ns, yaml.safe_dump(broken))
    c = wait_for(lambda: (c := condition(get(plane, ns, "queue", "billing"), "Ready")) and c["status"] == "False"
                 and c["reason"] == "DeploymentFailed" and c, timeout=20, what="billing refused")
    assert "no worker runs until it can be created" in c["message"], c
    assert condition(get(plane, ns, "queue", "billing"), "Stalled")["status"] == "True"
    assert get(plane, ns, "deployment", "billing-worker") is None
