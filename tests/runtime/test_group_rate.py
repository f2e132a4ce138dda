"""Per-group rate limits on real Redis (lua/includes/group_caps.lua): at most N starts of a
group in any window of its period, by Redis time; acquire parks a pick of a group at its
limit and leases the next pick instead, hands the parked tasks back when the group's window
allows, and tells its caller when that is (next_due), so an idle worker sleeps until then.

Starts are read from Redis: each task runs once here, so its record's started_at (Redis
time of its lease) is its start. Each test checks the queue's invariants at its end.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import effectmq
from effectmq.protocol import protocol
from tests.runtime.test_group_caps import invariants
from tests.runtime.test_rate_limit import until_settled
from tests.support.acl import queue_user
from tests.support.inprocess import make_worker, running, until_drained
from tests.support.processes import WorkerProcess


async def starts_of(q: effectmq.TaskQueue, ids: list[str]) -> list[int]:
    """The Redis times (ms) the tasks' attempts started, sorted (each ran once)."""
    async with q.redis.pipeline(transaction=False) as pipe:
        for task_id in ids:
            pipe.hget(q.keys.task(task_id), "started_at")
        return sorted(int(at) for at in await pipe.execute())


def most_in_a_window(starts: list[int], period_ms: int) -> int:
    """The most starts in any window of `period_ms` (a start at the window's end is outside)."""
    return max((sum(1 for t in starts[i:] if t < s + period_ms) for i, s in enumerate(starts)), default=0)


async def lease_all(q: effectmq.TaskQueue, count: int, timeout: float) -> list[effectmq.Lease]:
    """Lease until `count` leases were taken, each completed at once, sleeping as told."""
    taken: list[effectmq.Lease] = []
    deadline = time.monotonic() + timeout
    while len(taken) < count:
        assert time.monotonic() < deadline, (len(taken), await q.stats())
        leases, next_due = await q.acquire_many(count - len(taken))
        for lease in leases:
            await lease.complete()
        taken += leases
        if not leases:
            await asyncio.sleep(min(next_due if next_due is not None else 0.05, 1.0))
    return taken


# -- what a limit holds back, and what it does not ----------------------------------------

async def test_a_group_at_its_limit_is_parked_while_other_groups_run(make_queue):
    q = make_queue("grate-park", lock_timeout=60)
    stats = await q.configure_group("a", rate_limit=(2, 60))
    assert stats.rate_limit == (2, 60.0)
    await q.offer_many([("t", {}, {"group": g, "task_id": f"{g}{i}"}) for g in ("a", "b") for i in range(5)])
    leases, _ = await lease_all_once(q, 10)
    by_group = {g: sorted(lease.task_id for lease in leases if lease.task_id.startswith(g)) for g in ("a", "b")}
    assert by_group == {"a": ["a0", "a1"], "b": ["b0", "b1", "b2", "b3", "b4"]}, by_group
    stats = await q.group_stats("a")
    assert (stats.parked + stats.waiting, stats.rate_limit) == (3, (2, 60.0)), stats
    assert stats.parked >= 1
    assert (await q.get("a2")).state == "waiting"
    # Nothing can start before a's window allows it: the reply says when (a minute and its guard).
    for _ in range(3):  # the ids still named are parked one call at a time
        leases, next_due = await q.acquire_many(5)
        assert leases == []
    assert next_due is not None and 59 < next_due <= 60.02, next_due
    assert (await q.group_stats("a")).parked == 3
    assert await q.redis.zscore(q.keys.key("group_due"), "a") is not None
    await invariants(q)


async def lease_all_once(q: effectmq.TaskQueue, count: int) -> tuple[list[effectmq.Lease], float | None]:
    """Up to three calls for `count` leases (the first may only learn the ready ids)."""
    leases: list[effectmq.Lease] = []
    next_due = None
    for _ in range(3):
        got, next_due = await q.acquire_many(count - len(leases))
        leases += got
        if len(leases) >= count:
            break
    return leases, next_due


