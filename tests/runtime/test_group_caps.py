"""Per-group caps and pause on real Redis (lua/includes/group_caps.lua): acquire parks a
task whose group is paused or at its cap and leases the next pick instead; every way an
attempt ends frees its group's slot and hands a parked task back; resume and a raised cap
hand them back; worker processes never run more of a group than its cap.

Each test checks the queue's invariants from Redis alone at its end (tests/support/
write_rule.py queue_invariants: a parked task is in no index but the backlog, each group's
counts of waiting and running tasks are what the tasks say).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis.asyncio as aioredis

import effectmq
from effectmq.client.queue import MAX_GROUP_BYTES, MAX_LIST
from effectmq.errors import TaskError
from effectmq.protocol import protocol
from tests.runtime.test_rate_limit import until_settled
from tests.support.acl import queue_user
from tests.support.inprocess import make_worker, running, until_drained
from tests.support.processes import WorkerProcess
from tests.support.write_rule import queue_invariants


async def invariants(q: effectmq.TaskQueue) -> dict:
    raw = aioredis.Redis.from_url(q.url)
    try:
        return await queue_invariants(raw, q.keys.base.encode())
    finally:
        await raw.aclose()


def most_at_once(lines: list[list[str]], prefix: str) -> int:
    """The most attempts of tasks whose id starts with `prefix` running at once, from the
    handlers' own start and done lines (a done at the same instant as a start comes first)."""
    events = sorted((float(line[4]), 0 if line[0] == "done" else 1) for line in lines
                    if line[0] in ("start", "done") and line[1].startswith(prefix))
    running_now = most = 0
    for _, kind in events:
        running_now += 1 if kind else -1
        most = max(most, running_now)
    return most


async def at_the_cap(q: effectmq.TaskQueue, **options) -> effectmq.Lease:
    """Group a capped at 1: a0 leased, a1 parked by the next call (which leases b0 instead)."""
    await q.configure_group("a", max_active=1)
    await q.offer_many([("t", {}, {"group": "a", "task_id": "a0", **options}),
                        ("t", {}, {"group": "a", "task_id": "a1"}), ("t", {}, {"group": "b", "task_id": "b0"})])
    (first,), _ = await q.acquire_many(1)
    assert first.task_id == "a0"
    leases, _ = await q.acquire_many(2)
    assert [lease.task_id for lease in leases] == ["b0"]
    stats = await q.group_stats("a")
    assert (stats.active, stats.parked, stats.waiting, stats.max_active) == (1, 1, 0, 1), stats
    assert (await q.get("a1")).state == "waiting"  # parked is waiting, held back
    stats = await q.stats()
    assert (stats.parked, stats.waiting, stats.group_caps) == (1, 0, True)
    return first


async def freed(q: effectmq.TaskQueue, *, back: set[str]) -> None:
    """a's slot is free and its parked task went back: the next call leases one of `back`,
    and a second of a's tasks, if any waits, is parked again."""
    stats = await q.group_stats("a")
    assert (stats.active, stats.parked) == (0, 0), stats
    assert stats.waiting == len(back)
    leases, _ = await q.acquire_many(2)
    assert len(leases) == 1 and leases[0].task_id in back, leases
    stats = await q.group_stats("a")
    assert (stats.active, stats.parked) == (1, len(back) - 1), stats
    await invariants(q)


# -- every way an attempt ends frees its group's slot ------------------------------------

async def test_a_completion_frees_the_slot_and_hands_the_parked_task_back(make_queue):
    q = make_queue("caps-complete", lock_timeout=60)
    lease = await at_the_cap(q)
    await invariants(q)
    await lease.complete("ok")
    await freed(q, back={"a1"})


async def test_a_completion_sent_along_with_acquire_frees_the_slot_in_the_same_call(make_queue):
    q = make_queue("caps-along", lock_timeout=60)
    lease = await at_the_cap(q)
    outcomes, leases = await q.engine.complete_and_acquire([(lease, "null")], 2)
    assert outcomes == [protocol.Outcome.COMPLETED] and leases == []  # a1 went back at the end of the call
    assert (await q.group_stats("a")).waiting == 1
    (again,), _ = await q.acquire_many(1)
    assert again.task_id == "a1"
    await invariants(q)


