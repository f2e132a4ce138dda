"""`bash tooling/local.sh` as the README runs it, from another folder and with a relative
path: it reuses the virtualenv made for this checkout (and removes one made for an older
pyproject.toml), starts the dashboard beside the example with its URL on screen, and its
burst of slow tasks scales the workers up and then back down; Ctrl-C drains and stops.
(The first run's pip install is left out: it needs the package index.)"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.docs.blocks import ROOT
from tests.fixtures.redis import free_port, require_binary


def venv_of_this_checkout(cache: Path) -> Path:
    """The folder local.sh keys by checkout path and pyproject.toml, made here from the
    test's own virtualenv and marked installed."""
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
    project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    venv = cache / f"local-{checkout}-{project}"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/effectmq").symlink_to(Path(sys.executable).parent / "effectmq")
    (venv / ".installed").touch()
    return venv


def counts(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def test_local_sh_shows_the_dashboard_and_scaling_up_and_down(tmp_path):
    require_binary("redis-server", "install the Debian package redis-server")
    cache = tmp_path / "cache"
    venv = venv_of_this_checkout(cache)
    older = cache / f"{venv.name[:len('local-') + 8]}-000000000000"  # this checkout's, an older pyproject.toml
    older.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dashboard = free_port()
    out = tmp_path / "local.out"
    # This checkout's code, whichever checkout the shared test virtualenv was installed from.
    env = {**os.environ, "EFFECTMQ_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])}
    proc = subprocess.Popen(["bash", str(ROOT / "tooling/local.sh"), "--no-view", "--redis-port", str(free_port()),
                             "--data-dir", "data", "--dashboard-port", str(dashboard)],
                            cwd=elsewhere, env=env, stdout=open(out, "wb"), stderr=subprocess.STDOUT)

    def lines() -> list[str]:
        return out.read_text(errors="replace").splitlines()

    def wait_for(check, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in lines():
                if found := check(line):
                    return found
            assert proc.poll() is None, f"local.sh exited {proc.returncode}:\n" + "\n".join(lines()[-30:])
            time.sleep(0.3)
        raise AssertionError(f"no {what} in {timeout} s:\n" + "\n".join(lines()[-30:]))

    try:
        url = wait_for(lambda line: re.search(r"dashboard at (http://127\.0\.0\.1:\d+)", line), 60, "dashboard URL")
        assert url.group(1) == f"http://127.0.0.1:{dashboard}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url.group(1) + "/api/queues", timeout=5) as answer:
                    assert answer.status == 200 and b"emails" in answer.read()
                    break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard never answered:\n" + "\n".join(lines()[-20:])
                time.sleep(0.5)
        # 300 tasks of 3 s at 50 per worker: several workers, then fewer once the queue is idle.
        wait_for(lambda line: "workers=" in line and counts(line)["workers"] >= 4, 60, "scale-up to 4 workers")

        def scaled_down(line: str) -> bool:
            peak = max(counts(seen).get("workers", 0) for seen in lines())
            return "workers=" in line and counts(line)["completed"] >= 300 and counts(line)["workers"] < peak

        wait_for(scaled_down, 120, "scale-down after the burst")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        code = proc.wait(90)
    assert code == 0, "\n".join(lines()[-20:])
    assert lines()[-1] == f"effectmq local: stopped; state kept in {elsewhere / 'data'}"  # resolved before the cd
    assert not any("making" in line for line in lines()), "reinstalled although nothing changed"
    assert not older.exists() and venv.exists()
