"""Worker and script edge cases found by hand against real Redis, each reproduced here first:
undecodable values, failing handlers and retry policies, wake-ups, capped batches, resent
settlements and offers, lease lengths, stale deliveries, a Redis that starts after the worker."""

from __future__ import annotations

import asyncio
import base64
import math
import time
import urllib.error
import urllib.request

import pytest
import redis.asyncio as aioredis

import effectmq
from tests.support.inprocess import make_worker, running, settled


async def raw_hset(url, queue, task_id, field, value: bytes):
    """Write bytes straight into a task's record (a foreign writer, a bug, a bit flip)."""
    client = aioredis.Redis.from_url(url)
    await client.hset(queue.keys.task(task_id), field, value)
    await client.aclose()


# -- values decoded per task ------------------------------------------------------


async def test_one_undecodable_value_fails_only_its_task(make_queue, redis_url):
    q = make_queue("utf8", lock_timeout=2)
    for i in range(4):
        await q.offer("echo", i, task_id=f"good-{i}")
    await q.offer("echo", "x", task_id="bad")
    bad_bytes = b'"\xff\xfe caf\xe9"'
    await raw_hset(redis_url, q, "bad", "payload", bad_bytes)

    async def echo(payload):
        return payload

    async with running(make_worker(q, {"echo": echo}, concurrency=8)):
        infos = {tid: await settled(q, tid) for tid in ["bad"] + [f"good-{i}" for i in range(4)]}
    for i in range(4):
        assert (infos[f"good-{i}"].state, infos[f"good-{i}"].result) == ("completed", i)
    bad = infos["bad"]
    assert bad.state == "failed" and bad.error.tag == effectmq.errors.DEFECT, bad
    assert bad.stalled_attempt_count == 0 and "UTF-8" in bad.error.message
    assert base64.b64decode(bad.error.data["raw"]["payload"]) == bad_bytes  # kept for inspection
    assert bad.raw_payload == bad_bytes  # and get() still reads the record


# -- handler failures always settle ---------------------------------------------


class Rejected(effectmq.TaskError):
    pass


async def test_non_json_error_data_is_stored_as_repr_and_retried(make_queue):
    q = make_queue("errdata", lock_timeout=2, retry=effectmq.Fixed(0.01))

    async def picky(payload):
        raise Rejected("no", data={"when": object()})

    async with running(make_worker(q, {"picky": picky})):
        await q.offer("picky", None, task_id="p", max_retries=1)
        info = await settled(q, "p")
    assert info.state == "failed" and info.error.tag == "Rejected"
    assert info.handler_failure_count == 2 and info.stalled_attempt_count == 0 and info.attempt == 2
    assert isinstance(info.error.data, str) and "object object" in info.error.data


@pytest.mark.parametrize("policy", ["raises", "nan", "inf"])
async def test_a_broken_retry_policy_is_a_defect_of_the_attempt(make_queue, policy):
    q = make_queue("policy", lock_timeout=2, retry=effectmq.Fixed(0.01))

    def broken(failures):
        if policy == "raises":
            raise ZeroDivisionError("policy bug")
        return math.nan if policy == "nan" else math.inf

    app = effectmq.App()
    app.use_queue(q)

    @app.task(errors=(Rejected,), retry=broken, max_retries=1)
    async def flaky(payload):
        raise Rejected("try again")

    async with running(make_worker(q, app)):
        await app.offer("flaky", None, task_id="f")
        info = await settled(q, "f")
    assert info.state == "failed", info
    assert info.handler_failure_count == 2 and info.stalled_attempt_count == 0  # the queue's schedule
    assert info.error.tag == effectmq.errors.DEFECT and "retry policy" in info.error.message


# -- wake-ups -------------------------------------------------------------------


async def test_completions_under_max_active_wake_the_workers(make_queue):
    q = make_queue("capped", lock_timeout=2)
    await q.configure(max_active=1)

    async def quick(payload):
        await asyncio.sleep(0.01)

    async with running(make_worker(q, {"quick": quick}, concurrency=4)):
        await asyncio.sleep(0.2)
        start = time.monotonic()
        offered = await q.offer_many([("quick", i) for i in range(20)])
        for o in offered:
            await q.wait(o.task_id, timeout=10)
        took = time.monotonic() - start
    assert took < 2.0, f"20 tasks of 10 ms under max_active=1 took {took:.2f}s"


