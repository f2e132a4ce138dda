"""A queue's rate limit (settings rate_limit): at most `tasks` attempts start in any
window of `period` seconds, across every worker and process, by Redis time; and a hold of
the queue's starts (TaskQueue.hold_starts, a handler's RateLimited) for a downstream
service that answered 429.

The windows are checked on the lease start times Redis wrote (a task's started_at, Redis
time): for starts sorted in time, the one `tasks` places after any start comes at least
`period` later."""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from pathlib import Path

import pytest

import effectmq
from effectmq.client.engine import RateLimitedFor
from effectmq.protocol import protocol
from bench.rate_limit import most_in_a_window
from effectmq.protocol.protocol import AcquireStatus, Outcome
from tests.fixtures.redis import require_binary
from tests.support.acl import queue_user
from tests.support.inprocess import make_worker, running
from tests.support.processes import WorkerProcess

LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


async def start_times(q, ids) -> list[int]:
    """The Redis time (ms) each task's last lease started, sorted."""
    async with q.redis.pipeline(transaction=False) as pipe:
        for task_id in ids:
            pipe.hget(q.keys.task(task_id), "started_at")
        return sorted(int(s) for s in await pipe.execute())


async def redis_ms(q) -> float:
    seconds, micros = await q.redis.time()
    return seconds * 1000 + micros / 1000


