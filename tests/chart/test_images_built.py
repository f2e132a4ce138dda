"""The images, built for real: `tooling/images.sh` builds the operator, worker,
example and Redis images with buildah (no Docker daemon, no registry) into OCI
archives; each archive is checked as an OCI layout carrying the name the chart or
the examples reference, then imported into a fresh buildah storage and run:
the entrypoints answer, the user is the non-root one the chart's securityContext
names, and nothing of this machine's pip configuration or CA bundle is in a layer.
The worker images' `effectmq`, started as PID 1 of a PID namespace (as a container
runtime starts it), runs under tini and stops on a SIGTERM at any moment of its start.

Building needs root (or passwordless sudo) for debootstrap and buildah's chroot
isolation: without it the tests skip locally and fail under CI=true. A build that
fails always fails."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import yaml

import effectmq
from tests.chart import dockerfile
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
        "redis": f"{values['redis']['image']['repository']}:{values['redis']['image']['tag'] or chart['appVersion']}",
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
    # this checkout's archives by the paths printed (current/ is the newest of any checkout's)
    printed = {Path(line).parent.name: Path(line) for line in lines[:-1]}
    archives = {name: printed.get(name) for name in IMAGES}
    for name, path in archives.items():
        assert path is not None and path.is_file(), f"{name}'s archive not printed by tooling/images.sh: {lines}"
        assert (current / f"{name}.tar").is_symlink(), f"no current/{name}.tar"
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


# --------------------------------------------------------------------------
# Security fixes and pinned Python dependencies

# The first bookworm build of redis-server with the fix for CVE-2025-49844 (Lua
# use-after-free, remote code execution); later fixes come from bookworm-security.
REDIS_FIXED = "5:7.0.15-1~deb12u6"
BASE_REFRESH_LABEL = "effectmq.base.refresh"
BUILD_APT_SETTINGS = "etc/apt/apt.conf.d/99effectmq-build"


def dpkg_version(rootfs: Path, package: str) -> str:
    """The version of a package installed in an image, from the image's dpkg status."""
    result = subprocess.run(["dpkg-query", f"--admindir={rootfs}/var/lib/dpkg", "-W", "-f=${Version}", package],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout, f"{package} is not installed: {result.stderr}"
    return result.stdout


def at_least(version: str, floor: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", version, "ge", floor]).returncode == 0


def apt_suites(root: Path) -> set[str]:
    """The suites of the `deb` sources under <root>/etc/apt (one-line and deb822 files)."""
    suites: set[str] = set()
    etc = root / "etc/apt"
    for path in [etc / "sources.list", *sorted(etc.glob("sources.list.d/*.list"))]:
        for line in path.read_text().splitlines() if path.is_file() else []:
            words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if words[:1] == ["deb"] and len(words) >= 3:
                suites.add(words[2])
    for path in sorted(etc.glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^(\w[\w-]*):[ \t]*(.*)$", stanza, re.M))
            fields = {k.lower(): v for k, v in fields.items()}
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes").lower() != "no":
                suites.update(fields.get("suites", "").split())
    return suites


def security_suite_version(package: str) -> str | None:
    """The newest version of a package in this machine's bookworm-security lists."""
    result = subprocess.run(["apt-cache", "madison", package], capture_output=True, text=True)
    versions = [fields[1].strip() for fields in (line.split("|") for line in result.stdout.splitlines())
                if len(fields) == 3 and " bookworm-security/" in fields[2]]
    newest = None
    for version in versions:
        newest = version if newest is None or at_least(version, newest) else newest
    return newest


def test_redis_image_has_the_security_suites_fix(image_archives, containers):
    """The image side of the bundled Redis's security: it is Debian's redis-server with
    the fix for CVE-2025-49844 (from 5:7.0.15-1~deb12u6), and with the newer fixes
    only bookworm-security has (this machine's lists say which version that is);
    the image says which package version it holds. (Before, the base had no
    security suite: the image held the main suite's deb12u7, named redis:7.4.2.)"""
    _, rootfs = containers["redis"]
    version = dpkg_version(rootfs, "redis-server")
    assert at_least(version, REDIS_FIXED), f"redis-server {version} predates {REDIS_FIXED} (CVE-2025-49844)"
    security = security_suite_version("redis-server")
    assert security is None or at_least(version, security), (
        f"redis-server {version} in the image, {security} in bookworm-security: the image misses security fixes "
        "(a base refreshed before they came out? EFFECTMQ_IMAGE_REFRESH=<new value> rebuilds it)")
    assert dpkg_version(rootfs, "redis-tools") == version
    labels = read_archive(image_archives["redis"])[2]["config"].get("Labels") or {}
    assert labels.get("org.opencontainers.image.version") == version, labels


@pytest.mark.parametrize("name", IMAGES)
def test_images_apt_sources_include_the_security_suite(containers, name):
    """The base's apt sources (what the Dockerfiles' apt-get steps and users' FROM
    builds install from) have bookworm-security, and bookworm-updates when this
    machine has it."""
    _, rootfs = containers[name]
    suites = apt_suites(rootfs)
    wanted = {"bookworm", "bookworm-security"} | ({"bookworm-updates"} & apt_suites(Path("/")))
    assert wanted <= suites, f"{name}: the image's apt suites are {sorted(suites)}, not {sorted(wanted)}"


def current_refresh_period() -> str:
    """tooling/images.sh: EFFECTMQ_IMAGE_REFRESH, or the ISO week (UTC)."""
    return os.environ.get("EFFECTMQ_IMAGE_REFRESH") or time.strftime("%G-W%V", time.gmtime())


@pytest.mark.parametrize("name", IMAGES)
def test_images_base_is_of_this_refresh_period(image_archives, name):
    """The base is rebuilt (and upgraded from the security suite) every ISO week, so
    no image built from it is older than a week's security fixes. (Before, its key
    never changed: the first base built was kept forever.)"""
    labels = read_archive(image_archives[name])[2]["config"].get("Labels") or {}
    assert labels.get(BASE_REFRESH_LABEL) == current_refresh_period(), labels


@pytest.mark.parametrize("name", IMAGES)
def test_no_build_apt_settings_in_filesystem(containers, name):
    """Builds reach this machine's mirrors with its apt settings (a proxy; a
    snapshot mirror's expired Release files) mounted over an empty file: the
    image keeps the empty file, never the settings."""
    _, rootfs = containers[name]
    settings = rootfs / BUILD_APT_SETTINGS
    assert not settings.exists() or settings.stat().st_size == 0, f"{name}: /{BUILD_APT_SETTINGS} is not empty"


# Run by the image's Python: every distribution installed, and every requirement of
# effectmq[extras...] (extras of dependencies followed too) that is not met.
CLOSURE_PROBE = r"""
import json, sys
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
installed = {canonicalize_name(d.metadata["Name"]): d.version for d in md.distributions()}
unmet, seen, todo = [], set(), [("effectmq", frozenset(sys.argv[1:]))]
while todo:
    name, extras = todo.pop()
    if (name, extras) in seen:
        continue
    seen.add((name, extras))
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            continue
        key = canonicalize_name(req.name)
        if key not in installed or not req.specifier.contains(installed[key], prereleases=True):
            unmet.append(f"{name}: {text} (installed: {installed.get(key)})")
        else:
            todo.append((key, frozenset(req.extras)))
print(json.dumps({"python": sys.version.split()[0], "installed": installed, "unmet": unmet}))
"""


@pytest.mark.parametrize("name", ["operator", "worker"])
def test_python_images_hold_exactly_the_locked_packages(buildah, containers, name):
    """What pip installed in the image is the lock, version for version
    (plus effectmq and the venv's pip), and it meets every requirement of effectmq
    and its extras, the extras of dependencies included (`pip check` does not
    follow those, e.g. redis[hiredis])."""
    lock, extras = dockerfile.LOCKS[name]
    container, _ = containers[name]
    probe = json.loads(run_ok(buildah, container, "python", "-c", CLOSURE_PROBE, *extras))
    assert probe["python"].startswith("3.11."), f"the lock is for Python 3.11, the image has {probe['python']}"
    assert not probe["unmet"], f"{name}: unmet requirements: {probe['unmet']}"
    locked = {n: pin.version for n, pin in dockerfile.read_lock(ROOT / lock).items()}
    installed = {n: v for n, v in probe["installed"].items() if n not in ("effectmq", "pip")}
    assert installed == locked, {n: (installed.get(n), locked.get(n)) for n in installed.keys() | locked.keys()
                                 if installed.get(n) != locked.get(n)}


def test_a_second_run_in_the_period_reuses_the_archive(image_archives):
    """Warm runs stay fast: within a refresh period the base's key holds, so nothing is
    rebuilt (no apt). (The Redis image: its inputs are not the Python sources, which
    may change under a test run in a shared checkout.)"""
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), "redis"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.splitlines() == ["[images.sh] redis present"], result.stderr
    assert result.stdout.splitlines()[0] == str(image_archives["redis"].resolve())
    assert time.monotonic() - start < 120


# --------------------------------------------------------------------------
# PID 1: a SIGTERM in the first second of a worker container is not lost


def start_as_pid1(rootfs: Path, config: dict, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`argv` as a container runtime starts it: PID 1 of a new PID namespace, in the image's
    root filesystem, as the image's user, with only the image's environment and `env`, in
    its working directory. (This machine's network: Redis on loopback answers.)"""
    image_env = dict(e.split("=", 1) for e in config.get("Env", []))
    variables = [f"{k}={v}" for k, v in {**image_env, **env}.items()]
    workdir = config.get("WorkingDir") or "/"
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "chroot", f"--userspec={config['User']}", str(rootfs),
         "/usr/bin/env", "-i", *variables, "/bin/sh", "-c", 'cd "$0" && exec "$@"', workdir, *argv],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def container_init(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """The host pid of the PID 1 that `unshare --fork` started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.005)
    raise AssertionError("no PID 1 started")


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def test_worker_images_put_tini_in_front_of_effectmq(image_archives, containers):
    """tini is installed, and `effectmq` on PATH is the script that runs it when PID 1:
    the operator's Deployment sets `command: [effectmq, worker]`, which replaces the
    ENTRYPOINT, so tini cannot be only in the ENTRYPOINT."""
    for name in ("worker", "example"):
        _, rootfs = containers[name]
        assert (rootfs / "usr/bin/tini").is_file(), name
        config = read_archive(image_archives[name])[2]["config"]
        path = dict(e.split("=", 1) for e in config["Env"])["PATH"].split(":")
        assert path[:2] == ["/opt/effectmq/init", "/opt/effectmq/bin"], path
        shim = rootfs / "opt/effectmq/init/effectmq"
        assert shim.stat().st_mode & 0o111 and shim.read_text() == (ROOT / "worker_image/effectmq-pid1.sh").read_text()


def test_example_image_runs_effectmq_as_pid1_under_tini(image_archives, containers, redis_url, tmp_path):
    """The example image (the worker image plus handlers) started as a runtime starts it:
    PID 1 is tini, the worker its child; a SIGTERM at any moment of the start ends it
    and it takes no task (before, PID 1 was the worker, which dropped the signal until
    it had its handler)."""
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        unavailable("unshare --pid --fork does not work here (needs root)")
    _, rootfs = containers["example"]
    config = read_archive(image_archives["example"])[2]["config"]
    env = {"EFFECTMQ_QUEUE": "pid1", "EFFECTMQ_REDIS_URL": redis_url, "EFFECTMQ_DRAIN_TIMEOUT": "1"}
    q = effectmq.SyncTaskQueue("pid1", url=redis_url)
    try:
        # 1. Serving: PID 1 is tini, the worker its child; a SIGTERM drains it (exit 0).
        proc = start_as_pid1(rootfs, config, config["Entrypoint"], env, tmp_path / "serving.log")
        try:
            init = container_init(proc)
            done = q.offer("send_email", {"to": "pid1@example.com"}).task_id
            assert q.wait(done, timeout=60)["delivered_to"] == "pid1@example.com"
            assert comm(init) == "tini", comm(init)
            (child,) = Path(f"/proc/{init}/task/{init}/children").read_text().split()
            assert "effectmq\0worker" in Path(f"/proc/{child}/cmdline").read_text()
            os.kill(init, signal.SIGTERM)
            assert proc.wait(20) == 0, (tmp_path / "serving.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        # 2. A SIGTERM 0.1 to 0.9 s into the start, before the worker may have a handler of
        # its own: forwarded, never lost. The process ends; the task waits (a worker that
        # was already serving drained it: released, not stalled).
        for delay in (0.1, 0.3, 0.6, 0.9):
            waiting = q.offer("send_report", {"report": "never", "seconds": 30}).task_id
            log = tmp_path / f"start-{delay}.log"
            proc = start_as_pid1(rootfs, config, config["Entrypoint"], env, log)
            try:
                init = container_init(proc)
                time.sleep(delay)
                os.kill(init, signal.SIGTERM)
                code = proc.wait(20)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"SIGTERM {delay}s into the start was lost:\n{log.read_text()[-3000:]}") from None
            finally:
                if proc.poll() is None:
                    proc.kill()
            assert code in (0, 128 + signal.SIGTERM), (delay, code, log.read_text()[-3000:])
            info = q.get(waiting)
            assert info.state == "waiting" and info.stalled_attempt_count == 0, (delay, info)
            q.cancel(waiting)
    finally:
        q.close()