async def test_a_delayed_task_starts_when_due_not_at_the_next_poll(make_queue):
    q = make_queue("delayed", lock_timeout=2)
    started: dict[str, float] = {}

    async def stamp(payload, ctx):
        started[ctx.task_id] = time.monotonic()

    async with running(make_worker(q, {"stamp": stamp}, idle_poll=5.0)):
        await asyncio.sleep(0.3)  # the worker is asleep on an empty queue
        late = []
        for i in range(5):
            sent = time.monotonic()
            await q.offer("stamp", None, task_id=f"d{i}", delay=0.1)
            await q.wait(f"d{i}", timeout=10)
            late.append(started[f"d{i}"] - (sent + 0.1))
    # the next poll would be up to 5 s late; 0.5 s leaves room for a loaded CI machine
    assert max(late) < 0.5, f"delayed tasks started late by {[round(x, 3) for x in late]}"


# -- maintenance batch ---------------------------------------------------------


async def test_maintain_batch_is_capped_before_anything_is_written(make_queue):
    q = make_queue("sweep", lock_timeout=2, retention_completed=0)
    with pytest.raises(effectmq.InvalidOption, match="batch"):
        await q.maintain(batch=10_000)
    await q.configure(dedup_window=0.001)
    n = effectmq.client.queue.MAX_MAINTAIN_BATCH + 500
    await q.offer_many([{"name": "x", "payload": i, "task_id": f"r{i}"} for i in range(n)])
    while True:
        leases, _ = await q.acquire_many(1000)
        if not leases:
            break
        await q.complete_many([(lease, "null") for lease in leases])
    await asyncio.sleep(0.01)
    first = await q.maintain(batch=effectmq.client.queue.MAX_MAINTAIN_BATCH)
    second = await q.maintain(batch=effectmq.client.queue.MAX_MAINTAIN_BATCH)
    assert (first.expired_reservations, first.more) == (effectmq.client.queue.MAX_MAINTAIN_BATCH, True)
    assert second.expired_reservations == 500


async def test_acquire_many_is_capped(make_queue):
    q = make_queue("many", lock_timeout=2)
    await q.offer_many([("x", i) for i in range(effectmq.client.queue.MAX_ACQUIRE + 10)])
    leases, _ = await q.acquire_many(10 ** 6)
    assert len(leases) == effectmq.client.queue.MAX_ACQUIRE


# -- idempotent settlement ------------------------------------------------------


async def test_resent_complete_reports_the_settled_outcome_with_zero_retention(make_queue):
    q = make_queue("resend", lock_timeout=2, retention_completed=0)
    await q.offer("x", None, task_id="c")
    lease = await q.acquire()
    await lease.complete("done")
    assert await q.get("c") is None  # retention 0: the record is gone
    await lease.complete("done")  # the resend after a lost reply: no LeaseLost
    with pytest.raises(effectmq.AlreadySettled, match="completed"):
        await lease.release()


async def test_resent_fail_reports_retry_when_the_first_scheduled_one(make_queue):
    q = make_queue("resendfail", lock_timeout=2, retry=effectmq.Fixed(30))
    await q.offer("x", None, task_id="f")
    lease = await q.acquire()
    assert await lease.fail(Rejected("no")) is True
    assert await lease.fail(Rejected("no")) is True  # same answer, not "failed"
    info = await q.get("f")
    assert info.state == "delayed" and info.handler_failure_count == 1
    with pytest.raises(effectmq.AlreadySettled, match="retry"):
        await lease.complete("late")


async def test_resent_terminal_fail_with_zero_retention(make_queue):
    q = make_queue("resendterminal", lock_timeout=2, retention_failed=0)
    await q.offer("x", None, task_id="t")
    lease = await q.acquire()
    assert await lease.fail(Rejected("no"), retryable=False) is False
    assert await lease.fail(Rejected("no"), retryable=False) is False
    other = await q.acquire()
    assert other is None