@pytest.mark.parametrize("delay, back", [(0.0, {"a0", "a1"}), (30.0, {"a1"})])
async def test_a_failure_with_a_retry_frees_the_slot(make_queue, delay, back):
    q = make_queue("caps-retry", lock_timeout=60)
    lease = await at_the_cap(q)
    assert await q.engine.fail(lease, TaskError("boom"), retryable=True, retry=lambda n: delay, declared=()) \
        is protocol.Outcome.RETRY
    await freed(q, back=back)


async def test_a_final_failure_frees_the_slot(make_queue):
    q = make_queue("caps-fail", lock_timeout=60, retention_failed=0)
    lease = await at_the_cap(q)
    assert not await lease.fail(TaskError("boom"), retryable=False)
    await freed(q, back={"a1"})


@pytest.mark.parametrize("delay, back", [(0.0, {"a0", "a1"}), (30.0, {"a1"})])
async def test_a_release_frees_the_slot(make_queue, delay, back):
    q = make_queue("caps-release", lock_timeout=60)
    lease = await at_the_cap(q)
    await lease.release(delay=delay)
    await freed(q, back=back)


async def test_canceling_the_running_attempt_frees_the_slot(make_queue):
    q = make_queue("caps-cancel-active", lock_timeout=60)
    await at_the_cap(q)
    assert await q.cancel("a0") == "active"
    await freed(q, back={"a1"})


async def test_canceling_a_parked_task_takes_it_out_of_the_backlog(make_queue):
    q = make_queue("caps-cancel-parked", lock_timeout=60)
    lease = await at_the_cap(q)
    assert await q.cancel("a1") == "waiting"
    stats = await q.group_stats("a")
    assert (stats.active, stats.parked, stats.waiting) == (1, 0, 0), stats
    assert (await q.get("a1")).state == "canceled"
    await invariants(q)
    await lease.complete()
    assert (await q.group_stats("a")).active == 0
    assert await q.acquire() is None
    assert await q.retry("a1") == "canceled"  # back to waiting: leased as any task
    assert (await q.acquire()).task_id == "a1"
    await invariants(q)


async def test_a_reclaimed_lease_frees_the_slot(make_queue):
    q = make_queue("caps-reclaim", lock_timeout=60)
    lease = await at_the_cap(q)
    prefix = lease.token.rsplit(":", 1)[0]
    assert (await q._scripts.run(protocol.ReclaimArgs(prefix, ["a0"]))).reclaimed == 1
    await freed(q, back={"a0", "a1"})


async def test_a_stall_frees_the_slot(make_queue):
    q = make_queue("caps-stall", max_stalled_count=0, retention_failed=0)
    await q.configure_group("a", max_active=1)
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(2)])
    (lease,) = [x for x in (await q.acquire_many(2, lock_timeout=0.05))[0]]
    assert (await q.group_stats("a")).parked == 1
    await asyncio.sleep(0.1)
    report = await q.maintain()
    assert report.stalled_failed == 1 and (await q.get(lease.task_id)) is None
    await freed(q, back={"a1"})


# -- pause and resume, caps raised and removed -------------------------------------------

async def test_a_paused_group_waits_while_another_runs_then_resume_runs_it(make_queue):
    q = make_queue("caps-pause", lock_timeout=5)
    paused = await q.pause_group("a")
    assert paused.paused and paused.max_active == 0
    await q.offer_many([("job", f"{g}{i}", {"group": g, "task_id": f"{g}{i}"}) for g in "ab" for i in range(5)])
    ran: list[str] = []

    async def job(payload):
        ran.append(payload)

    async with running(make_worker(q, {"job": job}, concurrency=4)):
        deadline = time.monotonic() + 10
        while len(ran) < 5 or (await q.stats()).waiting:
            assert time.monotonic() < deadline, (ran, await q.stats())
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # an idle worker: nothing of a starts
        assert sorted(ran) == [f"b{i}" for i in range(5)]
        stats = await q.stats()
        assert (stats.waiting, stats.parked, stats.active) == (0, 5, 0), stats
        assert all(info.state == "waiting" for info in await asyncio.gather(*(q.get(f"a{i}") for i in range(5))))
        await invariants(q)
        resumed = await q.resume_group("a")
        assert not resumed.paused and resumed.parked == 0
        await until_settled(q, 10, timeout=10)
    assert sorted(ran) == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)]
    await invariants(q)


