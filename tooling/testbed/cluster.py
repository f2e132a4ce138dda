"""A one-node Kubernetes cluster on this machine, without Docker: pods really run.

The control plane of ``tooling/testbed/controlplane.py`` (etcd, kube-apiserver,
kube-controller-manager) plus kube-scheduler, and one node: containerd and runc
(Debian's packages), the CNI bridge plugin, kubelet, kube-proxy (iptables) and
CoreDNS, built from Go modules by ``tooling/node/build.sh``.

Networking stays off the host: the node lives in a network namespace this module
creates (``emq-node``), joined to the host by one veth pair. The API server
listens on the host end (10.250.0.1), the node is 10.250.0.2, pods get addresses
from a bridge inside the node's namespace (10.244.0.0/24), masqueraded when they
leave it; kube-proxy's and the bridge's iptables rules live in that namespace
only. CoreDNS runs as a process in the node's namespace and answers the node's
address on port 53 (``cluster.local``); the kubelet points pods at it.

Images come from OCI archives (``tooling/images.sh``), imported into containerd
under the names a pod spec uses. The pod sandbox image is a static ``pause``
compiled here (no registry serves one). Storage: a default StorageClass with
pre-made hostPath PersistentVolumes, so the chart's Redis gets its PVC.

One property of this machine is handled in configuration, not code: it refuses a
negative ``oom_score_adj`` even to root, and the kubelet asks -998 for the pod
sandbox; containerd's ``restrict_oom_score_adj`` clamps it to containerd's own (0).

Use it from pytest (fixture ``kube_cluster`` in ``tests/fixtures/node.py``) or by
hand: ``bash tooling/cluster.sh up|down|status`` runs ``python -m
tooling.testbed.cluster``, which keeps the cluster running after it exits and
records its processes in ``<state dir>/state.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NoReturn, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `tooling` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tooling.testbed import REPO_ROOT, Unavailable, cache_dir
from tooling.testbed.controlplane import (
    KubeControlPlane,
    ProcessExited,
    _write_kubeconfig,
    raise_unavailable,
    tail,
    wait_until,
)
from tooling.testbed.oci import write_single_binary_image

NODE_BUILD_COMMAND = "bash tooling/node/build.sh"
IMAGES_BUILD_COMMAND = "bash tooling/images.sh"
NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-proxy", "coredns")
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "iptables", "nsenter", "ip", "gcc")
CNI_BIN_DIR = Path("/usr/lib/cni")
NODE_NAME = "effectmq-node"
PAUSE_IMAGE = "localhost/effectmq-pause:1"
PAUSE_SOURCE = REPO_ROOT / "tooling" / "images" / "pause.c"
CLUSTER_DOMAIN = "cluster.local"
PERSISTENT_VOLUMES = 6
BRIDGE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"
STARTUP_TIMEOUT = float(os.environ.get("EFFECTMQ_KUBE_STARTUP_TIMEOUT", "180"))


def normalized_reference(name: str) -> str:
    """The image name a kubelet asks containerd for: Docker's short forms expanded
    (``redis:7`` names ``<default registry>/library/redis:7``)."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return name
    path = name if rest else f"library/{name}"
    return f"docker.io/{path}"


@dataclass
class NodeNetwork:
    """The node's network namespace and the veth pair that joins it to the host."""

    namespace: str = "emq-node"
    host_ip: str = "10.250.0.1"
    node_ip: str = "10.250.0.2"
    prefix: int = 30
    pod_cidr: str = "10.244.0.0/24"
    bridged_iptables: bool = field(default=True, compare=False)

    @property
    def host_link(self) -> str:
        return f"{self.namespace}-h"[:15]

    def inside(self, argv: Sequence[str]) -> list[str]:
        """argv run in the node's network namespace only (host mounts and PIDs)."""
        return ["nsenter", f"--net=/run/netns/{self.namespace}", *map(str, argv)]

    def exists(self) -> bool:
        return Path(f"/run/netns/{self.namespace}").exists()

    def processes_inside(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def create(self) -> None:
        if self.exists():
            holders = self.processes_inside()
            if holders:
                raise RuntimeError(
                    f"network namespace {self.namespace} exists and {len(holders)} processes run in it: "
                    f"another cluster is up (`bash tooling/cluster.sh down` removes it)"
                )
            # no node process left in it: a run that was killed before its teardown
            self.destroy()
        ns = self.namespace
        steps = [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", self.host_link, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "addr", "add", f"{self.host_ip}/{self.prefix}", "dev", self.host_link],
            ["ip", "link", "set", self.host_link, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{self.node_ip}/{self.prefix}", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            # a default route, so Service addresses (DNAT'ed by kube-proxy) are routable
            ["ip", "-n", ns, "route", "add", "default", "via", self.host_ip],
            # routing between pods and Services (per network namespace)
            self.inside(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]),
        ]
        for argv in steps:
            subprocess.run(argv, check=True, capture_output=True, text=True)
        # bridged pod-to-pod traffic through iptables, so a pod reaches a Service
        # whose endpoint shares its bridge; without br_netfilter kube-proxy
        # masquerades all Service traffic instead (bridged_iptables is False)
        if not Path(BRIDGE_NF).exists():
            subprocess.run(["modprobe", "br_netfilter"], capture_output=True)
        self.bridged_iptables = Path(BRIDGE_NF).exists()
        if self.bridged_iptables:
            subprocess.run(self.inside(["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"]),
                           check=True, capture_output=True, text=True)

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)


