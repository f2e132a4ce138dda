"""The node's network namespace: a run that was killed leaves it behind, and the next
run must take it back instead of refusing; a namespace a live node still uses is
never taken. Own namespace names and addresses, so a real cluster can stay up."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tooling.testbed.cluster import NodeNetwork

pytestmark = pytest.mark.skipif(
    os.environ.get("CI") != "true" and (os.geteuid() != 0 or shutil.which("ip") is None),
    reason="network namespaces need root and iproute2",
)


@pytest.fixture
def network():
    net = NodeNetwork(namespace=f"emqt-{os.getpid() % 100000}", host_ip="10.251.0.1", node_ip="10.251.0.2")
    net.destroy()
    yield net
    net.destroy()


def _host_addresses() -> str:
    return subprocess.run(["ip", "-4", "addr"], check=True, capture_output=True, text=True).stdout


def test_a_namespace_left_by_a_killed_run_is_taken_back(network):
    # what a SIGKILLed run leaves: the namespace and the host end of its veth pair
    network.create()
    assert network.exists()

    network.create()

    assert network.exists()
    assert network.node_ip in subprocess.run(network.inside(["ip", "-4", "addr"]), check=True,
                                              capture_output=True, text=True).stdout
    assert _host_addresses().count(f"{network.host_ip}/") == 1


def test_a_namespace_a_live_node_uses_is_never_taken(network):
    network.create()
    holder = subprocess.Popen(network.inside(["sleep", "60"]))
    try:
        # nsenter enters the namespace some time after Popen returns (long on a loaded machine)
        deadline = time.monotonic() + 30
        while not network.processes_inside():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never entered the namespace"
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="another cluster is up"):
            network.create()
        assert holder.poll() is None
        assert network.exists()
    finally:
        holder.kill()
        holder.wait()