async def until_settled(q, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (stats := await q.stats()).completed < count:
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


# -- values ------------------------------------------------------------------------------

BAD = [(0, 1.0), (100_001, 1.0), (1.5, 1.0), (True, 1.0), (10, 0), (10, 0.0001), (10, math.nan), (10, -1.0),
       (10, 86_401), (10, math.inf), (10, True), ("10", 1.0), (10,), (10, 1.0, 2), "10/s", 10]


@pytest.mark.parametrize("value", BAD, ids=repr)
async def test_a_rate_limit_out_of_its_bounds_is_refused_where_it_enters(make_queue, value):
    with pytest.raises(effectmq.InvalidOption, match="rate_limit"):
        make_queue("rate-bad", rate_limit=value)
    q = make_queue("rate-bad")
    with pytest.raises(effectmq.InvalidOption, match="rate_limit"):
        await q.configure(rate_limit=value)
    assert await q.redis.hget(q.keys.key("meta"), "rate_limit") is None


async def test_the_bounds_themselves_are_taken_and_read_back(make_queue):
    q = make_queue("rate-bounds")
    for value in [(1, 0.001), (100_000, 86_400.0), (5, 60)]:
        await q.configure(rate_limit=value)
        assert (await q.settings())["rate_limit"] == (value[0], float(value[1]))
    assert await q.redis.hget(q.keys.key("meta"), "rate_limit") == "5 60000"
    await q.configure(rate_limit=None)
    assert "rate_limit" not in await q.settings()


async def test_a_stored_limit_beyond_its_bounds_is_clamped_where_lua_reads_it(make_queue):
    q = make_queue("rate-clamp")
    await q.redis.hset(q.keys.key("meta"), "rate_limit", f"{10 ** 9} 0")  # written by hand: 1e9 per 0 ms
    assert (await q.settings())["rate_limit"] == (100_000, 0.001)
    await q.offer_many([("job", i) for i in range(3)])
    leases, _ = await q.acquire_many(3)
    assert len(leases) == 3
    assert await q.redis.pttl(q.keys.key("starts")) in (-2, 0, 1)  # the period read as 1 ms (gone, or going)
    await q.redis.hset(q.keys.key("meta"), "rate_limit", "2 999999999999")  # a period of 31 years
    await q.offer_many([("job", i) for i in range(3)])
    await asyncio.sleep(0.01)
    leases, next_due = await q.acquire_many(3)
    assert len(leases) == 2
    assert 86_000_000 < await q.redis.pttl(q.keys.key("starts")) <= 86_400_000 + protocol.RATE_GUARD  # a day


# -- the window --------------------------------------------------------------------------

async def test_a_call_leases_only_the_room_left_and_says_when_the_next_may_start(make_queue):
    q = make_queue("rate-room")
    await q.configure(rate_limit=(3, 2.0))
    await q.offer_many([("job", i, {"task_id": f"t{i}"}) for i in range(5)])
    leases, _ = await q.acquire_many(2)
    assert len(leases) == 2
    leases += (await q.acquire_many(5))[0]
    assert len(leases) == 3  # the room left: one
    before = await redis_ms(q)
    more, wait = await q.acquire_many(5)
    after = await redis_ms(q)
    assert more == [] and isinstance(wait, RateLimitedFor)
    (_, first), = await q.redis.zrange(q.keys.key("starts"), 0, 0, withscores=True)
    allowed = first + 2000 + 20  # the first start plus the period and its guard
    assert allowed - after - 1 <= wait * 1000 <= allowed - before + 1
    # The completions sent along are settled all the same.
    outcomes, none = await q.engine.complete_and_acquire([(lease, "1") for lease in leases], 2)
    assert outcomes == [Outcome.COMPLETED] * 3 and none == []
    assert (await q.stats()).completed == 3
    await asyncio.sleep(wait + 0.01)
    assert len((await q.acquire_many(5))[0]) == 2  # a new window: the last two


@pytest.mark.parametrize("period, guard", [(2.0, 20), (0.5, 5), (0.05, 0)])
async def test_a_start_waits_for_its_period_and_a_guard_of_a_hundredth_of_it(make_queue, period, guard):
    """At most 20 ms: the varying delay from a lease to its handler's start, so that handler
    starts keep to the window too (bench/rate_limit.py measures both)."""
    q = make_queue("rate-guard")
    await q.configure(rate_limit=(1, period))
    await q.offer_many([("job", i) for i in range(2)])
    await q.acquire_many(1)
    first = await q.redis.zrange(q.keys.key("starts"), 0, 0, withscores=True)
    reply = await q._scripts.run(protocol.AcquireArgs(1, 1000, "p", 10, 32, 16))
    assert reply.status is AcquireStatus.RATE_LIMITED
    assert reply.next_due == first[0][1] + period * 1000 + guard


def test_the_bounds_in_lua_are_the_protocols():
    source = (Path(protocol.__file__).parent / "lua" / "includes" / "rate.lua").read_text()
    found = {name: int(value) for value, name in re.findall(r"= (\d+)  -- protocol\.(\w+)", source)}
    assert found == {"MAX_RATE_TASKS": protocol.MAX_RATE_TASKS, "MAX_RATE_PERIOD": protocol.MAX_RATE_PERIOD * 1000,
                     "MAX_HOLD": protocol.MAX_HOLD * 1000, "RATE_GUARD": protocol.RATE_GUARD}


async def test_the_log_of_starts_holds_no_more_than_the_limit(make_queue):
    q = make_queue("rate-bounded")
    await q.configure(rate_limit=(5, 0.05))
    await q.offer_many([("job", i) for i in range(40)])
    for _ in range(8):
        leases, _ = await q.acquire_many(10)
        assert len(leases) <= 5
        await q.engine.complete_many([(lease, "1") for lease in leases])
        assert await q.redis.zcard(q.keys.key("starts")) <= 5
        await asyncio.sleep(0.06)
    members = await q.redis.zrange(q.keys.key("starts"), 0, -1)
    assert all(m.isdigit() for m in members)  # sequence numbers, never tokens


async def test_workers_in_one_process_keep_every_window(make_queue):
    q = make_queue("rate-inproc")
    await q.configure(rate_limit=(10, 0.5))
    ids = [f"t{i}" for i in range(45)]
    await q.offer_many([("job", i, {"task_id": task_id}) for i, task_id in enumerate(ids)])
    began = time.monotonic()

    async def job(payload):
        return payload

    workers = [make_worker(q, {"job": job}, concurrency=8, prefetch=4) for _ in range(3)]
    async with running(workers[0]), running(workers[1]), running(workers[2]):
        await until_settled(q, len(ids), timeout=20)
        assert all(w._prefetch.ahead() == 0 for w in workers)  # no lease held ahead, whatever prefetch says
    took = time.monotonic() - began
    starts = await start_times(q, ids)
    assert most_in_a_window(starts, 500) == 10
    assert all(starts[i + 10] - starts[i] >= 500 for i in range(len(starts) - 10))
    assert took < 2.0 + 1.0, f"{took:.2f}s for 4 full windows and a half: workers slept past the next start"


async def test_worker_processes_keep_every_window(redis_url, tmp_path):
    q = effectmq.TaskQueue("rate-procs", url=redis_url)
    try:
        await q.configure(rate_limit=(5, 1.0))
        ids = [f"t{i}" for i in range(20)]
        procs = [WorkerProcess(redis_url, "rate-procs", tmp_path, name=f"w{i}", args=["--concurrency", "4"])
                 for i in range(3)]
        try:
            deadline = time.monotonic() + 30
            while len(await q.workers()) < 3:  # all three announced: each competes from the first window
                assert time.monotonic() < deadline, [p.log()[-2000:] for p in procs]
                await asyncio.sleep(0.1)
            await q.offer_many([("work", {}, {"task_id": task_id}) for task_id in ids])
            await until_settled(q, len(ids), timeout=40)
        finally:
            for p in procs:
                p.stop()
        starts = await start_times(q, ids)
        assert most_in_a_window(starts, 1000) == 5, starts
        assert len({line[3] for line in procs[0].effect_lines() if line[0] == "start"}) >= 2  # several processes ran
        assert starts[-1] - starts[0] < 3000 + 1500  # 4 windows: woken when the next start was allowed
    finally:
        await q.close()


async def test_a_short_period_spaces_the_starts_in_windows(make_queue):
    """5 per minute, as 3 per 2 s: the first three at once, then three per window."""
    q = make_queue("rate-short")
    await q.configure(rate_limit=(3, 2.0))
    ids = [f"t{i}" for i in range(7)]
    await q.offer_many([("job", i, {"task_id": task_id}) for i, task_id in enumerate(ids)])

    async def job(payload):
        return payload

    async with running(make_worker(q, {"job": job}, concurrency=10)):
        await until_settled(q, len(ids), timeout=15)
    starts = await start_times(q, ids)
    waves = [(at - starts[0]) // 1000 for at in starts]  # 0, 2 and 4 s after the first
    assert waves == [0, 0, 0, 2, 2, 2, 4], starts


async def test_the_limit_of_a_taskqueue_applies_while_none_is_stored_and_a_stored_one_wins(make_queue):
    own = make_queue("rate-own", rate_limit=(2, 60))
    await own.offer_many([("job", i) for i in range(6)])
    assert len((await own.acquire_many(6))[0]) == 2  # its own
    await own.configure(rate_limit=(3, 60))
    assert len((await own.acquire_many(6))[0]) == 1  # the stored one: 3 in the window
    await own.configure(rate_limit=None)
    assert len((await own.acquire_many(6))[0]) == 0  # its own again (3 started already)
    other = make_queue("rate-own")
    assert len((await other.acquire_many(6))[0]) == 3  # a TaskQueue without one: no limit


async def test_removing_the_limit_lifts_it_for_running_workers(make_queue):
    q = make_queue("rate-lift")
    await q.configure(rate_limit=(1, 60))
    await q.offer_many([("job", i, {"task_id": f"t{i}"}) for i in range(3)])

    async def job(payload):
        return payload

    async with running(make_worker(q, {"job": job}, idle_poll=0.5)):
        await until_settled(q, 1, timeout=10)
        await asyncio.sleep(0.3)
        assert (await q.stats()).completed == 1
        await q.configure(rate_limit=None)
        await until_settled(q, 3, timeout=5)  # within idle_poll


# -- a hold of starts (429 Retry-After) ----------------------------------------------------

async def test_a_hold_is_extended_never_shortened_and_bounded(make_queue):
    q = make_queue("rate-hold")
    assert 4.9 < await q.hold_starts(5) <= 5
    assert 4.8 < await q.hold_starts(1) <= 5  # the longer one stays
    assert 9.9 < await q.hold_starts(10) <= 10
    for bad in (-1, math.nan, math.inf, True, "5", protocol.MAX_HOLD + 1):
        with pytest.raises(effectmq.InvalidOption, match="seconds"):
            await q.hold_starts(bad)
    stats = await q.stats()
    assert 9 < stats.starts_held_for <= 10
    await q.offer("job", 1)
    leases, wait = await q.acquire_many(1)
    assert leases == [] and isinstance(wait, RateLimitedFor) and 9 < wait <= 10
    # held_until_ms written by hand beyond the bound: read as a day at most
    await q.redis.hset(q.keys.key("meta"), "held_until_ms", str(2 ** 60))
    reply = await q._scripts.run(protocol.AcquireArgs(1, 1000, "p", 10, 32, 16))
    assert reply.status is AcquireStatus.RATE_LIMITED
    assert reply.next_due - reply.now == protocol.MAX_HOLD * 1000


async def test_a_handler_that_raises_rate_limited_holds_the_queue_and_its_task_goes_back(make_queue):
    q = make_queue("rate-429", lock_timeout=5)
    await q.offer_many([("job", i, {"task_id": f"t{i}"}) for i in range(4)])
    turned_away = asyncio.Event()
    ran: list[tuple[str, float]] = []

    async def job(payload, ctx):
        if ctx.task_id == "t0" and ctx.attempt == 1:
            turned_away.set()
            raise effectmq.RateLimited(retry_after=1.0)
        ran.append((ctx.task_id, time.monotonic()))
        return payload

    async with running(make_worker(q, {"job": job}, concurrency=1, prefetch=0)):
        await asyncio.wait_for(turned_away.wait(), 5)
        held_at = time.monotonic()
        await until_settled(q, 4, timeout=10)
    assert ran and min(at for _, at in ran) - held_at > 0.8  # nothing started while held
    info = await q.get("t0")
    assert info.state == "completed" and info.attempt == 2 and info.handler_failure_count == 0
    assert info.stalled_attempt_count == 0


async def test_a_rate_limited_with_a_retry_after_out_of_bounds_fails_the_attempt(make_queue):
    q = make_queue("rate-429-bad", lock_timeout=5)
    await q.offer("job", 1, task_id="t", max_retries=0)

    async def job(payload):
        raise effectmq.RateLimited(retry_after=protocol.MAX_HOLD * 2)

    async with running(make_worker(q, {"job": job})):
        info = await q.get("t")
        for _ in range(100):
            if (info := await q.get("t")).state == "failed":
                break
            await asyncio.sleep(0.05)
    assert info.state == "failed" and "retry_after" in info.error.message
    assert (await q.stats()).starts_held_for == 0


async def test_a_worker_waits_out_the_limit_without_asking_on_every_offer(make_queue):
    """Offers while the limit allows no start wake nobody who would only be told no."""
    q = make_queue("rate-quiet")
    await q.configure(rate_limit=(1, 3.0))
    calls = 0
    acquire_many = q.acquire_many

    async def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return await acquire_many(*args, **kwargs)

    q.acquire_many = counted

    async def job(payload):
        return payload

    worker = make_worker(q, {"job": job}, concurrency=2, idle_poll=5.0)
    async with running(worker):
        await q.offer("job", 0)
        await until_settled(q, 1, timeout=5)
        calls = 0
        for i in range(20):
            await q.offer("job", i)
            await asyncio.sleep(0.05)
        assert calls <= 2, f"{calls} acquire calls while the limit allowed no start"
    waited = worker._rate_limited_seconds._value.get()
    assert waited > 0.5 and worker._rate_limited_replies._value.get() >= 1


# -- Redis time decides ----------------------------------------------------------------------

@pytest.mark.parametrize("skew", ["+1h", "-1h"])
async def test_a_worker_with_a_skewed_clock_keeps_the_windows(redis_url, tmp_path, skew):
    if not os.path.exists(LIBFAKETIME):
        require_binary("libfaketime", f"{LIBFAKETIME} missing: install the Debian package libfaketime")
    q = effectmq.TaskQueue("rate-skew", url=redis_url)
    try:
        await q.configure(rate_limit=(3, 1.0))
        ids = [f"t{i}" for i in range(9)]
        await q.offer_many([("work", {}, {"task_id": task_id}) for task_id in ids])
        w = WorkerProcess(redis_url, "rate-skew", tmp_path, name="skewed", env={"LD_PRELOAD": LIBFAKETIME,
                                                                                   "FAKETIME": skew})
        try:
            await until_settled(q, len(ids), timeout=30)
        finally:
            w.stop()
        start = next(line for line in w.effect_lines() if line[0] == "start")
        assert abs(abs(float(start[4]) - time.time()) - 3600) < 60, "the worker's clock was not skewed"
        starts = await start_times(q, ids)
        assert most_in_a_window(starts, 1000) == 3
        assert starts[-1] - starts[0] < 2000 + 1500  # slept until the next start, by Redis time
    finally:
        await q.close()


# -- what it costs ---------------------------------------------------------------------------

def command_calls(client) -> dict[str, int]:
    return {name[len("cmdstat_"):]: int(v["calls"]) for name, v in client.info("commandstats").items()}


async def test_no_limit_costs_no_redis_call_and_a_limit_four(make_queue, redis_server):
    """The limit is read from the meta hash acquire reads anyway (one HGETALL per call);
    set, it costs a ZCOUNT and, when leases start, a ZADD, a trim and an expiry."""
    admin = redis_server.client()

    async def one_lease(name: str, **options) -> dict[str, int]:
        q = make_queue(name)
        if options:
            await q.configure(**options)
        await q.offer_many([("job", i) for i in range(2)])
        await q.acquire_many(1)  # learns the ids
        admin.config_resetstat()
        (lease,), _ = await q.acquire_many(1)
        return command_calls(admin)

    unset = await one_lease("rate-cost-unset")
    limited = await one_lease("rate-cost-set", rate_limit=(100, 1.0))
    assert unset["hgetall"] == 1 and "zremrangebyrank" not in unset and "pexpire" not in unset
    extra = {name: limited.get(name, 0) - unset.get(name, 0) for name in set(limited) | set(unset)}
    assert {name: n for name, n in extra.items() if n} == {"zcount": 1, "zadd": 1, "zremrangebyrank": 1,
                                                           "pexpire": 1}


# -- a restricted Redis user -------------------------------------------------------------------

@pytest.mark.redis7  # the documented users are Redis 7's
async def test_a_restricted_user_keeps_the_limit(redis_server):
    with queue_user(redis_server, "ratelimited", "rate-acl") as url:
        q = effectmq.TaskQueue("rate-acl", url=url)
        try:
            await q.configure(rate_limit=(4, 0.5))
            ids = [f"t{i}" for i in range(12)]
            await q.offer_many([("job", i, {"task_id": task_id}) for i, task_id in enumerate(ids)])

            async def job(payload):
                return payload

            async with running(make_worker(q, {"job": job}, concurrency=4)):
                await until_settled(q, len(ids), timeout=10)
                assert 0 < await q.hold_starts(0.2) <= 0.2
            assert most_in_a_window(await start_times(q, ids), 500) == 4
            stats = await q.stats()
            assert stats.rate_limit == (4, 0.5)
        finally:
            await q.close()


async def test_stats_show_the_limit_the_window_and_a_hold(make_queue):
    q = make_queue("rate-stats")
    stats = await q.stats()
    assert (stats.rate_limit, stats.rate_window_starts, stats.starts_held_for) == (None, 0, 0.0)
    await q.configure(rate_limit=(5, 60))
    await q.offer_many([("job", i) for i in range(3)])
    await q.acquire_many(3)
    await q.acquire_many(3)
    await q.hold_starts(30)
    stats = await q.stats()
    assert stats.rate_limit == (5, 60.0) and stats.rate_window_starts == 3 and 29 < stats.starts_held_for <= 30
    assert stats.to_json()["rate_limit"] == (5, 60.0)
