"""Task groups on real Redis: groups take turns in the waiting index (lua/includes/groups.lua),
so acquire, which leases near the head of it, serves them in turn; each group's waiting count
is kept through every way in and out of waiting; bad group names are refused before anything
is sent.

Acquire leases among the first `window` waiting tasks (ACQUIRE_WINDOW times the ids a reply
names), not in exact head order: where a test needs exact order it reads the waiting index.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest

import effectmq
from effectmq.client.queue import MAX_GROUP_BYTES
from tests.runtime.test_bad_input import cli
from tests.support.processes import WorkerProcess


async def lease_all(q: effectmq.TaskQueue, n: int, lock_timeout: float = 30) -> list[effectmq.Lease]:
    """Lease `n` tasks one call at a time, completing none."""
    leases = []
    while len(leases) < n:
        lease = await q.acquire(lock_timeout=lock_timeout)
        assert lease is not None, f"only {len(leases)} of {n} were ready"
        leases.append(lease)
    return leases


async def waiting_order(q: effectmq.TaskQueue, n: int = -1) -> list[str]:
    """The first `n` waiting ids in head order (-1: all)."""
    return list(await q.redis.zrange(q.keys.key("waiting"), 0, n if n < 0 else n - 1))


async def test_a_small_group_is_served_next_to_a_large_one(make_queue):
    q = make_queue("fair")
    signal = await q.wake_signal().start()  # as a worker listens
    try:
        await q.offer_many([("work", {}, {"group": "a", "task_id": f"a{i:04}"}) for i in range(500)])
        assert len(await lease_all(q, 30)) == 30  # busy with A: names far into A's backlog
        await q.offer_many([("work", {}, {"group": "b", "task_id": f"b{i:02}"}) for i in range(20)])
        head = await waiting_order(q, 42)  # the head, then A's and B's n-th tasks side by side
        assert sum(1 for i in head if i.startswith("b")) == 20, head
        for _ in range(100):  # the wake message, naming B's tasks to declare first
            if q.engine._first:
                break
            await asyncio.sleep(0.01)
        leases = await lease_all(q, 40)
        assert sum(1 for lease in leases if lease.task_id.startswith("b")) == 20, [lease.task_id for lease in leases]
    finally:
        await signal.close()
    assert (await q.group_stats("a")).waiting == 500 - 30 - 20
    assert (await q.group_stats("b")).waiting == 0
    assert [g.group for g in await q.groups()] == ["a"]  # a group with nothing waiting is not listed


async def test_many_groups_take_turns(make_queue):
    q = make_queue("rr")
    groups = [f"g{n:02}" for n in range(20)]
    for g in groups:  # one group after the other, each a batch of 10
        await q.offer_many([("work", {}, {"group": g, "task_id": f"{g}-{i}"}) for i in range(10)])
    seen: Counter[str] = Counter()
    for n, task_id in enumerate(await waiting_order(q), 1):
        seen[task_id.split("-")[0]] += 1
        if n % 20 == 0:  # after each round every group had its turn, give or take one
            assert all(n // 20 - 1 <= seen[g] <= n // 20 + 1 for g in groups), (n, seen)
    assert len(await lease_all(q, 200)) == 200
    assert await q.groups() == []


async def test_priorities_apply_inside_a_group(make_queue):
    q = make_queue("prio")
    await q.offer_many([("work", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(5)])
    await q.offer("work", {}, group="a", task_id="urgent", priority=5)
    await q.offer("work", {}, group="b", task_id="b0")
    order = await waiting_order(q)
    assert order[0] == "urgent"  # its band first
    assert order.index("b0") <= 3  # and b's turn comes next to a's head (a1 shares its score), not after a's backlog
    assert [i for i in order if i.startswith("a")] == [f"a{i}" for i in range(5)]  # FIFO inside the group
    assert (await lease_all(q, 1))[0].task_id == "urgent"


async def test_a_reoffered_grouped_id_is_counted_once(make_queue):
    q = make_queue("reoffer")
    assert (await q.offer("work", {}, group="a", task_id="x")).created
    assert not (await q.offer("work", {"other": 1}, group="b", task_id="x")).created
    again = await q.offer_many([("work", {}, {"group": "a", "task_id": i}) for i in ("x", "y", "y")])
    assert [o.created for o in again] == [False, True, False]
    assert (await q.group_stats("a")).waiting == 2
    assert (await q.group_stats("b")).waiting == 0
    info = await q.get("x")
    assert info is not None and info.group == "a" and info.to_json()["group"] == "a"


async def test_every_way_in_and_out_of_waiting_keeps_the_counts(make_queue):
    q = make_queue("counts", lock_timeout=0.2, max_stalled_count=5)
    await q.offer_many([("work", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(6)])
    await q.offer("work", {}, group="a", task_id="later", delay=0.05)

    async def waiting() -> int:
        return (await q.group_stats("a")).waiting

    assert await waiting() == 6  # a delayed task is not waiting yet
    assert await q.cancel("a5") == "waiting"
    assert await waiting() == 5
    leases = await lease_all(q, 4, lock_timeout=0.2)
    assert await waiting() == 1
    await leases[0].release()
    assert await waiting() == 2
    await leases[1].fail({"tag": "Boom"}, retryable=False)
    assert await q.retry(leases[1].task_id) == "failed"
    assert await waiting() == 3
    await leases[2].complete(None)
    assert await q.cancel(leases[3].task_id) == "active"  # was not waiting: no change
    assert await waiting() == 3
    await asyncio.sleep(0.1)
    await q.maintain()  # promotes the delayed one
    assert await waiting() == 4
    stalled = await lease_all(q, 4, lock_timeout=0.2)  # everything, the promoted one too
    assert await waiting() == 0 and await q.groups() == []
    await asyncio.sleep(0.3)
    report = await q.maintain()  # the leases ran out: back to waiting
    assert report.recovered == 4
    assert await waiting() == 4
    again = await lease_all(q, 4)
    assert {lease.task_id for lease in again} == {lease.task_id for lease in stalled}
    for lease in again:
        await lease.complete(None)
    assert await waiting() == 0
    assert await q.redis.exists(q.keys.key("groups"), q.keys.key("group_clock")) == 0  # nothing kept for idle groups


async def test_a_grouped_task_that_comes_back_goes_to_the_back_of_its_group(make_queue):
    """A release (as a retry, a stall recovery, a promotion) puts the task after its own
    group's waiting tasks, as a new offer of that group: behind A's others, never behind
    B's longer backlog."""
    q = make_queue("comeback")
    await q.offer_many([("work", {}, {"group": "a", "task_id": f"a{i:03}"}) for i in range(50)])
    await q.offer_many([("work", {}, {"group": "b", "task_id": f"b{i:03}"}) for i in range(300)])
    back = (await lease_all(q, 1))[0]
    await back.release()
    order = await waiting_order(q)
    assert 95 <= order.index(back.task_id) <= 102, order.index(back.task_id)  # a's 50th turn of 350


