"""The scripts' error paths keep every task, each case against real Redis (each case
lost or corrupted a task on 8519fde): what the client sends is whatever a user or a
handler could make it send, bypassing the Python checks where those now come first."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

import effectmq
from effectmq.protocol import protocol
from effectmq.client.queue import offer_argv
from tests.support.inprocess import make_worker, running
from tests.support.write_rule import queue_invariants


async def _invariants(q, redis_url):
    raw = aioredis.Redis.from_url(redis_url)
    try:
        return await queue_invariants(raw, q.keys.base.encode())
    finally:
        await raw.aclose()


async def _fail_raw(q, lease, error_json: str, max_retries: int = 3) -> protocol.FailReply:
    """fail.lua given `error_json` as sent, not as engine.error_json would clean it."""
    return await q._scripts.run(protocol.FailArgs(lease._wire_id, lease.token, error_json, 1000, max_retries, -1, ""))


@pytest.mark.parametrize("data", [
    "1" + "0" * 400,  # an int beyond double range: cjson reads inf and cannot write it back
    "[" * 1100 + "]" * 1100,  # deeper than cjson reads
])
async def test_error_data_lua_cannot_reencode_still_counts_one_handler_failure(make_queue, redis_url, data):
    q = make_queue("bigerr", lock_timeout=60)
    await q.offer("t", 1, task_id="a")
    lease = await q.acquire()
    reply = await _fail_raw(q, lease, '{"tag":"Boom","message":"m","data":%s}' % data)
    assert reply.outcome is protocol.Outcome.RETRY and reply.handler_failure_count == 1
    info = await q.get("a")
    assert (info.state, info.handler_failure_count, info.stalled_attempt_count) == ("delayed", 1, 0)
    assert info.error.tag in ("Boom", "~effectmq/Error/Defect")
    await _invariants(q, redis_url)
    assert (await q.stats()).delayed == 1
    assert (await q.maintain()).recovered == 0  # it is no stall


async def test_error_larger_than_the_stored_limit_becomes_a_placeholder(make_queue):
    q = make_queue("hugeerr", lock_timeout=60, max_retries=0)
    await q.offer("t", 1, task_id="a")
    lease = await q.acquire()
    reply = await _fail_raw(q, lease, json.dumps({"tag": "Boom", "data": "x" * (1 << 21)}), max_retries=0)
    assert reply.outcome is protocol.Outcome.FAILED
    info = await q.get("a")
    assert info.state == "failed" and info.handler_failure_count == 1
    assert info.error.tag == "~effectmq/Error/Defect" and "larger than 1048576 bytes" in info.error.message


async def test_history_written_as_text_keeps_twenty_entries_and_reads_old_records(make_queue, redis_url):
    q = make_queue("history", lock_timeout=60, max_retries=100)
    await q.offer("t", 1, task_id="a")
    key = q.keys.task("a")
    # A history as a version before attempt_sizes wrote it.
    await q.redis.hset(key, "attempts", json.dumps([{"attempt": 0, "outcome": "released", "at": 1}]))
    for n in range(25):
        leases, _ = await q.acquire_many(1)
        reply = await q._scripts.run(protocol.FailArgs("a", leases[0].token, '{"tag":"E%d"}' % n, 0, 100, -1, ""))
        assert reply.outcome is protocol.Outcome.RETRY
    history = json.loads(await q.redis.hget(key, "attempts"))
    assert len(history) == 20
    assert [h["error"]["tag"] for h in history] == [f"E{n}" for n in range(5, 25)]
    await _invariants(q, redis_url)


DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _documented_acl_users() -> list[list[str]]:
    """The ACL SETUSER lines docs/protocol.md shows, as arguments."""
    return [line.split()[1:] for line in DOC.read_text().splitlines() if line.startswith("ACL SETUSER ")]


@pytest.mark.redis7  # the documented users are Redis 7's: 6.2 has no +function, and allows every channel
@pytest.mark.parametrize("acl", _documented_acl_users(), ids=lambda acl: acl[1])
async def test_a_restricted_user_as_documented_loses_nothing_and_the_worker_never_stops(redis_url, redis_server, acl,
                                                                                        caplog):
    """Redis 7 denies channels by default (acl-pubsub-default resetchannels). A
    user allowed the queue's keys only: complete of a task somebody waits on, offer and
    maintain used to fail after their first write; the worker stopped. With the
    channels too, an idle worker starts a new task at once (a wake-up, not a poll)."""
    admin = redis_server.client()
    user = acl[1]
    admin.execute_command("ACL", *acl)
    url = f"redis://{user}:pw@127.0.0.1:{redis_server.port}/0"
    q = effectmq.TaskQueue("acl", url=url, lock_timeout=5)
    try:
        offered = await q.offer_many([("job", i, {"task_id": f"t{i}"}) for i in range(20)])
        assert all(o.created for o in offered)
        assert not (await q.offer("job", 0, task_id="t0")).created  # the first offer wrote once

        await q.redis.zadd(q.keys.key("waiters"), {"t0": 2 ** 50})  # somebody waits on t0
        ran: list[int] = []
        started: dict[int, float] = {}

        async def job(payload):
            started[payload] = asyncio.get_running_loop().time()
            ran.append(payload)

        async with running(make_worker(q, {"job": job}, concurrency=4)) as task:
            for _ in range(300):
                if (await q.stats()).completed == 20:
                    break
                assert not task.done(), task
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.5)  # idle: its wake-up subscription, or its polling, settles
            offered_at = asyncio.get_running_loop().time()
            await q.offer("job", 100, task_id="late")
            for _ in range(100):
                if 100 in started:
                    break
                await asyncio.sleep(0.05)
            assert not task.done()
        stats = await q.stats()
        assert (stats.completed, stats.waiting, stats.active) == (21, 0, 0), stats
        assert sorted(ran) == [*range(20), 100]
        await _invariants(q, redis_url)
        assert (await q.get("t0")).stalled_attempt_count == 0
        denied = [r for r in caplog.records if "may not subscribe" in r.getMessage()]
        if "&{emq:acl}:*" in acl:
            assert started[100] - offered_at < 0.5, "with the channels, a wake-up starts the task"
            assert not denied
        else:  # said once, with what to grant
            assert len(denied) == 1 and "grant the channels &{emq:acl}:*" in denied[0].getMessage()
    finally:
        await q.close()
        admin.execute_command("ACL", "DELUSER", user)


async def test_promote_batch_beyond_luas_unpack_limit_still_promotes(make_queue, redis_url):
    """Was: 9,000 due delayed tasks named to one acquire failed it on unpack (every
    worker crash-looped, the completions in the same call lost their index entries)."""
    q = make_queue("promote", lock_timeout=60, retention_completed=0)
    await q.offer_many([("t", i, {"task_id": f"d{i}", "delay": 0.001}) for i in range(9000)])
    await q.offer("t", "w", task_id="w")
    done = await q.acquire()
    await asyncio.sleep(0.02)
    due = [f"d{i}".encode() for i in range(9000)]
    reply = await q._scripts.run(protocol.AcquireArgs(
        5, 60_000, "x", 9000, window=100, peek=10, candidates=due, retention_ms=0, receipt="", resent="",
        completions=[protocol.Completion("w", done.token, "null")]))
    assert list(reply.outcomes) == [protocol.Outcome.COMPLETED]
    assert len(reply.leases) == 5
    assert len(reply.due) <= 1000  # a bounded batch, whatever the caller asked
    stats = await q.stats()
    assert (stats.waiting, stats.active, stats.delayed, stats.completed) == (8995, 5, 0, 0)
    await _invariants(q, redis_url)


async def test_a_setting_beyond_2_to_the_63_keeps_records_for_ever(make_queue):
    """Where Lua formats numbers: a retention of 2^63 ms used to print as a negative
    number, so the next maintain deleted the record and its dedup reservation."""
    q = make_queue("huge", lock_timeout=60)
    await q.redis.hset(q.keys.key("meta"), mapping={"retention_completed_ms": str(2 ** 63 + 10),
                                                     "dedup_window_ms": str(10 ** 16)})
    await q.offer("t", 1, task_id="keep")
    lease = await q.acquire()
    await lease.complete("r")
    await asyncio.sleep(0.01)
    await q.maintain()
    assert (await q.get("keep")).state == "completed"
    score = await q.redis.zscore(q.keys.key("completed"), "keep")
    assert score == 2 ** 53
    assert not (await q.offer("t", 2, task_id="keep")).created


async def test_one_explicit_id_twice_in_one_offer_call_is_created_once(make_queue):
    """In the script: the second entry is a re-offer (created 0), the first's
    options stay."""
    q = make_queue("twice")
    _, first = offer_argv("t", 1, task_id="same", priority=5)
    _, second = offer_argv("t", 2, task_id="same", priority=-5, delay=30)
    reply = await q._scripts.run(protocol.OfferArgs([first, second]))
    assert reply.created == [True, False]
    info = await q.get("same")
    assert (info.state, info.payload) == ("waiting", 1)
    assert (await q.stats()).waiting == 1
