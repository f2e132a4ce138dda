"""kopf wiring: watch streams feed the registries, nothing else happens in handlers.

kopf is used as the watch machinery (and for the liveness endpoint): Queue,
Schedule and worker Deployment events update the controllers' registries and
nudge a reconcile (Secrets are not watched: redis_pool.py reads by name the ones
Queues refer to, and again every EFFECTMQ_SECRET_REFRESH_SECONDS); worker pod
events say how workers ended (worker_endings.py; the API server filters that watch
by label, so no other pod is streamed). All reconciling is done by the leader's
loops, so Events and writes come from one replica, and nothing (no finalizer, no
kopf annotation) is added to users' objects.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import kopf

from effectmq.eventloop.loopwatch import LoopWatch

from . import metrics
from .api import GROUP, VERSION
from .builders import MANAGED_BY
from .pod_endings import QUEUE_LABEL, WORKER_POD_SELECTOR
from .queue_controller import RECONCILES_AT_ONCE, QueueController
from .redis_pool import CONNECTIONS_PER_REDIS, SECRET_REFRESH, Connections
from .runtime.kube import API_THREADS, Kube, load_config
from .runtime.leader import LEASE_SECONDS, LeaderElector, coordination_api
from .runtime.watches import WATCHES
from .schedule_controller import ScheduleController
from .worker_endings import WorkerEndings


API_RETRY_CEILING = 30.0  # seconds between retries of an API request once kopf's own backoffs are spent
SHUTDOWN_STEP = 2.0  # seconds each shutdown step may take: SIGTERM to exit stays within a few seconds
LOOP_BLOCK_WARNING = 3.0  # seconds the loop may not run before the log says where it is stuck (Lease: 15 s)
log = logging.getLogger("effectmq.operator")


@dataclass(frozen=True)
class OperatorOptions:
    """What `effectmq-operator`'s command line sets (kopf.Memo carries it as `options`)."""

    namespaces: tuple[str, ...] = ()  # empty: the whole cluster
    api_threads: int = API_THREADS
    redis_connections: int = CONNECTIONS_PER_REDIS
    reconciles: int = RECONCILES_AT_ONCE
    lease_seconds: float = LEASE_SECONDS


@dataclass
class Running:
    """The operator's parts once started (kopf.Memo carries it as `running`)."""

    connections: Connections
    queues: QueueController
    schedules: ScheduleController
    elector: LeaderElector
    loop_watch: LoopWatch
    endings: WorkerEndings
    tasks: list[asyncio.Task] = field(default_factory=list)


class ApiBackoffs:
    """kopf's backoffs (1, 1, 2, ... 21 s), then every API_RETRY_CEILING seconds, for ever.

    kopf escalates a request whose backoffs are spent; when that request is a watch or
    the resource discovery, the operator exits (after about 54 s of an unreachable API
    server). A restart mends nothing and the kubelet's restart backoff then delays the
    operator's return by minutes, so requests wait for the API server instead. Iterable
    again for every request, and not Sized (kopf counts attempts of a Sized one)."""

    FIRST = (1.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0)

    def __iter__(self) -> Iterator[float]:
        return itertools.chain(self.FIRST, itertools.repeat(API_RETRY_CEILING))


def options_of(memo: kopf.Memo) -> OperatorOptions:
    return getattr(memo, "options", None) or OperatorOptions()  # `kopf run` sets none


