"""The images, built for real: `tooling/images.sh` builds the operator, worker,
example and Redis images with buildah (no Docker daemon, no registry) into OCI
archives; each archive is checked as an OCI layout carrying the name the chart or
the examples reference, then imported into a fresh buildah storage and run:
the entrypoints answer, the user is the non-root one the chart's securityContext
names, and nothing of this machine's pip configuration or CA bundle is in a layer.

Building needs root (or passwordless sudo) for debootstrap and buildah's chroot
isolation: without it the tests skip locally and fail under CI=true. A build that
fails always fails."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.fixtures.kube import unavailable
from tests.support.processes import ROOT

# A cold build (debootstrap, pip installs) takes minutes; it runs in the first test.
pytestmark = pytest.mark.timeout(1800)

SCRIPT = ROOT / "tooling" / "images.sh"
CHART = ROOT / "charts" / "effectmq"
IMAGES = ["operator", "worker", "example", "redis"]
PIP_CONFIG_PATHS = ["etc/pip.conf", "etc/xdg/pip/pip.conf", "root/.pip/pip.conf", "root/.config/pip/pip.conf"]
HOST_ENV_WORDS = ("PIP_", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR", "CURL_CA_BUNDLE")


def expected_names() -> dict[str, str]:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    queue = yaml.safe_load((ROOT / "examples" / "k8s" / "queue.yaml").read_text())
    operator_tag = values["image"]["tag"] or chart["appVersion"]
    return {
        "operator": f"{values['image']['repository']}:{operator_tag}",
        "worker": f"effectmq-worker:{chart['appVersion']}",
        "example": queue["spec"]["worker"]["image"],
        "redis": f"{values['redis']['image']['repository']}:{values['redis']['image']['tag']}",
    }


def can_build() -> str | None:
    """Why this machine cannot run tooling/images.sh, or None."""
    if shutil.which("apt-get") is None and shutil.which("buildah") is None:
        return "neither buildah nor apt-get (to install it) is available"
    if os.geteuid() != 0:
        sudo = shutil.which("sudo")
        if sudo is None or subprocess.run([sudo, "-n", "true"], capture_output=True).returncode != 0:
            return "tooling/images.sh needs root or passwordless sudo (debootstrap, buildah chroot isolation)"
    return None


@pytest.fixture(scope="session")
def image_archives() -> dict[str, Path]:
    reason = can_build()
    if reason:
        unavailable(reason)
    result = subprocess.run(["bash", str(SCRIPT), "all"], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    assert result.returncode == 0, f"tooling/images.sh failed ({result.returncode}):\n{result.stderr[-4000:]}"
    lines = result.stdout.strip().splitlines()
    current = Path(lines[-1])
    assert current.is_dir(), f"last line of tooling/images.sh is not a directory: {lines[-1]!r}"
    archives = {name: current / f"{name}.tar" for name in IMAGES}
    for name, path in archives.items():
        assert path.resolve().is_file(), f"no archive for {name}: {path}"
        assert str(path.resolve()) in lines, f"{name}'s archive not printed by tooling/images.sh"
    return archives


class Buildah:
    """buildah on a storage of its own (vfs, chroot isolation): the archives must
    be self-contained, not resolved from the build's storage."""

    def __init__(self, base: Path) -> None:
        self.global_args = ["--root", str(base / "root"), "--runroot", str(base / "runroot"),
                            "--storage-driver", "vfs"]
        self.containers: list[str] = []

    def __call__(self, *args: str, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
        result = subprocess.run(["buildah", *self.global_args, *args], capture_output=True, text=True,
                                timeout=timeout, env={**os.environ, "BUILDAH_ISOLATION": "chroot"})
        if check:
            assert result.returncode == 0, f"buildah {' '.join(args)}:\n{result.stdout}{result.stderr}"
        return result

    def from_archive(self, archive: Path) -> str:
        container = self("from", "--pull=always", "--quiet", f"oci-archive:{archive.resolve()}").stdout.strip()
        self.containers.append(container)
        return container

    def run(self, container: str, *command: str) -> subprocess.CompletedProcess:
        return self("run", "--isolation", "chroot", container, "--", *command, check=False, timeout=300)


@pytest.fixture(scope="session")
def buildah(image_archives, tmp_path_factory):
    tool = Buildah(tmp_path_factory.mktemp("buildah-storage"))
    yield tool
    for container in tool.containers:
        tool("rm", container, check=False)
    tool("rmi", "--all", "--force", check=False)


@pytest.fixture(scope="session")
def containers(buildah, image_archives) -> dict[str, tuple[str, Path]]:
    """image -> (working container, its mounted root filesystem)."""
    made = {}
    for name, archive in image_archives.items():
        container = buildah.from_archive(archive)
        made[name] = (container, Path(buildah("mount", container).stdout.strip()))
    return made


def read_archive(archive: Path) -> tuple[dict, dict, dict]:
    """(index, manifest, config) of a one-image OCI archive, every blob's digest checked."""
    with tarfile.open(archive.resolve()) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        layout = json.load(tar.extractfile(members["oci-layout"]))
        assert layout["imageLayoutVersion"] == "1.0.0"
        index = json.load(tar.extractfile(members["index.json"]))
        for name, member in members.items():
            if name.startswith("blobs/sha256/") and member.isfile():
                digest = hashlib.sha256()
                with tar.extractfile(member) as stream:
                    for chunk in iter(lambda: stream.read(1 << 20), b""):
                        digest.update(chunk)
                assert digest.hexdigest() == name.rsplit("/", 1)[1], f"{archive}: {name} does not match its digest"

        def blob(descriptor: dict) -> dict:
            algorithm, hexdigest = descriptor["digest"].split(":")
            return json.load(tar.extractfile(members[f"blobs/{algorithm}/{hexdigest}"]))

        assert len(index["manifests"]) == 1, index
        manifest = blob(index["manifests"][0])
        for layer in manifest["layers"]:
            algorithm, hexdigest = layer["digest"].split(":")
            assert f"blobs/{algorithm}/{hexdigest}" in members, f"{archive}: missing layer {layer['digest']}"
        return index, manifest, blob(manifest["config"])


@pytest.mark.parametrize("name", IMAGES)
def test_archive_is_oci_with_the_expected_name(image_archives, name):
    index, manifest, config = read_archive(image_archives[name])
    ref = index["manifests"][0].get("annotations", {}).get("org.opencontainers.image.ref.name")
    assert ref == expected_names()[name]
    assert manifest["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    assert config["os"] == "linux" and config["rootfs"]["type"] == "layers"
    assert len(config["rootfs"]["diff_ids"]) == len(manifest["layers"])


EXPECTED_CONFIG = {
    "operator": {"User": "10001:10001", "Entrypoint": ["effectmq-operator"]},
    "worker": {"User": "10001:10001", "Entrypoint": ["effectmq", "worker"], "WorkingDir": "/app"},
    "example": {"User": "10001:10001", "Entrypoint": ["effectmq", "worker"], "WorkingDir": "/app"},
    "redis": {"User": "999:999", "Cmd": ["redis-server"], "WorkingDir": "/data"},
}


@pytest.mark.parametrize("name", IMAGES)
def test_image_config_user_entrypoint_and_no_host_settings(image_archives, name):
    config = read_archive(image_archives[name])[2]["config"]
    for field, value in EXPECTED_CONFIG[name].items():
        assert config.get(field) == value, f"{name}: {field} is {config.get(field)!r}, not {value!r}"
    uid = config["User"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "the user must be numeric and non-root (runAsNonRoot)"
    leaked = [e for e in config.get("Env", []) if e.startswith(HOST_ENV_WORDS)]
    assert not leaked, f"{name}: host pip/CA settings in the image's environment: {leaked}"
    if name == "example":
        assert "EFFECTMQ_HANDLERS=shop.tasks:app" in config["Env"]


@pytest.mark.parametrize("name", IMAGES)
def test_no_host_pip_config_or_ca_in_filesystem(containers, name):
    _, rootfs = containers[name]
    for rel in PIP_CONFIG_PATHS:
        assert not (rootfs / rel).exists(), f"{name}: /{rel} is in the image"
    found = [str(p.relative_to(rootfs)) for p in rootfs.joinpath("opt").rglob("pip.conf")]
    assert not found, f"{name}: pip.conf in the image: {found}"
    bundle = (rootfs / "etc/ssl/certs/ca-certificates.crt").read_text()
    local_cas = sorted(Path("/usr/local/share/ca-certificates").rglob("*.crt"))
    for ca in local_cas:  # this machine's own CAs (what builds use to reach PyPI)
        body = "".join(line for line in ca.read_text().splitlines() if line and not line.startswith("-----"))
        assert body[:200] not in bundle.replace("\n", ""), f"{name}: the host's {ca.name} is in the image's CA bundle"


def run_ok(buildah, container: str, *command: str) -> str:
    result = buildah.run(container, *command)
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
    return result.stdout


@pytest.mark.parametrize("name", ["worker", "example"])
def test_worker_images_run_effectmq(buildah, containers, name):
    container, _ = containers[name]
    out = run_ok(buildah, container, "effectmq", "--help")
    assert "usage: effectmq" in out and "worker" in out
    assert "usage:" in run_ok(buildah, container, "effectmq", "worker", "--help")
    assert run_ok(buildah, container, "id", "-u").strip() == "10001"
    if name == "example":
        out = run_ok(buildah, container, "python", "-c", "import shop.tasks as t; print(type(t.app).__name__)")
        assert out.strip(), "shop.tasks:app did not import"


def test_operator_image_imports_the_operator(buildah, containers):
    container, _ = containers["operator"]
    out = run_ok(buildah, container, "python", "-c", "import effectmq_operator, kopf; print('ok')")
    assert out.strip() == "ok"
    assert run_ok(buildah, container, "id", "-u").strip() == "10001"
    assert "usage" in run_ok(buildah, container, "effectmq-operator", "--help").lower()


def test_operator_image_runs_the_charts_dashboard(buildah, containers):
    """The chart runs `effectmq dashboard` from the operator image: its web stack
    (the `dashboard` extra), templates and static files are in it."""
    container, _ = containers["operator"]
    probe = ("import importlib.resources as r, effectmq.dashboard.web; "
             "d = r.files('effectmq.dashboard'); "
             "print(sorted(p.name for p in d.joinpath('templates').iterdir() if p.name.endswith('.html'))[:1], "
             "d.joinpath('static').is_dir())")
    out = run_ok(buildah, container, "python", "-c", probe)
    assert out.strip().endswith("True") and ".html" in out, out
    assert "--token-file" in run_ok(buildah, container, "effectmq", "dashboard", "--help")


def test_redis_image_serves_the_chart(buildah, containers):
    container, rootfs = containers["redis"]
    assert run_ok(buildah, container, "redis-server", "--version").startswith("Redis server v=")
    assert run_ok(buildah, container, "redis-cli", "--version").startswith("redis-cli ")
    assert run_ok(buildah, container, "id", "-u").strip() == "999"
    # /data (the chart's volume) is the redis user's
    assert (rootfs / "data").stat().st_uid == 999
