"""The attempts' spans, and the OpenTelemetry SDK setup of `effectmq worker`.

Each attempt whose handler starts is a `process <queue>` span (CONSUMER) in the trace
of the task's creation context (client/tracing.py): its child by default, or, with
`Worker(trace_links=True)`, the root of a trace of its own that links to it (one
producer fanned out into 100k tasks then makes 100k small traces, not one giant one).
The span is current while the handler runs, so the handler's own spans are its
children. It carries the messaging attributes and EffectMQ's counters, never the
payload and never the lease token (a capability); events say what happened to the
lease (lost and why, a stale acknowledgement rejected, interrupted, released, a retry
scheduled and when).

`setup_sdk()` is for EffectMQ's own processes only: the library itself imports only the
OpenTelemetry API and uses whatever TracerProvider the application installed.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

from ..client import tracing
from ..client.engine import error_info

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from ..client.engine import Lease

log = logging.getLogger("effectmq.worker")

# Outcomes (Worker._settle's labels) that end an attempt's span with status ERROR.
FAILED_OUTCOMES = frozenset({"retry", "failed", "lease_lost"})


class AttemptTracing:
    """The spans of one worker's attempts (a worker keeps one while a TracerProvider is
    installed, None otherwise: its hot path then checks one attribute)."""

    def __init__(self, tracer: Tracer, queue: str, links: bool):
        self.tracer = tracer
        self.queue = queue
        self.links = links
        self.name = f"process {queue}"

    @classmethod
    def resolve(cls, queue: str, links: bool, current: AttemptTracing | None) -> AttemptTracing | None:
        """The tracing to use now: None while no TracerProvider is installed."""
        tracer = tracing.tracer()
        if tracer is None:
            return None
        if current is not None and current.tracer is tracer:
            return current
        return cls(tracer, queue, links)

    def start(self, lease: Lease) -> Span:
        attributes = tracing.messaging(self.queue, "process", lease.task_id)
        attributes.update({
            "effectmq.task.name": lease.name, "effectmq.attempt": lease.attempt,
            "effectmq.stalled_attempt_count": lease.stalled_attempt_count,
            "effectmq.handler_failure_count": lease.handler_failure_count,
        })
        created = tracing.extract(lease.trace)
        kind = tracing.trace.SpanKind.CONSUMER
        if self.links:
            links = [tracing.trace.Link(tracing.trace.get_current_span(created).get_span_context())] if created else []
            return self.tracer.start_span(self.name, context=tracing.otel_context.Context(), kind=kind,
                                          attributes=attributes, links=links)
        return self.tracer.start_span(self.name, context=created or tracing.otel_context.Context(), kind=kind,
                                      attributes=attributes)

    @staticmethod
    def exemplar(span: Span) -> dict[str, str] | None:
        """The attempt's trace id for its duration's exemplar (OpenMetrics), when sampled."""
        context = span.get_span_context()
        return {"trace_id": format(context.trace_id, "032x")} if context.trace_flags.sampled else None

    @staticmethod
    def activate(span: Span) -> Any:
        """Make `span` current in this task (the handler's spans are its children)."""
        return tracing.otel_context.attach(tracing.trace.set_span_in_context(span))

    @staticmethod
    def end(span: Span, outcome: str, activation: Any) -> None:
        tracing.otel_context.detach(activation)
        span.set_attribute("effectmq.outcome", outcome)
        if outcome in FAILED_OUTCOMES:
            span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, outcome))
        span.end()

    # -- on the current span (the attempt's task) --------------------------------

    @staticmethod
    def failed(error: Any, declared: Sequence[type[BaseException]]) -> None:
        """The attempt's failure: its error tag (as stored), and the exception itself."""
        span = tracing.trace.get_current_span()
        try:
            tag = error_info(error, declared)[0].tag
        except Exception:  # a value fail() would refuse: the settle says so
            tag = type(error).__name__
        span.set_attribute("effectmq.error.tag", tag)
        span.set_attribute("error.type", tag)
        if isinstance(error, BaseException):
            span.record_exception(error)

    @staticmethod
    def retry_scheduled(lease: Lease) -> None:
        at = lease.retry_at_ms
        attributes = {"effectmq.retry_at": _iso_ms(at)} if at >= 0 else {}
        tracing.trace.get_current_span().add_event("effectmq.retry_scheduled", attributes)

    @staticmethod
    def stale_ack_rejected(operation: str) -> None:
        tracing.trace.get_current_span().add_event("effectmq.stale_ack_rejected", {
            "effectmq.operation": operation,
            "effectmq.reason": "this attempt's lease was taken: another attempt owns the task, or it settled"})

    @staticmethod
    def interrupted(span: Span, released: bool) -> None:
        if released:
            span.add_event("effectmq.released", {"effectmq.reason": "the worker's drain timeout ran out"})
        else:
            span.add_event("effectmq.interrupted", {"effectmq.reason": "the handler was cancelled: its lease is lost"})

    @staticmethod
    def lease_lost(span: Span, why: str, owned_elsewhere: bool) -> None:
        cause = "renewal_refused" if owned_elsewhere else "window_closed"
        span.add_event("effectmq.lease_lost", {"effectmq.cause": cause, "effectmq.reason": why})


def _iso_ms(epoch_ms: int) -> str:
    return datetime.datetime.fromtimestamp(epoch_ms / 1000, datetime.timezone.utc).isoformat(timespec="milliseconds")


# -- the SDK, for `effectmq worker` -----------------------------------------------------

EXPORTER_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def setup_sdk(environ: dict[str, str] | None = None, service: str = "effectmq-worker") -> str | None:
    """Install a TracerProvider from the standard OTEL_* variables, for EffectMQ's own
    processes. Nothing when no exporter is asked for (none of EXPORTER_VARIABLES, or
    OTEL_TRACES_EXPORTER=none, or OTEL_SDK_DISABLED=true), when a provider is installed
    already (e.g. by opentelemetry-instrument), or when the SDK is not installed (a
    warning names the extra). Returns what was set up, for the log."""
    env = os.environ if environ is None else environ
    asked = [v for v in EXPORTER_VARIABLES if env.get(v)]
    exporters = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]
    if not asked or env.get("OTEL_SDK_DISABLED", "").lower() == "true" or exporters in ([], ["none"]):
        return None
    if tracing.trace is None:
        log.warning("%s set, but OpenTelemetry is not installed: no traces are exported. "
                    "Install effectmq[otel] (the API, SDK and OTLP exporter).", ", ".join(asked))
        return None
    if tracing.tracer() is not None:
        return None  # the application (or an agent) installed its own
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("%s set, but the OpenTelemetry SDK is not installed: no traces are exported. "
                    "Install effectmq[otel].", ", ".join(asked))
        return None
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER and OTEL_RESOURCE_ATTRIBUTES apply
    made = []
    for name in exporters:
        exporter = _exporter(name, env)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
            made.append(name)
    if not made:
        return None
    tracing.trace.set_tracer_provider(provider)
    return ", ".join(made)


def _exporter(name: str, env: Any) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if name == "otlp":
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") \
            or "http/protobuf"
        try:
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore
        except ImportError:
            package = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "effectmq[otel]"
            log.warning("OTLP over %s asked for, but its exporter is not installed: install %s", protocol, package)
            return None
        return OTLPSpanExporter()  # endpoint, headers, timeout: from OTEL_EXPORTER_OTLP_*
    log.warning("OTEL_TRACES_EXPORTER=%s is not supported by effectmq worker (otlp, console or none)", name)
    return None