async def park_all(q: effectmq.TaskQueue) -> None:
    """Acquire until nothing waits: every pick of a paused group is parked."""
    for _ in range(20):
        if not (await q.stats()).waiting:
            return
        leases, _ = await q.acquire_many(10)
        assert leases == []
    raise AssertionError(await q.stats())


async def test_parked_tasks_are_listed_by_group_in_the_order_they_go_back(make_queue):
    q = make_queue("caps-list", lock_timeout=60)
    for group in ("a", "ab", "<b>&'\""):  # "ab" shares a's first byte: not a's range
        await q.pause_group(group)
    await q.offer_many([("job", {}, {"group": g, "task_id": f"{g}-{i}", "priority": i % 2})
                        for g in ("ab", "a", "<b>&'\"") for i in range(4)])
    await park_all(q)
    # a's in waiting order: priority 1 first, then by offer; the groups by name (bytes)
    a_order = ["a-1", "a-3", "a-0", "a-2"]
    assert await q.parked_ids("a") == a_order
    assert [t.task_id for t in await q.parked_tasks("a", limit=2, offset=1)] == a_order[1:3]
    assert all(t.state == "waiting" and t.group == "a" for t in await q.parked_tasks("a"))
    every = await q.parked_ids(limit=1000)
    assert [i.rsplit("-", 1)[0] for i in every] == ["<b>&'\""] * 4 + ["a"] * 4 + ["ab"] * 4
    assert every[4:8] == a_order and await q.parked_ids(limit=3, offset=10) == every[10:]
    assert await q.parked_ids("nobody") == [] and await q.parked_tasks(offset=12) == []
    assert (await q.stats()).parked == len(every) == 12
    for bad in ({"limit": 0}, {"limit": MAX_LIST + 1}, {"offset": -1}, {"group": ""}, {"group": "a\0"}):
        with pytest.raises(effectmq.InvalidOption):
            await q.parked_ids(**bad)
    await q.resume_group("a")
    assert await q.parked_ids("a") == [] and len(await q.parked_ids()) == 8
    await invariants(q)
    raw = aioredis.Redis.from_url(q.url)  # an id another client wrote, not UTF-8: listed, its key named again
    try:
        key = q.keys.task("x\udcff").encode(errors="surrogateescape")
        await raw.hset(key, mapping={"name": "job", "state": "waiting"})
        await raw.zadd(q.keys.key("backlog"), {b"ab\0" + b"0" * 16 + b"x\xff": 0})
    finally:
        await raw.aclose()
    assert (await q.parked_ids("ab"))[0] == "x\udcff"
    assert [(t.task_id, t.name) for t in await q.parked_tasks("ab", limit=1)] == [("x\udcff", "job")]


async def test_raising_or_removing_a_cap_hands_back_what_it_allows(make_queue):
    q = make_queue("caps-raise", lock_timeout=60)
    await q.configure_group("a", max_active=1)
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(8)])
    leases, _ = await q.acquire_many(8)
    assert len(leases) == 1 and (await q.group_stats("a")).parked == 7
    raised = await q.configure_group("a", max_active=3)
    assert (raised.active, raised.waiting, raised.parked, raised.max_active) == (1, 2, 5, 3)
    await invariants(q)
    leases, _ = await q.acquire_many(8)
    assert len(leases) == 2 and (await q.group_stats("a")).active == 3
    removed = await q.configure_group("a", max_active=0)
    assert (removed.waiting, removed.parked, removed.max_active) == (5, 0, 0)
    leases, _ = await q.acquire_many(8)
    assert len(leases) == 5 and (await q.group_stats("a")).active == 8
    await invariants(q)


