"""Scripts touch only task hashes whose ids the caller knew before the call.

A settlement publishes on the task's channel only while somebody waits: on a cluster a
PUBLISH reaches every node, and 1,000 completions sent 1,000 messages nobody read.
maintain reads the due ids first (an idle one calls no script); acquire leases among ids
an earlier reply, a wake message or the caller's own offers named, in head order, and
competing acquirers still lease every task once.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import effectmq
from effectmq.protocol import protocol
from tests.support.commandstats import script_calls
from tests.support.inprocess import drain


def publishes(client) -> int:
    return client.info("commandstats").get("cmdstat_publish", {}).get("calls", 0)


async def test_completions_nobody_waits_for_publish_nothing(make_redis):
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("quiet", url=server.url)
    try:
        await q.offer_many([("job", i) for i in range(1000)])
        before = publishes(admin)
        await drain(q, 1000)
        assert publishes(admin) - before == 0
    finally:
        await q.close()


async def test_a_waiter_still_gets_its_result_at_once(make_redis):
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("waited", url=server.url)
    try:
        await q.offer("job", 1, task_id="watched")
        await q.offer_many([("job", i) for i in range(99)])
        waiter = asyncio.create_task(q.wait("watched", timeout=10))
        while await q.redis.zscore(q.keys.key("waiters"), "watched") is None:  # registered
            await asyncio.sleep(0.005)
        before = publishes(admin)
        start = time.monotonic()
        await drain(q, 100)
        assert await asyncio.wait_for(waiter, 5) is None
        assert time.monotonic() - start < 2  # woken by the message, not the 5 s re-check
        assert publishes(admin) - before == 1  # the one task somebody waits on
        assert await q.redis.zscore(q.keys.key("waiters"), "watched") is None  # settled: interest ended
    finally:
        await q.close()


async def test_maintain_sweeps_waiters_whose_interest_ran_out(make_queue):
    q = make_queue("waiters-expire")
    await q.redis.zadd(q.keys.key("waiters"), {"gone": 1, "kept": 2 ** 50})
    report = await q.maintain()
    assert report.expired_reservations == 1
    assert await q.redis.zrange(q.keys.key("waiters"), 0, -1) == ["kept"]


async def test_an_idle_maintain_calls_no_script(make_redis):
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("idle", url=server.url, lock_timeout=60)
    try:
        await q.offer("job", 1)
        await q.offer("job", 2, delay=60)
        assert await q.acquire() is not None
        before = script_calls(admin)
        report = await q.maintain()
        assert report.touched == 0 and not report.more
        assert script_calls(admin) == before
    finally:
        await q.close()


async def test_maintain_finds_what_fell_due_by_redis_time(make_queue):
    q = make_queue("due", lock_timeout=0.05, retention_completed=0.05, max_stalled_count=5)
    await q.offer_many([("job", i) for i in range(5)] + [("job", "later", {"delay": 0.05})])
    stalled = await q.acquire_many(2)
    done, _ = await q.acquire_many(1, lock_timeout=30)
    await done[0].complete("ok")
    await asyncio.sleep(0.15)
    report = await q.maintain(batch=100)
    assert (report.recovered, report.promoted, report.expired_records) == (len(stalled[0]), 1, 1)
    assert (await q.stats()).waiting == 5  # 2 stalled back, 2 untouched, 1 promoted


async def test_competing_acquirers_lease_every_task_once(make_queue):
    """Several engines (as in several processes) declare only ids a reply named; each
    task is still leased exactly once, and a task of higher priority offered while they
    hold named ids goes first."""
    queues = [make_queue("shared") for _ in range(4)]
    await queues[0].offer_many([("job", i) for i in range(400)])
    leased: list[str] = []

    async def take(q):
        while True:
            leases, next_due = await q.acquire_many(7)
            leased.extend(lease.task_id for lease in leases)
            if not leases and next_due is None:
                return

    for q in queues:  # each one has named ids in hand now
        first, _ = await q.acquire_many(1)
        leased.extend(lease.task_id for lease in first)
    await queues[0].offer("job", "urgent", task_id="urgent", priority=5)
    nxt, _ = await queues[2].acquire_many(1)
    assert [lease.task_id for lease in nxt] == ["urgent"]
    await asyncio.gather(*(take(q) for q in queues))
    assert len(leased) == len(set(leased)) == 400
    assert (await queues[0].stats()).waiting == 0


async def test_concurrent_acquires_of_one_process_each_get_a_task(make_queue):
    """Callers of one queue object never take each other's named ids: with a task
    offered before each acquire, no acquire comes back empty."""
    q = make_queue("one-process", retention_completed=0)
    empty = 0
    remaining = 1000

    async def loop():
        nonlocal empty, remaining
        while remaining > 0:
            remaining -= 1
            await q.offer("job", {})
            lease = await q.acquire()
            if lease is None:
                empty += 1
            else:
                await lease.complete(None)

    await asyncio.gather(*(loop() for _ in range(8)))
    assert empty == 0
    stats = await q.stats()
    assert (stats.waiting, stats.active) == (0, 0)


async def test_ids_learnt_from_own_offers_never_pass_older_tasks(make_queue):
    """A process knows the tasks it offered, not those another offered before: it still
    leases the head first."""
    mine, other = make_queue("fifo"), make_queue("fifo")
    await other.offer("job", 1, task_id="older")
    await mine.offer("job", 2, task_id="newer")
    first, second = await mine.acquire(), await mine.acquire()
    assert (first.task_id, second.task_id) == ("older", "newer")


async def test_a_task_back_in_a_band_before_the_last_named_id_is_not_passed_over(make_queue):
    """A retried task comes back into its priority band after an acquire named the ids up
    to a lower band; nobody was named it since, so a task of its band offered after it
    must not be leased first (the model-based test found this)."""
    q = make_queue("back-in-band", retry=effectmq.Fixed(0), max_retries=3)
    await q.offer("job", 1, task_id="high", priority=1)
    await q.offer("job", 2, task_id="low", priority=0)
    first = await q.acquire()  # names the ids after it: up to "low"
    assert first.task_id == "high" and await first.fail(effectmq.ErrorInfo("Boom"))  # waiting again
    await q.offer("job", 3, task_id="later", priority=1)
    assert [(await q.acquire()).task_id for _ in range(3)] == ["high", "later", "low"]


@pytest.mark.parametrize("count", [20, 100])  # sorted inline; by table.sort (over 64)
async def test_candidates_declared_out_of_order_are_leased_in_head_order(make_queue, count):
    q = make_queue(f"order-{count}")
    ids = [f"t{i:03d}" for i in range(count)]
    for i, task_id in enumerate(ids):
        await q.offer("job", i, task_id=task_id)
    shuffled = ids[1::2][::-1] + ids[::2]  # the head among them, nothing in order
    reply = await q.engine.scripts.run(protocol.AcquireArgs(
        count, 30_000, "test", 10, window=1000, peek=16, candidates=shuffled))
    assert [lease.values["id"] for lease in reply.leases] == ids
