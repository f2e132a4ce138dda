"""Prometheus metrics of workers (labels are bounded: queue, task name, outcome)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
IN_FLIGHT = Gauge("effectmq_in_flight", "Attempts running in this worker", ["queue"])
DEPTH = Gauge("effectmq_queue_depth", "Tasks per state (as last seen by this process)", ["queue", "state"])
OLDEST_WAITING = Gauge("effectmq_oldest_waiting_seconds", "Age of the oldest waiting task", ["queue"])
STALLS = Counter("effectmq_stalls_recovered", "Expired leases recovered by maintenance", ["queue", "outcome"])
REDIS_READY = Gauge("effectmq_worker_redis_ready",
                    "1 while this worker's last Redis call succeeded, 0 while it is backing off", ["queue"])
LOOP_ERRORS = Counter("effectmq_worker_loop_errors", "Errors a worker loop backed off from, by loop and reply class",
                      ["queue", "loop", "code"])
MAINTENANCE_LAST = Gauge("effectmq_maintenance_last_success_timestamp_seconds",
                         "Unix time of the last successful maintenance pass", ["queue"])


def record_stats(stats) -> None:
    for state in ("waiting", "delayed", "active", "completed", "failed", "canceled"):
        DEPTH.labels(stats.queue, state).set(getattr(stats, state))
    OLDEST_WAITING.labels(stats.queue).set(stats.oldest_waiting_seconds)


def start_server(port: int, addr: str = "0.0.0.0") -> None:
    from prometheus_client import start_http_server

    start_http_server(port, addr)


class AttemptMetrics:
    """The labelled series of one queue, looked up once: `.labels()` on every
    attempt was a seventh of a busy worker's CPU."""

    def __init__(self, queue: str):
        self.queue = queue
        self.in_flight = IN_FLIGHT.labels(queue)
        self._attempts: dict[str, Counter] = {}
        self._settled: dict[tuple[str, str], tuple] = {}

    def started(self, task: str) -> None:
        counter = self._attempts.get(task)
        if counter is None:
            counter = self._attempts[task] = ATTEMPTS.labels(self.queue, task)
        counter.inc()

    def settled(self, task: str, outcome: str, seconds: float) -> None:
        series = self._settled.get((task, outcome))
        if series is None:
            series = self._settled[(task, outcome)] = (
                OUTCOMES.labels(self.queue, task, outcome), DURATION.labels(self.queue, task, outcome),
                LEASE_LOSSES.labels(self.queue, task) if outcome == "lease_lost" else None)
        series[0].inc()
        series[1].observe(seconds)
        if series[2] is not None:
            series[2].inc()
