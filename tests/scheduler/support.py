"""Helpers for scheduler tests: instants, rewinding a cursor, scheduler subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from effectmq.scheduler import Scheduler
from tests.support.operator import wait_for

ROOT = Path(__file__).resolve().parents[2]


async def clear_of_boundary(scheduler: Scheduler, period: int, margin: float) -> int:
    """Waits while the next `period` boundary (seconds, by Redis time) is closer than
    `margin`, so that no tick of a schedule firing once per period falls due meanwhile.
    Returns Redis time (s)."""
    while True:
        seconds, micros = await scheduler.redis.time()
        left = period - (seconds % period) - micros / 1e6
        if left >= margin:
            return seconds
        await asyncio.sleep(left + 0.05)


async def make_one_tick_due(scheduler: Scheduler, ids: list[str], period: int = 3600, margin: int = 30) -> int:
    """Every cursor just before the latest `period` boundary (seconds; the schedules
    fire once per period), so exactly one tick is due per schedule, missed. Waits while
    the next boundary is closer than `margin`. Returns that boundary (s). Used by
    tests/scheduler/test_scale.py and bench/schedules.py."""
    seconds = await clear_of_boundary(scheduler, period, margin)
    boundary = seconds - seconds % period
    async with scheduler.redis.pipeline(transaction=False) as pipe:
        for sid in ids:
            pipe.hset(scheduler.store.key(sid), "cursor", boundary * 1000 - 1)
            pipe.zadd(scheduler.store.due_key, {sid: 0})
        await pipe.execute()
    return boundary


def T(text: str) -> int:
    """An instant (seconds) from ISO 8601; a trailing Z or an offset is required."""
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp())


def Z(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def redis_now_ms(scheduler: Scheduler) -> int:
    seconds, micros = await scheduler.redis.time()
    return seconds * 1000 + micros // 1000


async def rewind(scheduler: Scheduler, schedule_id: str, seconds: float) -> int:
    """Simulate downtime: the cursor goes `seconds` back from Redis time and the
    schedule becomes due (the layout of lua/lib.lua). Returns the new cursor (ms)."""
    cursor = await redis_now_ms(scheduler) - round(seconds * 1000)
    await scheduler.redis.hset(scheduler.store.key(schedule_id), "cursor", cursor)
    await scheduler.redis.zadd(scheduler.store.due_key, {schedule_id: 0})
    return cursor


def _env(redis_url: str, extra: dict | None = None) -> dict:
    return {**os.environ, "EFFECTMQ_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(extra or {})}


def cli(redis_url: str, *args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run `python -m effectmq scheduler ...` to completion."""
    return subprocess.run([sys.executable, "-m", "effectmq", "scheduler", *args], cwd=ROOT, env=_env(redis_url, env),
                          capture_output=True, text=True, timeout=timeout)


def cli_json(redis_url: str, *args: str, env: dict | None = None):
    done = cli(redis_url, *args, "--json", env=env)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr}"
    return json.loads(done.stdout)


class SchedulerProcess:
    """`effectmq scheduler run --json` (or the fault runner) as a real subprocess."""

    def __init__(self, redis_url: str, namespace: str, tmp: Path, *, name: str, fault: str | None = None,
                 interval: float = 0.5):
        self.name = name
        self.output = tmp / f"{name}.out"
        self.offers = tmp / f"{name}.offers.jsonl"
        if fault is None:
            cmd = [sys.executable, "-m", "effectmq", "scheduler", "run", "--json", "--scheduler-namespace", namespace,
                   "--interval", str(interval)]
        else:
            cmd = [sys.executable, "-m", "tests.scheduler.runner", "--url", redis_url, "--namespace", namespace,
                   "--fault", fault, "--log", str(self.offers), "--interval", str(interval)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(redis_url), stdout=open(self.output, "ab"),
                                     stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def reports(self) -> list[dict]:
        """The JSON pass reports `run --json` printed."""
        return [json.loads(line) for line in self.text().splitlines() if line.startswith("{")]

    def offer_log(self) -> list[dict]:
        if not self.offers.exists():
            return []
        return [json.loads(line) for line in self.offers.read_text().splitlines() if line.strip()]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig: int | None = None, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig) if sig is not None else self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name} did not stop within {timeout}s:\n{self.text()[-3000:]}") from None
        return self.proc.returncode


def wait_until(predicate, timeout: float, what: str, poll: float = 0.05):
    return wait_for(predicate, timeout=timeout, interval=poll, what=what)
