"""Retention keeps up with load: expired records are deleted as fast as they
fall due, in calls that each stay bounded."""

from __future__ import annotations

import asyncio
import time

import pytest

import effectmq
from tests.support.inprocess import running

RECORDS = 60_000
# A worker's first pass comes within 1.5 maintenance intervals (7.5 s at the default
# of 5 s, the jitter); 60,000 records at the 8,000/s one worker completes take 7.5 s
# more. The fixed ten calls of 100 per interval deleted at most ~3,000 in that time.
DELETED_WITHIN = 15.0


async def noop(payload):
    return None


async def completed_records(q: effectmq.TaskQueue, n: int) -> None:
    """`n` completed records, made through the worker protocol a thousand at a time."""
    await q.offer_many(("noop", None) for _ in range(n))
    while True:
        leases, _ = await q.acquire_many(1000)
        if not leases:
            return
        await q.complete_many([(lease, "null") for lease in leases])


@pytest.mark.slow
async def test_one_worker_deletes_60k_expired_records_within_15_s(make_redis):
    server = make_redis()
    admin = server.client()
    q = effectmq.TaskQueue("retention", url=server.url, retention_completed=1)
    try:
        await completed_records(q, RECORDS)
        assert (await q.stats()).completed == RECORDS
        await asyncio.sleep(1.1)  # every record is past its retention now
        admin.config_set("slowlog-log-slower-than", 100_000)  # microseconds: calls over 100 ms
        admin.slowlog_reset()
        worker = effectmq.Worker(q, {"noop": noop}, install_signal_handlers=False)  # the default settings
        started = time.monotonic()
        async with running(worker):
            left = RECORDS
            while left and time.monotonic() - started < DELETED_WITHIN:
                await asyncio.sleep(0.1)
                left = (await q.stats()).completed
        took = time.monotonic() - started
        hashes = sum(1 for _ in admin.scan_iter(match=q.keys.task("*"), count=1000))
    finally:
        await q.close()
    print(f"{RECORDS - left} of {RECORDS} expired records deleted in {took:.1f} s")
    assert left == 0, f"{left} of {RECORDS} expired records still there after {took:.1f} s"
    assert hashes == 0, f"{hashes} task hashes left"
    slow = [(entry["duration"], entry["command"][:40]) for entry in admin.slowlog_get(128)]
    assert slow == [], f"calls over 100 ms: {slow}"


async def test_sweep_goes_on_while_calls_report_more_within_its_budget(make_queue):
    q = make_queue("sweep", retention_completed=0.001)
    await completed_records(q, 250)
    await asyncio.sleep(0.01)
    first = await q.sweep(batch=100, budget=0)  # no time left after the first call
    assert (first.expired_records, first.more) == (100, True)
    rest = await q.sweep(batch=100, budget=30)
    assert (rest.expired_records, rest.more) == (150, False)
    assert (await q.stats()).completed == 0
    with pytest.raises(effectmq.InvalidOption, match="budget"):
        await q.sweep(budget=-1)


async def test_worker_rejects_a_maintenance_batch_past_the_bound(queue):
    with pytest.raises(effectmq.InvalidOption, match="maintenance_batch"):
        effectmq.Worker(queue, {"noop": noop}, maintenance_batch=effectmq.client.queue.MAX_MAINTAIN_BATCH + 1)
    with pytest.raises(effectmq.InvalidOption, match="maintenance_interval"):
        effectmq.Worker(queue, {"noop": noop}, maintenance_interval=0)
