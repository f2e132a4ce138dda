"""Queues with tasks in known states, made through the engine's own operations."""

from __future__ import annotations

import effectmq
from effectmq import TaskQueue


class MailboxFull(effectmq.TaskError):
    """A typed error: its tag is its class name."""


async def fail_one(q: TaskQueue, error: BaseException, *, retryable: bool = False) -> str:
    lease = await q.acquire()
    assert lease is not None
    await lease.fail(error, retryable=retryable)
    return lease.task_id


async def two_queues(url: str) -> dict:
    """emails: 3 waiting, 1 active, 2 completed, 2 failed (one typed); reports/daily: 2 waiting, 1 delayed."""
    async with TaskQueue("emails", url=url) as q:
        await q.want_events()  # as the dashboard does for the queues it shows: lifecycle events are kept
        ids = [o.task_id for o in await q.offer_many(
            [("send_email", {"to": f"user{i}@example.com"}, {"task_id": f"mail-{i}"}) for i in range(8)])]
        for _ in range(2):
            lease = await q.acquire()
            assert lease is not None
            await lease.progress({"step": "sent"})
            await lease.complete({"delivered": True})
        typed = await fail_one(q, MailboxFull("mailbox of user2@example.com is full", data={"retry_in": 60}))
        defect = await fail_one(q, RuntimeError("SMTP connection reset"))
        running = await q.acquire(lock_timeout=600)
        assert running is not None
        await q.worker_beat("worker-a", 1, 10, ttl=600)
    async with TaskQueue("reports/daily", url=url) as r:
        await r.offer("send_report", {"report": "sales"}, task_id="report-1")
        await r.offer("send_report", {"report": "stock"}, task_id="report-2")
        await r.offer("send_report", {"report": "later"}, task_id="report-3", delay=3600)
    return {"ids": ids, "typed": typed, "defect": defect, "running": running.task_id}
