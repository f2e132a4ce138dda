"""A real Kubernetes control plane on this machine, without Docker.

Starts etcd, kube-apiserver (RBAC on, certificates and service-account keys
made on the fly) and kube-controller-manager, built from Go modules by
``tooling/controlplane/build.sh`` into a per-machine cache: a
:class:`KubeControlPlane` with ``.kubeconfig``, ``.server``, ``.bin_dir``,
``.kubectl(...)``, ``.helm(...)``. The pytest fixtures over it are in
``tests/fixtures/kube.py``.

Binaries come from ``$EFFECTMQ_CONTROLPLANE_BIN``, else from
``${EFFECTMQ_CACHE:-~/.cache/effectmq}/controlplane/current``
(:func:`locate_bin_dir`).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn, Optional, Sequence, TypeVar

from tooling.testbed import REPO_ROOT, Unavailable, cache_dir

CRDS_DIR = REPO_ROOT / "crds"
BUILD_COMMAND = "bash tooling/controlplane/build.sh"

REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
STARTUP_TIMEOUT = float(os.environ.get("EFFECTMQ_KUBE_STARTUP_TIMEOUT", "180"))

T = TypeVar("T")


# --------------------------------------------------------------------------
# helpers


def raise_unavailable(message: str) -> NoReturn:
    raise Unavailable(message)


def default_bin_dir() -> Path:
    return cache_dir() / "controlplane" / "current"


def locate_bin_dir() -> Path:
    """The directory of the control plane binaries; :class:`Unavailable` when some are missing."""
    env = os.environ.get("EFFECTMQ_CONTROLPLANE_BIN")
    bin_dir = Path(env) if env else default_bin_dir()
    missing = [
        name for name in REQUIRED_BINARIES if not os.access(bin_dir / name, os.X_OK)
    ]
    if missing:
        source = "EFFECTMQ_CONTROLPLANE_BIN" if env else "the build cache"
        raise Unavailable(
            f"Kubernetes control plane binaries missing in {bin_dir} ({source}): "
            f"{', '.join(missing)}. Build them with `{BUILD_COMMAND}` "
            f"or point EFFECTMQ_CONTROLPLANE_BIN at a directory holding them."
        )
    return bin_dir.resolve()


def free_ports(count: int, address: str = "127.0.0.1") -> list[int]:
    """Distinct free ports on ``address`` (all held open while picking, so no repeats)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((address, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


class ProcessExited(RuntimeError):
    """A control plane process died: waiting for it any longer is pointless."""


def wait_until(
    probe: Callable[[], Optional[T]],
    timeout: float,
    what: str,
    interval: float = 0.25,
) -> T:
    """Call probe until it returns something truthy; raise TimeoutError after timeout."""
    deadline = time.monotonic() + timeout
    last_error: Optional[BaseException] = None
    while True:
        try:
            result = probe()
            if result:
                return result
        except ProcessExited:
            raise
        except Exception as exc:  # reported on timeout
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


class CommandError(subprocess.CalledProcessError):
    """A failed kubectl/helm call whose message carries its output."""

    def __str__(self) -> str:
        cmd = " ".join(str(c) for c in self.cmd)
        return (
            f"`{cmd}` exited with {self.returncode}\n"
            f"--- stdout\n{self.stdout or ''}\n--- stderr\n{self.stderr or ''}"
        )


# --------------------------------------------------------------------------
# certificates


@dataclass
class _KeyPair:
    key_pem: bytes
    cert_pem: bytes


def _ec_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _make_certs(
    directory: Path,
    address: str = "127.0.0.1",
    clients: Sequence[tuple[str, str, Optional[str]]] = (),
) -> dict[str, Path]:
    """CA, API server serving cert (for ``address`` too), admin and controller-manager
    client certs, service-account key pair, and one client cert per ``clients`` entry
    (file stem, common name, organization). Returns file paths by file name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    not_before = now - datetime.timedelta(hours=1)
    not_after = now + datetime.timedelta(days=7)

    def name(cn: str, org: Optional[str] = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = _ec_key()
    ca_name = name("effectmq-test-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(subject: x509.Name, usage, sans: Sequence[x509.GeneralName] = ()) -> _KeyPair:
        key = _ec_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_encipherment=False, key_cert_sign=False,
                    crl_sign=False, content_commitment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return _KeyPair(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))

    first_service_ip = next(ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE).hosts())
    serving = leaf(
        name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        [
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes"),
            x509.DNSName("kubernetes.default"),
            x509.DNSName("kubernetes.default.svc"),
            x509.DNSName("kubernetes.default.svc.cluster.local"),
            *{x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", address)},
            x509.IPAddress(first_service_ip),
        ],
    )
    admin = leaf(name("effectmq-test-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)
    kcm = leaf(name("system:kube-controller-manager"), ExtendedKeyUsageOID.CLIENT_AUTH)

    sa_key = _ec_key()
    sa_pub = sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )

    files = {
        "ca.crt": ca_cert.public_bytes(serialization.Encoding.PEM),
        "ca.key": _key_pem(ca_key),
        "apiserver.crt": serving.cert_pem,
        "apiserver.key": serving.key_pem,
        "admin.crt": admin.cert_pem,
        "admin.key": admin.key_pem,
        "kcm.crt": kcm.cert_pem,
        "kcm.key": kcm.key_pem,
        "sa.key": _key_pem(sa_key),
        "sa.pub": sa_pub,
    }
    for stem, cn, org in clients:
        pair = leaf(name(cn, org), ExtendedKeyUsageOID.CLIENT_AUTH)
        files[f"{stem}.crt"] = pair.cert_pem
        files[f"{stem}.key"] = pair.key_pem
    paths = {}
    for filename, data in files.items():
        path = directory / filename
        path.write_bytes(data)
        path.chmod(0o600)
        paths[filename] = path
    return paths


def _write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> None:
    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "effectmq-test",
                "cluster": {"server": server, "certificate-authority-data": b64(ca)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)},
            }
        ],
        "contexts": [
            {"name": "effectmq-test", "context": {"cluster": "effectmq-test", "user": user}}
        ],
        "current-context": "effectmq-test",
    }
    # JSON is YAML: every kubeconfig reader (kubectl, helm, kopf, the python client) takes it.
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


# --------------------------------------------------------------------------
# the control plane


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class KubeControlPlane:
    """A running etcd + kube-apiserver + kube-controller-manager.

    ``address``: where the API server listens and what it advertises. Loopback for
    the control-plane-only tests; a node's view of this host for the one-node
    cluster (tooling/testbed/cluster.py), whose pods reach it through the
    ``kubernetes`` Service. ``clients``: extra client certificates to make
    (file stem, common name, organization), for the node's components.
    ``unavailable``: called with a message when a tool it needs is missing (the
    pytest fixtures skip there; by default it raises :class:`Unavailable`).
    """

    bin_dir: Path
    work_dir: Path
    log_dir: Path
    address: str = "127.0.0.1"
    clients: Sequence[tuple[str, str, Optional[str]]] = ()
    certs: dict[str, Path] = field(default_factory=dict)
    server: str = ""
    kubeconfig: Path = Path()
    ca_file: Path = Path()
    admin_cert: Path = Path()
    admin_key: Path = Path()
    etcd_url: str = ""
    procs: list[_Proc] = field(default_factory=list)
    unavailable: Callable[[str], NoReturn] = field(default=raise_unavailable, repr=False, compare=False)

    # ---- commands

    def env(self, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
        """Environment for a child process that talks to this control plane."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        helm_home = self.work_dir / "helm"
        env["HELM_CACHE_HOME"] = str(helm_home / "cache")
        env["HELM_CONFIG_HOME"] = str(helm_home / "config")
        env["HELM_DATA_HOME"] = str(helm_home / "data")
        if extra:
            env.update(extra)
        return env

    def _run(
        self,
        argv: list[str],
        check: bool,
        input: Optional[str],
        timeout: float,
        env: Optional[dict[str, str]],
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(env),
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and result.returncode != 0:
            raise CommandError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: Optional[str] = None,
        timeout: float = 120,
        env: Optional[dict[str, str]] = None,
    ) -> subprocess.CompletedProcess:
        """Run the built kubectl as admin; raises CommandError when check and it fails."""
        argv = [
            str(self.bin_dir / "kubectl"),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.work_dir / 'kubectl-cache'}",
            *map(str, args),
        ]
        return self._run(argv, check, input, timeout, env)

    def kubectl_json(self, *args: str, **kwargs) -> dict:
        """`kubectl ... -o json`, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", **kwargs).stdout)

    def token_kubeconfig(self, token: str, name: str = "token-user") -> Path:
        """A kubeconfig that authenticates with a bearer token (e.g. from
        `kubectl create token <sa>`), to act as a ServiceAccount instead of admin.
        Pass it as KUBECONFIG, or as a later `--kubeconfig=` to kubectl()."""
        path = self.work_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', name)}.kubeconfig"
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "effectmq-test", "cluster": {"server": self.server, "certificate-authority-data": ca}}
            ],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "effectmq-test", "user": name}}],
            "current-context": name,
        }
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)
        return path

    def helm(
        self,
        *args: str,
        check: bool = True,
        input: Optional[str] = None,
        timeout: float = 300,
        env: Optional[dict[str, str]] = None,
    ) -> subprocess.CompletedProcess:
        """Run the built helm against this control plane (isolated helm home)."""
        helm = self.bin_dir / "helm"
        if not os.access(helm, os.X_OK):
            self.unavailable(f"helm missing in {self.bin_dir}; build it with `{BUILD_COMMAND}`")
        argv = [str(helm), f"--kubeconfig={self.kubeconfig}", *map(str, args)]
        return self._run(argv, check, input, timeout, env)

    # ---- lifecycle

    def _spawn(self, name: str, argv: list[str]) -> _Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
                start_new_session=True,
            )
        proc = _Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _check_alive(self) -> None:
        for proc in self.procs:
            code = proc.popen.poll()
            if code is not None:
                raise ProcessExited(f"{proc.name} exited with code {code}")

    def startup_report(self, error: BaseException) -> str:
        parts = [f"Kubernetes control plane failed to start: {error}", f"logs in {self.log_dir}"]
        for log in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- tail of {log.name}\n{tail(log)}")
        return "\n".join(parts)

    def _https_get(self, path: str) -> tuple[int, str]:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.admin_cert), str(self.admin_key))
        try:
            with urllib.request.urlopen(self.server + path, context=ctx, timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def start(self) -> None:
        pki = self.work_dir / "pki"
        pki.mkdir()
        certs = self.certs = _make_certs(pki, self.address, self.clients)
        self.ca_file = certs["ca.crt"]
        self.admin_cert = certs["admin.crt"]
        self.admin_key = certs["admin.key"]

        # etcd
        client_port, peer_port = free_ports(2)
        (secure_port,) = free_ports(1, self.address)
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._spawn(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=effectmq-test",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=effectmq-test={peer_url}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )

        def etcd_healthy() -> bool:
            self._check_alive()
            with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as resp:
                return json.loads(resp.read()).get("health") == "true"

        wait_until(etcd_healthy, STARTUP_TIMEOUT, "etcd /health")

        # kube-apiserver
        self.server = f"https://{self.address}:{secure_port}"
        loopback = ipaddress.ip_address(self.address).is_loopback
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                f"--bind-address={self.address}",
                f"--advertise-address={self.address}",
                f"--secure-port={secure_port}",
                f"--cert-dir={self.work_dir / 'apiserver-certs'}",
                f"--tls-cert-file={certs['apiserver.crt']}",
                f"--tls-private-key-file={certs['apiserver.key']}",
                f"--client-ca-file={certs['ca.crt']}",
                # Node: kubelets act only for their own node (with NodeRestriction)
                "--authorization-mode=Node,RBAC",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={certs['sa.pub']}",
                f"--service-account-signing-key-file={certs['sa.key']}",
                "--allow-privileged=true",
                # kubectl logs/exec/port-forward through a kubelet, as admin
                f"--kubelet-client-certificate={certs['admin.crt']}",
                f"--kubelet-client-key={certs['admin.key']}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                # the `kubernetes` Service cannot get 127.0.0.1 as an endpoint
                # (loopback is refused); nothing in-cluster needs it then
                f"--endpoint-reconciler-type={'none' if loopback else 'lease'}",
                "--profiling=false",
                "--v=1",
            ],
        )
        self.kubeconfig = self.work_dir / "admin.kubeconfig"
        _write_kubeconfig(
            self.kubeconfig, self.server, self.ca_file, self.admin_cert, self.admin_key,
            "effectmq-test-admin",
        )

        def apiserver_ready() -> bool:
            self._check_alive()
            status, _ = self._https_get("/readyz")
            return status == 200

        wait_until(apiserver_ready, STARTUP_TIMEOUT, "kube-apiserver /readyz")

        # kube-controller-manager (Deployments -> ReplicaSets, garbage collection,
        # namespace deletion, service accounts and their tokens)
        kcm_kubeconfig = self.work_dir / "controller-manager.kubeconfig"
        _write_kubeconfig(
            kcm_kubeconfig, self.server, self.ca_file, certs["kcm.crt"], certs["kcm.key"],
            "system:kube-controller-manager",
        )
        self._spawn(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kcm_kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={certs['sa.key']}",
                f"--root-ca-file={certs['ca.crt']}",
                f"--cluster-signing-cert-file={certs['ca.crt']}",
                f"--cluster-signing-key-file={certs['ca.key']}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--profiling=false",
                "--v=1",
            ],
        )

        # The serviceaccount controller creating `default` in `default` shows the
        # controller manager is up and acting.
        def controller_manager_acting() -> bool:
            self._check_alive()
            result = self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False)
            return result.returncode == 0

        wait_until(controller_manager_acting, STARTUP_TIMEOUT, "kube-controller-manager")

    def stop_process(self, name: str) -> list[str]:
        """Stop one process (SIGTERM, then SIGKILL after 15 s); returns its argv, for
        start_process: the same flags, certificates and ports."""
        proc = next(p for p in self.procs if p.name == name)
        argv = [str(a) for a in proc.popen.args]  # type: ignore[union-attr]
        try:
            os.killpg(proc.popen.pid, signal.SIGTERM)
            proc.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=15)
        except ProcessLookupError:
            pass
        self.procs.remove(proc)
        return argv

    def start_process(self, name: str, argv: list[str]) -> None:
        """Start a process stop_process stopped; for kube-apiserver, wait for /readyz."""
        proc = self._spawn(name, argv)
        if name == "kube-apiserver":
            def apiserver_ready() -> bool:
                if proc.popen.poll() is not None:
                    raise ProcessExited(f"{name} exited with code {proc.popen.returncode}")
                status, _ = self._https_get("/readyz")
                return status == 200

            wait_until(apiserver_ready, STARTUP_TIMEOUT, "kube-apiserver /readyz")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                try:
                    os.killpg(proc.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait(timeout=15)
        self.procs.clear()
