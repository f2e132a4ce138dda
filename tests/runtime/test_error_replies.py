"""Redis error replies (OOM, BUSY, READONLY, LOADING) during a run with long handlers:
no worker loop dies, no healthy attempt stalls, every task completes.

Each fault is real: `CONFIG SET maxmemory`, a long-running EVAL, `REPLICAOF` an
unreachable primary, a restart that loads a large dataset slowly.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.exceptions as redis_errors
from redis.backoff import NoBackoff
from redis.retry import Retry

import effectmq
from tests.fixtures.redis import free_port, server_version
from tests.support.inprocess import make_worker, running, settled

pytestmark = pytest.mark.slow


def hold_oom(server, seconds):
    r = server.client()
    r.config_set("maxmemory", "1")
    time.sleep(seconds)
    r.config_set("maxmemory", "0")


def hold_busy(server, seconds):
    r = server.client()
    r.config_set("busy-reply-threshold" if server_version() >= (7, 0) else "lua-time-limit", "100")
    # A script that spins on TIME: every other client gets BUSY until it ends.
    spin = """
    local t = redis.call('TIME'); local start = t[1] * 1000000 + t[2]
    while true do
      t = redis.call('TIME')
      if t[1] * 1000000 + t[2] - start > tonumber(ARGV[1]) then return 1 end
    end"""
    r.eval(spin, 0, int(seconds * 1_000_000))


def hold_readonly(server, seconds):
    r = server.client()
    r.execute_command("REPLICAOF", "127.0.0.1", free_port())  # never reachable: the data stays
    time.sleep(seconds)
    r.execute_command("REPLICAOF", "NO", "ONE")


FAULTS = {"oom": hold_oom, "busy": hold_busy, "readonly": hold_readonly}


async def retrying(call, *args, **kwargs):
    """A careful client: a refusal for now (LOADING just after the fault) is tried again."""
    for _ in range(100):
        try:
            return await call(*args, **kwargs)
        except effectmq.RedisUnavailable:
            await asyncio.sleep(0.1)
    return await call(*args, **kwargs)


async def long_tasks_through(server, fault, *, lock_timeout=3.0, handler_seconds=4.0, fault_seconds=1.2):
    """Four long attempts and an idle slot polling; the fault lands mid-run. The 1.2 s fault
    fits well inside a 3 s lease's safety window (with 2 s, a loaded machine's slow renewal
    after a BUSY spell once lost the leases in the full run: 'could not be confirmed')."""
    q = effectmq.TaskQueue("replies", url=server.url, lock_timeout=lock_timeout, max_stalled_count=5)
    ran: list[tuple[str, int]] = []

    async def slow(payload, ctx):
        ran.append((ctx.task_id, ctx.attempt))
        await asyncio.sleep(payload["sleep"])
        return ctx.attempt

    worker = make_worker(q, {"slow": slow}, concurrency=6, idle_poll=0.2)
    # An attempt abandoned by a dead consumer: only a live maintenance loop recovers it.
    await q.offer("slow", {"sleep": 0.01}, task_id="abandoned")
    assert (await q.acquire(lock_timeout=0.5)).task_id == "abandoned"
    async with running(worker) as run:
        for i in range(4):
            await q.offer("slow", {"sleep": handler_seconds}, task_id=f"long-{i}")
        await asyncio.sleep(0.4)
        await asyncio.to_thread(fault, server, fault_seconds)
        assert not run.done(), "worker.run() ended during the fault"
        for i in range(4):  # offered after the fault: the acquire loop is alive
            await retrying(q.offer, "slow", {"sleep": 0.01}, task_id=f"after-{i}")
        ids = [f"long-{i}" for i in range(4)] + [f"after-{i}" for i in range(4)] + ["abandoned"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = {i: await retrying(q.get, i) for i in ids}
            if all(info.state == "completed" for info in infos.values()):
                break
            await asyncio.sleep(0.1)
        live = await q.workers()
    await q.close()
    states = {i: (info.state, info.attempt, info.stalled_attempt_count) for i, info in infos.items()}
    for i in ids[:-1]:
        assert states[i] == ("completed", 1, 0), (fault, states)  # no healthy attempt stalled
    assert states["abandoned"] == ("completed", 2, 1), (fault, states)  # maintenance kept running
    assert worker.name in live  # the announce loop kept running
    return ran


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_error_replies_kill_no_loop(make_redis, fault):
    server = make_redis()
    await long_tasks_through(server, FAULTS[fault])


@pytest.mark.redis7  # loading-process-events-interval-bytes is 7.0's: 6.2 answers nothing while it loads
async def test_loading_after_a_restart_kills_no_loop(make_redis):
    """A restart that loads slowly: connection refused, then LOADING for about 2 s."""
    server = make_redis(aof=True, extra_args=("--key-load-delay", "100",
                                              "--loading-process-events-interval-bytes", "1024"))
    filler = server.client()
    with filler.pipeline(transaction=False) as pipe:
        for i in range(20_000):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
    filler.bgrewriteaof()  # the keys go into the AOF's RDB base, which loads key by key

    def restart_loading(server, _seconds):
        while filler.info("persistence")["aof_rewrite_in_progress"]:
            time.sleep(0.05)
        server.stop()
        threading.Thread(target=server.start, daemon=True).start()
        probe = redis.Redis(port=server.port, socket_connect_timeout=0.2,
                            retry=Retry(NoBackoff(), 0))  # see the reply, not redis-py's retries
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # LOADING was really answered
            try:
                probe.get("filler:0")  # PING is served while loading; a read is not
            except redis_errors.ConnectionError as exc:  # BusyLoadingError, or LOADING while connecting
                if "loading" in str(exc).lower():
                    return
            time.sleep(0.02)
        raise AssertionError("the restart never answered LOADING")

    await long_tasks_through(server, restart_loading, lock_timeout=8.0, handler_seconds=6.0)


def parsed(reply: str) -> redis_errors.RedisError:
    """The exception redis-py's parser makes of an error reply (its class, its text: some
    versions strip the code from the text, 6 and later keep it as `status_code`)."""
    from redis._parsers.base import BaseParser

    return BaseParser.parse_error(reply)


@pytest.mark.parametrize("reply, code, retryable", [
    (parsed("OOM command not allowed when used memory > 'maxmemory'."), "OOM", True),
    (parsed("BUSY Redis is busy running a script."), "BUSY", True),
    (parsed("READONLY You can't write against a read only replica."), "READONLY", True),
    (parsed("LOADING Redis is loading the dataset in memory"), "LOADING", True),
    (parsed("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."), "MASTERDOWN", True),
    (parsed("TRYAGAIN Multiple keys request during rehashing of slot"), "TRYAGAIN", True),
    (parsed("CLUSTERDOWN The cluster is down"), "CLUSTERDOWN", True),
    (parsed("MISCONF Redis is configured to save RDB snapshots"), "MISCONF", True),
    (parsed("NOREPLICAS Not enough good replicas to write."), "NOREPLICAS", True),
    (redis_errors.ConnectionError("Connection reset by peer"), "CONNECTION", True),
    (redis_errors.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."), "CONNECTION", True),
    (redis_errors.TimeoutError("Timeout reading from socket"), "TIMEOUT", True),
    (parsed("WRONGPASS invalid username-password pair or user is disabled."), "AUTH", False),
    (parsed("NOPERM this user has no permissions to run the 'evalsha' command"), "NOPERM", False),
    (parsed("WRONGTYPE Operation against a key holding the wrong kind of value"), "WRONGTYPE", False),
    (parsed("ERR Error running script (call to f_0123): @user_script:1: bug"), "ERR", False),
    # Redis 6.2 wraps the error of a command a script ran; 7 passes it on as it is
    (parsed("ERR Error running script (call to f_94ae): @user_script:158: @user_script: 158: -OOM command not "
            "allowed when used memory > 'maxmemory'."), "OOM", True),
    (parsed("ERR Error running script (call to f_6104): @user_script:422: @user_script: 422: -READONLY You can't "
            "write against a read only replica."), "READONLY", True),
])
def test_every_reply_class_is_classified(reply, code, retryable):
    from effectmq.transport.connection import classify_reply

    kind = classify_reply(reply)
    assert (kind.code, kind.retryable) == (code, retryable), (reply, kind)  # the log line names the class


@pytest.mark.parametrize("text, code, retryable", [
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", "BUSY", True),
    ("LOADING Redis is loading the dataset in memory", "LOADING", True),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", "WRONGTYPE", False),
])
def test_a_reply_to_a_pipelined_command_is_classified_by_its_own_code(text, code, retryable):
    """redis-py puts the command in front of a pipelined command's error: a BUSY reply to
    maintenance's pipeline was taken for ERR and stopped the worker (a CI run of 5178c5f)."""
    from redis.asyncio.client import Pipeline

    from effectmq.transport.connection import classify_reply

    reply = parsed(text)
    Pipeline.annotate_exception(None, reply, 1, ["ZRANGE", "{emq:q}:active", "-inf", "1796213196220", "BYSCORE"])
    assert str(reply).startswith("Command # 1 (ZRANGE"), str(reply)
    kind = classify_reply(reply)
    assert (kind.code, kind.retryable) == (code, retryable), (str(reply), kind)


