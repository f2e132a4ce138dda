"""A worker that may not start anything (max_active reached, or the queue paused) waits
for a wake-up instead of asking again and again, even while a delayed task is due."""

from __future__ import annotations

import asyncio

from tests.support.inprocess import make_worker, running


async def test_a_due_task_on_a_full_queue_is_no_reason_to_ask_again_now(make_queue):
    q = make_queue("limited-due")
    await q.configure(max_active=1)
    await q.offer("job", {}, task_id="holder")
    holder = await q.acquire()
    await q.offer("job", {}, task_id="later", delay=0.05)
    await asyncio.sleep(0.1)
    leases, next_due = await q.acquire_many(1)
    assert leases == [] and next_due is None  # was 0 or less: "look again now"
    await holder.complete("done")
    (lease,) = (await q.acquire_many(1))[0]  # the slot freed: the due task is leased
    assert lease.task_id == "later"


async def test_a_worker_on_a_full_queue_with_a_due_task_does_not_spin(make_queue):
    q = make_queue("limited-spin")
    await q.configure(max_active=1)
    release = asyncio.Event()
    calls = 0
    acquire_many = q.acquire_many

    async def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return await acquire_many(*args, **kwargs)

    q.acquire_many = counted

    async def job(ctx, payload):
        await release.wait()

    worker = make_worker(q, {"job": job}, concurrency=2, maintenance_interval=60, idle_poll=5.0)
    async with running(worker):
        await q.offer("job", {}, task_id="first")
        for _ in range(100):
            if (await q.stats()).active == 1:
                break
            await asyncio.sleep(0.02)
        await q.offer("job", {}, task_id="due", delay=0.05)
        calls = 0
        await asyncio.sleep(2.0)
        assert calls < 10, f"{calls} acquire calls in 2 s while nothing could start"
        release.set()
        await q.wait("due", timeout=10)  # the slot freed: it ran
    assert (await q.get("due")).state == "completed"


async def test_a_due_task_on_a_paused_queue_waits_for_the_resume(make_queue):
    q = make_queue("paused-due")
    await q.offer("job", {}, task_id="later", delay=0.05)
    await q.pause()
    await asyncio.sleep(0.1)
    assert await q.acquire_many(1) == ([], None)
    await q.resume()  # configure.lua wakes idle workers
    (lease,) = (await q.acquire_many(1))[0]
    assert lease.task_id == "later"
