"""A real OpenTelemetry Collector for the tests: OTLP in, spans out to a file.

The binary is built from Go modules by ``tooling/otelcol/build.sh`` (the OTLP receiver
and contrib's file exporter, at one collector release) into a per-machine cache. It
runs two ways:

- :class:`CollectorProcess`: a process on loopback (no cluster needed);
- :func:`kubernetes_objects`: a Deployment and Service on the one-node cluster
  (``tooling/testbed/cluster.py``), from a single-binary image (:func:`write_image`)
  that ``OneNodeCluster.import_image`` loads; the file lands in a hostPath directory
  the test reads, since the node's pods run on this machine's filesystem.

Either way :func:`read_spans` reads back what the collector received, as
:class:`Span` records. The binary comes from ``$EFFECTMQ_OTELCOL_BIN``, else from
``${EFFECTMQ_CACHE:-~/.cache/effectmq}/otelcol/current`` (:func:`locate_binary`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from tooling.testbed import Unavailable, cache_dir
from tooling.testbed.controlplane import ProcessExited, free_ports, tail, wait_until
from tooling.testbed.oci import write_single_binary_image

BUILD_COMMAND = "bash tooling/otelcol/build.sh"
IMAGE_NAME = "localhost/effectmq-otelcol"
OTLP_HTTP_PORT = 4318
SPANS_FILE = "spans.jsonl"
CONFIG_IN_POD = "/etc/otelcol/config.json"
SPANS_DIR_IN_POD = "/spans"
IMAGE_USER = 65535  # write_single_binary_image's user
# OTLP's SpanKind numbers (the file exporter's JSON writes them as numbers)
SPAN_KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def locate_binary() -> Path:
    """The collector binary; :class:`Unavailable` when it is not built."""
    env = os.environ.get("EFFECTMQ_OTELCOL_BIN")
    path = Path(env) if env else cache_dir() / "otelcol" / "current"
    if not (path.is_file() and os.access(path, os.X_OK)):
        source = "EFFECTMQ_OTELCOL_BIN" if env else "the build cache"
        raise Unavailable(f"OpenTelemetry Collector binary missing at {path} ({source}); "
                          f"build it with `{BUILD_COMMAND}`")
    return path.resolve()


def config(spans_path: str, http_endpoint: str) -> dict:
    """The collector's configuration (JSON is YAML): OTLP/HTTP on ``http_endpoint``,
    every span written to ``spans_path`` as OTLP JSON, one export request a line.
    Its own telemetry stays off (no metrics port to collide with)."""
    return {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": http_endpoint}}}},
        "exporters": {"file": {"path": spans_path, "flush_interval": "100ms"}},
        "service": {
            "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
        },
    }


# --------------------------------------------------------------------------
# reading what it received


@dataclass(frozen=True)
class Span:
    trace_id: str  # hex, as OTLP JSON writes it
    span_id: str
    parent_span_id: str  # "" for a root
    name: str
    kind: str  # PRODUCER, CONSUMER, ... (SPAN_KINDS)
    attributes: dict[str, Any]
    service: str  # the resource's service.name
    events: tuple[tuple[str, dict[str, Any]], ...] = field(default=())
    resource: dict[str, Any] = field(default_factory=dict)  # the resource's attributes (k8s.pod.name, ...)


def _value(value: dict) -> Any:
    """An OTLP JSON AnyValue as Python (an int64 comes as a string)."""
    if "intValue" in value:
        return int(value["intValue"])
    if "arrayValue" in value:
        return [_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", []))
    for key in ("stringValue", "boolValue", "doubleValue", "bytesValue"):
        if key in value:
            return value[key]
    return None


def _attributes(items: list) -> dict[str, Any]:
    return {item["key"]: _value(item.get("value", {})) for item in items}


def parse_spans(lines: str) -> list[Span]:
    """The spans of the file exporter's output (OTLP JSON, one request a line). A last
    line still being written (no newline yet) is left for the next read."""
    spans = []
    complete, _, _being_written = lines.rpartition("\n")
    for line in complete.splitlines():
        if not line.strip():
            continue
        for resource_spans in json.loads(line).get("resourceSpans", []):
            resource = _attributes(resource_spans.get("resource", {}).get("attributes", []))
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    kind = span.get("kind", 0)
                    spans.append(Span(
                        trace_id=span["traceId"], span_id=span["spanId"],
                        parent_span_id=span.get("parentSpanId", ""), name=span["name"],
                        kind=SPAN_KINDS.get(kind, str(kind)) if isinstance(kind, int) else kind,
                        attributes=_attributes(span.get("attributes", [])),
                        service=str(resource.get("service.name", "")),
                        events=tuple((e["name"], _attributes(e.get("attributes", [])))
                                     for e in span.get("events", [])),
                        resource=resource,
                    ))
    return spans


def read_spans(path: Path) -> list[Span]:
    try:
        return parse_spans(path.read_text())
    except FileNotFoundError:
        return []


# --------------------------------------------------------------------------
# as a process on this machine


class CollectorProcess:
    """The collector on ``address`` (loopback by default), writing to ``work_dir/spans.jsonl``.
    ``.endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self, binary: Path, work_dir: Path, address: str = "127.0.0.1") -> None:
        self.binary, self.work_dir, self.address = binary, work_dir, address
        self.spans_path = work_dir / SPANS_FILE
        self.log = work_dir / "otelcol.log"
        self.port = 0
        self.popen: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def spans(self) -> list[Span]:
        return read_spans(self.spans_path)

    def start(self, timeout: float = 60) -> None:
        (self.port,) = free_ports(1, self.address)
        config_path = self.work_dir / "otelcol.json"
        config_path.write_text(json.dumps(config(str(self.spans_path), f"{self.address}:{self.port}")))
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen([str(self.binary), f"--config={config_path}"], stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def listening() -> bool:
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise ProcessExited(f"otelcol exited with {self.popen.returncode}:\n{tail(self.log)}")
            with socket.create_connection((self.address, self.port), timeout=1):
                return True

        wait_until(listening, timeout, "the collector's OTLP/HTTP port")

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()  # the collector flushes its exporters on SIGTERM
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=15)

    def __enter__(self) -> CollectorProcess:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --------------------------------------------------------------------------
