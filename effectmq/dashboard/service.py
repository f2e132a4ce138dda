"""The dashboard's reads and actions on Redis: engine calls in, `views` dicts out.

All I/O of the dashboard lives here; `web` only parses requests and renders what
these methods return. Actions are the engine's own fenced operations (TaskQueue.retry,
cancel, pause, resume; Scheduler.put), never writes of our own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from redis.asyncio.cluster import RedisCluster

from ..protocol import protocol
from ..client.checks import check_number, redis_write_notes
from ..transport.connection import RedisErrors, connect
from ..errors import EffectMQError, InvalidOption
from ..protocol.keys import QUEUE_NAME, check_queue_name
from ..client.queue import EVENTS_INTEREST, TaskQueue
from ..scheduler import DEFAULT_NAMESPACE, Scheduler
from . import auth, views
from ..client.discovery import discover_queues, queue_exists
from ..client.models import parse_task
from ..scheduler.store import discover_scheduler_namespaces

log = logging.getLogger("effectmq.dashboard")

DISCOVERY_INTERVAL = 30.0  # seconds at least between two SCANs of the keyspace for queues
EVENTS_EVERY = EVENTS_INTEREST / 3  # want_events() registers interest for EVENTS_INTEREST: ask well within it
SOCKET_TIMEOUT = 3.0  # a page waits at most this long for a Redis that stopped answering
MAX_CONNECTIONS = 32  # to Redis; more requests at once wait for a free one (up to SOCKET_TIMEOUT)
RETRY_ALL_LIMIT = 1000  # dead letters retried by one "retry all"


class _Scan:
    """A SCAN's answer, kept for `interval` seconds, and at most one SCAN at a time: every
    caller that wants one meanwhile waits for the one under way (single flight), and a
    caller that goes away (its client hung up) does not cancel it for the others."""

    def __init__(self, scan: Callable[[], Awaitable[list[str]]], interval: float):
        self._scan = scan
        self._interval = interval
        self._last: tuple[float, list[str]] | None = None  # (when, names) of the last SCAN
        self._flight: asyncio.Future | None = None

    async def names(self) -> list[str]:
        last = self._last
        if last is not None and time.monotonic() - last[0] < self._interval:
            return last[1]
        if self._flight is None:
            self._flight = flight = asyncio.ensure_future(self._run())
            flight.add_done_callback(self._done)
        return await asyncio.shield(self._flight)

    async def _run(self) -> list[str]:
        names = await self._scan()
        self._last = (time.monotonic(), names)
        return names

    def _done(self, flight: asyncio.Future) -> None:
        if self._flight is flight:
            self._flight = None
        if not flight.cancelled():
            flight.exception()  # retrieved: a failure is each waiter's to report

    async def cancel(self) -> None:
        if self._flight is not None:
            self._flight.cancel()
            with contextlib.suppress(BaseException):
                await self._flight


async def _none() -> None:
    return None


class UnknownQueue(EffectMQError, LookupError):
    """A queue this dashboard does not show (not given with --queue, or not found)."""


@dataclass
class DashboardConfig:
    url: str | None = None
    queues: list[str] = field(default_factory=list)  # empty: every queue found in Redis
    prefix: str = "emq"
    actions: bool = False
    token: str | None = None  # the action token (with actions)
    scheduler_namespace: str | None = None  # None: every scheduler namespace that holds a schedule
    read_token: str | None = None  # set: every page needs a session or Bearer token (this one or `token`)
    allowed_hosts: list[str] = field(default_factory=list)  # Host names answered besides loopback ("*": any)
    behind_tls: bool = False  # served through TLS (an ingress): the session cookie is Secure
    # Proxies (addresses or CIDRs) whose X-Forwarded-For names the client (auth.client_address)
    trusted_proxies: tuple[str, ...] = ()
    session_max_age: float = auth.SESSION_MAX_AGE
    # Register interest in lifecycle events (a write per queue every EVENTS_EVERY) so task
    # pages show them; None: only with actions (a read-only dashboard writes nothing).
    want_events: bool | None = None
    discovery_interval: float = DISCOVERY_INTERVAL
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        auth.check_token(self.token, "action token")
        auth.check_token(self.read_token, "read token")
        try:
            self.trusted_networks = auth.trusted_networks(self.trusted_proxies)
        except ValueError as exc:
            raise InvalidOption(str(exc)) from None
        check_number("session_max_age", self.session_max_age, minimum=1, allow_none=False, maximum=30 * 86400)
        check_number("discovery_interval", self.discovery_interval, minimum=0, allow_none=False, maximum=86400)
        check_number("max_connections", self.max_connections, minimum=1, integer=True, allow_none=False,
                     maximum=10_000)

    @property
    def writes_events(self) -> bool:
        return self.actions if self.want_events is None else self.want_events


class DashboardService:
    def __init__(self, config: DashboardConfig):
        self.config = config
        for name in config.queues:
            check_queue_name(name)
        self.redis, self._owns_client, self.shown_url = connect(None, config.url, socket_timeout=SOCKET_TIMEOUT,
                                                                max_connections=config.max_connections)
        self._queues: dict[str, TaskQueue] = {}
        self._found: set[str] = set()  # queues seen to exist since the last SCAN (a page named them)
        self._queue_scan = _Scan(self._scan_queues, config.discovery_interval)
        self._schedulers: dict[str, Scheduler] = {}
        self._namespace_scan = _Scan(self._scan_namespaces, config.discovery_interval)
        self._events_task: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._redis_errors = RedisErrors(self.redis, f"at {self.shown_url} (dashboard)")

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        if self.config.writes_events:
            self._events_task = asyncio.create_task(self._keep_events_wanted())

    async def close(self) -> None:
        self._closing.set()
        if self._events_task is not None:
            self._events_task.cancel()  # may be taken for a lost connection: the loop ends on _closing too
            with contextlib.suppress(asyncio.CancelledError):
                await self._events_task
        for scan in (self._queue_scan, self._namespace_scan):
            await scan.cancel()
        if self._owns_client:
            await self.redis.aclose()

    async def _keep_events_wanted(self) -> None:
        """Lifecycle events are written only while a reader asked recently (want_events):
        the task pages show them, so keep asking for every queue shown (with actions, or
        when told to: it writes to every queue)."""
        problem = None  # the last one logged: a lasting one (a read-only replica) is logged once
        while not self._closing.is_set():
            try:
                names = await self.queue_names()
                await asyncio.gather(*(self.queue(n).want_events() for n in names))
                if problem is not None:
                    log.info("interest in events registered again")
                problem = None
            except EffectMQError as exc:
                if str(exc) != problem:
                    log.warning("could not register interest in events (task pages show only those already "
                                "written): %s", exc)
                problem = str(exc)
            except Exception:  # a bug here must not end the loop silently
                log.exception("could not register interest in events")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), EVENTS_EVERY)

    # -- queues -----------------------------------------------------------------

    async def queue_names(self) -> list[str]:
        """The queues shown: those given, or those the last discovery found (a SCAN of
        the keyspace, at most one every discovery_interval, whoever asks) and those seen
        to exist since."""
        if self.config.queues:
            return list(self.config.queues)
        names = await self._queue_scan.names()
        return sorted(set(names) | self._found)

    async def _scan_queues(self) -> list[str]:
        with self._redis_errors:  # redis-py errors as RedisUnavailable
            names = await discover_queues(self.redis, self.config.prefix)
        self._found = set()
        return names

    def queue(self, name: str) -> TaskQueue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = TaskQueue(name, redis=self.redis, prefix=self.config.prefix)
        return q

    async def known_queue(self, name: str) -> TaskQueue:
        """The queue, when this dashboard shows it (a name in a URL is user input: it is
        looked up by its own two keys, never by a SCAN)."""
        if self.config.queues:
            if name not in self.config.queues:
                raise UnknownQueue(f"queue {name!r} is not shown by this dashboard")
        elif name not in await self.queue_names():
            if not QUEUE_NAME.match(name):
                raise UnknownQueue(f"no queue {name!r} in this Redis")
            with self._redis_errors:
                exists = await queue_exists(self.redis, self.config.prefix, name)
            if not exists:
                raise UnknownQueue(f"no queue {name!r} in this Redis")
            self._found.add(name)  # created since the last SCAN: shown from now on
        return self.queue(name)

    async def ping(self) -> None:
        with self._redis_errors:
            await self.redis.ping()

    async def redis_notes(self) -> list[str]:
        """What Redis's INFO says about it taking new tasks (checks.redis_write_notes), for
        every primary of a cluster. None when INFO is refused (an ACL, a managed service)
        or does not come: the page's own reads report a Redis that does not answer."""
        sections = ("memory", "persistence", "replication")  # one each: 6.2 takes one per INFO
        try:
            if isinstance(self.redis, RedisCluster):
                replies = await asyncio.gather(*(self.redis.info(s, target_nodes=RedisCluster.PRIMARIES)
                                                 for s in sections))
                nodes = sorted(replies[0])
                return [f"{node}: {note}" for node in nodes
                        for note in redis_write_notes({k: v for r in replies for k, v in r.get(node, {}).items()})]
            replies = await asyncio.gather(*(self.redis.info(s) for s in sections))
        except Exception:  # nothing to tell; the queues' reads say what is wrong
            return []
        info = {k: v for r in replies for k, v in r.items()}
        if info.get("rdb_last_bgsave_status") == "err":  # refused only with these settings
            with contextlib.suppress(Exception):  # managed services often disable CONFIG
                for name in ("save", "stop-writes-on-bgsave-error"):
                    info.update({f"config_{k}": v for k, v in (await self.redis.config_get(name)).items()})
        return redis_write_notes(info)

    async def summary(self, name: str) -> dict:
        q = self.queue(name)
        stats, settings, workers, points, poison = await asyncio.gather(q.stats(), q.settings(), q.workers(),
                                                                        q.throughput(minutes=60), q.poison_count())
        return views.queue_summary(stats, settings, workers, points, poison)

    async def overview(self) -> list[dict]:
        names = await self.queue_names()
        return list(await asyncio.gather(*(self.summary(n) for n in names)))

    async def sensitive(self, q: TaskQueue) -> bool:
        # read on every request: a queue marked sensitive is hidden from the next page on
        return bool((await q.settings()).get("sensitive"))

    async def tasks(self, name: str, state: str, offset: int, limit: int, search: str,
                    group: str | None = None) -> dict:
        """A page of one list; `group` narrows the parked list to that group's."""
        q = await self.known_queue(name)
        summary = await self.summary(name)
        total = summary[state] if state in (views.POISON, views.PARKED) else summary["counts"][state]
        if search:
            ids: list = [search]
        elif state == views.PARKED:
            ids = await q.parked_ids(group, limit=limit, offset=offset)
            if group is not None:
                total = (await q.group_stats(group)).parked
        else:
            # the poison list: the most recent pod deaths first (its scores are their times)
            command = "ZREVRANGE" if state == views.POISON else "ZRANGE"
            with self._redis_errors:
                ids = await self.redis.execute_command(command, q.keys.key(state), offset, offset + limit - 1,
                                                       NEVER_DECODE=True)
        rows = [views.task_row(info, sensitive=summary["sensitive"]) for info in await self._list_records(q, ids)]
        page = views.Page(0, limit, len(rows)) if search else views.Page(offset, limit, total)
        return {"queue": summary, "state": state, "search": search, "group": group, "tasks": rows,
                "page": page.to_json(), "_page": page}

    async def groups(self, name: str, offset: int, limit: int, group: str | None = None) -> dict:
        """The queue page's groups section (views.groups_section): a page of the groups with
        waiting tasks, busiest first, and the group the page names."""
        q = await self.known_queue(name)
        with self._redis_errors:
            total = await self.redis.zcard(q.keys.key("groups"))  # the groups with waiting tasks
        shown, looked_up = await asyncio.gather(q.groups(offset=offset, count=limit),
                                                q.group_stats(group) if group is not None else _none())
        return views.groups_section(shown, views.Page(offset, limit, total), looked_up)

    async def _list_records(self, q: TaskQueue, ids: list) -> list:
        """The tasks of a list, each read with the fields its row shows (HMGET), never
        its payload, result or progress; ids whose record is gone are left out."""
        ids = [views.decode_id(raw) for raw in ids]
        if not ids:
            return []
        with self._redis_errors:
            async with self.redis.pipeline(transaction=False) as pipe:
                for task_id in ids:
                    pipe.execute_command("HMGET", protocol.wire(q.keys.task(task_id)), *views.LIST_FIELDS,
                                         NEVER_DECODE=True)
                replies = await pipe.execute()
        records = []
        for task_id, reply in zip(ids, replies):
            present = [(name, value) for name, value in zip(views.LIST_FIELDS, reply) if value is not None]
            if present:  # else gone since the ZRANGE (expired, or a search for no task)
                names, values = zip(*present)
                records.append(parse_task(task_id, protocol.decode_fields(names, list(values))))
        return records

    async def task(self, name: str, task_id: str) -> dict | None:
        q = await self.known_queue(name)
        flat, sensitive, events = await asyncio.gather(self._record(q, task_id), self.sensitive(q),
                                                       q.task_events(task_id))
        if not flat:
            return None
        info = parse_task(task_id, protocol.decode_hash(flat))
        return {"queue": name, "task": views.task_detail(info, sensitive=sensitive),
                "events": views.task_events(events)}

    async def _record(self, q: TaskQueue, task_id: str):
        with self._redis_errors:
            return await self.redis.execute_command("HGETALL", protocol.wire(q.keys.task(task_id)),
                                                    NEVER_DECODE=True)

    # -- actions (each one engine operation) --------------------------------------

    async def retry(self, name: str, task_id: str) -> views.ActionResult:
        q = await self.known_queue(name)
        return views.retry_result(task_id, await q.retry(task_id))

    async def cancel(self, name: str, task_id: str) -> views.ActionResult:
        q = await self.known_queue(name)
        return views.cancel_result(task_id, await q.cancel(task_id))

    async def retry_all(self, name: str) -> views.ActionResult:
        """Each dead letter through TaskQueue.retry (one fenced script call each): one
        that changed meanwhile (retried elsewhere, expired) is counted, not forced."""
        q = await self.known_queue(name)
        dead = await q.dead_letters(limit=RETRY_ALL_LIMIT)
        results = [views.retry_result(t.task_id, await q.retry(t.task_id)) for t in dead]
        retried = sum(r.status == 200 for r in results)
        skipped = len(results) - retried
        return views.ActionResult(200, f"{retried} dead letters sent back to waiting"
                                       + (f", {skipped} had changed meanwhile" if skipped else ""))

    async def set_paused(self, name: str, paused: bool) -> views.ActionResult:
        q = await self.known_queue(name)
        await (q.pause() if paused else q.resume())
        return views.ActionResult(200, f"queue {name!r} {'paused' if paused else 'resumed'}")

    # -- schedules --------------------------------------------------------------------

    def _shows_schedule_of(self, queue: str | None) -> bool:
        """With --queue, only the schedules of those queues are shown (or acted on)."""
        return not self.config.queues or queue in self.config.queues

    def scheduler(self, namespace: str) -> Scheduler:
        scheduler = self._schedulers.get(namespace)
        if scheduler is None:
            scheduler = self._schedulers[namespace] = Scheduler(self.redis, namespace=namespace,
                                                                prefix=self.config.prefix, url=self.config.url)
        return scheduler

    async def scheduler_namespaces(self) -> list[str]:
        """The namespace given, else those that hold a schedule (the operator keeps its
        schedules in one of its own, `effectmq local` too, the CLI in DEFAULT_NAMESPACE),
        found as queues are: a SCAN at most every discovery_interval, single flight."""
        if self.config.scheduler_namespace:
            return [self.config.scheduler_namespace]
        return await self._namespace_scan.names() or [DEFAULT_NAMESPACE]

    async def _scan_namespaces(self) -> list[str]:
        with self._redis_errors:
            return await discover_scheduler_namespaces(self.redis, self.config.prefix)

    async def schedules(self, queue: str | None = None) -> list[dict]:
        shown = [{**views.schedule_view(s), "namespace": namespace}
                 for namespace in await self.scheduler_namespaces()
                 for s in await self.scheduler(namespace).list(limit=1000)]
        return [s for s in shown if (queue is None or s["queue"] == queue) and self._shows_schedule_of(s["queue"])]

    async def set_suspended(self, schedule_id: str, suspend: bool, namespace: str | None = None) -> views.ActionResult:
        """Suspend or resume a schedule; `namespace` picks one scheduler namespace when
        several hold the id (the page's buttons name the row's)."""
        held = []
        shown = await self.scheduler_namespaces()
        for namespace in [n for n in shown if namespace is None or n == namespace]:
            status = await self.scheduler(namespace).status(schedule_id)
            if status is not None and self._shows_schedule_of(status.spec.queue if status.spec else None):
                held.append((namespace, status))
        if not held:
            return views.ActionResult(404, f"no schedule {schedule_id!r}")
        if len(held) > 1:
            return views.ActionResult(409, f"schedule {schedule_id!r} is in scheduler namespaces "
                                           f"{', '.join(n for n, _ in held)}: say which with ?namespace=<name> "
                                           "(or start the dashboard with --scheduler-namespace)")
        namespace, status = held[0]
        if status.spec is None:
            return views.ActionResult(409, f"schedule {schedule_id!r} has an unreadable definition")
        if status.spec.suspend == suspend:
            return views.ActionResult(200, f"schedule {schedule_id!r} already {'suspended' if suspend else 'running'}")
        await self.scheduler(namespace).put(dataclasses.replace(status.spec, suspend=suspend))
        return views.ActionResult(200, f"schedule {schedule_id!r} {'suspended' if suspend else 'resumed'}")

