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
from redis.asyncio.cluster import RedisCluster

from ..checks import redis_write_notes
from ..connection import RedisErrors, connect
from ..errors import EffectMQError
from ..keys import check_queue_name
from ..queue import EVENTS_INTEREST, TaskQueue
from ..scheduler import Scheduler
from . import views
from .discovery import discover_queues

log = logging.getLogger("effectmq.dashboard")

DISCOVERY_TTL = 10.0  # seconds a SCAN for queues is reused
EVENTS_EVERY = EVENTS_INTEREST / 3  # want_events() registers interest for EVENTS_INTEREST: ask well within it
SOCKET_TIMEOUT = 3.0  # a page waits at most this long for a Redis that stopped answering
RETRY_ALL_LIMIT = 1000  # dead letters retried by one "retry all"


class UnknownQueue(EffectMQError, LookupError):
    """A queue this dashboard does not show (not given with --queue, or not found)."""


@dataclass
class DashboardConfig:
    url: str | None = None
    queues: list[str] = field(default_factory=list)  # empty: every queue found in Redis
    prefix: str = "emq"
    actions: bool = False
    token: str | None = None
    scheduler_namespace: str = "default"


class DashboardService:
    def __init__(self, config: DashboardConfig):
        self.config = config
        self.redis, self._owns_client, self.shown_url = connect(None, config.url, socket_timeout=SOCKET_TIMEOUT)
        for name in config.queues:
            check_queue_name(name)
        self._queues: dict[str, TaskQueue] = {}
        self._discovered: tuple[float, list[str]] = (0.0, [])
        self.scheduler = Scheduler(self.redis, namespace=config.scheduler_namespace, prefix=config.prefix,
                                   url=config.url)
        self._events_task: asyncio.Task | None = None
        self._redis_errors = RedisErrors(self.redis, f"at {self.shown_url} (dashboard)")

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        self._events_task = asyncio.create_task(self._keep_events_wanted())

    async def close(self) -> None:
        if self._events_task is not None:
            self._events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._events_task
        if self._owns_client:
            await self.redis.aclose()

    async def _keep_events_wanted(self) -> None:
        """Lifecycle events are written only while a reader asked recently (want_events):
        the task pages show them, so keep asking for every queue shown."""
        problem = None  # the last one logged: a lasting one (a read-only replica) is logged once
        while True:
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
            except Exception:  # noqa: BLE001 - a bug here must not end the loop silently
                log.exception("could not register interest in events")
            await asyncio.sleep(EVENTS_EVERY)

    # -- queues -----------------------------------------------------------------

    async def queue_names(self) -> list[str]:
        if self.config.queues:
            return list(self.config.queues)
        at, names = self._discovered
        if time.monotonic() - at > DISCOVERY_TTL:
            with self._redis_errors:  # redis-py errors as RedisUnavailable
                names = await discover_queues(self.redis, self.config.prefix)
            self._discovered = (time.monotonic(), names)
        return names

    def queue(self, name: str) -> TaskQueue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = TaskQueue(name, redis=self.redis, prefix=self.config.prefix)
        return q

    async def known_queue(self, name: str) -> TaskQueue:
        """The queue, when this dashboard shows it (a name in a URL is user input)."""
        if self.config.queues:
            if name not in self.config.queues:
                raise UnknownQueue(f"queue {name!r} is not shown by this dashboard")
        elif name not in await self.queue_names():
            self._discovered = (0.0, [])  # a queue created since the last SCAN
            if name not in await self.queue_names():
                raise UnknownQueue(f"no queue {name!r} in this Redis")
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
        except Exception:  # noqa: BLE001 - nothing to tell; the queues' reads say what is wrong
            return []
        info = {k: v for r in replies for k, v in r.items()}
        if info.get("rdb_last_bgsave_status") == "err":  # refused only with these settings
            with contextlib.suppress(Exception):  # managed services often disable CONFIG
                for name in ("save", "stop-writes-on-bgsave-error"):
                    info.update({f"config_{k}": v for k, v in (await self.redis.config_get(name)).items()})
        return redis_write_notes(info)

    async def summary(self, name: str) -> dict:
        q = self.queue(name)
        stats, settings, workers, points = await asyncio.gather(q.stats(), q.settings(), q.workers(),
                                                                q.throughput(minutes=60))
        return views.queue_summary(stats, settings, workers, points)

    async def overview(self) -> list[dict]:
        names = await self.queue_names()
        return list(await asyncio.gather(*(self.summary(n) for n in names)))

    async def sensitive(self, q: TaskQueue) -> bool:
        # read on every request: a queue marked sensitive is hidden from the next page on
        return bool((await q.settings()).get("sensitive"))

    async def tasks(self, name: str, state: str, offset: int, limit: int, search: str) -> dict:
        q = await self.known_queue(name)
        summary = await self.summary(name)
        if search:
            info = await q.get(search)
            rows = [views.task_row(info)] if info is not None else []
            page = views.Page(0, limit, len(rows))
        else:
            rows = [views.task_row(t) for t in await q.list_tasks(state, limit=limit, offset=offset)]
            page = views.Page(offset, limit, summary["counts"][state])
        return {"queue": summary, "state": state, "search": search, "tasks": rows, "page": page.to_json(),
                "_page": page}

    async def task(self, name: str, task_id: str) -> dict | None:
        q = await self.known_queue(name)
        info, sensitive, events = await asyncio.gather(q.get(task_id), self.sensitive(q), q.task_events(task_id))
        if info is None:
            return None
        return {"queue": name, "task": views.task_detail(info, sensitive=sensitive),
                "events": views.task_events(events)}

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

    async def schedules(self, queue: str | None = None) -> list[dict]:
        shown = [views.schedule_view(s) for s in await self.scheduler.list(limit=1000)]
        return [s for s in shown if queue is None or s["queue"] == queue]

    async def set_suspended(self, schedule_id: str, suspend: bool) -> views.ActionResult:
        status = await self.scheduler.status(schedule_id)
        if status is None:
            return views.ActionResult(404, f"no schedule {schedule_id!r}")
        if status.spec is None:
            return views.ActionResult(409, f"schedule {schedule_id!r} has an unreadable definition")
        if status.spec.suspend == suspend:
            return views.ActionResult(200, f"schedule {schedule_id!r} already {'suspended' if suspend else 'running'}")
        await self.scheduler.put(dataclasses.replace(status.spec, suspend=suspend))
        return views.ActionResult(200, f"schedule {schedule_id!r} {'suspended' if suspend else 'resumed'}")