async def test_the_queues_default_caps_every_group_without_its_own(make_queue):
    q = make_queue("caps-default", lock_timeout=60)
    await q.configure(group_max_active=2)
    await q.configure_group("own", max_active=3)
    await q.configure_group("free", max_active=0)
    await q.offer_many([("t", {}, {"group": g, "task_id": f"{g}{i}"}) for g in ("a", "own", "free")
                        for i in range(5)])
    leases, _ = await q.acquire_many(15)
    by_group = {g: sum(1 for lease in leases if lease.task_id.startswith(g)) for g in ("a", "own", "free")}
    assert by_group == {"a": 2, "own": 3, "free": 5}, by_group
    assert (await q.group_stats("a")).max_active == 2
    await q.configure(group_max_active=4)  # a's new room: its parked tasks go back at once
    stats = await q.group_stats("a")
    assert (stats.waiting, stats.parked, stats.max_active) == (2, 1, 4), stats
    assert (await q.configure_group("own", max_active=-1)).max_active == 4  # back to the queue's
    await q.configure(group_max_active=None)  # no default: every group without its own cap runs free
    assert [(s.parked, s.max_active) for s in (await q.group_stats("a"), await q.group_stats("own"))] == \
        [(0, 0), (0, 0)]
    await invariants(q)


async def test_resume_hands_back_a_long_backlog_in_bounded_calls(make_queue):
    q = make_queue("caps-long", lock_timeout=60)
    await q.pause_group("a")
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i:03}"}) for i in range(250)])
    for _ in range(50):  # each call parks what it picks
        if (await q.acquire_many(100))[1] is None and not (await q.stats()).waiting:
            break
    assert (await q.stats()).parked == 250
    await q.redis.hdel(q.keys.key("group_ctl"), "p:a")  # resumed by hand: the hand-back below
    calls, after = 0, b""
    while True:
        reply = await q._scripts.run(protocol.ConfigureGroupArgs("a", batch=100, after=after))
        calls, after = calls + 1, reply.more
        if not after:
            break
    assert (calls, reply.parked, reply.waiting) == (3, 0, 250)
    order = await q.redis.zrange(q.keys.key("waiting"), 0, -1)
    assert order == [f"a{i:03}" for i in range(250)]  # at their old turns: in offer order
    await invariants(q)


# -- what the cap holds across worker processes ---------------------------------------------

async def test_three_worker_processes_never_run_more_of_a_group_than_its_cap(make_queue, redis_url, tmp_path):
    q = make_queue("caps-procs")
    await q.configure_group("a", max_active=3)
    await q.offer_many([("work", {"sleep": 0.1}, {"group": "a", "task_id": f"a{i:02}"}) for i in range(40)] +
                       [("work", {"sleep": 0.05}, {"group": "b", "task_id": f"b{i:02}"}) for i in range(40)])
    workers = [WorkerProcess(redis_url, "caps-procs", tmp_path, name=f"w{n}", args=["--concurrency", "4"])
               for n in range(3)]
    try:
        most = 0
        deadline = time.monotonic() + 60
        while (await q.stats()).completed < 80:
            assert time.monotonic() < deadline, [w.log()[-2000:] for w in workers]
            most = max(most, (await q.group_stats("a")).active)
            await asyncio.sleep(0.01)
    finally:
        for w in workers:
            w.stop()
    lines = workers[0].effect_lines()
    assert most_at_once(lines, "a") == 3, "never more than the cap, and the cap reached"
    assert most <= 3
    assert most_at_once(lines, "b") > 3  # b ran beside a, uncapped
    assert len({line[3] for line in lines if line[0] == "start" and line[1].startswith("a")}) >= 2
    b_done = max(float(line[4]) for line in lines if line[0] == "done" and line[1].startswith("b"))
    a_done = max(float(line[4]) for line in lines if line[0] == "done" and line[1].startswith("a"))
    assert b_done < a_done  # a's backlog held back only a
    assert (await q.group_stats("a")).active == 0
    await invariants(q)


