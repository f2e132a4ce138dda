"""Leader election against the real API server, with a TCP proxy in front of the
elector under test so its connection can be blackholed and restored.

Short timings (lease 6 s, renew deadline 4 s, retry 1 s) keep the tests quick. A
sampler records every 0.1 s which electors claim to lead; no sample may show two.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable
from urllib.parse import urlparse

import kubernetes
import pytest

from effectmq_operator.runtime.leader import LeaderElector
from tests.fixtures.proxy import TcpProxy

pytestmark = pytest.mark.kube

REPO = Path(__file__).resolve().parents[2]
LEASE_NAME = "effectmq-operator"
LEASE, DEADLINE, RETRY = 6.0, 4.0, 1.0


def as_service_account(plane, namespace: str, name: str) -> kubernetes.client.CoordinationV1Api:
    """A CoordinationV1Api that acts as ServiceAccount `name` (created, and allowed the Lease
    calls by a RoleBinding of that name) with a bearer token from a TokenRequest."""
    plane.kubectl("create", "serviceaccount", name, "-n", namespace)
    plane.kubectl("create", "role", name, "-n", namespace, "--verb=get,create,update",
                  "--resource=leases.coordination.k8s.io")
    plane.kubectl("create", "rolebinding", name, "-n", namespace, f"--role={name}",
                  f"--serviceaccount={namespace}:{name}")
    config = kubernetes.client.Configuration()
    config.host = plane.server
    config.ssl_ca_cert = str(plane.ca_file)
    config.api_key["authorization"] = "Bearer " + service_account_token(plane, namespace, name)
    return kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient(config))


def service_account_token(plane, namespace: str, name: str) -> str:
    return plane.kubectl("create", "token", name, "-n", namespace, "--duration=1h").stdout.strip()


def coordination(plane, port: int | None = None) -> kubernetes.client.CoordinationV1Api:
    """A CoordinationV1Api on its own ApiClient: direct, or through a proxy on `port`."""
    config = kubernetes.client.Configuration()
    config.host = f"https://127.0.0.1:{port}" if port else plane.server
    config.ssl_ca_cert = str(plane.ca_file)
    config.cert_file = str(plane.admin_cert)
    config.key_file = str(plane.admin_key)
    return kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient(config))


async def until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s (last: {result!r})")
        await asyncio.sleep(interval)


class Campaign:
    """Electors on one Lease in the test's namespace, their run() tasks, and a sampler."""

    def __init__(self, plane, namespace: str):
        self.plane, self.namespace = plane, namespace
        self.api_port = urlparse(plane.server).port
        self.view = coordination(plane)  # the test's own look at the Lease
        self.electors: list[LeaderElector] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.proxies: list[TcpProxy] = []
        self.samples: list[tuple[float, list[str]]] = []
        self._sampler = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            self.samples.append((time.monotonic(), [e.identity for e in self.electors if e.is_leader]))
            await asyncio.sleep(0.1)

    def proxy(self) -> TcpProxy:
        proxy = TcpProxy(self.api_port)
        self.proxies.append(proxy)
        return proxy

    def elector(self, identity: str, proxy: TcpProxy | None = None, start: bool = True,
                api: kubernetes.client.CoordinationV1Api | None = None, **kwargs) -> LeaderElector:
        kwargs = {"lease_seconds": LEASE, "renew_deadline": DEADLINE, "retry_period": RETRY, **kwargs}
        api = api or coordination(self.plane, proxy.port if proxy else None)
        elector = LeaderElector(api, namespace=self.namespace, name=LEASE_NAME, identity=identity, **kwargs)
        self.electors.append(elector)
        if start:
            self.tasks[identity] = asyncio.create_task(elector.run(), name=f"elector-{identity}")
        return elector

    async def stop(self, elector: LeaderElector) -> float:
        """Cancel the elector's run(); the seconds it took to return."""
        task = self.tasks.pop(elector.identity)
        started = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return time.monotonic() - started

    async def lease(self) -> kubernetes.client.V1LeaseSpec:
        lease = await asyncio.to_thread(self.view.read_namespaced_lease, LEASE_NAME, self.namespace,
                                        _request_timeout=(5, 5))
        return lease.spec

    def assert_never_two_leaders(self) -> None:
        assert len(self.samples) > 10
        both = [(round(t - self.samples[0][0], 1), who) for t, who in self.samples if len(who) > 1]
        assert both == [], f"two leaders at once: {both[:5]}"

    async def close(self) -> None:
        for task in [self._sampler, *self.tasks.values()]:
            task.cancel()
        await asyncio.gather(self._sampler, *self.tasks.values(), return_exceptions=True)
        for proxy in self.proxies:
            proxy.close()
        for elector in self.electors:
            elector.coordination.api_client.close()
        self.view.api_client.close()