async def test_a_full_redis_lets_the_attempts_in_flight_renew_and_settle(make_redis):
    """Redis at maxmemory (noeviction) for longer than a lease: offers are refused, but the
    attempts already running keep their leases and settle, results kept (the default
    retention), instead of being interrupted and stalling, and the worker stays listed.
    Before, the first write of renew, complete, fail and the worker's announcement was
    refused with OOM: every attempt ended ~effectmq/Error/Stalled within 4 s."""
    server = make_redis()
    q = effectmq.TaskQueue("full", url=server.url, lock_timeout=1.0)
    release = asyncio.Event()
    running_now: set[str] = set()

    async def slow(payload, ctx):
        running_now.add(ctx.task_id)
        await release.wait()
        if payload["fails"]:
            raise RuntimeError("a failure, under OOM")
        return {"done": ctx.task_id}

    worker = make_worker(q, {"slow": slow}, concurrency=4)
    admin = server.client()
    async with running(worker):
        for i in range(4):
            await q.offer("slow", {"fails": i == 3}, task_id=f"t{i}", max_retries=0)
        while len(running_now) < 4:
            await asyncio.sleep(0.02)
        admin.config_set("maxmemory", "1")
        try:
            with pytest.raises(effectmq.RedisUnavailable, match="OOM"):
                await q.offer("slow", {"fails": False}, task_id="refused")
            # Longer than six leases and than a worker's announcement lives (6 s): only
            # renewals and announcements under OOM keep the leases and the worker listed
            # (the operator spares busy pods on scale-in by that list).
            await asyncio.sleep(6.5)
            assert worker.name in await q.workers()
            release.set()
            infos = {}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                infos = {f"t{i}": await q.get(f"t{i}") for i in range(4)}
                if all(info.state in ("completed", "failed") for info in infos.values()):
                    break
                await asyncio.sleep(0.1)
        finally:
            admin.config_set("maxmemory", "0")
    await q.close()
    states = {i: (info.state, info.attempt, info.stalled_attempt_count) for i, info in infos.items()}
    assert states == {"t0": ("completed", 1, 0), "t1": ("completed", 1, 0), "t2": ("completed", 1, 0),
                      "t3": ("failed", 1, 0)}, states
    assert infos["t0"].result == {"done": "t0"}
    assert infos["t3"].error.tag == "~effectmq/Error/Defect"  # undeclared: a defect, settled once


