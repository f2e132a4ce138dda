"""The operator with many Queues: connections per distinct Redis, polls that a
blackholed Redis cannot hold up, Kubernetes calls under real API latency, Secrets
read from a watch. Real control plane, real Redis, the operator as a process
(the API-latency test drives the operator's Kube in process, through a proxy)."""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import kubernetes
import pytest
import yaml

from effectmq_operator.redis_pool import CONNECTIONS_PER_REDIS
from effectmq_operator.runtime.kube import Kube
from tests.fixtures.proxy import LatencyProxy, TcpProxy
from tests.operator.test_operator_queues import apply, condition, get, queue_manifest, seconds_to_scale_from_zero
from tests.support.operator import default_kubeconfig, wait_for

pytestmark = pytest.mark.kube
FAST = {"pollIntervalSeconds": 1, "scaleDownStabilizationSeconds": 2, "cooldownSeconds": 2}
PASSWORD = "f4nout-s3cret-pw"
RECONCILES = 16  # at once, in the blackhole test


def queue_list(names: list[str], redis: dict, **spec_overrides) -> str:
    items = []
    for name in names:
        body = yaml.safe_load(queue_manifest(name, None, **spec_overrides))
        body["spec"]["redis"] = redis
        items.append(body)
    return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items})


def queues(plane, ns) -> dict[str, dict]:
    return {q["metadata"]["name"]: q for q in plane.kubectl_json("get", "queues", "-n", ns)["items"]}


def reachable(body) -> str | None:
    c = condition(body, "RedisReachable")
    return c and c["status"]


