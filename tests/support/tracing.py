"""This test process as an application that exports its spans with the OpenTelemetry SDK, and
an OTLP/HTTP receiver for processes that export theirs."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.util._once import Once


def install(provider: TracerProvider | None) -> None:
    # The API lets a process install its provider once; put back as OpenTelemetry's own
    # test utilities do, so that no other test runs traced.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


@contextlib.contextmanager
def exporting_over_otlp(endpoint: str, service: str) -> Iterator[trace.Tracer]:
    """A global TracerProvider exporting each span as it ends over OTLP/HTTP to
    ``endpoint`` (``<endpoint>/v1/traces``), with ``service.name`` ``service``; yields a
    tracer of it. Removed afterwards."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    install(provider)
    try:
        yield trace.get_tracer(service)
    finally:
        provider.shutdown()
        install(None)


# -- an OTLP/HTTP receiver on loopback, for processes that export with the SDK --------------


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.server.lock:
            self.server.requests.append((self.path, request))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


class OtlpReceiver:
    """`with OtlpReceiver() as otlp:` pass `otlp.endpoint` as OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __enter__(self) -> "OtlpReceiver":
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.requests = []
        self.server.lock = threading.Lock()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def requests(self) -> list[tuple[str, ExportTraceServiceRequest]]:
        with self.server.lock:
            return list(self.server.requests)

    def spans(self) -> list[tuple[str, dict[str, str], Any]]:
        """(path, resource attributes, span) of every span received so far."""
        return [(path, {a.key: a.value.string_value for a in resource.resource.attributes}, span)
                for path, request in self.requests for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]