async def test_a_full_redis_still_recovers_stalls_and_hands_out_the_backlog(make_redis):
    """At maxmemory, the queue can be paused and resumed, maintenance recovers an expired
    lease and promotes a due task, and acquire hands both out (the stale attempt stays
    fenced). Before, pause was refused with OOM, and so was every acquire call that leased
    nothing: it wrote its naming hint first."""
    server = make_redis()
    q = effectmq.TaskQueue("full", url=server.url, max_stalled_count=3)
    admin = server.client()
    await q.offer("job", {}, task_id="stalls")
    await q.offer("job", {}, task_id="delayed", delay=0.5)
    stale = await q.acquire(lock_timeout=0.3)
    admin.config_set("maxmemory", "1")
    try:
        await q.pause()  # what an operator of a full Redis may do first
        await asyncio.sleep(0.7)
        assert await q.acquire() is None
        await q.resume()
        report = await q.maintain()
        assert (report.recovered, report.promoted) == (1, 1), report
        leases = [await q.acquire(), await q.acquire()]
        assert sorted((lease.task_id, lease.attempt) for lease in leases) == [("delayed", 1), ("stalls", 2)]
        assert await q.acquire() is None
        with pytest.raises(effectmq.LeaseLost):
            await stale.complete("late")
        for lease in leases:
            await lease.complete("done")
        assert [(await q.get(i)).state for i in ("stalls", "delayed")] == ["completed", "completed"]
    finally:
        admin.config_set("maxmemory", "0")
    await q.close()