@pytest.fixture
async def campaign(kube_control_plane, kube_namespace):
    campaign = Campaign(kube_control_plane, kube_namespace)
    try:
        yield campaign
    finally:
        await campaign.close()


def test_timings_are_validated():
    api = SimpleNamespace(api_client=None)
    with pytest.raises(ValueError, match="renew_deadline"):
        LeaderElector(api, namespace="ns", name="lease", lease_seconds=10, renew_deadline=10)
    with pytest.raises(ValueError, match="retry_period"):
        LeaderElector(api, namespace="ns", name="lease", lease_seconds=10, renew_deadline=2, retry_period=2)
    elector = LeaderElector(api, namespace="ns", name="lease", lease_seconds=6, renew_deadline=4, retry_period=1)
    assert elector.request_timeout == (1.0, 1.0) and not elector.is_leader and elector.healthy()


async def test_one_leader_renews_and_keeps_its_acquire_time(campaign):
    a = campaign.elector("a", proxy=campaign.proxy())
    await until(lambda: a.is_leader, 10, "a leads")
    first = await campaign.lease()
    assert (first.holder_identity, first.lease_transitions, first.lease_duration_seconds) == ("a", 0, 6)
    assert first.acquire_time is not None

    b = campaign.elector("b")  # direct connection
    await until(lambda: b.holder == "a", 5, "b sees a holding the Lease")

    renewals = [first.renew_time]
    deadline = time.monotonic() + 10
    while len(renewals) < 4:  # three renewals after the acquisition
        assert time.monotonic() < deadline, f"renewTime moved only {len(renewals) - 1} times: {renewals}"
        spec = await campaign.lease()
        assert (spec.holder_identity, spec.lease_transitions, spec.acquire_time) == ("a", 0, first.acquire_time)
        if spec.renew_time != renewals[-1]:
            assert spec.renew_time > renewals[-1]
            renewals.append(spec.renew_time)
        assert a.is_leader and not b.is_leader
        await asyncio.sleep(0.2)
    gaps = [(later - earlier).total_seconds() for earlier, later in zip(renewals, renewals[1:])]
    print(f"renewal gaps: {[round(g, 2) for g in gaps]} s")
    assert all(0.5 < g < 2 * RETRY + 0.5 for g in gaps), gaps
    assert a.healthy() and b.healthy()
    campaign.assert_never_two_leaders()


async def test_cut_leader_stands_down_before_the_takeover_and_rejoins_as_follower(campaign):
    proxy = campaign.proxy()
    a = campaign.elector("a", proxy=proxy)
    await until(lambda: a.is_leader, 10, "a leads")
    b = campaign.elector("b")
    await until(lambda: b.holder == "a", 5, "b sees a holding the Lease")
    acquired = (await campaign.lease()).acquire_time

    cut = time.monotonic()
    proxy.cut(drop_existing=False)  # blackhole: the kept-alive connection goes silent, new ones hang
    await until(lambda: not a.is_leader, DEADLINE + 2, "a stands down")
    a_off = time.monotonic() - cut
    assert a_off <= DEADLINE + 1.0, a_off
    assert not b.is_leader  # nobody leads in between
    assert a.healthy()  # still within lease_seconds of its last round trip

    await until(lambda: b.is_leader, LEASE + 3, "b takes over")
    b_on = time.monotonic() - cut
    assert a_off < b_on and b_on >= LEASE - RETRY - 0.5, (a_off, b_on)
    spec = await campaign.lease()
    assert (spec.holder_identity, spec.lease_transitions) == ("b", 1)
    assert spec.acquire_time > acquired

    await asyncio.sleep(max(0.0, cut + LEASE + 1 - time.monotonic()))
    assert a.healthy(), a.problem()  # cut off for longer than a lease: not leading, yet live
    print(f"after the cut: a stood down at {a_off:.1f} s, b took over at {b_on:.1f} s")

    restored = time.monotonic()
    proxy.restore()
    await until(lambda: a.healthy() and a.holder == "b", 2 * RETRY + 5, "a back as a healthy follower")
    rejoined = time.monotonic() - restored
    watch_until = time.monotonic() + LEASE + RETRY  # long enough to steal it if it ignored b's renewals
    while time.monotonic() < watch_until:
        assert not a.is_leader and b.is_leader
        spec = await campaign.lease()
        assert (spec.holder_identity, spec.lease_transitions) == ("b", 1)
        await asyncio.sleep(0.5)
    assert a.healthy()

    stopped = time.monotonic()
    await campaign.stop(b)  # b vanishes without releasing: a leads again once the lease runs out
    await until(lambda: a.is_leader, LEASE + 3, "a leads again")
    again = time.monotonic() - stopped
    assert again >= LEASE - RETRY - 0.5, again
    spec = await campaign.lease()
    assert (spec.holder_identity, spec.lease_transitions) == ("a", 2)
    print(f"a rejoined as follower {rejoined:.1f} s after the restore, led again {again:.1f} s after b stopped")
    campaign.assert_never_two_leaders()


