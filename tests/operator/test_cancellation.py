"""A loop of the operator that is cancelled ends, also when the cancel is dropped on its
way: Python 3.11's `asyncio.wait_for` returns the result of a call that finishes just as
its caller is cancelled, and redis-py finishes a command it was cancelled in and returns
its reply. Either way the cancel never reached the loop: a Queue or Schedule loop
cancelled at a lost leadership or at shutdown went on, and whoever waited for it
waited forever (seen as a test that hung for 300 s under load, waiting for the Queue
loop it had cancelled)."""

from __future__ import annotations

import asyncio

from effectmq_operator.queue_controller import QueueController
from effectmq_operator.redis_pool import Connections, RedisTarget
from effectmq_operator.schedule_controller import ScheduleController
from tests.operator.test_schedule_identity import StatusOnly


def cancel_as_it_returns(task_of, real):
    """`real`, an awaited call, made to cancel the awaiting loop (`task_of()`) as it returns."""
    async def call(*args, **kwargs):
        value = await real(*args, **kwargs)
        asyncio.get_running_loop().call_soon(task_of().cancel)
        return value
    return call


async def ended(task: asyncio.Task, within: float = 3.0) -> bool:
    """Whether `task` ended cancelled within the time (if not, it is cancelled until it does)."""
    done, _ = await asyncio.wait({task}, timeout=within)
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    return bool(done) and task.cancelled()


class ListsOnly:
    """The API server of a Queue loop that finds no Queue."""

    async def list_resources(self, plural: str, namespaces: list[str]) -> list[dict]:
        await asyncio.sleep(0)  # a list waits on the API server
        return []


async def test_the_queue_loop_ends_when_cancelled_as_its_list_returns():
    kube = ListsOnly()
    connections = Connections(kube=None)
    queues = QueueController(kube, connections)
    loop: asyncio.Task | None = None
    # the list runs under asyncio.wait_for (the registry's deadline): the cancel lands as it returns
    kube.list_resources = cancel_as_it_returns(lambda: loop, kube.list_resources)
    loop = asyncio.create_task(queues.run(lambda: True, interval=0.01))
    try:
        assert await ended(loop), "the Queue loop went on after it was cancelled"
    finally:
        await connections.close()


async def test_the_tick_loops_stop_when_cancelled_as_a_pass_returns(redis_url):
    connections = Connections(kube=None)
    controller = ScheduleController(StatusOnly(), connections, QueueController(None, connections))
    target = RedisTarget(redis_url)
    scheduler = connections.scheduler(target)
    ticks = controller.ticks
    # the cancel lands as the pass returns: in the next Redis command, which redis-py finishes
    scheduler.tick = cancel_as_it_returns(lambda: ticks._loops[target], scheduler.tick)
    try:
        ticks.ensure({target})
        assert await ended(ticks._loops[target]), "the tick loop went on after it was cancelled"
        await asyncio.wait_for(ticks.stop(), 3.0)
    finally:
        await connections.close()
