import pytest

import effectmq
from effectmq.scheduler import Scheduler


@pytest.fixture
async def scheduler(redis_url):
    s = Scheduler(redis_url, namespace="test")
    yield s
    await s.close()


@pytest.fixture
async def make_queue(redis_url):
    queues: list[effectmq.TaskQueue] = []

    def make(name: str, **options) -> effectmq.TaskQueue:
        q = effectmq.TaskQueue(name, url=redis_url, **options)
        queues.append(q)
        return q

    yield make
    for q in queues:
        await q.close()
