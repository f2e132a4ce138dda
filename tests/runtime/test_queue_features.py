"""Offer semantics, ordering, limits, retention, wait, events and administration."""

import asyncio

import pytest

import effectmq
from effectmq.protocol import scripts
from tests.fixtures.redis import has_functions


async def test_reoffer_leaves_stored_task_untouched(queue):
    first = await queue.offer("a", {"v": 1}, task_id="same", priority=5)
    lease = await queue.acquire()
    second = await queue.offer("b", {"v": 2}, task_id="same", priority=0, max_retries=9)
    assert first.created and not second.created and second.task_id == "same"
    info = await queue.get("same")
    assert (info.name, info.payload, info.priority, info.state, info.attempt) == ("a", {"v": 1}, 5, "active", 1)
    assert info.max_retries is None
    await lease.complete()


async def test_finished_id_stays_reserved_after_its_record_expired(make_queue):
    q = make_queue("dedup", retention_completed=0)  # record dropped at completion
    await q.offer("x", None, task_id="tick-1")
    await (await q.acquire()).complete("done")
    assert await q.get("tick-1") is None
    again = await q.offer("x", None, task_id="tick-1")
    assert not again.created and await q.acquire() is None
    # Generated ids are not reserved (nothing could re-offer them).
    auto = await q.offer("x", None)
    await (await q.acquire()).complete()
    assert len(await q.redis.zrange(q.keys.key("dedup"), 0, -1)) == 1 and auto.created


async def test_dedup_reservation_ends_with_its_window(make_queue):
    q = make_queue("window", retention_completed=0)
    await q.configure(dedup_window=0.2)
    await q.offer("x", None, task_id="w")
    await (await q.acquire()).complete()
    assert not (await q.offer("x", None, task_id="w")).created
    await asyncio.sleep(0.25)
    report = await q.maintain()
    assert report.expired_reservations == 1
    assert (await q.offer("x", None, task_id="w")).created


async def test_reservations_end_in_bounded_batches_lowest_first(make_queue):
    q = make_queue("reserved", retention_completed=0)
    for window, ids in ((0.1, range(7)), (60, range(7, 10))):
        await q.configure(dedup_window=window)
        await q.offer_many([("x", i, {"task_id": f"d{i}"}) for i in ids])
        leases, _ = await q.acquire_many(len(ids))
        await q.engine.complete_many([(lease, "null") for lease in leases])
    await asyncio.sleep(0.15)
    first = await q.maintain(batch=5)
    second = await q.maintain(batch=5)
    assert (first.expired_reservations, first.more) == (5, True)
    assert (second.expired_reservations, second.more) == (2, False)
    kept = await q.redis.zrange(q.keys.key("dedup"), 0, -1)
    assert sorted(kept) == [b"d7", b"d8", b"d9"] or sorted(kept) == ["d7", "d8", "d9"]
    assert not (await q.offer("x", 0, task_id="d9")).created


async def test_retention_expires_records_in_bounded_batches(make_queue):
    q = make_queue("retention", retention_completed=0.1)
    await q.offer_many([("x", i, {"task_id": f"r{i}"}) for i in range(7)])
    leases, _ = await q.acquire_many(7)
    for lease in leases:
        await lease.complete(lease.payload)
    await asyncio.sleep(0.15)
    first = await q.maintain(batch=3)
    assert first.expired_records == 3 and first.more
    second = await q.maintain(batch=3)
    third = await q.maintain(batch=3)
    assert (second.expired_records, third.expired_records, third.more) == (3, 1, False)
    assert (await q.stats()).completed == 0
    assert not (await q.offer("x", 0, task_id="r0")).created  # still reserved


async def test_priorities_then_fifo(queue):
    for i, prio in enumerate([0, 5, 0, 5, -1, 10]):
        await queue.offer("x", i, priority=prio)
    order = []
    while (lease := await queue.acquire()) is not None:
        order.append(lease.payload)
        await lease.complete()
    assert order == [5, 1, 3, 0, 2, 4]


