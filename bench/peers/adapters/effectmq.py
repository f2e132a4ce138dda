"""EffectMQ from this checkout: `python -m effectmq worker`, leases, heartbeats and fencing on (defaults).

Results off = the queue setting retention_completed=0 (a completed task's record is
dropped at once). Everything else is the default (lock timeout 30 s, events stream
of 10,000, maintenance every 5 s).
"""

from __future__ import annotations

import sys

import effectmq

from bench.peers import work
from bench.peers.adapters.base import BULK, Adapter as Base, Settings

S = Settings.from_env()
app = effectmq.App(S.queue, url=S.url)


def _trace_everything() -> None:
    """The effectmq-traced experiment: the SDK as an application installs it, every span
    sampled and batched, then dropped (the exporter's own cost is the backend's)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)


if S.options.get("traced"):  # imported by the producer and by each worker process
    _trace_everything()


@app.task
async def noop(payload):
    await work.run_async(payload["i"])


class Adapter(Base):
    distributions = ("effectmq", "redis", "hiredis")
    notes = "retention_completed=0 (results off); leases, heartbeats, fencing, maintenance at defaults"
    bulk_way = "TaskQueue.offer_many"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.q = effectmq.TaskQueue(settings.queue, url=settings.url, max_connections=256)

    def worker_command(self, slot: int) -> list[str]:
        return [sys.executable, "-m", "effectmq", "worker", "bench.peers.adapters.effectmq:app",
                "--queue", self.s.queue, "--url", self.s.url, "--concurrency", str(self.s.concurrency),
                "--log-level", "WARNING",
                *(["--prefetch", str(S.options["prefetch"])] if "prefetch" in S.options else []),
                *(["--loop", S.options["loop"]] if "loop" in S.options else [])]

    async def setup(self) -> None:
        settings = {"retention_completed": 0}
        if "events_maxlen" in S.options:  # the effectmq-noevents experiment
            settings["events_maxlen"] = S.options["events_maxlen"]
        await self.q.configure(**settings)

    async def prefill(self, numbers: range) -> None:
        batch = []
        for i in numbers:
            batch.append(("noop", {"i": i}))
            if len(batch) == BULK:
                await self.q.offer_many(batch)
                batch = []
        if batch:
            await self.q.offer_many(batch)

    async def offer(self, i: int) -> None:
        await self.q.offer("noop", {"i": i})

    async def drained(self) -> bool:
        stats = await self.q.stats()
        return stats.waiting == 0 and stats.active == 0 and stats.delayed == 0

    async def close(self) -> None:
        await self.q.close()

    def options_summary(self) -> dict:
        return {"concurrency": self.s.concurrency, "retention_completed": 0, "lock_timeout": 30,
                "events_maxlen": S.options.get("events_maxlen", "default (10000)"),
                "prefetch": S.options.get("prefetch", "auto"), "loop": S.options.get("loop", "asyncio")}
