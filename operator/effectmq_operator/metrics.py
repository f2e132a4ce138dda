"""Prometheus metrics of the operator (label: the queue's name in Redis)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from effectmq.client.models import STALL_CAUSES
from effectmq.worker.metrics import LOOP_LAG_BUCKETS
from effectmq.worker.metrics import STALL_CAUSES as STALLS_BY_CAUSE  # effectmq_stalls_total, as the workers count it

SCALE_DECISIONS = Counter("effectmq_operator_scale_decisions", "Replica changes made", ["queue", "direction"])
DESIRED_REPLICAS = Gauge("effectmq_operator_desired_replicas", "Replicas the last decision asked for", ["queue"])
BACKLOG = Gauge("effectmq_operator_backlog", "Tasks per state at the last poll", ["queue", "state"])
OLDEST_WAITING = Gauge("effectmq_operator_oldest_waiting_seconds", "Age of the oldest waiting task", ["queue"])
POLL_ERRORS = Counter("effectmq_operator_poll_errors", "Polls that could not reach Redis", ["queue"])
ACCEPTING_TASKS = Gauge("effectmq_operator_accepting_tasks",
                        "1 when the queue's Redis took the last poll's probe write (offers go through), 0 when it "
                        "refused it (full at maxmemory, a failing RDB save, a read-only replica)", ["queue"])
RECOVERED = Counter("effectmq_operator_leases_recovered", "Expired leases recovered by the operator's maintenance",
                    ["queue", "outcome"])
WORKER_ENDINGS = Counter("effectmq_operator_worker_endings", "Worker pod endings (a container run or a pod that "
                         "ended) recorded on their queue's Redis, by cause", ["queue", "cause"])
RECONCILES = Counter("effectmq_operator_reconciles", "Queue reconciles finished", ["outcome"])
OLDEST_RECONCILE = Gauge("effectmq_operator_oldest_reconcile_age_seconds",
                         "Seconds since the least recently reconciled Queue was last reconciled "
                         "(a full pass takes this long)")
API_REQUESTS = Counter("effectmq_operator_api_requests", "Kubernetes API calls made by the reconcilers")
TICKS = Counter("effectmq_operator_schedule_ticks", "Schedule ticks materialized as tasks", ["schedule"])
LOOP_LAG = Histogram("effectmq_operator_event_loop_lag_seconds", "How late the operator's event loop ran a tick it "
                     "was due to run (a blocked loop runs no reconcile and renews no Lease)",
                     buckets=LOOP_LAG_BUCKETS)


def record_poll(queue: str, stats, desired: int) -> None:
    for state in ("waiting", "delayed", "active", "failed", "completed"):
        BACKLOG.labels(queue, state).set(getattr(stats, state))
    OLDEST_WAITING.labels(queue).set(stats.oldest_waiting_seconds)
    DESIRED_REPLICAS.labels(queue).set(desired)


def record_maintenance(queue: str, report) -> None:
    if report.recovered:
        RECOVERED.labels(queue, "recovered").inc(report.recovered)
    if report.stalled_failed:
        RECOVERED.labels(queue, "failed").inc(report.stalled_failed)
    # The stalls this process recovered, by cause, in the workers' own counter: the alert and
    # the dashboard sum it over every process, and a queue whose workers all died (OOMKilled)
    # has its stalls recovered here only. Every cause's series exists from the first poll at
    # 0, so increase() sees the first stalls too (a series born at 3 increases by nothing).
    for cause in STALL_CAUSES:
        STALLS_BY_CAUSE.labels(queue, cause).inc(report.stall_causes.get(cause, 0))