async def test_the_parked_tasks_go_back_when_the_window_allows_and_no_window_holds_more(make_queue):
    q = make_queue("grate-window", lock_timeout=60)
    await q.configure_group("a", rate_limit=(2, 0.3))
    ids = [f"a{i}" for i in range(9)]
    await q.offer_many([("t", {}, {"group": "a", "task_id": task_id}) for task_id in ids])
    began = time.monotonic()
    await lease_all(q, 9, timeout=20)
    took = time.monotonic() - began
    starts = await starts_of(q, ids)
    assert most_in_a_window(starts, 300) == 2, starts
    assert 1.2 <= took, took  # 9 starts at 2 a window: 5 windows, the first at once
    assert (await q.group_stats("a")).parked == 0
    assert await q.redis.exists(q.keys.key("group_due")) == 0  # nothing parked: no group due
    await invariants(q)


async def test_a_groups_own_limit_beats_the_queues_default(make_queue):
    q = make_queue("grate-default", lock_timeout=60)
    await q.configure(group_rate_limit=(1, 60))
    assert (await q.configure_group("own", rate_limit=(3, 60))).rate_limit == (3, 60.0)
    assert (await q.configure_group("free", rate_limit=0)).rate_limit is None
    await q.offer_many([("t", {}, {"group": g, "task_id": f"{g}{i}"}) for g in ("a", "own", "free")
                        for i in range(5)])
    leases, _ = await lease_all_once(q, 15)
    by_group = {g: sum(1 for lease in leases if lease.task_id.startswith(g)) for g in ("a", "own", "free")}
    assert by_group == {"a": 1, "own": 3, "free": 5}, by_group
    assert (await q.group_stats("a")).rate_limit == (1, 60.0)
    assert (await q.configure_group("own", rate_limit=-1)).rate_limit == (1, 60.0)  # back to the queue's
    assert (await q.group_stats("free")).rate_limit is None
    await invariants(q)


async def test_removing_a_limit_hands_the_parked_tasks_back(make_queue):
    q = make_queue("grate-remove", lock_timeout=60)
    await q.configure_group("a", rate_limit=(1, 60))
    await q.configure(group_rate_limit=(1, 60))  # b's, the queue's default
    await q.offer_many([("t", {}, {"group": g, "task_id": f"{g}{i}"}) for g in ("a", "b") for i in range(4)])
    await lease_all_once(q, 8)
    for _ in range(3):
        await q.acquire_many(8)  # every id named is looked at, and parked
    parked = {g: (await q.group_stats(g)).parked for g in ("a", "b")}
    assert parked == {"a": 3, "b": 3}, parked
    stats = await q.configure_group("a", rate_limit=0)  # its own limit gone: no limit at all
    assert (stats.parked, stats.waiting, stats.rate_limit) == (0, 3, None), stats
    await q.configure(group_rate_limit=None)  # the default gone: b's go back too
    stats = await q.group_stats("b")
    assert (stats.parked, stats.waiting, stats.rate_limit) == (0, 3, None), stats
    leases, _ = await lease_all_once(q, 6)
    assert sorted(lease.task_id for lease in leases) == ["a1", "a2", "a3", "b1", "b2", "b3"]
    await invariants(q)


async def test_a_limit_and_a_cap_together_hold_both(make_queue):
    q = make_queue("grate-cap", lock_timeout=60)
    await q.configure_group("a", max_active=2, rate_limit=(3, 0.4))
    ids = [f"a{i}" for i in range(8)]
    await q.offer_many([("t", {}, {"group": "a", "task_id": task_id}) for task_id in ids])
    leases, _ = await lease_all_once(q, 8)
    assert len(leases) == 2  # the cap binds first
    for lease in leases:
        await lease.complete()
    rest = await lease_all(q, 6, timeout=20)
    assert len(rest) == 6
    assert most_in_a_window(await starts_of(q, ids), 400) <= 3
    await invariants(q)