async def test_settle_resent_after_a_reply_dropped_by_the_proxy(tcp_proxy, redis_url):
    """The reply is lost on the wire; the runner resends on a fresh connection."""
    q = effectmq.TaskQueue("dropped", url=tcp_proxy.url, lock_timeout=5, retention_completed=0,
                           retry=effectmq.Fixed(30))
    await q.offer("x", None, task_id="a")
    await q.offer("x", None, task_id="b")
    first, second = (await q.acquire_many(2))[0]
    tcp_proxy.drop_next_reply()
    await first.complete("ok")
    assert tcp_proxy.replies_dropped == 1
    tcp_proxy.drop_next_reply()
    assert await second.fail(Rejected("no")) is True
    assert tcp_proxy.replies_dropped == 2
    info = await q.get("b")
    assert info.state == "delayed" and info.handler_failure_count == 1
    assert await q.get("a") is None
    await q.close()


async def test_an_offer_resent_after_its_reply_was_lost_still_says_it_created_the_task(tcp_proxy):
    """The first send created the tasks and its reply was lost; the runner's resend finds
    them. The call created them, so `created` is True; a later offer of an id is not."""
    q = effectmq.TaskQueue("offer-resent", url=tcp_proxy.url)
    await q.offer("x", None, task_id="warm")  # the script is loaded: the dropped reply is the offer's
    tcp_proxy.drop_next_reply()
    offered = await q.offer("x", {"n": 1}, task_id="explicit")
    assert tcp_proxy.replies_dropped == 1 and offered.created
    tcp_proxy.drop_next_reply()
    generated = await q.offer("x", {"n": 2})
    assert tcp_proxy.replies_dropped == 2 and generated.created
    tcp_proxy.drop_next_reply()
    many = await q.offer_many([("x", {"n": 3}), {"name": "x", "payload": {"n": 4}, "task_id": "explicit-2"},
                               {"name": "x", "payload": {"n": 5}, "task_id": "explicit"}])
    assert tcp_proxy.replies_dropped == 3
    assert [o.created for o in many] == [True, True, False]  # "explicit" was known before this call
    assert not (await q.offer("x", {"n": 1}, task_id="explicit")).created
    assert (await q.stats()).waiting == 5
    await q.close()


# -- lease lengths ---------------------------------------------------------------


async def test_a_short_queue_level_lease_is_renewed_in_time(make_queue):
    q = make_queue("shortlease", lock_timeout=30)
    await q.configure(lock_timeout=1)

    async def slow(payload):
        await asyncio.sleep(3)

    async with running(make_worker(q, {"slow": slow})):
        await q.offer("slow", None, task_id="s")
        info = await settled(q, "s", timeout=15)
    assert (info.state, info.attempt, info.stalled_attempt_count) == ("completed", 1, 0)


async def test_the_workers_own_lease_length_is_kept_on_renewal(make_queue):
    """A 3 s lease outlives 3.6 s of work on renewals of 3 s, never the queue's 30 s.
    (A CI run starved the worker near a renewal: the lease ran out once and attempt 2
    did the work; the renewal lengths are what this test is about.)"""
    q = make_queue("ownlease", lock_timeout=30)
    seen: dict[int, list[float]] = {}  # attempt -> seconds left on its lease at each read

    async def slow(payload, ctx):
        for _ in range(3):
            await asyncio.sleep(1.2)
            info = await q.get(ctx.task_id)
            seen.setdefault(ctx.attempt, []).append(info.lease_deadline.timestamp() - time.time())

    async with running(make_worker(q, {"slow": slow}, lock_timeout=3)):
        await q.offer("slow", None, task_id="o")
        info = await settled(q, "o", timeout=25)
    assert info.state == "completed", info
    assert len(seen[info.attempt]) == 3, seen  # the attempt that completed read its lease at 3.6 s
    assert max(left for reads in seen.values() for left in reads) <= 3.1, seen  # never the queue's 30 s


# -- stale deliveries -----------------------------------------------------------


