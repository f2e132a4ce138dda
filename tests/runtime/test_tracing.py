"""OpenTelemetry traces: an offer's `send` span and each attempt's `process` span in one
trace, the lease's events on the attempt, a stall recovered by maintenance, schedule
ticks as trace roots, and `effectmq worker` exporting over OTLP; without the `otel`
extra the library still runs. Spans are read from the SDK's in-memory exporter, tasks
run through real workers against the test Redis."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import effectmq
from effectmq.scheduler import Scheduler, ScheduleSpec
from tests.support.inprocess import make_worker, running, settled
from tests.support.processes import ROOT, WorkerProcess
from tests.support.tracing import OtlpReceiver
from tests.support.tracing import install

SECRET = "payload-secret-7f3a"  # in every payload: no span may show it


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    install(provider)
    yield exporter
    install(None)


def named(exporter: InMemorySpanExporter, name: str) -> list:
    return sorted((s for s in exporter.get_finished_spans() if s.name == name), key=lambda s: s.start_time)


def events(span) -> dict[str, dict]:
    return {e.name: dict(e.attributes) for e in span.events}


def shows_nothing_of(exporter: InMemorySpanExporter, *secrets: str) -> None:
    """No attribute, event or link of any span contains one of `secrets`."""
    for span in exporter.get_finished_spans():
        seen = json.dumps([dict(span.attributes), [(e.name, dict(e.attributes)) for e in span.events],
                           [dict(link.attributes or {}) for link in span.links]], default=str)
        for secret in secrets:
            assert secret not in seen, f"span {span.name!r} shows {secret!r}: {seen}"


async def test_an_offer_and_its_attempt_are_one_trace(make_queue, spans):
    q = make_queue("traced")
    tracer = trace.get_tracer("test")

    async def job(payload, ctx):
        with tracer.start_as_current_span("inside the handler"):
            return "done"

    async with running(make_worker(q, {"job": job})):
        with tracer.start_as_current_span("request") as request:
            await q.offer("job", {"secret": SECRET}, task_id="t1")
        assert await q.wait("t1", timeout=5) == "done"
    (send,), (process,), (inner,) = named(spans, "send traced"), named(spans, "process traced"), \
        named(spans, "inside the handler")
    assert send.kind is SpanKind.PRODUCER and send.parent.span_id == request.get_span_context().span_id
    assert process.kind is SpanKind.CONSUMER and process.parent.span_id == send.context.span_id
    assert process.context.trace_id == send.context.trace_id == request.get_span_context().trace_id
    assert inner.parent.span_id == process.context.span_id  # the handler's own spans are the attempt's children
    assert dict(send.attributes) == {"messaging.system": "effectmq", "messaging.destination.name": "traced",
                                     "messaging.operation.type": "send", "messaging.operation.name": "send",
                                     "messaging.message.id": "t1"}
    assert dict(process.attributes) == {
        "messaging.system": "effectmq", "messaging.destination.name": "traced", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.message.id": "t1", "effectmq.task.name": "job",
        "effectmq.attempt": 1, "effectmq.stalled_attempt_count": 0, "effectmq.handler_failure_count": 0,
        "effectmq.outcome": "completed"}
    assert process.status.status_code is StatusCode.UNSET and not process.events
    stored = json.loads(await q.redis.hget(q.keys.task("t1"), "trace"))
    assert stored["traceparent"].startswith(f"00-{send.context.trace_id:032x}-{send.context.span_id:016x}-")
    token = await q.redis.hget(q.keys.task("t1"), "last_token")
    assert token and SECRET not in json.dumps(stored)
    shows_nothing_of(spans, SECRET, token)


def test_an_offer_from_sync_code_is_a_child_of_the_caller_s_span(redis_url, spans):
    # SyncTaskQueue runs the offer on its own loop's thread: the caller's context goes along
    q = effectmq.SyncTaskQueue("sync-traced", url=redis_url)
    try:
        with trace.get_tracer("test").start_as_current_span("GET /view") as view:
            q.offer("job", None, task_id="y1")
            q.offer_many([("job", None, {"task_id": "y2"})])
    finally:
        q.close()
    assert [s.parent.span_id for s in named(spans, "send sync-traced")] == [view.get_span_context().span_id] * 2


async def test_untraced_an_offer_stores_no_creation_context_and_a_given_one_is_bounded(make_queue):
    q = make_queue("untraced")
    await q.offer("job", None, task_id="n1")
    await q.offer_many([("job", None, {"task_id": "n2"})])
    for task_id in ("n1", "n2"):
        assert await q.redis.hget(q.keys.task(task_id), "trace") is None
        assert "t" not in await q.redis.hget(q.keys.task(task_id), "extra")
    with pytest.raises(effectmq.InvalidOption, match="at most 2048 bytes, got 2049"):
        await q.offer_many([("job", None, {"task_id": "n3", "trace": "x" * 2049})])
    assert await q.get("n3") is None


async def test_with_trace_links_each_attempt_is_a_trace_of_its_own_linked_to_the_offer(make_queue, spans):
    q = make_queue("fanned-out")
    async with running(make_worker(q, {"job": lambda payload: payload}, trace_links=True)):
        offered = await q.offer_many([("job", i) for i in range(3)])
        for o in offered:
            await q.wait(o.task_id, timeout=5)
    (send,), processes = named(spans, "send fanned-out"), named(spans, "process fanned-out")
    assert send.attributes["messaging.batch.message_count"] == 3 and "messaging.message.id" not in send.attributes
    assert sorted(p.attributes["messaging.message.id"] for p in processes) == sorted(o.task_id for o in offered)
    for process in processes:
        assert process.parent is None and process.context.trace_id != send.context.trace_id
        assert [link.context.span_id for link in process.links] == [send.context.span_id]


async def test_a_batch_is_one_send_span_whose_context_every_task_carries(make_queue, spans):
    q = make_queue("batch")
    async with running(make_worker(q, {"job": lambda payload: payload})):
        offered = await q.offer_many([("job", {"secret": SECRET, "n": i}) for i in range(3)])
        for o in offered:
            await q.wait(o.task_id, timeout=5)
    (send,), processes = named(spans, "send batch"), named(spans, "process batch")
    assert len(processes) == 3
    assert all(p.parent.span_id == send.context.span_id for p in processes)
    shows_nothing_of(spans, SECRET)


async def test_a_reoffer_keeps_the_first_creation_context(make_queue, spans):
    q = make_queue("reoffered")
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("first request"):
        assert (await q.offer("job", None, task_id="once")).created
    stored = await q.redis.hget(q.keys.task("once"), "trace")
    with tracer.start_as_current_span("second request"):
        assert not (await q.offer("job", None, task_id="once")).created
        assert not (await q.offer_many([("job", None, {"task_id": "once"})]))[0].created
    assert await q.redis.hget(q.keys.task("once"), "trace") == stored
    async with running(make_worker(q, {"job": lambda payload: "ok"})):
        await q.wait("once", timeout=5)
    first_send = named(spans, "send reoffered")[0]
    (process,) = named(spans, "process reoffered")
    assert process.parent.span_id == first_send.context.span_id


async def test_a_failed_attempt_has_status_error_its_tag_and_the_retry_scheduled(make_queue, spans):
    q = make_queue("retried", retry=effectmq.Fixed(0.05))

    class MailboxFull(Exception):
        pass

    app = effectmq.App("retried")
    app.use_queue(q)

    @app.task(errors=(MailboxFull,))
    async def send(payload, ctx):
        if ctx.attempt == 1:
            raise MailboxFull("try later")
        return "sent"

    async with running(make_worker(q, app)):
        before = time.time()
        await q.offer("send", {"secret": SECRET}, task_id="r1")
        assert await q.wait("r1", timeout=5) == "sent"
    (offer,), (first, second) = named(spans, "send retried"), named(spans, "process retried")
    assert first.status.status_code is StatusCode.ERROR
    assert (first.attributes["effectmq.outcome"], first.attributes["effectmq.error.tag"],
            first.attributes["error.type"]) == ("retry", "MailboxFull", "MailboxFull")
    retry = events(first)["effectmq.retry_scheduled"]
    retry_at = time.mktime(time.strptime(retry["effectmq.retry_at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    assert before - 1 < retry_at < time.time() + 1
    assert events(first)["exception"]["exception.type"].endswith("MailboxFull")
    assert second.attributes["effectmq.outcome"] == "completed" and second.attributes["effectmq.attempt"] == 2
    assert second.attributes["effectmq.handler_failure_count"] == 1
    assert second.status.status_code is StatusCode.UNSET
    assert first.parent.span_id == second.parent.span_id == offer.context.span_id


async def test_a_lease_lost_while_the_handler_runs_is_an_event_and_the_handler_is_interrupted(make_queue, spans):
    q = make_queue("lost", lock_timeout=0.3)
    started = asyncio.Event()

    async def job(payload):
        started.set()
        await asyncio.sleep(30)

    async with running(make_worker(q, {"job": job})):
        await q.offer("job", None, task_id="c1")
        await asyncio.wait_for(started.wait(), 5)
        await q.cancel("c1")  # the next renewal is refused
        for _ in range(200):
            if named(spans, "process lost"):
                break
            await asyncio.sleep(0.02)
    (process,) = named(spans, "process lost")
    assert process.status.status_code is StatusCode.ERROR and process.attributes["effectmq.outcome"] == "lease_lost"
    seen = events(process)
    assert seen["effectmq.lease_lost"]["effectmq.cause"] == "renewal_refused"
    assert "effectmq.interrupted" in seen and list(seen).index("effectmq.lease_lost") < list(seen).index(
        "effectmq.interrupted")


async def test_a_lease_no_renewal_confirms_in_time_is_lost_as_its_window_closed(make_queue, tcp_proxy, spans):
    through_proxy = make_queue("partitioned", url=tcp_proxy.url, lock_timeout=1.0)
    direct = make_queue("partitioned", lock_timeout=1.0)
    entered = asyncio.Event()

    async def hold(payload):
        entered.set()
        await asyncio.sleep(60)

    async with running(make_worker(through_proxy, {"hold": hold}, maintenance_interval=60)):
        await direct.offer("hold", None, task_id="p1")
        await asyncio.wait_for(entered.wait(), 5)
        tcp_proxy.cut()
        for _ in range(250):
            if named(spans, "process partitioned"):
                break
            await asyncio.sleep(0.02)
        tcp_proxy.restore()
    (process,) = named(spans, "process partitioned")
    lost = events(process)["effectmq.lease_lost"]
    assert lost == {"effectmq.cause": "window_closed", "effectmq.reason": "lease could not be confirmed in time"}
    assert "effectmq.interrupted" in events(process) and process.attributes["effectmq.outcome"] == "lease_lost"


async def test_an_attempt_the_drain_hands_back_is_released_in_its_span(make_queue, spans):
    q = make_queue("drained")
    started = asyncio.Event()

    async def job(payload):
        started.set()
        await asyncio.sleep(30)

    async with running(make_worker(q, {"job": job}, drain_timeout=0.1)):
        await q.offer("job", None, task_id="h1")
        await asyncio.wait_for(started.wait(), 5)
    (process,) = named(spans, "process drained")
    assert process.attributes["effectmq.outcome"] == "released" and "effectmq.released" in events(process)
    assert process.status.status_code is StatusCode.UNSET
    assert (await q.get("h1")).state == "waiting"


async def test_a_stale_acknowledgement_and_the_stall_recovery_are_in_the_trace_of_the_next_attempt(make_queue,
                                                                                                   spans):
    # Attempt 1's worker paused past its lease: maintenance recovered the stall, attempt 2
    # ran and completed; attempt 1 wakes, still believing it owns the task, and completes.
    q = make_queue("stale", max_stalled_count=3)
    with trace.get_tracer("test").start_as_current_span("request") as request:
        await q.offer("job", {"secret": SECRET}, task_id="s1")
    first = await q.acquire(lock_timeout=0.1)
    await asyncio.sleep(0.25)
    report = await q.maintain()
    assert report.recovered == 1

    async def job(payload, ctx):
        return f"attempt {ctx.attempt}"

    worker = make_worker(q, {"job": job})
    async with running(worker):
        assert await q.wait("s1", timeout=5) == "attempt 2"
        first.confirmed_until = time.monotonic() + 30  # as the paused worker still believes
        worker._start(first)
        for _ in range(200):
            if len(named(spans, "process stale")) == 2:
                break
            await asyncio.sleep(0.02)
    (recover,) = named(spans, "recover stale")
    second, stale = named(spans, "process stale")
    trace_id = request.get_span_context().trace_id
    assert recover.context.trace_id == second.context.trace_id == stale.context.trace_id == trace_id
    assert events(recover)["effectmq.stall_recovered"] == {
        "effectmq.attempt": 1, "effectmq.stalled_attempt_count": 1, "effectmq.task_state": "waiting",
        "effectmq.reason": "lease expired: its worker stopped renewing it (died, paused or cut off)",
        "effectmq.stall.cause": "unknown"}  # its worker announced no pod
    assert recover.attributes["messaging.message.id"] == "s1" and "messaging.operation.type" not in recover.attributes
    assert (second.attributes["effectmq.attempt"], second.attributes["effectmq.stalled_attempt_count"]) == (2, 1)
    assert stale.attributes["effectmq.attempt"] == 1 and stale.attributes["effectmq.outcome"] == "lease_lost"
    assert events(stale)["effectmq.stale_ack_rejected"]["effectmq.operation"] == "complete"
    assert stale.status.status_code is StatusCode.ERROR
    assert (await q.get("s1")).result == "attempt 2"
    shows_nothing_of(spans, SECRET, first.token)


async def test_a_task_that_stalls_too_often_fails_in_a_recover_span(make_queue, spans):
    q = make_queue("stalled-out", max_stalled_count=0)
    await q.offer("job", None, task_id="d1")
    await q.worker_beat("w", 1, 1, 60, pod=effectmq.PodIdentity("worker-x2", "uid-1", "n1"))
    await q.acquire(lock_timeout=0.05)
    await q.record_worker_ending(effectmq.WorkerEnding("worker-x2", "uid-1", "n1", "oom_killed", 137))
    await asyncio.sleep(0.15)
    assert (await q.maintain()).stalled_failed == 1
    (recover,) = named(spans, "recover stalled-out")
    assert recover.parent.span_id == named(spans, "send stalled-out")[0].context.span_id
    event = events(recover)["effectmq.stall_recovered"]
    assert event["effectmq.task_state"] == "failed"
    assert (event["effectmq.stall.cause"], event["effectmq.stall.pod"], event["effectmq.stall.node"]) == (
        "oom_killed", "worker-x2", "n1")
    assert recover.status.status_code is StatusCode.ERROR
    assert recover.attributes["error.type"] == "~effectmq/Error/Stalled"


async def test_a_schedule_tick_is_the_root_of_its_task_s_trace(redis_url, make_queue, spans):
    q = make_queue("ticked")
    async with Scheduler(redis_url, namespace="tracing") as scheduler:
        await scheduler.put(ScheduleSpec(id="tracing/each-second", queue="ticked", cron="* * * * * *", task="job"))
        await asyncio.sleep(1.1)
        report = await scheduler.tick()
    assert report.materialized and not report.errors
    async with running(make_worker(q, {"job": lambda payload: "ok"})):
        for m in report.materialized:
            await settled(q, m.task_id)
    sends, processes = named(spans, "send ticked"), named(spans, "process ticked")
    (batch,) = [s for s in sends if "messaging.batch.message_count" in s.attributes]  # offer_many's
    ticks = {s.attributes["messaging.message.id"]: s for s in sends if s is not batch}
    assert set(ticks) == {m.task_id for m in report.materialized} == {
        p.attributes["messaging.message.id"] for p in processes}
    for m in report.materialized:
        tick = ticks[m.task_id]
        assert tick.parent is None and tick.kind is SpanKind.PRODUCER
        assert tick.attributes["effectmq.schedule.name"] == "tracing/each-second"
        assert tick.attributes["effectmq.schedule.tick"] == m.tick.isoformat()
    for process in processes:
        assert process.parent.span_id == ticks[process.attributes["messaging.message.id"]].context.span_id
    # the batch's send span links to the creation contexts its tasks brought (the ticks')
    assert sorted(link.context.span_id for link in batch.links) == sorted(t.context.span_id for t in ticks.values())


def test_effectmq_worker_exports_its_attempts_over_otlp(redis_url, tmp_path):
    with OtlpReceiver() as collector:
        worker = WorkerProcess(redis_url, "exported", tmp_path, args=["--maintenance-interval", "0.2"],
                               env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
                                    "OTEL_SERVICE_NAME": "billing-worker", "OTEL_BSP_SCHEDULE_DELAY": "100"})
        q = effectmq.SyncTaskQueue("exported", url=redis_url)
        try:
            q.offer("work", {"secret": SECRET}, task_id="e1")
            assert q.wait("e1", timeout=20)["attempt"] == 1
        finally:
            q.close()
        assert worker.stop() == 0
        exported = collector.spans()
    assert "exporting traces (OTEL_* variables): otlp" in worker.log()
    (path, resource, span), = [(p, r, s) for p, r, s in exported if s.name == "process exported"]
    assert path == "/v1/traces" and span.kind == span.SPAN_KIND_CONSUMER
    attributes = {a.key: a.value for a in span.attributes}
    assert resource["service.name"] == "billing-worker" and attributes["messaging.message.id"].string_value == "e1"
    assert SECRET not in str(exported)


# Python run with the opentelemetry packages hidden, as where the extra is not installed.
WITHOUT_OTEL = textwrap.dedent("""
    import importlib.abc, sys

    class NoOpenTelemetry(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError(f"{name} is hidden by this test")

    sys.meta_path.insert(0, NoOpenTelemetry())
""")


def test_without_the_otel_extra_the_library_imports_and_runs(redis_url, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_OTEL)
    script = textwrap.dedent(f"""
        import asyncio, sys
        import effectmq
        from effectmq.client import tracing
        assert "opentelemetry" not in sys.modules and tracing.tracer() is None

        async def main():
            q = effectmq.TaskQueue("untraced", url={redis_url!r})
            worker = effectmq.Worker(q, {{"job": lambda payload: payload + 1}}, install_signal_handlers=False,
                                     trace_links=True)
            run = asyncio.create_task(worker.run())
            await q.offer("job", 1, task_id="u1")
            await q.offer_many([("job", 2, {{"task_id": "u2"}})])
            print(await q.wait("u1", timeout=10), await q.wait("u2", timeout=10))
            worker.stop()
            await run
            await q.close()

        asyncio.run(main())
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["2", "3"]
    # effectmq worker with an exporter asked for says what to install, and runs untraced
    worker = WorkerProcess(redis_url, "untraced-cli", tmp_path,
                           env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    try:
        q = effectmq.SyncTaskQueue("untraced-cli", url=redis_url)
        try:
            q.offer("work", None, task_id="w1")
            assert q.wait("w1", timeout=20)["attempt"] == 1
        finally:
            q.close()
    finally:
        assert worker.stop() == 0
    assert "OpenTelemetry is not installed" in worker.log() and "effectmq[otel]" in worker.log()
