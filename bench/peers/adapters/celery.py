"""Celery with the Redis broker, `celery worker --pool threads`.

task_acks_late=True (ack after the handler), task_ignore_result=True and no result
backend (results off), --concurrency = the in-flight budget, gossip, mingle and
heartbeat off (they only add broker traffic). Option `prefetch_multiplier`: Celery's
default 4 reserves up to 40 messages per process while 10 run; the `p1` variant
reserves only the budget.
"""

from __future__ import annotations

import asyncio

import redis
from celery import Celery, group

from bench.peers import work
from bench.peers.adapters.base import BULK, Adapter as Base, Settings, bin_path

S = Settings.from_env()
PREFETCH = S.options.get("prefetch_multiplier", 4)
app = Celery("bench", broker=S.url)
app.conf.update(
    task_acks_late=True,
    task_ignore_result=True,
    result_backend=None,
    worker_prefetch_multiplier=PREFETCH,
    task_default_queue=S.queue,
    broker_connection_retry_on_startup=True,
)


@app.task(name="noop")
def noop(i: int) -> None:
    work.run_sync(i)


class Adapter(Base):
    distributions = ("celery", "kombu", "redis", "hiredis")
    bulk_way = "group(noop.s(i) ...).apply_async()"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.redis = redis.Redis.from_url(settings.url)

    def worker_command(self, slot: int) -> list[str]:
        return [bin_path("celery"), "-A", "bench.peers.adapters.celery", "worker", "--pool", "threads",
                "--concurrency", str(self.s.concurrency), "--loglevel", "WARNING", "-n", f"w{slot}@%h",
                "-Q", self.s.queue, "--without-gossip", "--without-mingle", "--without-heartbeat"]

    async def prefill(self, numbers: range) -> None:
        numbers = list(numbers)
        for start in range(0, len(numbers), BULK):
            group(noop.s(i) for i in numbers[start:start + BULK]).apply_async()

    async def offer_serial(self, numbers: range) -> None:
        def loop() -> None:
            for i in numbers:
                noop.apply_async((i,))
        await asyncio.to_thread(loop)

    async def offer(self, i: int) -> None:
        await asyncio.to_thread(noop.apply_async, (i,))

    async def drained(self) -> bool:
        return self.redis.llen(self.s.queue) == 0 and self.redis.hlen("unacked") == 0

    async def close(self) -> None:
        self.redis.close()

    def options_summary(self) -> dict:
        return {"pool": "threads", "concurrency": self.s.concurrency, "acks_late": True, "ignore_result": True,
                "prefetch_multiplier": PREFETCH, "gossip_mingle_heartbeat": False}