async def test_delayed_tasks_become_ready_by_redis_time(queue):
    await queue.offer("x", "later", task_id="d", delay=0.3)
    await queue.offer("x", "now", task_id="n")
    leases, next_due = await queue.acquire_many(5)
    assert [lease.task_id for lease in leases] == ["n"] and 0 < next_due <= 0.3
    assert (await queue.get("d")).state == "delayed"
    await asyncio.sleep(0.35)
    lease = await queue.acquire()
    assert lease.task_id == "d"


async def test_max_active_caps_leases_across_workers(make_queue):
    q = make_queue("capped")
    await q.configure(max_active=2)
    await q.offer_many([("x", i) for i in range(5)])
    leases, _ = await q.acquire_many(5)
    other = make_queue("capped")
    assert len(leases) == 2 and await other.acquire() is None
    await leases[0].complete()
    assert await other.acquire() is not None
    await q.configure(max_active=None)
    more, _ = await q.acquire_many(5)
    assert len(more) == 2


async def test_pause_and_resume(queue):
    await queue.offer("x", None)
    await queue.pause()
    assert await queue.acquire() is None and (await queue.stats()).paused
    await queue.resume()
    assert await queue.acquire() is not None


async def test_wait_sees_completion_without_lost_wakeup(queue):
    await queue.offer("x", None, task_id="w1")

    async def finish_soon():
        lease = await queue.acquire()
        await asyncio.sleep(0.05)
        await lease.complete({"answer": 42})

    task = asyncio.create_task(finish_soon())
    assert await queue.wait("w1", timeout=5) == {"answer": 42}
    await task
    # Already settled: answers immediately from durable state.
    assert await queue.wait("w1", timeout=0.01) == {"answer": 42}


async def test_wait_raises_for_failed_and_unknown_tasks(queue):
    await queue.offer("x", None, task_id="bad", max_retries=0)
    await (await queue.acquire()).fail(effectmq.ErrorInfo("Nope", "no"))
    with pytest.raises(effectmq.TaskFailed) as err:
        await queue.wait("bad", timeout=1)
    assert err.value.error.tag == "Nope"
    with pytest.raises(effectmq.TaskNotFound):
        await queue.wait("never-offered", timeout=1)
    await queue.offer("x", None, task_id="slow")
    with pytest.raises(TimeoutError):
        await queue.wait("slow", timeout=0.1)


async def test_event_stream_records_the_lifecycle(queue):
    await queue.want_events()  # events are written while somebody asked for them
    await queue.offer("x", None, task_id="e1")
    lease = await queue.acquire()
    await lease.progress(0.5)
    await lease.complete()
    events = []
    async for event in queue.events(since="0", block=0.1):
        events.append((event["event"], event["id"]))
        if event["event"] == "completed":
            break
    assert events == [("created", "e1"), ("active", "e1"), ("progress", "e1"), ("completed", "e1")]


async def test_retry_of_dead_letter_runs_again_with_fresh_counters(queue):
    await queue.offer("x", None, task_id="dl", max_retries=0)
    await (await queue.acquire()).fail(RuntimeError("boom"))
    info = await queue.get("dl")
    assert info.state == "failed" and info.error.tag == effectmq.DEFECT
    assert await queue.retry("dl") == "failed"
    assert await queue.retry("dl") == "waiting"  # not failed anymore: nothing to do
    lease = await queue.acquire()
    assert lease.task_id == "dl" and lease.handler_failure_count == 0 and lease.attempt == 2
    await lease.complete("second time")
    assert (await queue.dead_letters()) == []


async def test_exponential_schedule_delays_retries(make_queue):
    q = make_queue("backoff", retry=effectmq.Exponential(initial=0.2, maximum=10, jitter=False))
    await q.offer("x", None, task_id="b")
    await (await q.acquire()).fail(effectmq.ErrorInfo("E"))
    info = await q.get("b")
    assert info.state == "delayed"
    gap = (info.ready_at - info.started_at).total_seconds()
    assert 0.15 <= gap <= 0.3
    await asyncio.sleep(0.25)
    lease = await q.acquire()
    await lease.fail(effectmq.ErrorInfo("E"))
    info = await q.get("b")
    assert 0.35 <= (info.ready_at - info.started_at).total_seconds() <= 0.5  # doubled


