"""An OCI registry on loopback that the one-node cluster's containerd pulls from.

The registry is the CNCF distribution registry, built from its Go module by
``tooling/registry/build.sh``, listening on 127.0.0.1 only, over plain HTTP.

The node runs in its own network namespace, where 127.0.0.1 is the node's own
loopback, and the host's loopback is out of reach (the node reaches the host only at
the veth's host end, 10.250.0.1, where nothing of the registry listens). So a
forwarder listens on 127.0.0.1:<same port> inside the node's namespace and relays
each connection to the registry on the host's 127.0.0.1: one image name,
``127.0.0.1:<port>/<repository>:<tag>``, works on the host (helm push, skopeo) and
on the node (the kubelet's pulls). containerd learns to speak plain HTTP to it from
a ``hosts.toml`` in the cluster's registry host directory.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from tooling.testbed import REPO_ROOT

BUILD_COMMAND = "bash tooling/registry/build.sh"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def build_registry() -> Path:
    """Build (or reuse) the registry binary; its path."""
    env = {**os.environ, "PATH": f"{os.environ['PATH']}:/usr/local/go/bin"}
    result = subprocess.run(["bash", str(REPO_ROOT / "tooling" / "registry" / "build.sh")],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"`{BUILD_COMMAND}` failed:\n{result.stderr[-3000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackRegistry:
    """``registry serve`` on 127.0.0.1:<port>, its blobs in ``work_dir``."""

    forwarder: "NamespaceForwarder | None" = None  # set once a node namespace reaches it

    def __init__(self, binary: Path, work_dir: Path):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.work_dir = work_dir
        self.log_path = work_dir / "registry.log"
        config = work_dir / "config.yml"
        config.write_text(f"""version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: {work_dir / "data"}
  delete:
    enabled: true
http:
  addr: {self.address}
""")
        # no tracing exporter: nothing listens for one
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
        self.proc = subprocess.Popen([str(binary), "serve", str(config)], env=env, stdin=subprocess.DEVNULL,
                                     stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the registry did not answer on {self.address}:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def listen_in_namespace(netns: Path, address: tuple[str, int]) -> socket.socket:
    """A listening socket in network namespace ``netns``; the calling thread returns
    to its own namespace before this returns (a socket keeps the one it was made in)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(netns, os.O_RDONLY)
    try:
        _setns(target)
        try:
            return socket.create_server(address)
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)


class NamespaceForwarder:
    """127.0.0.1:<port> inside ``netns`` relayed to 127.0.0.1:<port> of this process's namespace."""

    def __init__(self, netns: Path, port: int):
        self.port = port
        self.listener = listen_in_namespace(netns, ("127.0.0.1", port))
        self.connections = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port))
            except OSError:
                client.close()
                continue
            self.connections += 1
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _relay(client: socket.socket, upstream: socket.socket) -> None:
        def pipe(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)  # a half-close passes through
            except OSError:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
        back.start()
        pipe(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        self._closed = True
        self.listener.close()


def trust_plain_http(hosts_dir: Path, address: str) -> None:
    """containerd's host settings for ``address``: pull and resolve over plain HTTP."""
    host_dir = hosts_dir / address
    host_dir.mkdir(parents=True, exist_ok=True)
    (host_dir / "hosts.toml").write_text(f"""server = "http://{address}"

[host."http://{address}"]
  capabilities = ["pull", "resolve"]
""")
