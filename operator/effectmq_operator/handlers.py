"""kopf wiring: watch streams feed the registries, nothing else happens in handlers.

kopf is used as the watch machinery (and for the liveness endpoint): Queue,
Schedule and worker Deployment events update the controllers' registries and
nudge a reconcile (Secrets are not watched: connections.py reads by name the ones
Queues refer to, and again every EFFECTMQ_SECRET_REFRESH_SECONDS). All
reconciling is done by the leader's loops, so Events and writes come from one
replica, and nothing (no finalizer, no kopf annotation) is added to users' objects.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

import kopf

from effectmq.loopwatch import LoopWatch

from . import metrics
from .builders import GROUP, MANAGED_BY, VERSION
from .connections import CONNECTIONS_PER_REDIS, SECRET_REFRESH, Connections
from .controller import RECONCILES_AT_ONCE, QueueController
from .kube import API_THREADS, Kube, load_config
from .leader import LEASE_SECONDS, LeaderElector, coordination_api
from .schedules import ScheduleController

try:  # kopf's internals that Watches wraps and calls (where kopf 1.37 to 1.45 has them)
    from kopf._cogs.clients import api as kopf_api
    from kopf._cogs.clients import errors as kopf_errors
    from kopf._core.reactor import queueing as kopf_queueing
except ImportError:  # a kopf that moved them: Watches.install() says it cannot guard the watches
    kopf_api = kopf_errors = kopf_queueing = None  # type: ignore[assignment]

SHUTDOWN_STEP = 2.0  # seconds each shutdown step may take: SIGTERM to exit stays within a few seconds
LOOP_BLOCK_WARNING = 3.0  # seconds the loop may not run before the log says where it is stuck (Lease: 15 s)
UNSERVED_RECHECK = 5.0  # seconds between looks at a resource whose watch answered 404 (its CRD deleted)
OWN_RESOURCES = (f"queues.{GROUP}", f"schedules.{GROUP}")
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
    tasks: list[asyncio.Task] = field(default_factory=list)


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


class Watches:
    """kopf's watch streams, made to outlive a deleted CRD, and what they can watch now.

    kopf ends the whole operator (exit code 1) when a watch stream answers 404: its
    watcher raises APINotFoundError and the task that runs all watchers re-raises it.
    That happens when a CRD is deleted and the watch reconnects before kopf's own CRD
    observer has stopped it (the observer re-reads API discovery, which lags the
    deletion). Each watcher here runs inside a loop instead: on a 404 it says so,
    looks again every UNSERVED_RECHECK seconds, and watches again (a fresh list) when
    the resource is served again; kopf's observer may stop it meanwhile (and starts a
    new one when the CRD is back). The probe reports which of the operator's own
    resources have no working watch (deleted, or never created), and stays 200: a
    restart cannot bring a CRD back."""

    def __init__(self) -> None:
        self._state: dict[tuple[str, str | None], bool] = {}  # (plural.group, namespace) -> watching

    def install(self) -> None:
        """Wrap kopf's watcher (idempotent: once per process)."""
        if kopf_queueing is None or not hasattr(kopf_queueing, "watcher"):
            log.warning("kopf %s has no watcher where this operator expects it: a deleted CRD will end the "
                        "process (exit 1) as it did before", getattr(kopf, "__version__", "?"))
            return
        current = kopf_queueing.watcher
        if getattr(current, "__wrapped_by__", None) is self:
            return
        original = getattr(current, "__wrapped__", current)

        async def watcher(*, resource, namespace, settings, **kwargs) -> None:
            await self._watch(original, resource=resource, namespace=namespace, settings=settings, **kwargs)

        watcher.__wrapped__ = original  # type: ignore[attr-defined]  # how install() knows its own
        watcher.__wrapped_by__ = self  # type: ignore[attr-defined]
        kopf_queueing.watcher = watcher

    def unserved(self, names: tuple[str, ...] = OWN_RESOURCES) -> list[str]:
        """Those of `names` that no watch stream is watching now."""
        return [name for name in names if not any(on for (n, _), on in self._state.items() if n == name)]

    async def _watch(self, original, *, resource, namespace, settings, **kwargs) -> None:
        name = f"{resource.plural}.{resource.group}" if resource.group else resource.plural
        key = (name, namespace)
        where = f"in namespace {namespace}" if namespace else "cluster-wide"
        self._state[key] = True
        try:
            while True:
                try:
                    return await original(resource=resource, namespace=namespace, settings=settings, **kwargs)
                except kopf_errors.APINotFoundError:
                    self._state[key] = False
                    log.warning("%s are not served (404: their CRD was deleted?); the operator keeps running "
                                "and watches them again %s when they are back", name, where)
                    await self._until_served(resource, namespace, settings)
                    self._state[key] = True
                    log.info("%s are served again: watching them %s", name, where)
        finally:
            self._state.pop(key, None)

    async def _until_served(self, resource, namespace, settings) -> None:
        url = resource.get_url(namespace=namespace, params={"limit": "1"})
        while True:
            await asyncio.sleep(UNSERVED_RECHECK)
            try:
                await kopf_api.get(url, settings=settings, logger=log)
                return
            except kopf_errors.APINotFoundError:
                continue
            except Exception as exc:  # an API server away: look again later
                log.debug("looking for %s: %s", url, exc)


WATCHES = Watches()


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
                      elector=elector, loop_watch=loop_watch())

    def is_leader() -> bool:
        return elector.is_leader

    kube.may_write = is_leader  # checked again at every write: a reconcile in flight when leadership ends stops
    running.loop_watch.start(asyncio.get_running_loop())
    running.tasks = [
        asyncio.create_task(elector.run(), name="effectmq-leader"),
        asyncio.create_task(queues.run(is_leader), name="effectmq-queues"),
        asyncio.create_task(running.schedules.run(is_leader), name="effectmq-schedules"),
    ]
    memo.running = running


@kopf.on.probe(id="effectmq")
def probe(memo: kopf.Memo, **_) -> dict:
    """Liveness: fails when a loop died or the Lease could not be reached for a whole lease
    duration. A CRD that is missing is said (`unserved`), not failed on: a restart would not
    bring it back, and the operator watches it again when it is re-created."""
    running = running_of(memo)
    if running is None:
        raise kopf.TemporaryError("starting")
    dead = [t.get_name() for t in running.tasks if t.done()]
    if dead:
        raise kopf.PermanentError(f"loops stopped: {', '.join(dead)}")
    if not running.elector.healthy():
        raise kopf.PermanentError("the leader election cannot reach the API server")
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


def _running(memo: kopf.Memo) -> Running:
    running = running_of(memo)
    assert running is not None, "kopf delivers events only after the startup handlers"
    return running


def _plain(body: kopf.Body) -> dict:
    return dict(body)  # the raw event: nested values are plain dicts
