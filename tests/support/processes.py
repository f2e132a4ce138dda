"""Start `effectmq worker` as a real subprocess, the way a pod runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stop_process(proc: subprocess.Popen, timeout: float = 20.0, sig: int | None = None) -> int:
    """Ask a child to stop (SIGTERM or `sig`), kill it if it does not within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(sig) if sig is not None else proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class WorkerProcess:
    def __init__(self, redis_url: str, queue: str, tmp: Path, *, args: list[str] = (), env: dict | None = None,
                 prefix: list[str] = (), name: str = "worker", handlers: str = "tests.support.handlers:app"):
        self.log_path = tmp / f"{name}-{time.monotonic_ns()}.log"
        self.effects = tmp / "effects.log"
        full_env = {
            **os.environ,
            "EFFECTMQ_REDIS_URL": redis_url,
            "EFFECTMQ_QUEUE": queue,
            "EFFECTMQ_TEST_EFFECTS": str(self.effects),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        cmd = [*prefix, sys.executable, "-m", "effectmq", "worker", handlers, *args]
        self.proc = subprocess.Popen(cmd, env=full_env, cwd=ROOT, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def effect_lines(self) -> list[list[str]]:
        if not self.effects.exists():
            return []
        return [line.split() for line in self.effects.read_text().splitlines() if line.strip()]

    def wait_for_effect(self, predicate, timeout: float = 20.0) -> list[list[str]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.effect_lines()
            if predicate(lines):
                return lines
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError(f"effect not seen within {timeout}s; worker log:\n{self.log()[-3000:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> int:
        return stop_process(self.proc, timeout)