async def test_a_progress_report_redis_refuses_does_not_fail_the_attempt(make_redis):
    """Progress is advice: when Redis refuses it for now (here: full), ctx.progress says so
    (False) and the handler goes on; a stored report returns True. Before, RedisUnavailable
    reached the handler and failed the attempt: the task ended failed after 4 attempts."""
    server = make_redis()
    q = effectmq.TaskQueue("full", url=server.url)
    admin = server.client()
    reports: list[bool] = []

    async def reports_progress(payload, ctx):
        reports.append(await ctx.progress({"step": 1}))
        admin.config_set("maxmemory", "1")
        try:
            reports.append(await ctx.progress({"step": 2}))
        finally:
            admin.config_set("maxmemory", "0")
        return "done"

    await q.offer("job", {}, task_id="p")
    async with running(make_worker(q, {"job": reports_progress}, concurrency=1)):
        info = await settled(q, "p")
    await q.close()
    assert (info.state, info.attempt, info.result, info.progress) == ("completed", 1, "done", {"step": 1}), info
    assert reports == [True, False]


@pytest.mark.parametrize("redis_args, warned", [
    (("--maxmemory-policy", "allkeys-lru"), True),
    (("--maxmemory-policy", "volatile-ttl"), True),
    (("--maxmemory-policy", "noeviction"), False),
    (("--rename-command", "CONFIG", ""), False),  # a managed Redis that does not say: no guess
])
async def test_a_worker_warns_once_when_redis_may_evict_tasks(make_redis, caplog, redis_args, warned):
    """docs/operations.md requires maxmemory-policy noeviction (an evicted key is lost work);
    a worker started against a Redis that evicts says so at start, as BullMQ does, and runs."""
    server = make_redis(extra_args=redis_args)
    q = effectmq.TaskQueue("evicts", url=server.url)
    ran = asyncio.Event()

    async def job(payload):
        ran.set()

    caplog.set_level("WARNING", logger="effectmq.worker")
    async with running(make_worker(q, {"job": job})):
        await q.offer("job", {})
        await asyncio.wait_for(ran.wait(), 10)
    await q.close()
    warnings = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    if warned:
        assert len(warnings) == 1, warnings
        assert f"maxmemory-policy {redis_args[1]}" in warnings[0] and "set maxmemory-policy noeviction" in warnings[0]
    else:
        assert warnings == []
