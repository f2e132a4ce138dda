"""Traces through a real OpenTelemetry Collector: the one tooling/otelcol builds and
tests/cluster/test_on_a_node.py deploys, run here as a process on loopback, so the
collector, its file output and tooling/testbed/otelcol.py's reader are checked in
seconds. A producer in this process and an `effectmq worker` process export to it over
OTLP/HTTP; the file it writes holds one trace."""

from __future__ import annotations

import pytest
import redis

import effectmq
from effectmq.protocol.keys import QueueKeys
from tests.fixtures.kube import unavailable
from tests.support.operator import wait_for
from tests.support.processes import WorkerProcess
from tests.support.tracing import exporting_over_otlp
from tooling.testbed import Unavailable, otelcol

SECRET = "payload-secret-91d0"  # in the payload: the collector must never receive it


@pytest.fixture
def collector(tmp_path):
    try:
        binary = otelcol.locate_binary()
    except Unavailable as exc:
        unavailable(str(exc))
    with otelcol.CollectorProcess(binary, tmp_path) as running:
        yield running


def test_a_producer_and_an_effectmq_worker_make_one_trace_in_the_collector(redis_url, collector, tmp_path):
    worker = WorkerProcess(redis_url, "collected", tmp_path,
                           env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
                                "OTEL_SERVICE_NAME": "billing-worker", "OTEL_BSP_SCHEDULE_DELAY": "100"})
    try:
        with exporting_over_otlp(collector.endpoint, "web") as tracer:
            q = effectmq.SyncTaskQueue("collected", url=redis_url)
            try:
                with tracer.start_as_current_span("POST /invoices") as request:
                    q.offer("work", {"secret": SECRET}, task_id="c1")
                assert q.wait("c1", timeout=20)["attempt"] == 1
            finally:
                q.close()
    finally:
        assert worker.stop() == 0
    assert "exporting traces (OTEL_* variables): otlp" in worker.log()
    trace_id = format(request.get_span_context().trace_id, "032x")

    def the_trace() -> dict[str, otelcol.Span] | None:
        spans = {s.name: s for s in collector.spans() if s.trace_id == trace_id}
        return spans if len(spans) == 3 else None

    spans = wait_for(the_trace, timeout=20, what="the request, send and process spans in the collector's file")
    root, send, process = spans["POST /invoices"], spans["send collected"], spans["process collected"]
    assert root.parent_span_id == "" and send.parent_span_id == root.span_id
    assert process.parent_span_id == send.span_id
    assert (send.kind, send.service, process.kind, process.service) == ("PRODUCER", "web", "CONSUMER", "billing-worker")
    for span in (send, process):
        assert {k: span.attributes[k] for k in ("messaging.system", "messaging.destination.name",
                                                 "messaging.message.id")} == {
            "messaging.system": "effectmq", "messaging.destination.name": "collected", "messaging.message.id": "c1"}
    assert process.attributes["effectmq.outcome"] == "completed"
    # nothing the collector received shows the payload or the attempt's lease token
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    token = client.hget(QueueKeys("emq", "collected").task("c1"), "last_token")
    client.close()
    received = collector.spans_path.read_text()
    assert token and token not in received and SECRET not in received