async def test_a_killed_worker_frees_its_slot_by_its_stall(make_queue, redis_url, tmp_path):
    q = make_queue("caps-kill")
    await q.configure(lock_timeout=1.0)
    await q.configure_group("a", max_active=1)
    await q.offer("work", {"sleep": 60}, group="a", task_id="long", max_stalled_count=0)
    await q.offer("work", {}, group="a", task_id="next")
    worker = WorkerProcess(redis_url, "caps-kill", tmp_path, args=["--concurrency", "2"])
    try:
        worker.wait_for_effect(lambda lines: any(line[:2] == ["start", "long"] for line in lines))
        deadline = time.monotonic() + 10
        while (await q.group_stats("a")).parked != 1:  # its free slot asked, and parked next
            assert time.monotonic() < deadline, worker.log()[-2000:]
            await asyncio.sleep(0.02)
        worker.signal(signal.SIGKILL)
        worker.proc.wait()
    finally:
        worker.stop()
    assert (await q.maintain()).stalled_failed == 0  # the lease still runs
    await asyncio.sleep(1.1)
    assert (await q.maintain()).stalled_failed == 1
    stats = await q.group_stats("a")
    assert (stats.active, stats.parked, stats.waiting) == (0, 0, 1), stats
    (lease,), _ = await q.acquire_many(1)
    assert lease.task_id == "next"
    await invariants(q)


# -- bounds, counting, and what a queue without caps pays ------------------------------------

@pytest.mark.parametrize("value, problem", [
    (-2, ">= -1"), (1.5, "integer"), (True, "integer"), ("3", "integer"), (2**31, "<= 2147483647"),
    (None, "max_active or rate_limit"),
])
async def test_a_bad_cap_is_refused_before_anything_is_sent(make_queue, value, problem):
    q = make_queue("caps-bad")
    with pytest.raises(effectmq.InvalidOption, match=problem):
        await q.configure_group("a", max_active=value)
    assert await q.redis.exists(q.keys.key("group_ctl"), q.keys.key("meta")) == 0


@pytest.mark.parametrize("group, problem", [
    ("", "non-empty"), (7, "non-empty string"), ("x" * (MAX_GROUP_BYTES + 1), "MAX_GROUP_BYTES = 128"),
    ("a\nb", "control characters"), ("a\x00b", "control characters"), ("\ud800", "UTF-8"),
])
async def test_a_bad_group_is_refused_by_every_group_call(make_queue, group, problem):
    q = make_queue("caps-bad-group")
    for call in (lambda: q.configure_group(group, max_active=1), lambda: q.pause_group(group),
                 lambda: q.resume_group(group), lambda: q.group_stats(group)):
        with pytest.raises(effectmq.InvalidOption, match=problem):
            await call()
    with pytest.raises(effectmq.InvalidOption, match="group_max_active"):
        await q.configure(group_max_active=-1)
    assert await q.redis.exists(q.keys.key("group_ctl"), q.keys.key("meta")) == 0


async def test_the_script_refuses_a_bad_argument_before_writing(make_queue):
    q = make_queue("caps-script-bad")
    for args in (protocol.ConfigureGroupArgs("a", max_active="-2"), protocol.ConfigureGroupArgs("a", paused="2"),
                 protocol.ConfigureGroupArgs("a", max_active="1e3x"), protocol.ConfigureGroupArgs("a", after=b"x"),
                 protocol.ConfigureGroupArgs("", after=b"(x")):
        with pytest.raises(effectmq.RedisRefused, match="invalid group setting"):
            await q._scripts.run(args)
    assert await q.redis.exists(q.keys.key("group_ctl"), q.keys.key("meta")) == 0


