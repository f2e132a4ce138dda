import pytest

import effectmq


@pytest.fixture
async def make_queue(redis_url):
    queues: list[effectmq.TaskQueue] = []

    def make(name: str = "q", **options) -> effectmq.TaskQueue:
        options.setdefault("url", redis_url)
        q = effectmq.TaskQueue(name, **options)
        queues.append(q)
        return q

    yield make
    for q in queues:
        await q.close()


@pytest.fixture
async def queue(make_queue):
    return make_queue("q", lock_timeout=0.3)