def running_of(memo: kopf.Memo) -> Running | None:
    return getattr(memo, "running", None)  # None before startup finished


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
    WATCHES.install()  # before kopf starts its watchers (after the startup handlers)
    settings.posting.level = logging.WARNING  # routine logs stay logs
    settings.posting.reporting_component = "effectmq-operator"
    # Worker pods only, selected by the API server: kopf's `labels=` filter alone would
    # stream every pod of the cluster to the operator and drop the others here.
    settings.watching.label_selectors["v1", "pods"] = WORKER_POD_SELECTOR
    # A watch on a silently dead connection must not hang forever.
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 75
    settings.watching.connect_timeout = 5
    settings.networking.request_timeout = 15
    settings.networking.connect_timeout = 5
    settings.networking.error_backoffs = ApiBackoffs()
    # Shutdown: our event handlers are instant, so kopf need not wait 2 s per watcher for
    # them; and the last resort if shutdown hangs on a dead connection: exit within 5 s.
    settings.batching.exit_timeout = 0.5
    settings.process.ultimate_exiting_timeout = 4.5
    load_config()
    options = options_of(memo)
    namespaces = list(options.namespaces)
    kube = Kube(threads=options.api_threads)
    connections = Connections(kube, max_connections=options.redis_connections,
                              secret_refresh=float(os.environ.get("EFFECTMQ_SECRET_REFRESH_SECONDS") or SECRET_REFRESH))
    queues = QueueController(kube, connections, namespaces=namespaces, concurrency=options.reconciles)
    lease = options.lease_seconds
    elector = LeaderElector(coordination_api(), namespace=os.environ.get("POD_NAMESPACE", "default"),
                            name=os.environ.get("EFFECTMQ_OPERATOR_LEASE", "effectmq-operator"),
                            lease_seconds=lease, renew_deadline=lease * 2 / 3, retry_period=lease / 7.5)
    running = Running(connections=connections, queues=queues,
                      schedules=ScheduleController(kube, connections, queues, namespaces=namespaces),
                      elector=elector, loop_watch=loop_watch(), endings=WorkerEndings(queues, connections))

    def is_leader() -> bool:
        return elector.is_leader

    kube.may_write = is_leader  # checked again at every write: a reconcile in flight when leadership ends stops
    running.loop_watch.start(asyncio.get_running_loop())
    running.tasks = [
        asyncio.create_task(elector.run(), name="effectmq-leader"),
        asyncio.create_task(queues.run(is_leader), name="effectmq-queues"),
        asyncio.create_task(running.schedules.run(is_leader), name="effectmq-schedules"),
        asyncio.create_task(running.endings.run(is_leader), name="effectmq-worker-endings"),
    ]
    memo.running = running


@kopf.on.probe(id="effectmq")
def probe(memo: kopf.Memo, **_) -> dict:
    """Liveness (and readiness, the chart probes both here): fails when a loop died, or the
    leader election is stuck or refused (LeaderElector.problem). An API server that is down
    does not fail it: the replica stops leading at its renew deadline, and a restart would
    only delay its leading again once the server is back. A CRD that is missing is said
    (`unserved`), not failed on: a restart would not bring it back, and the operator watches
    it again when it is re-created."""
    running = running_of(memo)
    if running is None:
        raise kopf.TemporaryError("starting")
    dead = [t.get_name() for t in running.tasks if t.done()]
    if dead:
        raise kopf.PermanentError(f"loops stopped: {', '.join(dead)}")
    problem = running.elector.problem()
    if problem:
        raise kopf.PermanentError(problem)
    return {"leader": running.elector.is_leader, "unserved": WATCHES.unserved()}


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    running = running_of(memo)
    if running is None:
        return
    running.loop_watch.stop()
    for task in running.tasks:
        task.cancel()
    if running.tasks:
        await asyncio.wait(running.tasks, timeout=SHUTDOWN_STEP)
    # Hand the Lease back (a successor need not wait for it to expire) while the
    # Redis clients close; neither may hold up the exit.
    closing = asyncio.ensure_future(asyncio.wait_for(running.connections.close(), SHUTDOWN_STEP))
    await running.elector.release(timeout=SHUTDOWN_STEP)
    await asyncio.gather(closing, return_exceptions=True)


@kopf.on.event(GROUP, VERSION, "queues")
async def queue_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _running(memo).queues.observe_queue(type, _plain(body))


@kopf.on.event(GROUP, VERSION, "schedules")
async def schedule_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _running(memo).schedules.observe(type, _plain(body))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED_BY)
async def deployment_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _running(memo).queues.observe_deployment(type, _plain(body))


@kopf.on.event("v1", "pods", labels={**MANAGED_BY, QUEUE_LABEL: kopf.PRESENT})
async def worker_pod_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    _running(memo).endings.observe(type, _plain(body))


def _running(memo: kopf.Memo) -> Running:
    running = running_of(memo)
    assert running is not None, "kopf delivers events only after the startup handlers"
    return running


def _plain(body: kopf.Body) -> dict:
    return dict(body)  # the raw event: nested values are plain dicts