@pytest.mark.parametrize("outage", ["blackholed", "refused"])
async def test_an_unreachable_api_server_ends_the_leadership_not_the_liveness(campaign, outage):
    """The API server out of reach for twice the lease, its connections hanging or reset: the
    leader stands down by its renew deadline and stays live all along (a restart cannot bring
    the server back); once the server is back the same elector leads again at once, since the
    Lease still names it."""
    proxy = campaign.proxy()
    a = campaign.elector("a", proxy=proxy)
    await until(lambda: a.is_leader, 10, "a leads")

    cut = time.monotonic()
    proxy.cut(drop_existing=False) if outage == "blackholed" else proxy.refuse()
    stood_down = None
    while (elapsed := time.monotonic() - cut) < 2 * LEASE:
        assert a.healthy(), f"{outage}: a unhealthy {elapsed:.1f} s into the outage: {a.problem()}"
        if stood_down is None and not a.is_leader:
            stood_down = elapsed
        await asyncio.sleep(0.1)
    assert stood_down is not None and stood_down <= DEADLINE + 1.0, stood_down

    restored = time.monotonic()
    proxy.restore()
    await until(lambda: a.is_leader, 2 * RETRY + a.call_timeout + 1, "a leads again")
    back = time.monotonic() - restored
    spec = await campaign.lease()
    assert (spec.holder_identity, spec.lease_transitions) == ("a", 0)  # renewed its own Lease: no takeover
    assert a.healthy() and not campaign.tasks["a"].done()  # the same run(), never restarted
    print(f"{outage} for {2 * LEASE:g} s: a stood down at {stood_down:.1f} s, stayed live, "
          f"led again {back:.1f} s after the restore")
    campaign.assert_never_two_leaders()


@pytest.mark.parametrize("revoked", ["RoleBinding deleted", "ServiceAccount deleted"])
async def test_refused_lease_calls_fail_the_liveness_after_refused_after(campaign, revoked, caplog):
    """The API server answers every Lease call 403 (RBAC removed) or 401 (the token's
    ServiceAccount deleted): live for refused_after, then not; once the calls are allowed
    again (a restart would re-read the mounted token) the elector is live and leads."""
    plane, ns, name = campaign.plane, campaign.namespace, "elector"
    refused_after = 3.0
    a = campaign.elector("a", api=as_service_account(plane, ns, name), refused_after=refused_after)
    await until(lambda: a.is_leader, 10, "a leads as its ServiceAccount")
    status = 403 if revoked == "RoleBinding deleted" else 401
    plane.kubectl("delete", "rolebinding" if status == 403 else "serviceaccount", name, "-n", ns)
    # the API server caches a token's authentication for 10 s: the 401s start within that
    await until(lambda: a.facts().refused_since is not None, 12 + 2 * RETRY + a.call_timeout, f"a refused ({status})")
    refused = time.monotonic()
    assert f"call failed: {status} " in caplog.text, caplog.text
    while time.monotonic() - refused < refused_after - 0.5:
        assert a.healthy(), a.problem()  # refused, but not for long yet
        await asyncio.sleep(0.1)
    await until(lambda: not a.healthy(), 1.5, "a unhealthy")
    assert not a.is_leader and "401/403" in (a.problem() or "")
    took = time.monotonic() - refused

    if status == 403:
        plane.kubectl("create", "rolebinding", name, "-n", ns, f"--role={name}", f"--serviceaccount={ns}:{name}")
    else:  # a new ServiceAccount of the same name, and its token where the client reads it
        plane.kubectl("create", "serviceaccount", name, "-n", ns)
        token = service_account_token(plane, ns, name)
        a.coordination.api_client.configuration.api_key["authorization"] = "Bearer " + token
    await until(lambda: a.healthy() and a.is_leader, 2 * RETRY + a.call_timeout + 1, "a live and leading again")
    print(f"{revoked}: {status} for {took:.1f} s before the liveness failed (refused_after {refused_after:g} s)")


