"""A SIGTERM in the first second of `effectmq worker` stops it before it takes a task.

In a container the worker was PID 1, and the kernel drops every signal PID 1 has no
handler for; the worker's handler came only with Worker.run(), after the handler
module was imported. A pod deleted in its first second went on taking tasks while
Terminating and was SIGKILLed mid-task at the end of its grace period (a stall).
`unshare --pid --fork` makes the worker PID 1 of a new PID namespace, the way a
container runtime does, and a handler module whose import takes a second holds the
start open while the signal comes. The worker images put tini in front as PID 1
(tests/chart/test_images_built.py); without PID 1 the signal must work at any moment
too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import effectmq
from tests.fixtures.kube import unavailable
from tests.support.processes import WorkerProcess

pytestmark = pytest.mark.slow
SLOW_IMPORT = """\
import os, pathlib, time
pathlib.Path(os.environ["IMPORT_STARTED"]).write_text(str(time.monotonic()))
time.sleep(float(os.environ.get("IMPORT_SECONDS", "1")))
from tests.support.handlers import app
"""


def can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    probe = subprocess.run(["unshare", "--pid", "--fork", "sh", "-c", 'echo "$$"'], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        return f"unshare --pid --fork does not work here (needs root): {probe.stderr.strip()}"
    return None


def slow_app(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "slow_app.py").write_text(SLOW_IMPORT)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2])]),
            "IMPORT_STARTED": str(tmp_path / "import-started")}


def child_of(pid: int, timeout: float = 10.0) -> int:
    """The process `unshare --fork` started: PID 1 of its namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError(f"unshare ({pid}) started no process within {timeout}s")


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the worker exited ({proc.returncode}) before importing its handlers"
        assert time.monotonic() < deadline, f"{path.name} not written within {timeout}s"
        time.sleep(0.01)


def exit_code(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


async def test_pid1_worker_told_to_stop_while_its_handlers_import_never_acquires(redis_url, tmp_path):
    reason = can_unshare()
    if reason:
        unavailable(reason)
    q = effectmq.TaskQueue("pid1", url=redis_url)
    await q.offer("work", {"sleep": 0}, task_id="t")
    env = slow_app(tmp_path)
    w = WorkerProcess(redis_url, "pid1", tmp_path, handlers="slow_app:app", env=env,
                      prefix=["unshare", "--pid", "--fork", "--kill-child"], args=["--maintenance-interval", "0.2"])
    try:
        worker_pid = child_of(w.proc.pid)
        nspid = Path(f"/proc/{worker_pid}/status").read_text().split("NSpid:")[1].splitlines()[0].split()
        assert nspid[-1] == "1", f"the worker is not PID 1 of its namespace: {nspid}"
        wait_for_file(Path(env["IMPORT_STARTED"]), w.proc)
        os.kill(worker_pid, signal.SIGTERM)  # half a second before the import ends
        code = exit_code(w.proc, 20)
        info = await q.get("t")
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
    assert code == 0, f"the worker did not stop on SIGTERM (exit {code}); it served:\n{w.log()[-3000:]}"
    assert info.state == "waiting" and info.attempt == 0, info  # never acquired
    assert not w.effect_lines(), w.effect_lines()
    assert "SIGTERM before the worker started" in w.log(), w.log()[-3000:]
    await q.close()


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.8, 1.6])
async def test_sigterm_at_any_moment_of_the_start_strands_nothing(redis_url, tmp_path, delay):
    """Not PID 1 (as under tini): the signal at 50 ms (Python still starting: the default
    action ends it), during the handler import (drains before serving), or once serving
    (drains the attempt it holds: released, no stall)."""
    q = effectmq.TaskQueue("any", url=redis_url)
    await q.offer("work", {"sleep": 30}, task_id="long")
    env = {**slow_app(tmp_path), "IMPORT_SECONDS": "0.5"}
    w = WorkerProcess(redis_url, "any", tmp_path, handlers="slow_app:app", env=env,
                      args=["--drain-timeout", "0.5", "--lock-timeout", "5"])
    try:
        time.sleep(delay)
        w.proc.send_signal(signal.SIGTERM)
        code = exit_code(w.proc, 20)
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
    assert code in (0, -signal.SIGTERM), f"exit {code}:\n{w.log()[-3000:]}"
    info = await q.get("long")
    assert info.state == "waiting" and info.stalled_attempt_count == 0, info
    await q.close()


async def test_a_second_signal_before_the_worker_starts_ends_a_hung_start(redis_url, tmp_path):
    """The first signal during the handler import is remembered (the worker stops before
    serving); an import that hangs stays interruptible by a second one."""
    env = {**slow_app(tmp_path), "IMPORT_SECONDS": "60"}
    w = WorkerProcess(redis_url, "hung", tmp_path, handlers="slow_app:app", env=env)
    try:
        wait_for_file(Path(env["IMPORT_STARTED"]), w.proc)
        w.proc.send_signal(signal.SIGTERM)
        assert exit_code(w.proc, 1.0) is None, "the first signal must wait for the import (then stop cleanly)"
        w.proc.send_signal(signal.SIGTERM)
        code = exit_code(w.proc, 10)
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
    assert code == 128 + signal.SIGTERM, (code, w.log()[-3000:])
