"""kopf wiring: watch streams feed the registries, nothing else happens in handlers.

kopf is used as the watch machinery (and for the liveness endpoint): Queue,
Schedule and worker Deployment events update the controllers' registries and
nudge a reconcile; Secret events keep the cache of Redis URLs current. All
reconciling is done by the leader's loops, so Events and writes come from one
replica, and nothing (no finalizer, no kopf annotation) is added to users' objects.
"""

from __future__ import annotations

import asyncio
import logging
import os

import kopf

from effectmq.loopwatch import LoopWatch

from . import metrics
from .builders import GROUP, MANAGED_BY, VERSION
from .connections import CONNECTIONS_PER_REDIS, Connections
from .controller import RECONCILES_AT_ONCE, QueueController
from .kube import API_THREADS, Kube, load_config
from .leader import LEASE_SECONDS, LeaderElector, coordination_api
from .schedules import ScheduleController

SHUTDOWN_STEP = 2.0  # seconds each shutdown step may take: SIGTERM to exit stays within a few seconds
LOOP_BLOCK_WARNING = 3.0  # seconds the loop may not run before the log says where it is stuck (Lease: 15 s)


class _QuietWatch(logging.Filter):
    """Watch handlers run for every event; their "succeeded" lines would flood the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith("succeeded.") and "_event'" in message)


class _RetriesAreWarnings(logging.Filter):
    """kopf logs every API request it retries at ERROR; a retry is routine (an API server
    restarting, a new CRD's storage initializing) and a request that runs out of retries
    is still logged at ERROR ("escalating")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and record.name.startswith("kopf") \
                and "failed; will retry:" in record.getMessage():
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


class _ProbesAreDebug(logging.Filter):
    """Every liveness and readiness probe would log two INFO lines (kopf's "Activity
    'effectmq' succeeded." and the health server's access line): an answered probe is
    DEBUG, shown with --verbose; a failed one keeps its level."""

    def filter(self, record: logging.LogRecord) -> bool:
        answered = (record.name == "aiohttp.access" and getattr(record, "response_status", 500) < 400) or \
            (record.name == "kopf.activities.probe" and record.getMessage().endswith("succeeded."))
        if not answered or record.levelno <= logging.DEBUG:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


QUIET_WATCH, RETRIES_ARE_WARNINGS, PROBES_ARE_DEBUG = _QuietWatch(), _RetriesAreWarnings(), _ProbesAreDebug()


def quiet_kopf_logs() -> None:
    """kopf's routine lines at the level they deserve. The retry filter sits on the root
    handlers (kopf logs retries on the logger of whatever asked); the probe filter on
    the two loggers that report probes (a logger's filters run after its level check)."""
    logging.getLogger("kopf.objects").addFilter(QUIET_WATCH)
    for name in ("aiohttp.access", "kopf.activities.probe"):
        logging.getLogger(name).addFilter(PROBES_ARE_DEBUG)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RETRIES_ARE_WARNINGS)


def loop_watch(warn_after: float = LOOP_BLOCK_WARNING) -> LoopWatch:
    """The watchdog of the operator's loop: a block is logged with where the loop is stuck."""
    return LoopWatch(warn_after, lag=metrics.LOOP_LAG, logger=logging.getLogger("effectmq.operator"),
                     consequence="no reconcile, tick pass or Lease renewal runs until it returns")


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    quiet_kopf_logs()
    settings.posting.level = logging.WARNING  # routine logs stay logs
    settings.posting.reporting_component = "effectmq-operator"
    # A watch on a silently dead connection must not hang forever.
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 75
    settings.watching.connect_timeout = 5
    settings.networking.request_timeout = 15
    settings.networking.connect_timeout = 5
    # Shutdown: our event handlers are instant, so kopf need not wait 2 s per watcher for
    # them; and the last resort if shutdown hangs on a dead connection: exit within 5 s.
    settings.batching.exit_timeout = 0.5
    settings.process.ultimate_exiting_timeout = 4.5
    load_config()
    namespaces = list(getattr(memo, "namespaces", None) or [])
    kube = Kube(threads=getattr(memo, "api_threads", None) or API_THREADS)
    connections = Connections(kube, max_connections=getattr(memo, "redis_connections", None) or CONNECTIONS_PER_REDIS)
    memo.queues = QueueController(kube, connections, namespaces=namespaces,
                                  concurrency=getattr(memo, "reconciles", None) or RECONCILES_AT_ONCE)
    memo.schedules = ScheduleController(kube, connections, memo.queues, namespaces=namespaces)
    memo.connections = connections
    lease_seconds = getattr(memo, "lease_seconds", None) or LEASE_SECONDS
    memo.elector = LeaderElector(coordination_api(), namespace=os.environ.get("POD_NAMESPACE", "default"),
                                 name=os.environ.get("EFFECTMQ_OPERATOR_LEASE", "effectmq-operator"),
                                 lease_seconds=lease_seconds, renew_deadline=lease_seconds * 2 / 3,
                                 retry_period=lease_seconds / 7.5)
    is_leader = lambda: memo.elector.is_leader  # noqa: E731
    kube.may_write = is_leader  # checked again at every write: a reconcile in flight when leadership ends stops
    memo.loop_watch = loop_watch()
    memo.loop_watch.start(asyncio.get_running_loop())
    memo.tasks = [
        asyncio.create_task(memo.elector.run(), name="effectmq-leader"),
        asyncio.create_task(memo.queues.run(is_leader), name="effectmq-queues"),
        asyncio.create_task(memo.schedules.run(is_leader), name="effectmq-schedules"),
    ]


@kopf.on.probe(id="effectmq")
def probe(memo: kopf.Memo, **_) -> dict:
    """Liveness: fails when a loop died or the Lease could not be reached for a whole lease duration."""
    dead = [t.get_name() for t in getattr(memo, "tasks", []) if t.done()]
    if dead:
        raise kopf.PermanentError(f"loops stopped: {', '.join(dead)}")
    if not memo.elector.healthy():
        raise kopf.PermanentError("the leader election cannot reach the API server")
    return {"leader": memo.elector.is_leader}


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    if hasattr(memo, "loop_watch"):
        memo.loop_watch.stop()
    tasks = getattr(memo, "tasks", [])
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=SHUTDOWN_STEP)
    if hasattr(memo, "elector"):
        # Hand the Lease back (a successor need not wait for it to expire) while the
        # Redis clients close; neither may hold up the exit.
        closing = asyncio.ensure_future(asyncio.wait_for(memo.connections.close(), SHUTDOWN_STEP))
        await memo.elector.release(timeout=SHUTDOWN_STEP)
        await asyncio.gather(closing, return_exceptions=True)


@kopf.on.event(GROUP, VERSION, "queues")
async def queue_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    memo.queues.observe_queue(type, _plain(body))


@kopf.on.event(GROUP, VERSION, "schedules")
async def schedule_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    memo.schedules.observe(type, _plain(body))


@kopf.on.event("", "v1", "secrets")
async def secret_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    memo.connections.observe_secret(type, _plain(body))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
async def deployment_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    memo.queues.observe_deployment(type, _plain(body))


def _plain(body: kopf.Body) -> dict:
    return dict(body)  # the raw event: nested values are plain dicts