# on the one-node cluster


def write_image(binary: Path, archive: Path) -> str:
    """The collector as a single-binary OCI image in ``archive``; returns its name,
    tagged by the binary's hash (a rebuilt collector is a new image, never a stale one)."""
    digest = hashlib.sha256(binary.read_bytes()).hexdigest()[:16]
    ref = f"{IMAGE_NAME}:{digest}"
    write_single_binary_image(binary, "/otelcol", ref, archive)
    return ref


def kubernetes_objects(namespace: str, image: str, spans_dir: Path, name: str = "otel-collector") -> list[dict]:
    """A ConfigMap, a one-replica Deployment and a Service named ``name``: what a user
    deploys as the cluster's collector. Pods reach it at
    ``http://<name>.<namespace>:4318``; it writes the spans to ``spans_dir/spans.jsonl``
    on this machine (a hostPath: make ``spans_dir`` writable for uid 65535 first)."""
    labels = {"app.kubernetes.io/name": name}
    collector_config = config(f"{SPANS_DIR_IN_POD}/{SPANS_FILE}", f"0.0.0.0:{OTLP_HTTP_PORT}")
    container = {
        "name": "otelcol",
        "image": image,
        "imagePullPolicy": "Never",  # imported into the node's containerd, served by no registry
        "args": [f"--config={CONFIG_IN_POD}"],
        "ports": [{"name": "otlp-http", "containerPort": OTLP_HTTP_PORT}],
        "readinessProbe": {"tcpSocket": {"port": OTLP_HTTP_PORT}, "periodSeconds": 1},
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_USER, "readOnlyRootFilesystem": True,
                            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": "config", "mountPath": str(Path(CONFIG_IN_POD).parent), "readOnly": True},
                         {"name": "spans", "mountPath": SPANS_DIR_IN_POD}],
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
         "data": {Path(CONFIG_IN_POD).name: json.dumps(collector_config, indent=2)}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "containers": [container],
                      "volumes": [{"name": "config", "configMap": {"name": name}},
                                  {"name": "spans", "hostPath": {"path": str(spans_dir), "type": "Directory"}}],
                  }}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace, "labels": labels},
         "spec": {"selector": labels,
                  "ports": [{"name": "otlp-http", "port": OTLP_HTTP_PORT, "targetPort": OTLP_HTTP_PORT}]}},
    ]