async def test_cancel_and_release_return_promptly_while_blackholed(campaign):
    proxy = campaign.proxy()
    a = campaign.elector("a", proxy=proxy, request_timeout=(30.0, 30.0))  # a call would hang for 30 s
    await until(lambda: a.is_leader, 10, "a leads")
    proxy.cut(drop_existing=False)
    await until(lambda: not a.is_leader, DEADLINE + 2, "a stands down while its renewal hangs")
    took = await campaign.stop(a)
    assert took < 1.0, took
    assert not a.healthy()  # run() has stopped

    started = time.monotonic()
    assert await a.release(timeout=2.0) is False  # cannot reach the server; never raises
    release_took = time.monotonic() - started
    assert release_took < 2.5, release_took

    c = campaign.elector("c", proxy=proxy, start=False)  # default timeouts, same dead route
    started = time.monotonic()
    assert await c.release() is False
    default_took = time.monotonic() - started
    assert default_took <= c.release_timeout, (default_took, c.release_timeout)
    assert (await campaign.lease()).holder_identity == "a"  # nothing reached the server
    print(f"blackholed: cancel {took * 1000:.0f} ms, release(timeout=2) {release_took:.1f} s, "
          f"release() {default_took:.1f} s (bound {c.release_timeout:g} s)")


async def test_release_only_by_the_holder(campaign):
    a = campaign.elector("a")
    await until(lambda: a.is_leader, 10, "a leads")
    b = campaign.elector("b")
    await until(lambda: b.holder == "a", 5, "b sees a holding the Lease")
    before = await campaign.lease()

    assert await b.release() is False  # not b's to release
    spec = await campaign.lease()
    assert spec.holder_identity == "a" and spec.acquire_time == before.acquire_time
    await until(lambda: a.is_leader and not b.is_leader, 1, "a still leads")

    assert await campaign.stop(a) < 1.0  # the operator's shutdown: stop campaigning, then release
    assert not a.is_leader
    released = time.monotonic()
    assert await a.release() is True
    spec = await campaign.lease()
    assert not spec.holder_identity or (spec.holder_identity, spec.lease_transitions) == ("b", 1)
    await until(lambda: b.is_leader, 2 * RETRY + 1.5, "b takes over the released Lease")
    took = time.monotonic() - released
    spec = await campaign.lease()
    assert (spec.holder_identity, spec.lease_transitions) == ("b", 1)

    # b releases while its run() goes on: it never campaigns again, c takes the Lease
    c = campaign.elector("c")
    await until(lambda: c.holder == "b", 5, "c sees b holding the Lease")
    assert await b.release() is True
    assert not b.is_leader
    await until(lambda: c.is_leader, 2 * RETRY + 1.5, "c takes over the released Lease")
    spec = await campaign.lease()
    assert (spec.holder_identity, spec.lease_transitions) == ("c", 2)
    assert not b.is_leader and b.healthy()  # a healthy follower for good
    print(f"b took over {took:.1f} s after a released (lease {LEASE:g} s)")
    campaign.assert_never_two_leaders()


SIGTERM_SCRIPT = r"""
import asyncio, signal, sys
import kubernetes
from effectmq_operator.runtime.leader import LeaderElector

port, ca, cert, key, namespace = sys.argv[1:]

async def main():
    config = kubernetes.client.Configuration()
    config.host = f"https://127.0.0.1:{port}"
    config.ssl_ca_cert, config.cert_file, config.key_file = ca, cert, key
    elector = LeaderElector(kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient(config)),
                            namespace=namespace, name="effectmq-operator", identity="p", lease_seconds=6,
                            renew_deadline=4, retry_period=1, request_timeout=(30, 30))
    elector.on_started_leading = lambda: print("leading", flush=True)
    elector.on_stopped_leading = lambda: print("stopped", flush=True)
    task = asyncio.create_task(elector.run())
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        pass
    await elector.release(timeout=1)
    print("exiting", flush=True)

asyncio.run(main())
"""


async def test_sigterm_exits_promptly_while_a_lease_call_hangs(campaign, tmp_path):
    plane = campaign.plane
    proxy = campaign.proxy()
    out = tmp_path / "elector.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), os.environ.get("PYTHONPATH", "")])}
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(proxy.port), str(plane.ca_file),
                                 str(plane.admin_cert), str(plane.admin_key), campaign.namespace],
                                stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        await until(lambda: "leading" in out.read_text(), 20, "the child leads")
        proxy.cut(drop_existing=False)
        await until(lambda: "stopped" in out.read_text(), DEADLINE + 2, "the child stands down")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await until(lambda: proc.poll() is not None, 10, "the child exits")
        took = time.monotonic() - started
        assert proc.returncode == 0, out.read_text()
        assert "exiting" in out.read_text()
        assert took < 3.0, took
        print(f"SIGTERM to exit with a renewal hanging: {took:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