@dataclass
class ClusterState:
    """What `down` needs after the process that started the cluster is gone."""

    work_dir: str
    kubeconfig: str
    server: str
    network: dict
    pids: dict[str, int] = field(default_factory=dict)


def missing_host_tools() -> list[str]:
    missing = [tool for tool in HOST_TOOLS if shutil.which(tool) is None]
    missing += [f"{CNI_BIN_DIR}/{p}" for p in ("bridge", "host-local", "loopback", "portmap")
                if not (CNI_BIN_DIR / p).exists()]
    return missing


class OneNodeCluster:
    """Control plane + scheduler on the host, one node in its own network namespace."""

    def __init__(
        self,
        controlplane_bin: Path,
        node_bin: Path,
        work_dir: Path,
        log_dir: Path,
        image_archives: Sequence[Path] = (),
        network: Optional[NodeNetwork] = None,
        unavailable: Callable[[str], NoReturn] = raise_unavailable,
    ) -> None:
        self.node_bin = node_bin
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.image_archives = list(image_archives)
        self.network = network or NodeNetwork()
        self.plane = KubeControlPlane(
            bin_dir=controlplane_bin,
            work_dir=work_dir,
            log_dir=log_dir,
            address=self.network.host_ip,
            clients=(
                ("scheduler", "system:kube-scheduler", None),
                ("kubelet", f"system:node:{NODE_NAME}", "system:nodes"),
                ("proxy", "system:kube-proxy", None),
            ),
            unavailable=unavailable,
        )
        self.network_owned = False  # destroyed on stop only if this cluster made it
        self.containerd_dir = work_dir / "containerd"
        self.containerd_socket = self.containerd_dir / "containerd.sock"
        # one <host:port>/hosts.toml per registry, read at each pull (e.g. a loopback
        # registry over plain HTTP: tests/cluster/registry.py)
        self.registry_hosts_dir = self.containerd_dir / "certs.d"

    # ---- conveniences for tests

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    def kubectl(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.plane.kubectl(*args, **kwargs)

    def kubectl_json(self, *args: str, **kwargs) -> dict:
        return self.plane.kubectl_json(*args, **kwargs)

    def helm(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return self.plane.helm(*args, **kwargs)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args],
            check=check, capture_output=True, text=True, timeout=300,
        )

    def on_node(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run a command on the node (its network: Service and pod addresses work)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.network.inside(argv), **kwargs)

    # ---- lifecycle

    def start(self) -> None:
        missing = missing_host_tools()
        if missing:
            raise RuntimeError(f"missing on this machine: {', '.join(missing)}")
        if os.geteuid() != 0:
            raise RuntimeError("the one-node cluster needs root (a network namespace, containerd, cgroups)")
        self.network.create()
        self.network_owned = True
        self.plane.start()
        self._write_client_kubeconfigs()
        self._start_scheduler()
        self._start_containerd()
        self._import_images()
        self._start_kubelet()
        self._start_kube_proxy()
        self._start_coredns()
        self._wait_node_ready()
        self._create_storage()

    def _client_kubeconfig(self, stem: str, user: str) -> Path:
        path = self.work_dir / f"{stem}.kubeconfig"
        certs = self.plane.certs
        _write_kubeconfig(path, self.plane.server, certs["ca.crt"], certs[f"{stem}.crt"],
                          certs[f"{stem}.key"], user)
        return path

    def _write_client_kubeconfigs(self) -> None:
        self.scheduler_kubeconfig = self._client_kubeconfig("scheduler", "system:kube-scheduler")
        self.kubelet_kubeconfig = self._client_kubeconfig("kubelet", f"system:node:{NODE_NAME}")
        self.proxy_kubeconfig = self._client_kubeconfig("proxy", "system:kube-proxy")

    def _start_scheduler(self) -> None:
        self.plane._spawn("kube-scheduler", [
            str(self.node_bin / "kube-scheduler"),
            f"--kubeconfig={self.scheduler_kubeconfig}",
            f"--authentication-kubeconfig={self.scheduler_kubeconfig}",
            f"--authorization-kubeconfig={self.scheduler_kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
            "--profiling=false",
            "--v=1",
        ])

    def _start_containerd(self) -> None:
        d = self.containerd_dir
        cni_conf = self.work_dir / "cni" / "net.d"
        cni_conf.mkdir(parents=True)
        (cni_conf / "10-effectmq.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0",
            "name": "effectmq",
            "plugins": [
                {
                    "type": "bridge", "bridge": "emq0", "isGateway": True, "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {"type": "host-local", "ranges": [[{"subnet": self.network.pod_cidr}]],
                             "routes": [{"dst": "0.0.0.0/0"}],
                             "dataDir": str(self.work_dir / "cni" / "ipam")},
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }, indent=2))
        d.mkdir(parents=True, exist_ok=True)
        self.registry_hosts_dir.mkdir(exist_ok=True)
        config = d / "config.toml"
        config.write_text(f"""version = 2
root = "{d}/root"
state = "{d}/state"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]
[grpc]
  address = "{self.containerd_socket}"
[ttrpc]
  address = "{self.containerd_socket}.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # this machine refuses a negative oom_score_adj (the kubelet asks -998 for a
  # sandbox): clamp to containerd's own
  restrict_oom_score_adj = true
  # pod network namespaces under our state dir, not /run/netns
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{self.registry_hosts_dir}"
""")
        self.plane._spawn("containerd", self.network.inside(["containerd", f"--config={config}"]))

        def answering() -> bool:
            self.plane._check_alive()
            return self.ctr("version", check=False).returncode == 0

        wait_until(answering, STARTUP_TIMEOUT, "containerd")

    def _pause_archive(self) -> Path:
        build = self.work_dir / "pause"
        build.mkdir()
        binary = build / "pause"
        subprocess.run(["gcc", "-static", "-O2", "-s", "-o", str(binary), str(PAUSE_SOURCE)],
                       check=True, capture_output=True, text=True)
        archive = build / "pause.tar"
        write_single_binary_image(binary, "/pause", PAUSE_IMAGE, archive)
        return archive

    def _import_images(self) -> None:
        for archive in [self._pause_archive(), *self.image_archives]:
            self.import_image(archive)

    def import_image(self, archive: Path) -> list[str]:
        """Import an OCI archive; returns the names pods can use for it."""
        before = set(self.ctr("images", "ls", "-q").stdout.split())
        self.ctr("images", "import", "--no-unpack", str(archive))
        names = [n for n in set(self.ctr("images", "ls", "-q").stdout.split()) - before
                 if not n.startswith("sha256:")]
        if not names:  # re-imported: find its name in the archive
            with tarfile.open(archive) as tar:
                index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
            names = [m["annotations"]["org.opencontainers.image.ref.name"]
                     for m in index["manifests"]]
        result = []
        for name in names:
            full = normalized_reference(name)
            if full != name:
                self.ctr("images", "tag", "--force", name, full)
            result.append(full)
        return result

    def _start_kubelet(self) -> None:
        root = self.work_dir / "kubelet"
        root.mkdir()
        resolv = self.work_dir / "resolv.conf"
        resolv.write_text(f"nameserver {self.network.node_ip}\n")
        config = self.work_dir / "kubelet.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.plane.ca_file)},
            },
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "clusterDNS": [self.network.node_ip],
            "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(resolv),
            "podLogsDir": str(self.work_dir / "pod-logs"),
            # this machine refuses negative values (see the module docstring)
            "oomScoreAdj": 0,
            # imported images are never pulled again: never collect them
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%"},
            "serializeImagePulls": False,
            "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False,
        }, indent=2))
        self.plane._spawn("kubelet", self.network.inside([
            str(self.node_bin / "kubelet"),
            f"--config={config}",
            f"--kubeconfig={self.kubelet_kubeconfig}",
            f"--root-dir={root}",
            f"--cert-dir={root / 'pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={self.network.node_ip}",
            "--v=1",
        ]))

    def _start_kube_proxy(self) -> None:
        config = self.work_dir / "kube-proxy.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.proxy_kubeconfig)},
            "mode": "iptables",
            "clusterCIDR": self.network.pod_cidr,
            "hostnameOverride": NODE_NAME,
            "bindAddress": self.network.node_ip,
            "healthzBindAddress": f"{self.network.node_ip}:10256",
            "metricsBindAddress": f"{self.network.node_ip}:10249",
            # leave the machine-wide conntrack table size alone
            "conntrack": {"maxPerCore": 0, "min": 0},
            "masqueradeAll": not self.network.bridged_iptables,
        }, indent=2))
        self.plane._spawn("kube-proxy", self.network.inside([
            str(self.node_bin / "kube-proxy"), f"--config={config}", "--v=1",
        ]))

    def _start_coredns(self) -> None:
        corefile = self.work_dir / "Corefile"
        ip = self.network.node_ip
        corefile.write_text(f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {ip}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.plane.kubeconfig}
        pods insecure
    }}
    cache 5
}}
.:53 {{
    bind {ip}
    errors
    # no upstream resolver on this network: everything else does not exist
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
""")
        self.plane._spawn("coredns", self.network.inside([
            str(self.node_bin / "coredns"), "-conf", str(corefile),
        ]))

    def _wait_node_ready(self) -> None:
        def ready() -> bool:
            self.plane._check_alive()
            result = self.kubectl(
                "get", "node", NODE_NAME, "-o",
                "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False,
            )
            return result.stdout.strip() == "True"

        wait_until(ready, STARTUP_TIMEOUT, f"node {NODE_NAME} Ready")

    def _create_storage(self) -> None:
        """A default StorageClass and hostPath volumes for PersistentVolumeClaims."""
        volumes = self.work_dir / "volumes"
        items: list[dict] = [{
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": "standard", "annotations": {
                "storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Retain",
        }]
        for i in range(PERSISTENT_VOLUMES):
            path = volumes / f"pv-{i}"
            path.mkdir(parents=True)
            path.chmod(0o777)  # hostPath ignores fsGroup: any pod user may write
            items.append({
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"local-{i}"},
                "spec": {
                    "capacity": {"storage": "10Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "standard",
                    "hostPath": {"path": str(path), "type": "Directory"},
                },
            })
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    # ---- reports and teardown

    def report(self, error: BaseException) -> str:
        return self.plane.startup_report(error).replace(
            "Kubernetes control plane failed", "one-node cluster failed", 1)

    def state(self) -> ClusterState:
        return ClusterState(
            work_dir=str(self.work_dir),
            kubeconfig=str(self.kubeconfig),
            server=self.plane.server,
            network=asdict(self.network) if self.network_owned else {},
            pids={p.name: p.popen.pid for p in self.plane.procs},
        )

    def stop(self) -> None:
        teardown(self.state())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_groups(pids: Sequence[int], timeout: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)
            for pid in pids:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text`` (containerd's shims and containers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def _unmount_under(root: str) -> None:
    """Unmount everything mounted below ``root``, deepest first."""
    prefix = root.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted({p for p in points if p.startswith(prefix)}, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _pod_cgroups() -> list[Path]:
    """The kubelet's cgroups (cgroupfs driver, every hierarchy), deepest first."""
    base = Path("/sys/fs/cgroup")
    found: list[Path] = []
    for hierarchy in base.iterdir() if base.exists() else []:
        top = hierarchy / "kubepods"
        if top.is_dir():  # os.walk: containers still exiting remove their cgroups under it
            found += [top, *(Path(d) / n for d, names, _ in os.walk(top) for n in names)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _kill_pod_processes() -> None:
    """Every process in a pod's cgroup: containers outlive their shims otherwise."""
    for _ in range(50):
        pids = set()
        for cgroup in _pod_cgroups():
            try:
                pids |= {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove_pod_cgroups() -> None:
    for cgroup in _pod_cgroups():
        try:
            cgroup.rmdir()
        except OSError:
            pass


def teardown(state: ClusterState) -> None:
    """Stop every process of the cluster, its containers, mounts and network."""
    pids = state.pids
    order = ["coredns", "kube-proxy", "kubelet", "kube-scheduler"]
    _kill_groups([pids[n] for n in order if n in pids], timeout=10)
    # containers and their shims (they outlive containerd by design)
    socket = str(Path(state.work_dir) / "containerd" / "containerd.sock")
    shims = _processes_mentioning(socket)
    _kill_pod_processes()
    if "containerd" in pids:
        _kill_groups([pids["containerd"]], timeout=10)
    for pid in shims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    rest = [pids[n] for n in ("kube-controller-manager", "kube-apiserver", "etcd") if n in pids]
    _kill_groups(rest, timeout=15)
    _unmount_under(state.work_dir)
    _remove_pod_cgroups()
    if state.network:  # not another cluster's, when ours never got to make one
        NodeNetwork(**state.network).destroy()


# --------------------------------------------------------------------------
# `python -m tooling.testbed.cluster up|down|status` (what tooling/cluster.sh runs)


def locate(env: str, sub: str, names: Sequence[str], build: str, what: str = "binaries") -> Path:
    """``$env``, else ``<cache>/<sub>/current``; :class:`Unavailable` when one of ``names`` is missing."""
    path = Path(os.environ[env]) if os.environ.get(env) else cache_dir() / sub / "current"
    missing = [n for n in names if not os.access(path / n, os.X_OK)]
    if missing:
        raise Unavailable(f"{what} missing in {path}: {', '.join(missing)}; build them with `{build}`")
    return path.resolve()


def locate_node_bin() -> Path:
    return locate("EFFECTMQ_NODE_BIN", "node", NODE_BINARIES, NODE_BUILD_COMMAND, what="node binaries")


def image_archives() -> list[Path]:
    current = cache_dir() / "images" / "current"
    return sorted(current.glob("*.tar"))


def _cli_up(state_file: Path) -> int:
    if state_file.exists():
        print(f"a cluster is already up (state in {state_file}); `down` first", file=sys.stderr)
        return 1
    archives = image_archives()
    if not archives:
        print(f"no image archives in {cache_dir() / 'images' / 'current'} "
              f"(build with `{IMAGES_BUILD_COMMAND}`)", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="emq-cluster-"))
    logs = work / "logs"
    logs.mkdir()
    try:
        controlplane_bin = locate("EFFECTMQ_CONTROLPLANE_BIN", "controlplane",
                                  ("etcd", "kube-apiserver", "kubectl", "helm"), "bash tooling/controlplane/build.sh",
                                  what="control plane binaries")
        node_bin = locate_node_bin()
    except Unavailable as exc:
        raise SystemExit(str(exc)) from None
    cluster = OneNodeCluster(controlplane_bin, node_bin, work, logs, archives)
    try:
        cluster.start()
    except (Exception, ProcessExited) as exc:  # reported, then cleaned
        print(cluster.report(exc), file=sys.stderr)
        cluster.stop()
        return 1
    state_file.parent.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(asdict(cluster.state()), indent=2))
    kubeconfig = state_file.parent / "kubeconfig"
    shutil.copyfile(cluster.kubeconfig, kubeconfig)
    kubeconfig.chmod(0o600)
    print(f"cluster up: node {NODE_NAME} Ready, API server {cluster.plane.server}", file=sys.stderr)
    print(f"logs in {logs}", file=sys.stderr)
    print(f"export KUBECONFIG={kubeconfig}")
    return 0


def _cli_down(state_file: Path) -> int:
    if not state_file.exists():
        print("no cluster is up", file=sys.stderr)
        NodeNetwork().destroy()  # a namespace left by a crashed `up`
        return 0
    state = ClusterState(**json.loads(state_file.read_text()))
    teardown(state)
    shutil.rmtree(state.work_dir, ignore_errors=True)
    state_file.unlink()
    (state_file.parent / "kubeconfig").unlink(missing_ok=True)
    print("cluster down", file=sys.stderr)
    return 0


def _cli_status(state_file: Path) -> int:
    if not state_file.exists():
        print("no cluster is up")
        return 1
    state = ClusterState(**json.loads(state_file.read_text()))
    ok = True
    for name, pid in state.pids.items():
        alive = _pid_alive(pid)
        ok &= alive
        print(f"{name:24} {'running' if alive else 'EXITED'} (pid {pid})")
        if not alive:
            print(tail(Path(state.work_dir) / "logs" / f"{name}.log", 5))
    print(f"export KUBECONFIG={state_file.parent / 'kubeconfig'}")
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tooling/cluster.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument("--state-dir", type=Path, default=cache_dir() / "cluster")
    args = parser.parse_args(argv)
    state_file = args.state_dir / "state.json"
    return {"up": _cli_up, "down": _cli_down, "status": _cli_status}[args.command](state_file)


if __name__ == "__main__":
    sys.exit(main())