async def test_tasks_without_a_group_take_one_turn_while_groups_wait(make_queue):
    q = make_queue("mixed")
    await q.offer_many([("work", {}, {"group": "a", "task_id": f"a{i:03}"}) for i in range(100)])
    await q.offer_many([("work", {}, {"task_id": f"plain{i}"}) for i in range(5)])
    head = await waiting_order(q, 11)
    assert sum(1 for i in head if i.startswith("plain")) == 5, head
    info = await q.get("plain0")
    assert info is not None and info.group is None
    assert (await q.group_stats("a")).waiting == 100 and len(await q.groups()) == 1


async def test_a_queue_without_groups_keeps_fifo_and_writes_no_group_keys(make_queue):
    q = make_queue("plain")
    for i in range(3):
        await q.offer_many([("work", {}, {"task_id": f"t{i}{j}"}) for j in range(10)])
    assert await waiting_order(q) == [f"t{i}{j}" for i in range(3) for j in range(10)]
    lease = (await lease_all(q, 1))[0]
    await lease.release()
    assert (await waiting_order(q))[-1] == lease.task_id  # a release goes to the back, as before
    assert await q.redis.exists(q.keys.key("groups"), q.keys.key("group_clock")) == 0


@pytest.mark.parametrize("group, problem", [
    ("", "non-empty"), (7, "non-empty string"), ("x" * (MAX_GROUP_BYTES + 1), "MAX_GROUP_BYTES = 128"),
    ("é" * 65, "MAX_GROUP_BYTES"), ("a\nb", "control characters"), ("a\x00b", "control characters"),
    ("\ud800", "UTF-8"),
])
async def test_a_bad_group_is_refused_before_anything_is_sent(make_queue, group, problem):
    q = make_queue("bad")
    with pytest.raises(effectmq.InvalidOption, match=problem):
        await q.offer("work", {}, group=group, task_id="t")
    with pytest.raises(effectmq.InvalidOption, match=problem):
        await q.offer_many([("work", {}, {"task_id": "u"}), ("work", {}, {"group": group})])
    with pytest.raises(effectmq.InvalidOption, match=problem):
        await q.group_stats(group)
    assert await q.get("t") is None and await q.get("u") is None


