"""Less Redis work per task with the same guarantees, and what the dashboard reads.

Was: three event-stream writes per task with nobody reading, a `ready_since` sorted set
kept only for the oldest-waiting age, 9 commands per offered task and 18 per leased and
completed one (INFO commandstats of a drain).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

import pytest
import redis

import effectmq
from effectmq.protocol import protocol, scripts
from effectmq.errors import TaskError
from tests.support.commandstats import script_calls
from tests.support.inprocess import drain, make_worker, running


def calls(client, command: str | None = None) -> int:
    """Commands Redis ran (inside scripts too): all of them, or of one command."""
    stats = client.info("commandstats")
    if command:
        return stats.get(f"cmdstat_{command}", {}).get("calls", 0)
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


async def test_nobody_reading_events_means_no_stream_writes(make_redis):
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("quiet-events", url=server.url)
    try:
        before = calls(admin, "xadd")
        await q.offer_many([("job", i) for i in range(200)])
        await drain(q, 200)
        assert calls(admin, "xadd") - before == 0  # was 3 per task: created, active, completed
        assert admin.xlen(q.keys.key("events")) == 0
    finally:
        await q.close()


async def test_a_reader_gets_every_event_while_it_reads(make_redis):
    server = make_redis()
    q = effectmq.TaskQueue("read-events", url=server.url)
    seen: list[tuple[str, str]] = []

    async def follow():
        async for event in q.events(since="$", block=0.1):
            seen.append((event["event"], event["id"]))

    try:
        reader = asyncio.create_task(follow())
        while not await q.redis.hget(q.keys.key("meta"), "events_until"):  # the reader asked
            await asyncio.sleep(0.01)
        await q.offer("job", 1, task_id="followed")
        await drain(q, 1)
        deadline = time.monotonic() + 5
        while ("completed", "followed") not in seen and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        reader.cancel()
        assert seen == [("created", "followed"), ("active", "followed"), ("completed", "followed")]
        history = await q.task_events("followed")
        assert [e["event"] for e in history] == ["created", "active", "completed"]
        assert all(int(e["at"]) > 0 for e in history)
    finally:
        await q.close()


async def test_events_always_writes_them_without_a_reader(make_queue):
    q = make_queue("always-events")
    await q.configure(events_always=True)
    assert (await q.settings())["events_always"] is True
    await q.offer("job", 1, task_id="audited")
    assert [e["event"] for e in await q.task_events("audited")] == ["created"]


async def test_offers_and_a_drain_cost_a_fraction_of_the_commands(make_redis):
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("lean", url=server.url, retention_completed=0)
    try:
        before = calls(admin)
        await q.offer_many([("job", i) for i in range(500)])
        per_offer = (calls(admin) - before) / 500
        assert per_offer <= 3, per_offer  # was 9
        before = calls(admin)
        await drain(q, 500)
        per_task = (calls(admin) - before) / 500
        assert per_task <= 9, per_task  # was 18
    finally:
        await q.close()


async def test_a_busy_worker_settles_its_slots_in_few_calls(make_redis):
    # Calls carried a part of a worker's slots each, for ever: after one short reply the
    # rest rode the next call. A call's fixed cost is most of its cost, so the number of
    # script calls per task is Redis's work per task.
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("batches", url=server.url, retention_completed=0)
    tasks = 2000

    async def one_round_trip(payload):  # a short wait on I/O, as a handler's own Redis call
        await asyncio.sleep(0.0002)

    try:
        await q.offer_many([("job", i) for i in range(tasks)])
        before = script_calls(admin)
        await drain(q, tasks, one_round_trip, concurrency=10)
        per_task = (script_calls(admin) - before) / tasks
        print(f"script calls per task {per_task:.3f}")
        assert per_task <= 0.15, per_task
    finally:
        await q.close()



async def test_competing_workers_with_10ms_handlers_settle_a_whole_wave_per_call(make_redis):
    # Two workers of 10 slots, 10 ms handlers: when another worker took some of the ids
    # a call declared, the reply came short and the acquire loop leased the rest in a call
    # of its own, so each worker ran two waves of about 5 that never merged again: about
    # 6 tasks per call, where 10 are there to be settled. Now a worker is not named the
    # ids another holds, and a batch waits for the attempts about to finish.
    # Without prefetch: held leases start as handlers return, so completions come in no
    # waves to merge (0.10-0.13 calls per task here; 0.135 and 0.155 once each in CI on a
    # loaded machine). The defect is in every round; a busy machine only in some, so the
    # best of three rounds is measured.
    server = make_redis()
    admin = server.client()
    queues = [effectmq.TaskQueue("waves", url=server.url, retention_completed=0) for _ in range(2)]
    tasks = 2000

    async def one_round() -> float:
        seen = 0
        done = asyncio.Event()

        async def job(payload):
            nonlocal seen
            await asyncio.sleep(0.01)
            seen += 1
            if seen == tasks:
                done.set()

        await queues[0].offer_many([("job", i) for i in range(tasks)])
        before = script_calls(admin)
        options = dict(concurrency=10, prefetch=0, maintenance_interval=5.0)
        async with running(make_worker(queues[0], {"job": job}, **options)), \
                running(make_worker(queues[1], {"job": job}, **options)):
            await asyncio.wait_for(done.wait(), 60)
            return (script_calls(admin) - before) / tasks

    try:
        rounds = []
        for _ in range(3):
            rounds.append(await one_round())
            if rounds[-1] <= 0.15:
                break
        print("script calls per task", ", ".join(f"{r:.3f}" for r in rounds))
        assert min(rounds) <= 0.15, rounds  # was 0.164-0.193 in every round (two waves that never merged)
    finally:
        for q in queues:
            await q.close()


async def test_a_batch_waits_for_a_wave_at_most_a_round_trip(make_queue):
    # A batch waits for the attempts expected to finish soon: "slow" started with "quick",
    # so it is expected with it; it must not hold quick's completion for its 2 s. (With
    # the wait unbounded this fails; it passed then too while a wave a little later than
    # the usual time was not waited for at all.)
    q = make_queue("wave-bound", retention_completed=10)
    ended: dict[str, float] = {}

    async def job(payload):
        await asyncio.sleep(payload["s"])
        ended[payload["id"]] = time.monotonic()

    # Four waves of 10 set the usual time; the reply after them leases both at once.
    warm = [("job", {"s": 0.01, "id": f"warm{i}"}) for i in range(40)]
    await q.offer_many([*warm, ("job", {"s": 0.01, "id": "quick"}, {"task_id": "quick"}),
                        ("job", {"s": 2.0, "id": "slow"}, {"task_id": "slow"})])
    async with running(make_worker(q, {"job": job}, concurrency=10)):
        await q.wait("quick", timeout=10)
        acknowledged = time.monotonic()
        assert (await q.get("slow")).state == "active"
        assert acknowledged - ended["quick"] < 0.5  # not held for the slow one (2 s)


async def test_oldest_waiting_age_comes_from_the_head_of_each_priority_band(make_queue):
    q = make_queue("ages")
    await q.offer("job", 1, task_id="old-low", priority=-5)
    await asyncio.sleep(0.3)
    await q.offer("job", 2, task_id="new-high", priority=5)
    await q.offer("job", 3, task_id="new-normal")
    stats = await q.stats()
    assert stats.waiting == 3
    assert 0.3 <= stats.oldest_waiting_seconds < 5  # old-low, though it is last in line
    lease = await q.acquire()
    assert lease.task_id == "new-high"
    await lease.complete()
    assert (await q.stats()).oldest_waiting_seconds >= 0.3
    for _ in range(2):
        lease = await q.acquire()
        await lease.complete()
    assert (await q.stats()).oldest_waiting_seconds == 0.0


class Flaky(TaskError):
    """Raised by the test handler."""


async def test_every_attempt_that_did_not_succeed_is_kept_on_the_task(make_queue):
    q = make_queue("history", retry=effectmq.Fixed(0), max_retries=5)
    await q.offer("job", 1, task_id="twice")
    attempts = 0

    async def handler(_payload):
        nonlocal attempts
        attempts += 1
        if attempts <= 2:
            raise Flaky(f"try {attempts}")
        return "ok"

    await drain(q, 3, handler)
    info = await q.get("twice")
    assert info.state == "completed" and info.attempt == 3
    assert [(a.attempt, a.outcome, a.error.tag, a.error.message) for a in info.attempts] == \
        [(1, "failed", "Flaky", "try 1"), (2, "failed", "Flaky", "try 2")]
    assert all(a.finished_at is not None for a in info.attempts)
    assert info.to_json()["attempts"][0]["error"]["tag"] == "Flaky"


async def test_throughput_counts_settled_tasks_per_minute(make_queue):
    q = make_queue("rates", max_retries=0)
    await q.offer_many([("job", i) for i in range(7)])

    async def handler(payload):
        if payload < 2:
            raise Flaky("no")

    await drain(q, 7, handler)
    points = await q.throughput(minutes=60)
    assert len(points) == 60
    assert points[-1].minute <= datetime.now(timezone.utc)
    assert sum(p.completed for p in points) == 5 and sum(p.failed for p in points) == 2
    assert [p.minute for p in points] == sorted(p.minute for p in points)


async def test_a_queue_can_be_marked_sensitive(make_queue):
    q = make_queue("secret-payloads")
    assert (await q.settings())["sensitive"] is False
    await q.configure(sensitive=True)
    assert (await q.settings())["sensitive"] is True
    await q.configure(sensitive=None)
    assert (await q.settings())["sensitive"] is False


async def test_a_lease_gets_the_optional_fields_a_task_has_and_only_looks_for_those(make_queue):
    q = make_queue("extras", retention_completed=0)
    await q.offer("plain", None)
    await q.offer("tick", None, task_id="t1")
    await q.offer("tuned", None, task_id="t2", priority=-1, max_retries=3, max_stalled_count=2, timeout=5)
    hashes = {}
    for tid in [info.task_id for info in await q.list_tasks("waiting")]:
        hashes[tid] = await q.redis.hget(q.keys.task(tid), "extra")
    assert sorted(hashes.values()) == ["", "e", "eprso"]
    leases = {lease.name: lease for lease in (await q.acquire_many(3))[0]}
    assert (leases["plain"].max_retries, leases["plain"].options, leases["plain"].priority) == (None, {}, 0)
    assert (leases["tick"].max_retries, leases["tick"].options, leases["tick"].priority) == (None, {}, 0)
    tuned = leases["tuned"]
    assert (tuned.max_retries, tuned.priority) == (3, -1) and tuned.options.get("timeout") == 5
    await q.engine.complete_many([(lease, "null") for lease in leases.values()])
    # Explicit ids stay reserved after their record is gone; a generated one is not.
    assert sorted(await q.redis.zrange(q.keys.key("dedup"), 0, -1)) == ["t1", "t2"]


async def test_records_written_before_the_extra_field_keep_their_options_and_reservation(make_queue):
    q = make_queue("older", retention_completed=0)
    await q.offer("old", None, task_id="o1", max_retries=4, timeout=7)
    await q.redis.hdel(q.keys.task("o1"), "extra")  # as an older version wrote it
    lease = await q.acquire()
    assert (lease.max_retries, lease.options.get("timeout")) == (4, 7)
    await lease.complete()
    assert await q.get("o1") is None
    assert await q.redis.zrange(q.keys.key("dedup"), 0, -1) == ["o1"]
    assert not (await q.offer("old", None, task_id="o1")).created


async def test_a_task_is_ready_when_created_unless_delayed_and_its_wait_counts_from_then(make_queue):
    q = make_queue("ready-at")
    now = await q.offer("now", None, task_id="n")
    later = await q.offer("later", None, task_id="l", delay=0.2)
    ready, delayed = await q.get(now.task_id), await q.get(later.task_id)
    assert ready.ready_at == ready.created_at
    assert 0.15 <= (delayed.ready_at - delayed.created_at).total_seconds() <= 0.25
    assert await q.redis.hget(q.keys.task("n"), "ready_at") is None  # created_at stands for it
    await asyncio.sleep(0.3)
    assert 0.25 <= (await q.stats()).oldest_waiting_seconds < 5


async def test_a_busy_worker_gets_every_lease_it_asks_for_call_after_call(make_queue):
    # Was: each reply named ids past the window (16 named, 9 declared; the rest passed
    # over), and the 18th call leased 5 of 6: its candidates were past the window.
    q = make_queue("full-calls", retention_completed=0)
    for start in range(0, 1500, 500):
        await q.offer_many([("t", i) for i in range(start, start + 500)])
    for k in (6, 20):
        leases, _ = await q.acquire_many(k)
        short = []
        for call in range(40):
            _, leases = await q.engine.complete_and_acquire([(lease, "null") for lease in leases], k)
            if len(leases) != k:
                short.append((call, len(leases)))
        assert short == [], f"calls that leased fewer than {k}: {short}"
        await q.engine.complete_many([(lease, "null") for lease in leases])


async def test_a_call_keeps_one_receipt_for_the_records_it_deletes_not_a_marker_each(make_queue):
    # Was: one settled marker per completed token (about a tenth of a worker's call), each
    # later removed by a sweep of maintain.
    q = make_queue("receipts", retention_completed=0, lock_timeout=30)
    await q.offer_many([("t", i) for i in range(20)])
    leases, _ = await q.acquire_many(10)
    assert len(leases) == 10
    outcomes, more = await q.engine.complete_and_acquire([(lease, "null") for lease in leases], 10)
    assert outcomes == [protocol.Outcome.COMPLETED] * 10 and len(more) == 10
    assert await q.redis.zcard(q.keys.key("settled")) == 0
    receipts = [key async for key in q.redis.scan_iter(match=q.keys.key("r:*"))]
    assert len(receipts) == 1
    kept = (await q.redis.get(receipts[0])).split()
    assert sorted(kept) == sorted(lease.token for lease in leases)
    # Kept while a resend may come: the lease's deadline, plus the slack.
    assert 30_000 < await q.redis.pttl(receipts[0]) <= 35_000
    # A lone completion gets a settled marker: less memory than a key of its own.
    await q.engine.complete_many([(more[0], "null")])
    assert await q.redis.zcard(q.keys.key("settled")) == 1
    # A record that is kept needs neither: it says which token settled it.
    await q.configure(retention_completed=60)
    await q.engine.complete_many([(lease, "null") for lease in more[1:]])
    assert len([key async for key in q.redis.scan_iter(match=q.keys.key("r:*"))]) == 1
    assert await q.redis.zcard(q.keys.key("settled")) == 1


async def test_a_settlement_resent_after_a_lost_reply_is_found_in_the_receipt(tcp_proxy):
    q = effectmq.TaskQueue("receipt-resent", url=tcp_proxy.url, lock_timeout=5, retention_completed=0)
    try:
        await q.offer_many([("x", i) for i in range(4)])
        leases, _ = await q.acquire_many(3)
        stale = leases[2]
        await q.redis.hset(q.keys.task(stale.task_id), "token", "someone-else")  # this lease is lost
        tcp_proxy.drop_next_reply()  # acquire is never sent twice: the call fails
        with pytest.raises(effectmq.RedisUnavailable):
            await q.engine.complete_and_acquire([(lease, "null") for lease in leases], 1)
        assert tcp_proxy.replies_dropped == 1
        assert await q.get(leases[0].task_id) is None  # it landed: the records are gone
        # The resend, in a call of its own, names the first call's receipt.
        outcomes = await q.engine.complete_many([(lease, "null") for lease in leases])
        assert outcomes == [protocol.Outcome.COMPLETED] * 2 + [protocol.Outcome.LOST]
        with pytest.raises(effectmq.AlreadySettled, match="completed"):
            await leases[0].release()
        with pytest.raises(effectmq.AlreadySettled, match="completed"):
            await leases[1].fail(RuntimeError("late"))
        with pytest.raises(effectmq.LeaseLost):
            await stale.release()
    finally:
        await q.close()


async def test_a_call_names_only_receipt_keys_it_declared(make_queue):
    q = make_queue("receipt-keys", retention_completed=0)
    await q.offer("x", None, task_id="a")
    lease = await q.acquire()
    keys = [*q.keys.script_keys, q.keys.task("a")]  # no receipt key for the receipt named
    with pytest.raises(redis.exceptions.ResponseError, match="undeclared receipt key"):
        await q.redis.eval(scripts.source("complete"), len(keys), *keys, 0, "mine", "", "a", lease.token, "null")
    assert (await q.get("a")).state == "active"