async def test_the_starts_of_groups_that_stopped_are_swept_by_later_starts(make_queue):
    """Each call that logs starts trims one neighbouring group's old ones: the log keeps
    only live windows, whatever the number of groups that stopped starting."""
    q = make_queue("grate-sweep", lock_timeout=60)
    await q.configure(group_rate_limit=(5, 0.05))
    await q.configure_group("z", rate_limit=(100, 60))
    await q.configure_group("g3", rate_limit=0)  # its starts logged before: all of them go
    stopped = [f"g{i}" for i in range(5)]
    await q.offer_many([("t", {}, {"group": g, "task_id": f"{g}-{i}"}) for g in stopped for i in range(2)])
    await q.redis.zadd(q.keys.key("group_starts"), {"g3\0000000000000001\0" + "1": 0})
    await lease_all_once(q, 10)
    logged = [m.split("\0")[0] for m in await q.redis.zrange(q.keys.key("group_starts"), 0, -1)]
    assert [g for g in logged if g != "g3"] == ["g0", "g0", "g1", "g1", "g2", "g2", "g4", "g4"], logged
    await asyncio.sleep(0.1)  # their windows are over
    await q.offer_many([("t", {}, {"group": "z", "task_id": f"z{i}"}) for i in range(6)])
    for _ in range(6):
        await lease_all_once(q, 1)
    members = await q.redis.zrange(q.keys.key("group_starts"), 0, -1)
    assert [m.split("\0")[0] for m in members] == ["z"] * 6, members
    await invariants(q)


# -- bounds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, problem", [
    ((0, 1.0), ">= 1"), ((1, 0), ">="), ((100_001, 1), "<= 100000"), ((1, 86_401), "<= 86400"), (-2, "rate_limit"),
    ((1.5, 1), "integer"), (True, "rate_limit"), ("1/s", "rate_limit"),
])
async def test_a_bad_group_rate_limit_is_refused_before_anything_is_sent(make_queue, value, problem):
    q = make_queue("grate-bad")
    with pytest.raises(effectmq.InvalidOption, match=problem):
        await q.configure_group("a", rate_limit=value)
    assert await q.redis.exists(q.keys.key("group_ctl"), q.keys.key("meta")) == 0


async def test_the_script_refuses_a_bad_rate_limit_before_writing(make_queue):
    q = make_queue("grate-script-bad")
    for args in (protocol.ConfigureGroupArgs("a", rate_limit="5"), protocol.ConfigureGroupArgs("a", rate_limit="-2"),
                 protocol.ConfigureGroupArgs("a", rate_limit="5 1s"),
                 protocol.ConfigureGroupArgs("", rate_limit="5 1000")):
        with pytest.raises(effectmq.RedisRefused, match="invalid group setting"):
            await q._scripts.run(args)
    assert await q.redis.exists(q.keys.key("group_ctl"), q.keys.key("meta")) == 0


async def test_a_client_that_does_not_know_the_queue_counts_is_refused_before_writing(make_queue):
    """A rate limit starts the counting as a cap does: a call without the group keys is
    refused before anything (GROUPKEYS), then sent again with them."""
    q, other = make_queue("grate-keys", lock_timeout=60), make_queue("grate-keys", lock_timeout=60)
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(3)])
    (lease,), _ = await q.acquire_many(1)
    await lease.complete()
    assert not q._scripts.group_keys
    await other.configure(group_rate_limit=(1, 60))
    assert await q.redis.hget(q.keys.key("meta"), "group_caps") is not None
    before = await q.redis.hgetall(q.keys.task("a1"))
    args = protocol.AcquireArgs(1, 60_000, "p", 10, 8, 16, candidates=["a1", "a2"])
    refused = q._scripts._packed("acquire", args.argv(),
                                 q._scripts.task_keys(args.task_ids()) +
                                 q._scripts.last_keys(args.last_keys, args.optional_keys))
    replies = await q._scripts._send([refused], raw=False)
    assert str(replies[0]).startswith("GROUPKEYS ") and await q.redis.hgetall(q.keys.task("a1")) == before
    assert await q.redis.exists(q.keys.key("group_starts"), q.keys.key("backlog")) == 0
    leases, _ = await lease_all_once(q, 2)  # refused, then sent again with them
    assert [lease.task_id for lease in leases] == ["a1"] and q._scripts.group_keys
    await invariants(q)


# -- across workers ----------------------------------------------------------------------------

