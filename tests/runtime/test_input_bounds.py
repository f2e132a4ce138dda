"""Every number a user gives is bounded where it enters (issue 34: defect 7)."""

from __future__ import annotations

import sys

import pytest

import effectmq
from effectmq import protocol

YEARS_10 = 315_360_000  # seconds: protocol.MAX_DURATION
COUNT = 2**31 - 1  # protocol.MAX_COUNT


def test_the_limits_keep_every_millisecond_value_far_below_2_to_the_53():
    assert protocol.MAX_DURATION == YEARS_10 and protocol.MAX_COUNT == COUNT
    for limit in (protocol.MAX_DELAY, protocol.MAX_LOCK_TIMEOUT, protocol.MAX_RETENTION,
                  protocol.MAX_DEDUP_WINDOW):
        # Redis time in ms (2100 AD: 4.1e12) plus the largest duration in ms
        assert 4_102_444_800_000 + protocol.ms(limit) < 2**50
    assert protocol.MAX_PROMOTE_BATCH == 1000  # Lua unpacks the due ids: its limit is ~8000


# -- defect 7: huge options overflow ----------------------------------------------------


@pytest.mark.parametrize("option, value, limit", [
    ("retention_completed", sys.maxsize, "315360000"),
    ("retention_failed", 1e16, "315360000"),
    ("lock_timeout", 1e16, "315360000"),
    ("promote_batch", 1001, "1000"),
    ("promote_batch", 9000, "1000"),
    ("max_retries", 2**31, str(COUNT)),
    ("max_stalled_count", 2**63, str(COUNT)),
    ("socket_timeout", 1e16, "315360000"),
    ("max_connections", 2**40, str(COUNT)),
])
def test_the_constructor_rejects_a_number_over_its_limit(redis_url, option, value, limit):
    with pytest.raises(effectmq.InvalidOption, match=rf"{option} must be <= {limit}\b"):
        effectmq.TaskQueue("q", url=redis_url, **{option: value})


@pytest.mark.parametrize("option, value, limit", [
    ("retention_completed", sys.maxsize, "315360000"),
    ("retention_failed", YEARS_10 + 1, "315360000"),
    ("dedup_window", 1e16, "315360000"),
    ("lock_timeout", 1e10, "315360000"),
    ("max_retries", 2**31, str(COUNT)),
    ("max_stalled_count", 10**20, str(COUNT)),
    ("max_active", 2**63, str(COUNT)),
    ("events_maxlen", 2**53, str(COUNT)),
    ("retry", effectmq.Fixed(YEARS_10 + 1), "315360000"),
    ("retry", effectmq.Exponential(1.0, 1e16), "315360000"),
    ("retry", effectmq.Exponential(1.0, 60, factor=1e6), "1000"),
])
async def test_configure_rejects_a_number_over_its_limit_and_writes_nothing(make_queue, option, value, limit):
    q = make_queue("cfg")
    with pytest.raises(effectmq.InvalidOption, match=rf"{option}\S* must be <= {limit}\b"):
        await q.configure(paused=True, **{option: value})
    assert await q.settings() == {"events_always": False, "sensitive": False}  # nothing written, not even paused


@pytest.mark.parametrize("option, value, limit", [
    ("delay", YEARS_10 + 1, "315360000"),
    ("max_retries", 2**31, str(COUNT)),
    ("max_stalled_count", 2**63, str(COUNT)),
    ("timeout", 1e16, "315360000"),
    ("retry", effectmq.Fixed(1e12), "315360000"),
])
async def test_offer_and_offer_many_reject_a_number_over_its_limit(queue, option, value, limit):
    with pytest.raises(effectmq.InvalidOption, match=rf"{option}\S* must be <= {limit}\b"):
        await queue.offer("x", None, **{option: value})
    with pytest.raises(effectmq.InvalidOption, match=rf"{option}\S* must be <= {limit}\b"):
        await queue.offer_many([("x", 1), ("x", 2, {option: value})])
    assert (await queue.stats()).waiting == 0


async def test_calls_reject_counts_and_durations_over_their_limits(make_queue):
    q = make_queue("calls")
    with pytest.raises(effectmq.InvalidOption, match=r"limit must be <= 10000\b"):
        await q.list_tasks("waiting", limit=10**12)
    with pytest.raises(effectmq.InvalidOption, match=rf"offset must be <= {COUNT}\b"):
        await q.list_tasks("waiting", offset=2**63)
    with pytest.raises(effectmq.InvalidOption, match=r"offset must be >= 0"):
        await q.list_tasks("waiting", offset=-5)
    with pytest.raises(effectmq.InvalidOption, match=r"limit must be <= 10000\b"):
        await q.dead_letters(limit=10**6)
    with pytest.raises(effectmq.InvalidOption, match=r"limit must be <= 10000\b"):
        await q.task_events("x", limit=10**6)
    with pytest.raises(effectmq.InvalidOption, match=r"batch must be <= 5000\b"):
        await q.maintain(batch=10**9)
    with pytest.raises(effectmq.InvalidOption, match=r"budget must be <= 315360000\b"):
        await q.sweep(budget=1e300)
    with pytest.raises(effectmq.InvalidOption, match=r"lock_timeout must be <= 315360000\b"):
        await q.acquire(lock_timeout=1e16)
    with pytest.raises(effectmq.InvalidOption, match=r"count must be <= 10000\b"):
        async for _ in q.events(count=10**9):
            pass
    with pytest.raises(effectmq.InvalidOption, match=r"block must be >= 0"):
        async for _ in q.events(block=-1):
            pass
    with pytest.raises(effectmq.InvalidOption, match=r"ttl must be <= 315360000\b"):
        await q.worker_beat("w", 0, 1, 1e16)
    with pytest.raises(effectmq.InvalidOption, match=rf"concurrency must be <= {COUNT}\b"):
        await q.worker_beat("w", 0, 2**40, 10)


