"""The attempts' durations carry their trace ids as exemplars, for OpenMetrics scrapers:
a slow bucket on a dashboard leads to the trace of an attempt that landed in it."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from tests.support.inprocess import make_worker, running
from tests.support.tracing import install
from tests.fixtures.redis import free_port


def scrape(port: int, accept: str | None) -> tuple[str, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


def exemplars(text: str, queue: str) -> set[str]:
    """Trace ids of the exemplars on the queue's attempt-duration buckets."""
    bucket = r'^effectmq_handler_duration_seconds_bucket\{[^}]*queue="%s"[^}]*\} \S+' % re.escape(queue)
    return set(re.findall(bucket + r' # \{trace_id="([0-9a-f]{32})"\}', text, re.M))


@pytest.mark.parametrize("sampled", [True, False])
async def test_an_attempt_s_duration_carries_its_trace_id_for_openmetrics(make_queue, sampled):
    exporter = InMemorySpanExporter()
    provider = TracerProvider() if sampled else TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    install(provider)
    try:
        q = make_queue(f"exemplars-{sampled}")
        port = free_port()
        async def job(payload):
            await asyncio.sleep(0.01)

        worker = make_worker(q, {"job": job}, metrics_port=port)
        async with running(worker):
            await q.offer("job", None, task_id="x1")
            await q.wait("x1", timeout=10)
            content_type, text = await asyncio.to_thread(scrape, port, "application/openmetrics-text; version=1.0.0")
            plain_type, plain = await asyncio.to_thread(scrape, port, None)
    finally:
        install(None)
    assert content_type.startswith("application/openmetrics-text") and plain_type.startswith("text/plain")
    process = [s for s in exporter.get_finished_spans() if s.name == f"process {q.name}"]
    if sampled:
        assert exemplars(text, q.name) == {format(process[0].context.trace_id, "032x")}
    else:  # an unsampled trace is nowhere to be found: no exemplar points at it
        assert process == [] and exemplars(text, q.name) == set()
    assert "# {" not in plain  # the Prometheus text format has no exemplars