async def test_attempts_running_when_the_first_cap_comes_finish_uncounted(make_queue):
    q = make_queue("caps-late", lock_timeout=60)
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(3)])
    early, _ = await q.acquire_many(2)
    await q.configure_group("a", max_active=1)
    assert (await q.group_stats("a")).active == 0  # not counted: their ends free nothing
    (late,), _ = await q.acquire_many(1)
    assert (await q.group_stats("a")).active == 1
    for lease in early:
        await lease.complete()
    assert (await q.group_stats("a")).active == 1  # late's slot is still taken
    await invariants(q)
    await late.complete()
    assert (await q.group_stats("a")).active == 0


async def test_a_queue_without_caps_keeps_no_group_state(make_queue):
    q = make_queue("caps-none", lock_timeout=60)
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(4)])
    leases, _ = await q.acquire_many(4)
    await leases[0].complete()
    await leases[1].release()
    await q.cancel(leases[2].task_id)
    assert await q.redis.hget(q.keys.key("meta"), "group_caps") is None
    assert await q.redis.exists(q.keys.key("group_ctl"), q.keys.key("backlog")) == 0
    assert not (await q.stats()).group_caps
    stats = await q.group_stats("a")
    assert (stats.active, stats.parked, stats.max_active, stats.paused) == (0, 0, 0, False)
    await q.configure_group("a", max_active=0)  # no cap: no counting either
    assert await q.redis.hget(q.keys.key("meta"), "group_caps") is None


async def test_a_client_declares_the_group_keys_only_once_the_queue_counts(make_queue):
    """Two more keys cost every call (bench/script_cost.py): a client leaves them out until a
    script refuses a call without them, before anything, because the queue counts its
    groups; the runner then sends it again with them, and from then on."""
    q, other = make_queue("caps-keys", lock_timeout=60), make_queue("caps-keys", lock_timeout=60)
    await q.offer_many([("t", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(3)])
    (lease,), _ = await q.acquire_many(1)
    await lease.complete()
    await q.stats()
    assert not q._scripts.group_keys  # a queue without caps: never declared
    await other.configure_group("a", max_active=1)
    before = await q.redis.hgetall(q.keys.task("a1"))
    args = protocol.AcquireArgs(1, 60_000, "p", 10, 8, 16)
    refused = q._scripts._packed("acquire", args.argv(), q._scripts.last_keys(args.last_keys, args.optional_keys))
    replies = await q._scripts._send([refused], raw=False)
    assert str(replies[0]).startswith("GROUPKEYS ") and await q.redis.hgetall(q.keys.task("a1")) == before
    leases, _ = await q.acquire_many(2)  # refused, then sent again with them
    assert len(leases) == 1 and q._scripts.group_keys
    assert (await q.group_stats("a")).active == 1 and (await q.stats()).parked == 1
    await invariants(q)


async def test_the_sync_facade_mirrors_the_group_calls(redis_url):
    with effectmq.SyncTaskQueue("caps-sync", url=redis_url) as q:
        assert q.configure_group("a", max_active=2).max_active == 2
        assert q.pause_group("a").paused
        assert not q.resume_group("a").paused
        assert q.group_stats("a").to_json() == {"group": "a", "waiting": 0, "active": 0, "parked": 0,
                                                "max_active": 2, "paused": False, "rate_limit": None}


@pytest.mark.redis7  # the documented users are Redis 7's
async def test_a_restricted_user_as_documented_keeps_the_cap(redis_server):
    with queue_user(redis_server, "capped", "caps-acl") as url:
        q = effectmq.TaskQueue("caps-acl", url=url)
        try:
            await q.configure(group_max_active=2)
            await q.offer_many([("job", i, {"group": "a", "task_id": f"a{i}"}) for i in range(12)])
            at_once = most = 0

            async def job(payload):
                nonlocal at_once, most
                at_once += 1
                most = max(most, at_once)
                await asyncio.sleep(0.02)
                at_once -= 1

            async with running(make_worker(q, {"job": job}, concurrency=6)):
                await until_settled(q, 12, timeout=20)
                await until_drained(q)
            assert most == 2
            assert (await q.stats()).parked == 0
        finally:
            await q.close()
