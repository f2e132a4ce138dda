"""Prometheus metrics of workers (labels are bounded: queue, task name, outcome)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from ..client import models

ATTEMPTS = Counter("effectmq_attempts", "Attempts started", ["queue", "task"])
OUTCOMES = Counter(
    "effectmq_outcomes", "Attempts settled, by outcome "
    "(completed, retry, failed, lease_lost, released)", ["queue", "task", "outcome"],
)
FAILURES = Counter("effectmq_failures", "Handler failures by error kind (handler, timeout, defect)",
                   ["queue", "task", "kind"])
LEASE_LOSSES = Counter("effectmq_lease_losses", "Attempts interrupted or rejected because the lease was lost",
                       ["queue", "task"])
DURATION = Histogram(
    "effectmq_handler_duration_seconds", "Handler run time", ["queue", "task", "outcome"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge("effectmq_in_flight", "Attempts running in this process (held leases not counted)", ["queue"])
PREFETCHED = Gauge("effectmq_prefetched", "Leases held ahead in this process, not started yet (prefetch)", ["queue"])
DEPTH = Gauge("effectmq_queue_depth", "Tasks per state (as last seen by this process)", ["queue", "state"])
OLDEST_WAITING = Gauge("effectmq_oldest_waiting_seconds", "Age of the oldest waiting task", ["queue"])
STALLS = Counter("effectmq_stalls_recovered", "Expired leases recovered by maintenance", ["queue", "outcome"])
# effectmq_stalls_total: cause is one of models.STALL_CAUSES (how the worker's pod ended, or unknown)
STALL_CAUSES = Counter("effectmq_stalls", "Stalls (expired leases) recovered by this process's maintenance, by cause "
                       "(oom_killed, evicted, error_exit, deleted, node_lost, drained, unknown)", ["queue", "cause"])
REDIS_READY = Gauge("effectmq_worker_redis_ready",
                    "1 while this worker's last Redis call succeeded, 0 while it is backing off", ["queue"])
LOOP_ERRORS = Counter("effectmq_worker_loop_errors", "Errors a worker loop backed off from, by loop and reply class",
                      ["queue", "loop", "code"])
LOOP_LAG_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)  # seconds; the operator's loop too
LOOP_LAG = Histogram(
    "effectmq_worker_event_loop_lag_seconds", "How late the worker's event loop ran a tick it was due to run "
    "(a blocked loop runs no heartbeat)", ["queue"],
    buckets=LOOP_LAG_BUCKETS,
)
RATE_LIMITED = Counter("effectmq_rate_limited_replies", "Acquire replies that said the queue's rate limit (or a "
                       "hold of its starts) allows no start now", ["queue"])
RATE_LIMITED_SECONDS = Counter("effectmq_rate_limited_seconds", "Seconds this process's acquire loop waited because "
                               "the queue's rate limit (or a hold of its starts) allowed no start", ["queue"])
MAINTENANCE_LAST = Gauge("effectmq_maintenance_last_success_timestamp_seconds",
                         "Unix time of the last successful maintenance pass", ["queue"])


def record_stats(stats) -> None:
    for state in ("waiting", "delayed", "active", "completed", "failed", "canceled"):
        DEPTH.labels(stats.queue, state).set(getattr(stats, state))
    OLDEST_WAITING.labels(stats.queue).set(stats.oldest_waiting_seconds)


# A connection is served by one of at most this many threads, and closed when it sends
# nothing for this long: idle or slow clients cannot pile up a thread each.
SERVER_THREADS = 8
SERVER_IDLE_TIMEOUT = 2.0


class _BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `threads` connections served at once: one more is
    closed at once, without a thread (Prometheus and the kubelet try again)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 made connects wait seconds)

    def __init__(self, address: tuple[str, int], handler: type, threads: int):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(threads)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def start_server(port: int, addr: str = "0.0.0.0", ready: Callable[[], bool] | None = None) -> ThreadingHTTPServer:
    """Serve Prometheus metrics (any path) and the probes /livez (the process answers)
    and /readyz (200 while `ready()`, 503 otherwise) from a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        timeout = SERVER_IDLE_TIMEOUT

        def version_string(self) -> str:  # no versions in the Server header
            return "effectmq"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/livez":
                self._reply(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ok = ready() if ready is not None else True
                self._reply(200 if ok else 503, b"ok\n" if ok else b"not ready: Redis not reachable or stopping\n",
                            "text/plain")
            else:  # OpenMetrics (with the durations' trace exemplars) when the scraper asks for it
                encode, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._reply(200, encode(REGISTRY), content_type)

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no log line each
            pass

    server = _BoundedServer((addr, port), Handler, SERVER_THREADS)
    threading.Thread(target=server.serve_forever, name="effectmq-metrics", daemon=True).start()
    return server


class AttemptMetrics:
    """The labelled series of one queue, looked up once: `.labels()` on every
    attempt was a seventh of a busy worker's CPU."""

    # The workers of each queue in this process: (running, held) of each, read at scrape
    # time, so the gauges are never stale and cost the attempts nothing.
    _counts: dict[str, dict[int, Callable[[], tuple[int, int]]]] = {}

    def __init__(self, queue: str):
        self.queue = queue
        for cause in models.STALL_CAUSES:  # from 0, so that increase() counts a first stall too
            STALL_CAUSES.labels(queue, cause)
        self._attempts: dict[str, Counter] = {}
        self._settled: dict[tuple[str, str], tuple] = {}

    def track(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Count a worker's (running, held) attempts in the gauges until untrack()."""
        workers = self._counts.setdefault(self.queue, {})
        if not workers:
            IN_FLIGHT.labels(self.queue).set_function(lambda: sum(c()[0] for c in list(workers.values())))
            PREFETCHED.labels(self.queue).set_function(lambda: sum(c()[1] for c in list(workers.values())))
        workers[id(self)] = counts

    def untrack(self) -> None:
        self._counts.get(self.queue, {}).pop(id(self), None)

    def started(self, task: str) -> None:
        counter = self._attempts.get(task)
        if counter is None:
            counter = self._attempts[task] = ATTEMPTS.labels(self.queue, task)
        counter.inc()

    def settled(self, task: str, outcome: str, seconds: float, exemplar: dict[str, str] | None = None) -> None:
        """exemplar: the attempt's trace id, shown beside its bucket to OpenMetrics scrapers."""
        series = self._settled.get((task, outcome))
        if series is None:
            series = self._settled[(task, outcome)] = (
                OUTCOMES.labels(self.queue, task, outcome), DURATION.labels(self.queue, task, outcome),
                LEASE_LOSSES.labels(self.queue, task) if outcome == "lease_lost" else None)
        series[0].inc()
        series[1].observe(seconds, exemplar)
        if series[2] is not None:
            series[2].inc()