async def test_options_at_their_limits_are_accepted_and_round_trip(make_queue):
    q = make_queue("limits", lock_timeout=YEARS_10, retention_completed=YEARS_10, retention_failed=YEARS_10,
                   max_retries=COUNT, max_stalled_count=COUNT, promote_batch=1000, socket_timeout=YEARS_10,
                   max_connections=COUNT)
    at_limit = {"max_active": COUNT, "max_retries": COUNT, "max_stalled_count": COUNT, "lock_timeout": YEARS_10,
                "retention_completed": YEARS_10, "retention_failed": YEARS_10, "dedup_window": YEARS_10,
                "events_maxlen": COUNT, "retry": effectmq.Exponential(YEARS_10, YEARS_10, jitter=False)}
    await q.configure(**at_limit)
    stored = await q.settings()
    assert {key: stored[key] for key in at_limit} == at_limit
    assert await q.refresh_settings() == stored
    # keep-forever is None (or -1) as before
    await q.configure(retention_completed=-1, retention_failed=None)
    stored = await q.settings()
    assert stored["retention_completed"] is None and "retention_failed" not in stored

    before = await q.redis.time()
    offered = await q.offer("x", {"v": 1}, task_id="far", delay=YEARS_10, max_retries=COUNT,
                            max_stalled_count=COUNT, timeout=YEARS_10, retry=effectmq.Fixed(YEARS_10))
    info = await q.get("far")
    assert offered.created and info.state == "delayed"
    assert (info.max_retries, info.max_stalled_count) == (COUNT, COUNT)
    assert info.options == {"timeout": YEARS_10, "retry": {"backoff": "Fixed", "initialDelaySeconds": YEARS_10}}
    due = await q.redis.zscore(q.keys.key("delayed"), "far")
    assert abs(due - (before[0] * 1000 + YEARS_10 * 1000)) < 5_000
    [ok] = await q.offer_many([("x", 1, {"delay": YEARS_10, "max_retries": COUNT})])
    assert ok.created
    # An events stream of COUNT entries is only a bound: events are written as usual.
    await q.configure(events_always=True)
    await q.offer("x", None)
    assert await q.redis.xlen(q.keys.key("events")) >= 1
    assert len(await q.list_tasks("delayed", limit=10_000, offset=0)) == 2
    assert await q.list_tasks("delayed", offset=COUNT) == []
    await q.worker_beat("w", 0, COUNT, YEARS_10)
    assert (await q.workers())["w"] == (0, COUNT)


async def test_retention_at_its_maximum_keeps_the_record_through_maintain(make_queue):
    """sys.maxsize used to mean 'keep for ever' and deleted the record at the next
    maintain (Lua printed the expiry as a negative number); now it is refused, and the
    largest retention accepted keeps records and reservations."""
    with pytest.raises(effectmq.InvalidOption, match="retention_completed must be <= 315360000"):
        make_queue("keep", retention_completed=sys.maxsize)
    q = make_queue("keep", retention_completed=YEARS_10, retention_failed=YEARS_10)
    with pytest.raises(effectmq.InvalidOption, match="dedup_window must be <= 315360000"):
        await q.configure(dedup_window=1e16)
    await q.configure(dedup_window=YEARS_10)
    for tid in ("done", "dead"):
        await q.offer("x", None, task_id=tid, max_retries=0)
    await (await q.acquire()).complete("ok")
    await (await q.acquire()).fail("Boom")
    now_ms = (await q.redis.time())[0] * 1000
    for index, tid in (("completed", "done"), ("failed", "dead")):
        expiry = await q.redis.zscore(q.keys.key(index), tid)
        assert abs(expiry - (now_ms + YEARS_10 * 1000)) < 5_000, (index, expiry)
    report = await q.maintain(batch=100)
    assert report.expired_records == 0
    assert (await q.get("done")).result == "ok" and (await q.get("dead")).state == "failed"

    # retention 0 with the longest dedup window: the id stays reserved through maintain
    zero = make_queue("zero", retention_completed=0)
    await zero.configure(dedup_window=YEARS_10)
    await zero.offer("x", None, task_id="tick")
    await (await zero.acquire()).complete()
    await zero.maintain(batch=100)
    assert await zero.redis.zscore(zero.keys.key("dedup"), "tick") > now_ms + (YEARS_10 - 10) * 1000
    assert not (await zero.offer("x", None, task_id="tick")).created
