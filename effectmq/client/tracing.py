"""OpenTelemetry traces of offers, stalls and schedule ticks (the attempts' spans are
worker/tracing.py), through the OpenTelemetry API only: the `otel` extra.

As OpenTelemetry's guidelines for libraries say, EffectMQ never installs a
TracerProvider: it uses the global one the application installs. Without the API
installed, or before a provider is, `tracer()` is None and callers build no attribute,
no carrier and no span.

A task carries its creation context: the propagation fields (W3C `traceparent`,
`tracestate`, and what else the global propagator writes, e.g. `baggage`) of the span
that sent it, as a JSON object in the task record's `trace` field. offer.lua writes it
with the task, once: a re-offer of an existing id leaves the first one. Span names,
kinds and attributes follow OpenTelemetry's messaging conventions (`send <queue>`,
PRODUCER; `messaging.system` = "effectmq").
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..errors import STALLED, InvalidOption

try:
    from opentelemetry import context as otel_context, propagate, trace
except ImportError:  # the otel extra is not installed: every hook stays off
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from ..protocol.protocol import StalledTask

SYSTEM = "effectmq"
TRACER_NAME = "effectmq"
# A stored creation context is at most this long (JSON): a traceparent is 55 characters,
# a tracestate at most 512 (W3C); what else the propagator writes (baggage) is left out
# when it would not fit.
MAX_TRACE_BYTES = 2048
KEPT_WHEN_TOO_LONG = ("traceparent", "tracestate")
OPERATION_TYPES = frozenset({"create", "send", "receive", "process", "settle"})

_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
_provider: Any = None  # the provider `_tracer` came from
_tracer: Any = None


def tracer() -> Tracer | None:
    """EffectMQ's tracer from the global TracerProvider, or None while no provider is
    installed (or the API is not): then nothing is traced."""
    global _provider, _tracer
    if trace is None:
        return None
    # While none is installed, the API's getter looks for a provider named in the
    # environment on every call (about 1 us): the installed one (None) is read instead,
    # unless the environment names one (the getter installs that on its first call).
    if getattr(trace, "_TRACER_PROVIDER", False) is None and not _PROVIDER_FROM_ENV:
        return None
    provider = trace.get_tracer_provider()
    if provider is _provider:
        return _tracer
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    _provider, _tracer = provider, provider.get_tracer(TRACER_NAME, _version())
    return _tracer


def check_trace(value: Any) -> str:
    """A creation context given with an offer (its stored form, `carrier`), within bounds."""
    if not isinstance(value, str):
        raise InvalidOption(f"trace must be a stored creation context (a string), got {type(value).__name__}")
    if len(value) > MAX_TRACE_BYTES // 4 and len(value.encode()) > MAX_TRACE_BYTES:  # else it fits, even all 4-byte
        raise InvalidOption(f"trace must be a stored creation context of at most {MAX_TRACE_BYTES} bytes, "
                            f"got {len(value.encode())}")
    return value


def carrier(span: Span) -> str:
    """The stored form of `span`'s context: what the global propagator injects, as JSON."""
    fields: dict[str, str] = {}
    propagate.inject(fields, context=trace.set_span_in_context(span))
    text = json.dumps(fields, separators=(",", ":"))
    if len(text) > MAX_TRACE_BYTES:
        text = json.dumps({k: v for k, v in fields.items() if k in KEPT_WHEN_TOO_LONG}, separators=(",", ":"))
    return text if len(text) <= MAX_TRACE_BYTES and fields else ""


def extract(stored: str | None) -> Any:
    """The creation context read back (an OpenTelemetry Context), or None when the task has
    none or it cannot be read: a broken context never fails an attempt, it is only lost."""
    if not stored:
        return None
    try:
        fields = json.loads(stored)
    except ValueError:
        return None
    if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
        return None
    ctx = propagate.extract(fields)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def messaging(queue: str, operation: str, task_id: str | None = None) -> dict[str, Any]:
    """The messaging convention's attributes of one operation on `queue` (its operation
    type only where the convention has one: not for maintenance's `recover`)."""
    out: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.destination.name": queue,
                           "messaging.operation.name": operation}
    if operation in OPERATION_TYPES:
        out["messaging.operation.type"] = operation
    if task_id is not None:
        out["messaging.message.id"] = task_id
    return out


