"""The release artifacts, built and installed here: `python -m build` makes the wheel and
the sdist from the checkout's files, `twine check` accepts both, and the wheel installed
into a clean virtualenv runs the README's quickstart as written, against a real Redis,
with none of this checkout's code on the path."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Session, blocks, environment
from tests.docs.requirements import require_module

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def run(argv: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and sdist of the checkout's files, as they are in the working tree, new
    ones included, but none git ignores (a copy: building writes egg-info and build/
    beside the sources, and a copy leaves out the checkout's own build/ and .venv/)."""
    require_module("build", "the test extra (build, twine): pip install -e '.[test]'")
    require_module("twine", "the test extra (build, twine): pip install -e '.[test]'")
    tmp = tmp_path_factory.mktemp("release")
    source = tmp / "src"
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    # No isolation: the build backend (setuptools) comes from this virtualenv, not the network.
    run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", tmp / "dist", source])
    return tmp / "dist"


def test_wheel_and_sdist_pass_twine_check(dist):
    wheel, sdist = dist / f"effectmq-{VERSION}-py3-none-any.whl", dist / f"effectmq-{VERSION}.tar.gz"
    assert wheel.exists() and sdist.exists(), sorted(p.name for p in dist.iterdir())
    checked = run([sys.executable, "-m", "twine", "check", "--strict", wheel, sdist])
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    scripts = {p.relative_to(ROOT).as_posix() for p in (ROOT / "effectmq").rglob("*.lua")}
    assert scripts, "no Lua scripts under effectmq/"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert scripts | {"effectmq/py.typed", "effectmq_operator/__main__.py"} <= names, sorted(scripts - names)
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    assert scripts | {"README.md", "LICENSE", "pyproject.toml"} <= members, sorted(scripts - members)


def test_the_wheel_runs_the_readme_quickstart_in_a_clean_virtualenv(dist, redis_url, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python, bin_dir = venv / "bin/python", venv / "bin"
    # The wheel alone first (nothing named effectmq is visible yet), then its dependencies
    # from this virtualenv's site-packages (no index here), behind the clean one's own: the
    # wheel's effectmq is the one found, never this checkout's.
    wheel = dist / f"effectmq-{VERSION}-py3-none-any.whl"
    # Without PYTHONPATH: a checkout on it with its egg-info made pip call the wheel installed.
    run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheel],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    clean_site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (clean_site / "dependencies-of-the-test-run.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = environment(redis_url, extra_path=[str(bin_dir)])
    env.pop("PYTHONPATH")  # only what the wheel installed
    where = run([python, "-c", "import effectmq; print(effectmq.__file__, effectmq.__version__)"], env=env,
                cwd=tmp_path).stdout.split()
    assert Path(where[0]).is_relative_to(venv) and where[1] == VERSION, where
    assert run([bin_dir / "effectmq", "--version"], env=env).stdout.strip() == f"effectmq {VERSION}"

    work = tmp_path / "quickstart"
    work.mkdir()
    session = Session(work, env, python=str(python))
    ran = 0
    try:
        for block in blocks(ROOT / "README.md"):
            if block.runs or block.file:
                done = session.run(block)
                assert done.returncode == 0, f"{block.where}:\n{block.code}\n--- output ---\n{done.stdout[-4000:]}"
                ran += block.runs
                if block.runs and "python produce.py" in block.code:
                    assert "result {'delivered_to': 'ada@example.com'" in done.stdout, done.stdout
                    assert "offered welcome/ada already known" in done.stdout, done.stdout  # idempotent
                    assert "completed: 1" in done.stdout, done.stdout
    finally:
        session.close()
    assert ran >= 1
