"""Workers run inside the test's own event loop."""

from __future__ import annotations

import asyncio
import contextlib

import effectmq


@contextlib.asynccontextmanager
async def running(worker, *, stop_timeout: float = 30.0):
    """Run `worker` for the block; on exit stop it and require that run() returns."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, stop_timeout)


def make_worker(queue, handlers, **options):
    options.setdefault("install_signal_handlers", False)
    options.setdefault("maintenance_interval", 0.1)
    return effectmq.Worker(queue, handlers, **options)


async def settled(queue, task_id, timeout=10.0):
    with contextlib.suppress(effectmq.TaskFailed):
        await queue.wait(task_id, timeout=timeout)
    return await queue.get(task_id)