def api_server_count(plane, verb: str, resource: str) -> float:
    """Requests the API server served so far (apiserver_request_total, all clients)."""
    text = plane.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{") and f'verb="{verb}"' in line \
                and f'resource="{resource}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_queues_on_one_redis_share_a_few_connections(kube_control_plane, kube_namespace, start_operator, make_redis):
    plane, ns = kube_control_plane, kube_namespace
    server = make_redis()
    operator = start_operator()
    names = [f"q{i:02d}" for i in range(50)]
    apply(plane, ns, queue_list(names, {"url": server.url}, scaling=FAST))
    wait_for(lambda: sum(reachable(q) == "True" for q in queues(plane, ns).values()) == len(names), timeout=60,
             interval=1, what="every Queue polled")
    peak = 0
    for _ in range(30):  # three poll intervals of 50 Queues
        peak = max(peak, len(operator.redis_clients(server)))
        time.sleep(0.1)
    assert 1 <= peak <= CONNECTIONS_PER_REDIS, f"{peak} connections for {len(names)} Queues on one Redis"


def test_a_blackholed_redis_delays_no_other_queue(kube_control_plane, kube_namespace, start_operator, make_redis,
                                                   redis_url):
    plane, ns = kube_control_plane, kube_namespace
    dead = make_redis(password=PASSWORD)
    proxy = TcpProxy(dead.port)
    try:
        start_operator(extra_env={"EFFECTMQ_OPERATOR_RECONCILES": str(RECONCILES)})
        stuck = [f"stuck{i:02d}" for i in range(40)]  # more than the reconciles allowed at once
        apply(plane, ns, queue_list(stuck, {"url": f"redis://:{PASSWORD}@127.0.0.1:{proxy.port}/0"}, scaling=FAST))
        apply(plane, ns, queue_manifest("healthy", redis_url, scaling={**FAST, "activationTasks": 1}))
        wait_for(lambda: sum(reachable(q) == "True" for q in queues(plane, ns).values()) == len(stuck) + 1,
                 timeout=120, interval=1, what="every Queue polled")  # the setup, not the bound under test
        proxy.cut(drop_existing=False)  # every byte to that Redis vanishes: polls hang until their deadline
        time.sleep(4)
        took = seconds_to_scale_from_zero(plane, ns, "healthy", redis_url, tasks=3, timeout=20)
        assert took <= 1 + 2, f"scale-from-zero took {took:.1f}s while {len(stuck)} Queues' Redis was blackholed"

        def unreachable():
            found = queues(plane, ns)
            return all(reachable(found[n]) == "False" for n in stuck) and found
        found = wait_for(unreachable, timeout=30, interval=1, what="every blackholed Queue reported")
        conditions = [condition(found[n], "RedisReachable") for n in stuck]
        assert {c["reason"] for c in conditions} == {"RedisUnreachable"}
        assert PASSWORD not in json.dumps(conditions)
        assert f"127.0.0.1:{proxy.port}" in conditions[0]["message"]
    finally:
        proxy.close()


def test_a_rotated_secret_is_used_within_its_refresh_and_never_read_per_poll(kube_control_plane, kube_namespace,
                                                                             start_operator, make_redis):
    """The operator reads a Queue's Secret by name (it may not list or watch Secrets): once per
    refresh interval however often it polls, and a rotated password is used after at most one interval."""
    plane, ns = kube_control_plane, kube_namespace
    refresh = 4
    old, new = make_redis(password="old-" + PASSWORD), make_redis(password="new-" + PASSWORD)
    down = f"redis://:{PASSWORD}@127.0.0.1:1/0"  # nothing listens: its polls fail and retry
    for secret, url in (("redis", old.url), ("down", down)):
        plane.kubectl("create", "secret", "generic", secret, "-n", ns, f"--from-literal=url={url}")
    operator = start_operator(extra_env={"EFFECTMQ_SECRET_REFRESH_SECONDS": str(refresh)})
    for name, secret in (("rotating", "redis"), ("failing", "down")):
        apply(plane, ns, queue_list([name], {"urlFrom": {"secretKeyRef": {"name": secret, "key": "url"}}},
                                    scaling=FAST))
    wait_for(lambda: reachable(get(plane, ns, "queue", "rotating")) == "True", timeout=30, what="Queue polled")
    wait_for(lambda: reachable(get(plane, ns, "queue", "failing")) == "False", timeout=30, what="failure reported")
    reads = api_server_count(plane, "GET", "secrets")
    time.sleep(2 * refresh)  # eight polls of one Queue, several failed polls of the other
    # per Secret: at most one read per interval begun (a read per poll would be 8 for "redis" alone)
    assert api_server_count(plane, "GET", "secrets") - reads <= 2 * 3, "Secrets were read per poll"
    plane.kubectl("delete", "queue", "failing", "-n", ns)
    time.sleep(2)  # its last failed poll is over

    rotated = plane.kubectl("create", "secret", "generic", "redis", "-n", ns, f"--from-literal=url={new.url}",
                            "--dry-run=client", "-o", "yaml").stdout
    assert not operator.redis_clients(new)
    plane.kubectl("replace", "-f", "-", input=rotated)
    changed = time.monotonic()
    wait_for(lambda: operator.redis_clients(new), timeout=refresh + 10, interval=0.1,
             what="the operator on the new Redis")
    took = time.monotonic() - changed
    assert took <= refresh + 3, f"the rotated Secret was used after {took:.1f}s"
    wait_for(lambda: reachable(get(plane, ns, "queue", "rotating")) == "True", timeout=10, what="still reachable")


@pytest.fixture
def slow_api(kube_control_plane, tmp_path):
    """The default kubernetes client configuration pointed at the API server through
    a proxy that adds 50 ms each way; restored afterwards."""
    plane = kube_control_plane
    server = urlsplit(plane.server)
    proxy = LatencyProxy(server.hostname, server.port, 0.05)
    config = json.loads(plane.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    kubeconfig = tmp_path / "slow.kubeconfig"
    kubeconfig.write_text(json.dumps(config))
    try:
        with default_kubeconfig(kubeconfig):
            yield proxy
    finally:
        proxy.close()


async def test_api_calls_do_not_queue_behind_a_small_pool(kube_namespace, effectmq_crds, slow_api):
    kube = Kube()
    for _ in range(50):  # a first connection (TLS) before timing; a new CRD's storage may still be starting
        try:
            await kube.list_resources("queues", [kube_namespace])
            break
        except kubernetes.client.ApiException as exc:
            if exc.status != 429:
                raise
            await asyncio.sleep(0.2)
    calls = 200  # a pass over 200 Queues, one call each
    started = time.monotonic()
    await asyncio.gather(*[kube.list_resources("queues", [kube_namespace]) for _ in range(calls)])
    took = time.monotonic() - started
    # 32 threads: 0.6 s; 8 threads would take 2.5 s, the default pool of 6 3.3 s. The
    # margin is for a 2-core machine whose other test worker may be running a browser.
    eight_threads = calls * 0.1 / 8
    assert took < eight_threads * 0.8, f"{calls} calls at 100 ms round trip took {took:.2f}s"