async def test_group_pages_are_bounded_and_ordered(make_queue):
    q = make_queue("pages")
    for n in range(1, 6):
        await q.offer_many([("work", {}, {"group": f"g{n}"})] * n)
    assert [(g.group, g.waiting) for g in await q.groups(count=2)] == [("g5", 5), ("g4", 4)]
    assert [g.group for g in await q.groups(offset=2, count=2)] == ["g3", "g2"]
    assert [g.group for g in await q.groups(busiest=False, count=1)] == ["g1"]
    with pytest.raises(effectmq.InvalidOption, match="count must be <= 1,?000"):
        await q.groups(count=1001)
    assert (await q.group_stats("nobody")).waiting == 0


async def test_a_small_group_goes_first_while_worker_processes_are_busy(make_queue, redis_url, tmp_path):
    """Several worker processes, concurrency and prefetch, leasing a long backlog of group A:
    B's 20 tasks, offered meanwhile, are leased within about 2 x 20 leases."""
    q = make_queue("busy")
    await q.offer_many([("work", {"sleep": 0.01}, {"group": "a", "task_id": f"a{i:05}"}) for i in range(3000)])
    args = ["--concurrency", "4", "--prefetch", "4"]
    workers = [WorkerProcess(redis_url, "busy", tmp_path, args=args, name=f"w{n}") for n in range(3)]
    try:
        workers[0].wait_for_effect(lambda lines: sum(1 for line in lines if line[0] == "done") >= 200, timeout=60)
        seconds, micros = await q.redis.time()
        offered_at = int(seconds) * 1000 + int(micros) // 1000
        await q.offer_many([("work", {"sleep": 0.01}, {"group": "b", "task_id": f"b{i:02}"}) for i in range(20)])
        infos = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [await q.get(f"b{i:02}") for i in range(20)]
            if all(i is not None and i.started_at for i in infos):
                break
            await asyncio.sleep(0.05)
        assert all(i is not None and i.started_at for i in infos)
        last_b = max(i.started_at for i in infos if i is not None and i.started_at)
        a_between = 0
        async with q.redis.pipeline(transaction=False) as pipe:
            for n in range(3000):
                pipe.hget(q.keys.task(f"a{n:05}"), "started_at")
            started = await pipe.execute()
        for ms in started:
            if ms is not None and offered_at <= int(ms) <= int(last_b.timestamp() * 1000):
                a_between += 1
        # B's 20 enter waiting next to the head, and the offer's wake message tells the busy
        # workers to declare them first: all are leased within about 2 x 20 leases (without
        # groups they would come after the 2,000 and more A's still waiting).
        assert a_between <= 2 * 20, a_between
        assert (await q.group_stats("a")).waiting > 0  # A still had a backlog then
    finally:
        for w in workers:
            w.stop()


async def test_the_cli_offers_a_grouped_task_and_refuses_a_bad_group(make_queue, redis_url):
    common = ["--queue", "cli-groups", "--url", redis_url]
    assert cli("offer", "work", "{}", "--task-id", "t1", "--group", "acme", *common).returncode == 0
    task = json.loads(cli("task", "t1", "--json", *common).stdout)
    assert task["group"] == "acme"
    bad = cli("offer", "work", "{}", "--group", "a\tb", *common)
    assert bad.returncode != 0 and "control characters" in bad.stderr
    assert (await make_queue("cli-groups").group_stats("acme")).waiting == 1