@contextlib.contextmanager
def sending(tracer: Tracer, queue: str, task_id: str | None = None) -> Iterator[Span]:
    """A `send <queue>` span (PRODUCER) around an offer, current in the block: its context
    is the creation context of the tasks it sends. An error leaves it with status ERROR
    and the exception recorded."""
    attributes = messaging(queue, "send", task_id)
    with tracer.start_as_current_span(f"send {queue}", kind=trace.SpanKind.PRODUCER, attributes=attributes) as span:
        yield span


class BatchSend:
    """One `send` span for a batch (offer_many): each task without a creation context of
    its own gets the span's; the span links to those that have one (at most MAX_LINKS,
    the SDK's default limit), as the messaging conventions ask."""

    MAX_LINKS = 128

    def __init__(self, span: Span):
        self.span = span
        self.context = carrier(span)
        self.links = 0

    def stamp(self, task: Any) -> Any:
        """The OfferTask as sent in this batch."""
        if not task.trace:
            return task._replace(trace=self.context)
        if self.links < self.MAX_LINKS and (given := extract(task.trace)) is not None:
            self.links += 1
            self.span.add_link(trace.get_current_span(given).get_span_context())
        return task

    def sent(self, count: int) -> None:
        self.span.set_attribute("messaging.batch.message_count", count)


@contextlib.contextmanager
def tick_sends(tracer: Tracer, queue: str, ticks: Sequence[tuple[str, float, dict]]) -> Iterator[list[dict]]:
    """Schedule ticks offered together: each (schedule id, tick time in epoch seconds, its
    offer item) becomes a trace of its own, rooted in a `send <queue>` span (PRODUCER)
    that lasts as long as the offer; the block gets the items with those contexts to offer."""
    spans, items = [], []
    for schedule, at, item in ticks:
        attributes = messaging(queue, "send", item.get("task_id"))
        attributes["effectmq.schedule.name"] = schedule
        attributes["effectmq.schedule.tick"] = _iso(at)
        span = tracer.start_span(f"send {queue}", context=otel_context.Context(), kind=trace.SpanKind.PRODUCER,
                                 attributes=attributes)
        spans.append(span)
        items.append({**item, "trace": carrier(span)})
    try:
        yield items
    except BaseException as exc:
        for span in spans:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        for span in spans:
            span.end()


def stalls_recovered(tracer: Tracer, queue: str, stalls: Sequence[StalledTask]) -> None:
    """Each stall maintenance counted: a short `recover <queue>` span in the task's trace
    (a child of its creation context) with an event saying which attempt ended without an
    outcome, why (`effectmq.stall.cause`, one of STALL_CAUSES; the pod and node of the
    worker that held the lease when known) and what became of the task."""
    for stall in stalls:
        attributes = messaging(queue, "recover", stall.id)
        attributes.update({"effectmq.attempt": stall.attempt,
                           "effectmq.stalled_attempt_count": stall.stalled_attempt_count})
        span = tracer.start_span(f"recover {queue}", context=extract(stall.trace) or otel_context.Context(),
                                 kind=trace.SpanKind.INTERNAL, attributes=attributes)
        event = {
            "effectmq.attempt": stall.attempt, "effectmq.stalled_attempt_count": stall.stalled_attempt_count,
            "effectmq.task_state": "failed" if stall.failed else "waiting",
            "effectmq.reason": "lease expired: its worker stopped renewing it (died, paused or cut off)",
            "effectmq.stall.cause": stall.cause}
        if stall.pod:
            event["effectmq.stall.pod"] = stall.pod
        if stall.node:
            event["effectmq.stall.node"] = stall.node
        span.add_event("effectmq.stall_recovered", event)
        if stall.failed:
            span.set_attribute("error.type", STALLED)
            span.set_status(trace.Status(trace.StatusCode.ERROR, "stalled too often"))
        span.end()


def _version() -> str | None:
    try:  # the installed package's, as effectmq.__version__ (a checkout that is not installed has none)
        return importlib.metadata.version("effectmq")
    except importlib.metadata.PackageNotFoundError:
        return None


def _iso(epoch_seconds: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_seconds, datetime.timezone.utc).isoformat()