async def test_two_leases_of_one_task_in_one_worker(make_queue):
    """A stale acquire reply and the current one reach the same worker."""
    q = make_queue("twice", lock_timeout=1, max_stalled_count=5)
    await q.offer("job", None, task_id="j")
    stale = await q.acquire()
    await asyncio.sleep(1.05)
    await q.maintain()
    current = await q.acquire()
    assert current.token != stale.token
    runs = []

    async def job(payload, ctx):
        runs.append(ctx.attempt)
        await asyncio.sleep(2.5)  # longer than the lease: only renewals keep it
        return ctx.attempt

    delivered = [[stale, current]]
    real = q.acquire_many

    async def deliver(count, **kw):
        if delivered:
            return delivered.pop(), None
        return await real(count, **kw)

    q.acquire_many = deliver
    worker = make_worker(q, {"job": job}, concurrency=4)
    async with running(worker):
        await asyncio.sleep(0.5)
        assert worker.in_flight == 1  # the stale one was never started
        info = await settled(q, "j", timeout=15)
    assert (info.state, info.result, info.attempt) == ("completed", current.attempt, current.attempt)
    assert runs == [current.attempt]


async def test_a_lease_delivered_after_its_deadline_never_starts(make_queue):
    q = make_queue("late", lock_timeout=1)
    await q.offer("job", None, task_id="l")
    runs = []

    async def job(payload, ctx):
        runs.append(ctx.attempt)

    real = q.acquire_many
    late = [True]

    async def slow_reply(count, **kw):
        leases, due = await real(count, **kw)
        if leases and late:
            late.clear()
            await asyncio.sleep(1.2)  # the reply was held on the way: the lease is over
        return leases, due

    q.acquire_many = slow_reply
    async with running(make_worker(q, {"job": job})):
        info = await settled(q, "l", timeout=10)
    assert info.state == "completed" and info.attempt == 2 and runs == [2]  # attempt 1 never ran


# -- smaller ones ----------------------------------------------------------------


async def test_bad_values_get_clear_errors(make_queue):
    q = make_queue("small", lock_timeout=2)
    with pytest.raises(effectmq.InvalidOption, match="delay"):
        await q.offer("x", None, delay=1e12)
    with pytest.raises(effectmq.InvalidPayload, match="payload"):
        await q.offer("x", "lone \ud800 surrogate")
    with pytest.raises(effectmq.InvalidPayload):
        await q.offer_many([("x", {"k": "\udfff"})])


async def test_corrupt_task_options_fail_the_task_as_defect(make_queue, redis_url):
    q = make_queue("opts", lock_timeout=2)
    await q.offer("echo", 1, task_id="o", timeout=5)
    await raw_hset(redis_url, q, "o", "options", b"{not json")
    runs = []

    async def echo(payload):
        runs.append(payload)

    async with running(make_worker(q, {"echo": echo})):
        info = await settled(q, "o")
    assert runs == [] and info.state == "failed" and info.error.tag == effectmq.errors.DEFECT
    assert "options" in info.error.message


# -- a worker that starts before its Redis -------------------------------------------


def test_worker_waits_for_redis_at_start_instead_of_exiting(tmp_path, make_redis):
    """Not ready (/readyz 503) while Redis is missing, ready once it answers; alive throughout."""
    from tests.fixtures.redis import free_port
    from tests.support.processes import WorkerProcess

    port, metrics = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}/0"
    worker = WorkerProcess(url, "late", tmp_path, args=["--lock-timeout", "2", "--metrics-port", str(metrics)])
    try:
        time.sleep(3)
        assert worker.proc.poll() is None, worker.log()
        assert "Redis not reachable yet" in worker.log() and f"127.0.0.1:{port}" in worker.log()
        assert probe(metrics, "/livez") == 200 and probe(metrics, "/readyz") == 503
        make_redis(port=port)
        q = effectmq.SyncTaskQueue("late", url=url)
        q.offer("work", {}, task_id="w")
        worker.wait_for_effect(lambda lines: any(line[:2] == ["done", "w"] for line in lines), timeout=20)
        assert probe(metrics, "/readyz") == 200
        q.close()
    finally:
        assert worker.stop() == 0, worker.log()


def probe(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
