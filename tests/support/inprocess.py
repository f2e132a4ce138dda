"""Workers run inside the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib

import effectmq


@contextlib.asynccontextmanager
async def running(worker, *, stop_timeout: float = 30.0):
    """Run `worker` for the block; on exit stop it and require that run() returns, with
    its slot ledger in balance (every slot a call asked for given back)."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, stop_timeout)
    worker.slots.check()
    assert worker.slots.asking == 0, f"{worker.slots.asking} slots still asked for after the worker stopped"


def make_worker(queue, handlers, **options):
    options.setdefault("install_signal_handlers", False)
    options.setdefault("maintenance_interval", 0.1)
    return effectmq.Worker(queue, handlers, **options)


async def settled(queue, task_id, timeout=10.0):
    with contextlib.suppress(effectmq.TaskFailed):
        await queue.wait(task_id, timeout=timeout)
    return await queue.get(task_id)


async def drain(queue, count: int, handler=None, *, concurrency: int = 20) -> None:
    """Run a worker until `count` "job" tasks ran (through `handler`, if given) and none
    is left waiting, delayed or active."""
    seen = 0
    done = asyncio.Event()

    async def job(payload):
        nonlocal seen
        seen += 1
        if seen == count:
            done.set()
        if handler:
            return await handler(payload)

    async with running(make_worker(queue, {"job": job}, concurrency=concurrency)):
        await asyncio.wait_for(done.wait(), 30)
        await until_drained(queue)


async def until_drained(queue) -> None:
    """Wait until no task is left waiting, delayed or active."""
    while True:
        stats = await queue.stats()
        if stats.waiting == stats.active == stats.delayed == 0:
            return
        await asyncio.sleep(0.01)
