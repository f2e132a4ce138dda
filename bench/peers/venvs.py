"""One virtualenv per library, cached under ~/.cache/effectmq/bench-venvs/<lib>-<hash>.

The peers pin different redis-py versions, so each library gets its own venv built
from `adapters/<lib>.txt` (a pip requirements file). The hash covers that file, the
Python that builds the venv and, for EffectMQ (installed editable from this
checkout), the checkout's path and pyproject.toml: a changed pin builds a new venv,
an unchanged one is reused. A venv is only used once its build finished (a marker
file is written last), so an interrupted build is redone. A baseline (`run.py
--baseline REV`) is EffectMQ at another commit, extracted by `baseline_source` and
installed editable into its own venv the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
ADAPTERS = Path(__file__).resolve().parent / "adapters"
CACHE = Path(os.environ.get("EFFECTMQ_BENCH_VENVS", Path.home() / ".cache" / "effectmq" / "bench-venvs"))
MARKER = "bench-venv-ready.json"


def requirements_file(lib: str) -> Path:
    return ADAPTERS / f"{lib}.txt"


def venv_key(lib: str, python: str, root: Path = ROOT) -> str:
    h = hashlib.sha256()
    h.update(requirements_file(lib).read_bytes())
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             check=True).stdout
    h.update(version.encode())
    h.update(str(Path(python).resolve()).encode())
    if "${EFFECTMQ_ROOT}" in requirements_file(lib).read_text():
        h.update(str(root).encode())
        h.update((root / "pyproject.toml").read_bytes())
    return f"{lib}-{h.hexdigest()[:12]}"


def ensure_venv(lib: str, python: str = sys.executable, log=print, root: Path = ROOT) -> Path:
    """The venv's directory, built first if no finished build with this key exists.
    `root`: the EffectMQ source folder an editable requirement installs (a baseline's)."""
    path = CACHE / venv_key(lib, python, root)
    if (path / MARKER).exists():
        return path
    if path.exists():
        shutil.rmtree(path)  # an unfinished build
    log(f"building venv for {lib} at {path} ...")
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    env = dict(os.environ, EFFECTMQ_ROOT=str(root))
    result = subprocess.run([*pip, "-r", str(requirements_file(lib))], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"pip install for {lib} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    freeze = subprocess.run([str(path / "bin" / "python"), "-m", "pip", "freeze", "--all"], capture_output=True,
                            text=True, check=True).stdout
    (path / MARKER).write_text(json.dumps({"lib": lib, "freeze": freeze.splitlines()}, indent=1))
    return path


BASELINES = CACHE.parent / "bench-baselines"


def baseline_source(rev: str, log=print) -> tuple[str, Path]:
    """(commit, folder) of EffectMQ at `rev`, extracted once with `git archive | tar -x`
    (no worktree, no checkout: the working tree and git state stay untouched) into
    ~/.cache/effectmq/bench-baselines/<commit>, so its venv is keyed and reused like the others."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    dest = BASELINES / commit
    if (dest / ".bench-extracted").exists():
        return commit, dest
    log(f"extracting {rev} ({commit[:12]}) to {dest} ...")
    partial = dest.with_name(commit + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(partial)], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        raise SystemExit(f"git archive {rev} failed")
    (partial / ".bench-extracted").write_text(rev + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return commit, dest


def python_of(venv: Path) -> str:
    return str(venv / "bin" / "python")


if __name__ == "__main__":  # python bench/peers/venvs.py [lib ...]: build (or show) the venvs
    libs = sys.argv[1:] or sorted(p.stem for p in ADAPTERS.glob("*.txt"))
    for lib in libs:
        print(lib, ensure_venv(lib))