async def test_task_error_not_retryable_ends_at_once(queue):
    class Fatal(effectmq.TaskError):
        retryable = False

    await queue.offer("x", None, task_id="f", max_retries=5)
    assert await (await queue.acquire()).fail(Fatal("permanent", data={"code": 7})) is False
    info = await queue.get("f")
    assert info.state == "failed" and info.error.tag == "Fatal" and info.error.data == {"code": 7}


async def test_scripts_reload_after_script_flush(queue):
    await queue.offer("x", None)
    await queue.redis.script_flush()
    if has_functions():
        await queue.redis.function_flush()  # a restart without persistence drops both
    lease = await queue.acquire()  # NOSCRIPT or 'Function not found' answered, loaded again
    await lease.complete()
    assert (await queue.stats()).completed == 1
    if has_functions():
        assert await queue.redis.function_list(library=scripts.library()[0])  # the library is back
    else:
        assert all(await queue.redis.script_exists(scripts.sha("acquire"), scripts.sha("complete")))


async def test_maintenance_recovers_at_most_batch_leases(make_queue):
    q = make_queue("bounded", lock_timeout=0.1, max_stalled_count=5)
    await q.offer_many([("x", i) for i in range(5)])
    await q.acquire_many(5)
    await asyncio.sleep(0.15)
    first = await q.maintain(batch=2)
    assert (first.recovered, first.more) == (2, True)
    assert (await q.stats()).active == 3
    await q.maintain(batch=2)
    last = await q.maintain(batch=2)
    assert last.recovered == 1 and (await q.stats()).waiting == 5


async def test_queue_settings_apply_to_existing_tasks(make_queue):
    q = make_queue("settings", retry=effectmq.Fixed(0))
    await q.offer("x", None, task_id="s")
    await q.configure(max_retries=0, lock_timeout=7)
    lease = await q.acquire(lock_timeout=60)
    assert lease.lock_timeout == pytest.approx(7)  # the queue's setting wins
    assert await lease.fail(effectmq.ErrorInfo("E")) is False
    assert (await q.settings())["max_retries"] == 0


def test_sync_facade_for_producers(redis_url):
    with effectmq.SyncTaskQueue("sync", url=redis_url) as q:
        offered = q.offer("x", {"n": 1}, task_id="s1")
        assert offered.created and q.get("s1").state == "waiting"
        assert q.stats().waiting == 1
        with pytest.raises(TimeoutError):
            q.wait("s1", timeout=0.05)
        with pytest.raises(effectmq.InvalidPayload):
            q.offer("x", {1, 2})


def test_sync_facade_has_the_task_queues_signatures():
    """Every producer method of the sync facade takes exactly what TaskQueue's does."""
    import inspect

    for name in ("offer", "offer_many", "get", "wait", "cancel", "retry", "pause", "resume", "stats",
                 "configure", "settings", "maintain", "sweep", "list_tasks", "dead_letters", "ping"):
        sync = inspect.signature(getattr(effectmq.SyncTaskQueue, name))
        native = inspect.signature(getattr(effectmq.TaskQueue, name))
        assert list(sync.parameters.items()) == list(native.parameters.items()), name


async def test_an_announcement_reads_no_other_workers_and_still_drops_expired_ones(make_queue):
    """Suspected from reading 8519fde and confirmed: every announcement read the whole
    workers hash (HGETALL), so W workers announcing cost O(W^2) per interval. Now it looks
    at two other entries at random and drops those past their expiry."""
    q = make_queue("announce")
    for i in range(200):
        await q.worker_beat(f"w{i}", 1, 4, 60)
    await q.worker_beat("gone", 0, 4, 0.001)
    await asyncio.sleep(0.01)
    await q.redis.config_resetstat()
    for _ in range(400):  # two random looks each: the expired entry is found, surely
        await q.worker_beat("w0", 2, 4, 60)
    stats = await q.redis.info("commandstats")
    assert "cmdstat_hgetall" not in stats
    workers = await q.workers()
    assert "gone" not in workers and len(workers) == 200 and workers["w0"] == (2, 4)
    assert not await q.redis.hexists(q.keys.key("workers"), "gone")
    await q.worker_beat("w1", -1, 4, 60)  # leaving
    assert "w1" not in await q.workers()
