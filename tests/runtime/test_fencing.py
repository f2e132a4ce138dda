"""Fenced ownership: only the current attempt's token may write."""

import asyncio

import pytest

import effectmq
from effectmq import LeaseLost
from effectmq.protocol.protocol import Outcome


async def expire(queue, lease):
    """Let `lease` run out by Redis time, then recover it with a maintenance pass."""
    await asyncio.sleep(lease.lock_timeout + 0.05)
    report = await queue.maintain()
    assert report.recovered + report.stalled_failed == 1
    return report


async def test_stale_attempt_is_fenced_out(queue):
    await queue.offer("charge", {"amount": 5}, task_id="t1", max_stalled_count=3)
    a = await queue.acquire()
    await expire(queue, a)
    b = await queue.acquire()
    assert b.task_id == "t1" and b.token != a.token and b.attempt == 2

    for write in (a.renew(), a.complete("A"), a.fail(ValueError("A")), a.progress(50), a.release()):
        with pytest.raises(LeaseLost):
            await write
    info = await queue.get("t1")
    assert info.state == "active" and info.progress is None and info.error is None
    assert info.handler_failure_count == 0

    await b.progress(90)
    await b.complete({"by": "B"})
    info = await queue.get("t1")
    assert (info.state, info.result, info.progress) == ("completed", {"by": "B"}, 90)
    assert info.stalled_attempt_count == 1 and info.attempt == 2
    with pytest.raises(LeaseLost):
        await a.complete("late")
    assert (await queue.get("t1")).result == {"by": "B"}


async def test_same_task_reacquired_does_not_accept_old_token(queue):
    """ABA: a lease released and re-acquired gets a new token; the old one is dead."""
    await queue.offer("x", None, task_id="aba")
    first = await queue.acquire()
    await first.release()
    second = await queue.acquire()
    assert second.task_id == "aba" and second.token != first.token
    with pytest.raises(LeaseLost):
        await first.complete("old")
    await second.complete("new")
    assert (await queue.get("aba")).result == "new"


async def test_expired_lease_cannot_settle_even_before_recovery(queue):
    """Redis time decides: once the deadline passed, the old token is rejected."""
    await queue.offer("x", None, task_id="late")
    lease = await queue.acquire()
    await asyncio.sleep(lease.lock_timeout + 0.05)
    with pytest.raises(LeaseLost):
        await lease.complete("too late")
    assert (await queue.get("late")).state == "active"  # until maintenance recovers it
    await queue.maintain()
    assert (await queue.get("late")).state == "waiting"


async def test_renew_extends_ownership(queue):
    await queue.offer("x", None, task_id="long")
    lease = await queue.acquire()
    for _ in range(4):
        await asyncio.sleep(lease.lock_timeout / 2)
        await lease.renew()
    report = await queue.maintain()
    assert report.recovered == 0
    await lease.complete(1)
    assert (await queue.get("long")).stalled_attempt_count == 0


async def test_duplicate_acknowledgement_is_a_no_op(queue):
    """An ack retried after an unknown outcome gives the same answer, not an error."""
    await queue.offer("x", None, task_id="dup")
    lease = await queue.acquire()
    await lease.complete("once")
    await lease.complete("twice")  # same token: accepted as already done
    info = await queue.get("dup")
    assert info.result == "once" and info.state == "completed"


async def test_cancel_of_active_task_fences_its_attempt(queue):
    await queue.offer("x", None, task_id="c1")
    lease = await queue.acquire()
    assert await queue.cancel("c1") == "active"
    with pytest.raises(LeaseLost):
        await lease.renew()
    with pytest.raises(LeaseLost):
        await lease.complete("no")
    info = await queue.get("c1")
    assert info.state == "canceled" and info.error.tag == effectmq.CANCELED


async def test_stalls_are_counted_apart_from_failures(make_queue):
    q = make_queue("stalls", lock_timeout=0.2, max_retries=5, max_stalled_count=1, retry=effectmq.Fixed(0))
    await q.offer("x", None, task_id="s1")  # the queue's max_stalled_count: 1

    lease = await q.acquire()
    assert await lease.fail(effectmq.ErrorInfo("Declined")) is True  # typed failure, retried at once
    info = await q.get("s1")
    assert (info.handler_failure_count, info.stalled_attempt_count, info.state) == (1, 0, "waiting")

    lease = await q.acquire()
    await expire(q, lease)  # first stall: recovered
    info = await q.get("s1")
    assert (info.handler_failure_count, info.stalled_attempt_count, info.state) == (1, 1, "waiting")

    lease = await q.acquire()
    report = await expire(q, lease)  # second stall: exceeds max_stalled_count=1
    assert report.stalled_failed == 1
    info = await q.get("s1")
    assert info.state == "failed" and info.error.tag == effectmq.STALLED
    assert info.stalled_attempt_count == 2
    assert info.handler_failure_count == 1  # max_retries (5) was not consumed by stalls
    assert [t.task_id for t in await q.dead_letters()] == ["s1"]


async def test_max_retries_ends_in_failed_with_the_declared_tag(make_queue):
    q = make_queue("retries", lock_timeout=5, retry=effectmq.Fixed(0))
    await q.offer("x", None, task_id="r1", max_retries=2)
    for expected_retry in (True, True, False):
        lease = await q.acquire()
        assert await lease.fail(effectmq.ErrorInfo("PaymentDeclined", "card declined")) is expected_retry
    info = await q.get("r1")
    assert info.state == "failed" and info.error.tag == "PaymentDeclined"
    assert (info.handler_failure_count, info.stalled_attempt_count, info.attempt) == (3, 0, 3)


async def test_batched_completion_checks_each_token(queue):
    await queue.offer_many([("x", i, {"task_id": f"b{i}"}) for i in range(3)])
    leases, _ = await queue.acquire_many(3)
    await leases[1].release()
    stale = leases[1]
    fresh = await queue.acquire()
    codes = await queue.complete_many([(leases[0], '"a"'), (stale, '"stale"'), (leases[2], '"c"')])
    assert codes == [Outcome.COMPLETED, Outcome.RELEASED, Outcome.COMPLETED]  # the stale one changed nothing
    # A resend of a settled token gets the same answer; the new owner completes.
    assert await queue.complete_many([(leases[0], '"again"'), (fresh, '"b"')]) == [Outcome.COMPLETED] * 2
    results = [(await queue.get(f"b{i}")).result for i in range(3)]
    assert results == ["a", "b", "c"]


async def test_the_history_tells_a_stall_that_was_retried_from_the_one_that_ended_the_task(queue):
    await queue.offer("charge", {"amount": 5}, task_id="h1", max_stalled_count=1)
    for _ in range(2):
        await expire(queue, await queue.acquire())
    info = await queue.get("h1")
    assert info.state == "failed" and info.stalled_attempt_count == 2
    retried, ended = info.attempts
    assert (retried.outcome, ended.outcome) == ("stalled", "stalled")
    assert retried.error.tag == ended.error.tag == effectmq.STALLED
    assert "too many" not in retried.error.message and "back to waiting" in retried.error.message
    assert "too many times" in ended.error.message and info.error.message == ended.error.message
