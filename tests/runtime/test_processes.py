"""Real worker processes under real faults: SIGKILL, SIGSTOP/SIGCONT, Redis restart
with AOF, SIGTERM drain, and a skewed wall clock. After each, every accepted task
reaches exactly one terminal state."""

import asyncio
import os
import signal
import time
from collections import Counter

import pytest

import effectmq
from tests.fixtures.redis import require_binary
from tests.support.processes import WorkerProcess

pytestmark = pytest.mark.slow
FAST = ["--lock-timeout", "1", "--maintenance-interval", "0.2", "--concurrency", "4"]


async def offer_retrying(queue, task_id, payload, deadline=30.0):
    """A careful producer: re-offer with the same id until Redis confirms (idempotent)."""
    end = time.monotonic() + deadline
    while True:
        try:
            return await queue.offer("work", payload, task_id=task_id)
        except effectmq.RedisUnavailable:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.05)


async def all_terminal(queue, ids, timeout=60.0):
    end = time.monotonic() + timeout
    while True:
        try:
            infos = [await queue.get(i) for i in ids]
            if all(i is not None and i.terminal for i in infos):
                return infos
        except effectmq.RedisUnavailable:
            pass
        if time.monotonic() > end:
            states = Counter(i.state if i else None for i in infos)
            raise AssertionError(f"not all tasks terminal after {timeout}s: {states}")
        await asyncio.sleep(0.1)


def assert_exactly_one_terminal_state(redis_client, queue_name, ids):
    base = f"{{emq:{queue_name}}}:"
    for tid in ids:
        memberships = [idx for idx in ("waiting", "delayed", "active", "completed", "failed", "canceled")
                       if redis_client.zscore(base + idx, tid) is not None]
        assert len(memberships) == 1 and memberships[0] in ("completed", "failed", "canceled"), (tid, memberships)


async def test_sigkill_mid_handler_loses_nothing(redis_url, redis_server, tmp_path):
    q = effectmq.TaskQueue("kill", url=redis_url)
    ids = [f"k{i}" for i in range(20)]
    for tid in ids:
        await q.offer("work", {"sleep": 0.3}, task_id=tid)
    a = WorkerProcess(redis_url, "kill", tmp_path, args=FAST, name="a")
    a.wait_for_effect(lambda lines: sum(1 for line in lines if line[0] == "start") >= 4)
    a.signal(signal.SIGKILL)
    a.proc.wait()
    started = {line[1] for line in a.effect_lines() if line[0] == "start"}
    killed = started - {line[1] for line in a.effect_lines() if line[0] == "done"}
    assert killed, "the kill should have caught attempts mid-handler"
    b = WorkerProcess(redis_url, "kill", tmp_path, args=FAST, name="b")
    try:
        infos = await all_terminal(q, ids)
    finally:
        b.stop()
    assert all(i.state == "completed" for i in infos)
    for info in infos:
        assert info.stalled_attempt_count == (1 if info.task_id in killed else 0)
    assert_exactly_one_terminal_state(redis_server.client(), "kill", ids)
    await q.close()


async def test_sigstopped_worker_cannot_ack_after_resuming(redis_url, tmp_path):
    q = effectmq.TaskQueue("stop", url=redis_url)
    await q.offer("work", {"sleep": 1.0}, task_id="s")
    a = WorkerProcess(redis_url, "stop", tmp_path, args=FAST, name="a")
    a.wait_for_effect(lambda lines: any(line[0] == "start" for line in lines))
    a.signal(signal.SIGSTOP)
    b = WorkerProcess(redis_url, "stop", tmp_path, args=FAST, name="b")
    try:
        assert (await q.wait("s", timeout=20))["attempt"] == 2  # B recovered and completed it
        a.signal(signal.SIGCONT)
        await asyncio.sleep(2.0)  # A wakes up past its lease and tries to settle
    finally:
        a.signal(signal.SIGCONT)
        a.stop()
        b.stop()
    info = await q.get("s")
    assert info.state == "completed" and info.result["pid"] == b.proc.pid and info.stalled_attempt_count == 1
    assert "lease lost" in a.log() or "interrupting task s" in a.log(), a.log()[-2000:]
    await q.close()


async def test_redis_restart_with_aof_mid_run(make_redis, tmp_path):
    server = make_redis(aof=True)
    q = effectmq.TaskQueue("aof", url=server.url)
    ids = [f"a{i}" for i in range(150)]
    worker = WorkerProcess(server.url, "aof", tmp_path, name="w",
                           args=["--lock-timeout", "5", "--maintenance-interval", "0.5", "--concurrency", "8"])
    try:
        for tid in ids[:100]:
            await offer_retrying(q, tid, {"sleep": 0.02})
        worker.wait_for_effect(lambda lines: sum(1 for line in lines if line[0] == "done") >= 20)
        server.restart()
        for tid in ids[100:]:
            await offer_retrying(q, tid, {"sleep": 0.02})
        infos = await all_terminal(q, ids, timeout=90)
    finally:
        worker.stop()
    assert all(i.state == "completed" for i in infos), Counter(i.state for i in infos)
    assert_exactly_one_terminal_state(server.client(), "aof", ids)
    done = Counter(line[1] for line in worker.effect_lines() if line[0] == "done")
    assert set(done) == set(ids)  # at least once each; repeats only around the restart
    await q.close()


async def test_sigterm_drains_and_releases(redis_url, tmp_path):
    q = effectmq.TaskQueue("drain", url=redis_url)
    await q.offer("work", {"sleep": 60}, task_id="long")
    await q.offer("work", {"sleep": 0.3}, task_id="short")
    w = WorkerProcess(redis_url, "drain", tmp_path, args=[*FAST, "--drain-timeout", "1.5"], name="w")
    w.wait_for_effect(lambda lines: sum(1 for line in lines if line[0] == "start") == 2)
    w.signal(signal.SIGTERM)
    assert w.proc.wait(15) == 0
    short, long = await q.get("short"), await q.get("long")
    assert short.state == "completed"
    assert long.state == "waiting" and long.stalled_attempt_count == 0 and long.handler_failure_count == 0
    await q.close()


LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


@pytest.mark.parametrize("skew", ["+1h", "-1h"])
async def test_worker_with_skewed_clock_keeps_ownership(redis_url, tmp_path, skew):
    if not os.path.exists(LIBFAKETIME):
        require_binary("libfaketime", f"{LIBFAKETIME} missing: install the Debian package libfaketime")
    q = effectmq.TaskQueue("skew", url=redis_url, lock_timeout=1)
    await q.offer("work", {"sleep": 3}, task_id="sk")  # needs several renewals
    w = WorkerProcess(redis_url, "skew", tmp_path, name="skewed",
                      env={"LD_PRELOAD": LIBFAKETIME, "FAKETIME": skew},
                      args=["--lock-timeout", "1", "--maintenance-interval", "0.2"])
    try:
        end = time.monotonic() + 3.5
        while time.monotonic() < end:  # an honest process sweeps expired leases meanwhile
            assert (await q.maintain()).recovered == 0
            await asyncio.sleep(0.1)
        result = await q.wait("sk", timeout=20)
    finally:
        w.stop()
    start = next((line for line in w.effect_lines() if line[0] == "start"), None)
    assert start, f"no start recorded: {w.effect_lines()} {w.log()[-3000:]}"
    offset = float(start[4]) - time.time()
    assert abs(abs(offset) - 3600) < 60, f"the worker's clock was not skewed ({offset:.0f}s)"
    info = await q.get("sk")
    assert result["attempt"] == 1 and info.stalled_attempt_count == 0 and info.attempt == 1
    await q.close()