async def test_workers_in_one_process_keep_every_groups_window_and_sleep_until_it_allows(make_queue):
    q = make_queue("grate-inproc")
    await q.configure(group_rate_limit=(10, 0.5))
    ids = [f"{g}{i}" for g in "ab" for i in range(25)]
    await q.offer_many([("job", i, {"task_id": task_id, "group": task_id[0]}) for i, task_id in enumerate(ids)])
    began = time.monotonic()

    async def job(payload):
        return payload

    workers = [make_worker(q, {"job": job}, concurrency=8, prefetch=4) for _ in range(3)]
    async with running(workers[0]), running(workers[1]), running(workers[2]):
        await until_settled(q, len(ids), timeout=20)
        assert all(w._prefetch.ahead() == 0 for w in workers)  # no lease held ahead, whatever prefetch says
    took = time.monotonic() - began
    for g in "ab":
        starts = await starts_of(q, [i for i in ids if i[0] == g])
        assert most_in_a_window(starts, 500) == 10, (g, starts)
    assert took < 1.0 + 1.5, f"{took:.2f}s for 2 full windows and a half: workers slept past the next start"
    await invariants(q)


async def test_workers_hold_no_lease_ahead_once_a_group_has_its_own_limit(make_queue):
    # A group's own limit is not among the queue's settings a worker reads: with prefetch,
    # leases counted in one window started their handlers in the next (132 handler
    # starts in a 1 s window under a limit of 100, bench/rate_limit.py --group-rate).
    # A queue that counts its groups (a cap, a pause or a limit) now gets no lease held.
    q = make_queue("grate-own-prefetch")
    await q.configure_group("a", rate_limit=(10, 0.5))
    ids = [f"a{i}" for i in range(25)]
    await q.offer_many([("job", i, {"task_id": task_id, "group": "a"}) for i, task_id in enumerate(ids)])

    async def job(payload):
        return payload

    workers = [make_worker(q, {"job": job}, concurrency=8, prefetch=4) for _ in range(2)]
    async with running(workers[0]), running(workers[1]):
        await until_settled(q, len(ids), timeout=20)
        assert [w._prefetch.ahead() for w in workers] == [0, 0]  # was [4, 4]
    assert most_in_a_window(await starts_of(q, ids), 500) == 10
    await invariants(q)


async def test_two_worker_processes_never_start_more_of_a_group_than_its_limit(make_queue, redis_url, tmp_path):
    q = make_queue("grate-procs")
    await q.configure_group("a", rate_limit=(5, 0.5))
    a_ids, b_ids = [f"a{i:02}" for i in range(30)], [f"b{i:02}" for i in range(30)]
    await q.offer_many([("work", {"sleep": 0.01}, {"group": "a", "task_id": i}) for i in a_ids] +
                       [("work", {"sleep": 0.01}, {"group": "b", "task_id": i}) for i in b_ids])
    workers = [WorkerProcess(redis_url, "grate-procs", tmp_path, name=f"w{n}", args=["--concurrency", "4"])
               for n in range(2)]
    try:
        await until_settled(q, 60, timeout=60)
    finally:
        for w in workers:
            w.stop()
    a_starts, b_starts = await starts_of(q, a_ids), await starts_of(q, b_ids)
    assert most_in_a_window(a_starts, 500) == 5, a_starts
    assert a_starts[-1] - a_starts[0] >= 5 * 500  # 30 starts at 5 a window: 6 windows
    assert b_starts[-1] < a_starts[10], "b ran beside a, not after it"
    lines = workers[0].effect_lines()
    assert len({line[3] for line in lines if line[0] == "start" and line[1].startswith("a")}) == 2
    stats = await q.group_stats("a")
    assert (stats.parked, stats.waiting) == (0, 0)
    await invariants(q)


@pytest.mark.redis7  # the documented users are Redis 7's
async def test_a_restricted_user_as_documented_keeps_the_group_rate_limit(redis_server):
    with queue_user(redis_server, "rated", "grate-acl") as url:
        q = effectmq.TaskQueue("grate-acl", url=url)
        try:
            await q.configure(group_rate_limit=(3, 0.3))
            ids = [f"a{i}" for i in range(9)]
            await q.offer_many([("job", i, {"group": "a", "task_id": task_id}) for i, task_id in enumerate(ids)])

            async def job(payload):
                await asyncio.sleep(0.01)

            async with running(make_worker(q, {"job": job}, concurrency=6)):
                await until_settled(q, 9, timeout=20)
                await until_drained(q)
            assert most_in_a_window(await starts_of(q, ids), 300) == 3
            assert (await q.stats()).parked == 0
        finally:
            await q.close()
