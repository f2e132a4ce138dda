"""The Scheduler: materializes due cron ticks as ordinary, idempotent queue tasks.

One pass: read the due schedules and Redis time (`due.lua`, then the slices behind
them), decide per schedule (`policy.plan`, pure), offer the ticks' tasks with
deterministic ids (per queue, OFFER_SIZE ticks an offer, OFFERS_IN_FLIGHT at a time),
then advance each cursor by compare-and-set (`advance.lua`), GROUP_SCHEDULES
schedules at a time until all that was due when the pass began is done. Any number
of schedulers may run at once: offers are idempotent and only one cursor update per
decision wins. A schedule is decided with the Redis time its cursor was first read
at (recorded with it, lua/lib.lua's decided_at), so every decision from one cursor is
the same: a pass that stopped between its offers and its cursor update is redone with
the same ticks, spans and counts, and no tick is counted twice. A schedule that
cannot run records its error and is retried later; it never holds up the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable

import redis.asyncio as aioredis

from ..protocol import codec, protocol
from ..errors import EffectMQError, InvalidOption, RedisUnavailable
from ..client import tracing
from ..client.models import Offered
from ..transport.connection import OwnsConnection, connect
from ..client.queue import DEFAULT_DEDUP_WINDOW, TaskQueue
from . import policy
from .errors import InvalidSchedule
from .model import Materialized, ScheduleSpec, ScheduleStatus, TickReport, utc_from_ms
from .store import APPLIED, DEFAULT_NAMESPACE, FUTURE, LOST, DueBatch, Outcome, Row, ScheduleStore

log = logging.getLogger("effectmq.scheduler")

# A decision older than this (local monotonic clock) is dropped instead of offered,
# so no offer ever reaches Redis long after the Redis time it was decided with.
PLAN_MAX_AGE = 30.0
SETTINGS_TTL = 10.0  # seconds a queue's dedup window is cached
# Schedules decided before their offers are sent (bounds a pass's memory). A slice of
# `batch` schedules touches most target queues: offered slice by slice, 10,000
# schedules over 1,000 queues cost 10,000 offer round trips; grouped, 1,000.
GROUP_SCHEDULES = 10_000
# Slices are read ahead only while more queues than this wait for their offer: a slice
# read ahead costs about 7 ms more than one read by due.lua (a pipeline of 1,000
# HMGETs; 2 cores), an offer round trip about 0.15 ms, so with few target queues
# (10,000 schedules over 10) the slices are offered one after another.
READ_AHEAD_QUEUES = 50
# Ticks per offer at most: one offer script call (a refused offer is retried one
# schedule at a time: this also bounds that retry).
OFFER_SIZE = protocol.OFFER_CHUNK
# A queue's offer leaves once it holds this many ticks, looked at every DECIDE_CHUNK
# schedules, so Redis stores them while the rest is decided; smaller ones wait for
# the end of the group (a round trip costs about as much as a few ticks).
RIPE_OFFER = 32
DECIDE_CHUNK = 250
# Queue calls (offers, settings reads) in flight at once. Each holds a pooled connection:
# all at once, 1,000 target queues wanted 1,000 connections and most offers failed
# with "Too many connections"; one single-threaded Redis is no faster past a few dozen.
OFFERS_IN_FLIGHT = 32
# The pool of a client the Scheduler opens itself: the offers plus its other calls
# (due, advance, settings, concurrent puts). Past it, callers wait instead of failing.
MAX_CONNECTIONS = OFFERS_IN_FLIGHT + 8

BeforeOffer = Callable[[str, list[str]], Awaitable[None]]
AfterOffer = Callable[[str, list[Offered]], Awaitable[None]]


# (an alias: inside Scheduler, "list" names its method)
Decisions = list["_Decision"]
Offers = list[Offered]
Rows = list[Row]

class Scheduler(OwnsConnection):
    """Schedules of one namespace and the passes that materialize their ticks.

        scheduler = Scheduler("redis://localhost:6379/0", namespace="prod")
        await scheduler.put(ScheduleSpec(id="reports/nightly", queue="reports",
                                         cron="0 2 * * *", timezone="Europe/Berlin",
                                         task="send_report", payload={"kind": "daily"}))
        report = await scheduler.tick()     # or: await scheduler.run()
        status = await scheduler.status("reports/nightly")

    `before_offer` / `after_offer` are awaited around each offer batch (queue name
    and task ids / offer results): hooks for observability and fault tests.

    A client the Scheduler opens (from a URL) has a pool of MAX_CONNECTIONS that makes
    callers wait; a given client is used as is (the Scheduler itself keeps at most
    OFFERS_IN_FLIGHT offers on it at once).
    """

    def __init__(self, redis: str | aioredis.Redis | None = None, *, namespace: str = DEFAULT_NAMESPACE,
                 prefix: str = "emq", batch: int = 1000, error_backoff: float = 30.0,
                 before_offer: BeforeOffer | None = None, after_offer: AfterOffer | None = None,
                 url: str | None = None):
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise InvalidOption(f"batch must be a positive integer, got {batch!r}")
        client, url = (None, redis) if isinstance(redis, str) else (redis, url)  # url: names a given client
        self.redis, self._owns_client, self.url = connect(client, url, max_connections=MAX_CONNECTIONS)
        self.prefix = prefix
        self.store = ScheduleStore(self.redis, namespace=namespace, prefix=prefix, url=self.url)
        self.namespace = namespace
        self.batch = batch
        self.error_backoff = error_backoff
        self.before_offer = before_offer
        self.after_offer = after_offer
        self._queues: dict[str, TaskQueue] = {}
        self._in_flight = asyncio.Semaphore(OFFERS_IN_FLIGHT)
        self._specs: dict[str, tuple[str, str, ScheduleSpec | InvalidSchedule]] = {}
        self._dedup: dict[str, tuple[float, float]] = {}  # queue -> (valid until, window seconds)

    def __repr__(self) -> str:
        return f"Scheduler(namespace={self.namespace!r})"

    # -- definitions ---------------------------------------------------------------

    async def put(self, spec: ScheduleSpec | dict) -> ScheduleStatus:
        """Create or replace a schedule, then settle it at once (next tick, missed ticks)."""
        if isinstance(spec, dict):
            spec = ScheduleSpec.from_json(spec)
        await self.store.put(spec)
        if not spec.suspend:
            batch = await self.store.rows([spec.id])
            await self._pass(batch, TickReport(now=utc_from_ms(batch.now_ms)))
        status = await self.status(spec.id)
        assert status is not None
        return status

    async def remove(self, schedule_id: str) -> bool:
        """Delete a schedule; its already materialized tasks stay. False if unknown."""
        self._specs.pop(schedule_id, None)
        return await self.store.remove(schedule_id)

    async def status(self, schedule_id: str) -> ScheduleStatus | None:
        return (await self.store.statuses([schedule_id]))[0]

    async def statuses(self, schedule_ids: list[str]) -> list[ScheduleStatus | None]:
        """Several statuses in one round trip (None for unknown ids)."""
        return await self.store.statuses(schedule_ids)

    async def ping(self) -> None:
        """Raise RedisUnavailable when Redis cannot be reached."""
        await self.store.ping()

    async def list(self, *, after: str | None = None, limit: int = 1000) -> list[ScheduleStatus]:
        """Statuses in id order, `limit` at a time (pass the last id as `after` to page)."""
        ids = await self.store.ids(after=after, limit=limit)
        return [s for s in await self.store.statuses(ids) if s is not None]

    # -- passes --------------------------------------------------------------------

    async def tick(self) -> TickReport:
        """One pass: materialize every tick due when it began, `batch` schedules per slice.

        Slices read only what was due when the pass began, so a pass ends even while
        its schedules fall due again; what fell due meanwhile is the next pass's
        (`report.more`: `run()` starts it at once). A tick is thus created at most two
        passes after it fell due. Up to GROUP_SCHEDULES schedules are decided before
        their offers leave: about one offer round trip per queue per group.
        """
        head = await self.store.due(self.batch)
        began = head.now_ms
        report = TickReport(now=utc_from_ms(began))
        while True:
            _earliest(report, head.next_ms)
            full = len(head.rows) == self.batch  # more may be due behind it: read ahead
            await self._pass(head, report, upto_ms=began if full else None)
            if report.more:  # a stale decision: its schedules are left due, decided again next pass
                return report
            if not full:
                report.more = head.next_ms is not None and head.next_ms <= head.now_ms
                return report
            # Again from the head: what the group left due (a schedule passed over by a
            # read ahead, one that moved between reads) is read before the pass ends.
            head = await self.store.due(self.batch, upto_ms=began)

    async def run(self, *, interval: float = 1.0, stop: asyncio.Event | None = None,
                  on_pass: Callable[[TickReport], Any] | None = None) -> None:
        """Pass after pass until `stop` is set: wake at the next fire time, and at
        least every `interval` seconds (to see schedules other processes put)."""
        stop = stop or asyncio.Event()
        failures = 0
        while not stop.is_set():
            started = time.monotonic()
            wait = interval
            try:
                report = await self.tick()
                failures = 0
            except Exception as exc:  # a long-running scheduler outlives Redis outages and surprises
                failures += 1
                wait = min(interval * 2 ** failures, 30.0)
                log.warning("scheduler pass failed (retrying in %.1fs): %s", wait, exc,
                            exc_info=not isinstance(exc, RedisUnavailable))
            else:
                if on_pass is not None:
                    on_pass(report)
                if report.more:
                    wait = 0.0
                elif report.next_due is not None:
                    until = (report.next_due - report.now).total_seconds() - (time.monotonic() - started)
                    wait = min(interval, max(0.0, until + 0.002))
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)

    # -- one group of due schedules ------------------------------------------------

    async def _pass(self, head: DueBatch, report: TickReport, *, upto_ms: int | None = None) -> None:
        """Decide, offer, then advance the cursors of a group of due schedules: `head`
        and, with `upto_ms`, the slices due behind it, up to GROUP_SCHEDULES in all."""
        decided_at = time.monotonic()  # just after the group's oldest Redis time was read
        decide = _Decider(self, report)
        outbox = _Outbox(lambda queue, group: self._offer(queue, group, decided_at, report))

        def read_ahead(held: int) -> bool:
            # while it saves offers, the group has room, and its decisions are young
            # enough to be offered once it is decided
            return (outbox.waiting > READ_AHEAD_QUEUES and held + self.batch <= GROUP_SCHEDULES
                    and time.monotonic() - decided_at < PLAN_MAX_AGE / 3)

        try:
            async with contextlib.aclosing(self._slices(head, upto_ms, read_ahead)) as slices:
                async for now, rows in slices:
                    report.examined += len(rows)
                    specs = [self._spec(row) for row in rows]
                    max_ages = await self._max_ages({s.queue for s in specs if isinstance(s, ScheduleSpec)})
                    for start in range(0, len(rows), DECIDE_CHUNK):
                        end = start + DECIDE_CHUNK
                        for decision in decide(now, rows[start:end], specs[start:end], max_ages):
                            outbox.add(decision)
                        outbox.post_ripe()
                        await asyncio.sleep(0)  # let the offers posted leave
            outbox.flush()
            answers = await outbox.answers()
        except BaseException:
            await outbox.cancel()  # no cursor moves: the offers were idempotent
            raise

        outcomes = decide.settled
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer  # a bug or a hook's fault: no cursor moves; the offers were idempotent
        for group, failed in zip(outbox.groups, answers):
            if not isinstance(failed, dict):  # None (BaseExceptions were raised above)
                report.more = True  # decided too long ago to offer: left due, decided again
                continue
            for d in group:
                outcomes.append(self._failure(d.row, failed[d.row.id], d.now, report) if d.row.id in failed
                                else d.outcome())

        results: list[int] = []
        for start in range(0, len(outcomes), self.batch):  # advance.lua calls no larger than a slice
            results += await self.store.advance(outcomes[start:start + self.batch])
        for outcome, result in zip(outcomes, results):
            if result == LOST:
                report.lost += 1
            elif result == FUTURE:
                log.warning("schedule %r: Redis time went backwards; cursor not advanced", outcome.id)
            if result == APPLIED:
                _earliest(report, outcome.score)

    async def _slices(self, head: DueBatch, upto_ms: int | None,
                      read_ahead: Callable[[int], bool]) -> AsyncGenerator[tuple[int, Rows], None]:
        """(Redis time, rows) of `head`, then, with `upto_ms` and while `read_ahead(rows
        so far)`, of the slices due behind it: each schedule once."""
        batch, position, more = head, len(head.rows), upto_ms is not None
        seen: set[str] = set()
        while True:
            rows = [row for row in batch.rows if row.id not in seen]  # one moved between reads comes again
            seen.update(row.id for row in rows)
            yield batch.now_ms, rows
            if not more or not read_ahead(len(seen)):
                return
            assert upto_ms is not None
            batch, covered = await self.store.due_after(position, self.batch, upto_ms)
            position, more = position + covered, covered == self.batch

    async def _offer(self, queue_name: str, group: Decisions, decided_at: float,
                     report: TickReport) -> dict[str, str] | None:
        """Offer a queue's ticks in one round trip, isolating schedules whose offer is
        refused. Returns schedule id -> error for those not offered, or None when the
        decision got too old to offer."""
        queue = self._queue(queue_name)
        async with self._in_flight:  # see OFFERS_IN_FLIGHT
            try:
                self._record(queue_name, group, await self._offer_items(queue, group, decided_at), report)
                return {}
            except _StaleDecision:
                return None
            except RedisUnavailable as exc:
                return {d.row.id: f"offer to queue {queue_name!r} failed: {exc}" for d in group}
            except EffectMQError:
                pass
            failed: dict[str, str] = {}  # one bad schedule must not block the rest: one by one
            for d in group:
                try:
                    self._record(queue_name, [d], await self._offer_items(queue, [d], decided_at), report)
                except _StaleDecision:
                    return None
                except EffectMQError as exc:
                    failed[d.row.id] = f"offer to queue {queue_name!r} refused: {exc}"
            return failed

    async def _offer_items(self, queue: TaskQueue, group: Decisions, decided_at: float) -> Offers:
        items = [item for d in group for item in d.items]
        if not items:
            return []
        if self.before_offer is not None:
            await self.before_offer(queue.name, [item["task_id"] for item in items])
        if time.monotonic() - decided_at > PLAN_MAX_AGE:
            raise _StaleDecision()
        if (tracer := tracing.tracer()) is not None:  # each tick the root of a trace
            ticks = [(d.spec.id, tick.at, item) for d in group for tick, item in zip(d.plan.ticks, d.items)]
            with tracing.tick_sends(tracer, queue.name, ticks) as items:
                offered = await queue.offer_many(items)
        else:
            offered = await queue.offer_many(items)
        if self.after_offer is not None:
            await self.after_offer(queue.name, offered)
        return offered

    @staticmethod
    def _record(queue: str, group: Decisions, offered: Offers, report: TickReport) -> None:
        planned = [(d.spec.id, tick) for d in group for tick in d.plan.ticks]
        for (schedule_id, tick), result in zip(planned, offered):
            report.materialized.append(
                Materialized(schedule_id, queue, result.task_id, utc_from_ms(tick.at * 1000), result.created))

    def _failure(self, row: Row, message: str, now: int, report: TickReport) -> Outcome:
        report.errors[row.id] = message
        log.warning("schedule %r: %s", row.id, message)
        retry_at = now + round(self.error_backoff * 1000)
        _earliest(report, retry_at)
        return Outcome(row.id, row.version, row.cursor_ms, row.cursor_ms, retry_at, error=message)

    # -- caches ----------------------------------------------------------------------

    def _spec(self, row: Row) -> ScheduleSpec | InvalidSchedule:
        """The row's definition, parsed once per version; a broken one as its error."""
        cached = self._specs.get(row.id)
        if cached is not None and cached[0] == row.version and cached[1] == row.spec:
            return cached[2]
        try:
            spec: ScheduleSpec | InvalidSchedule = ScheduleSpec.from_json(codec.loads(row.spec, "schedule definition"))
        except InvalidSchedule as exc:
            spec = exc
        except Exception as exc:  # corrupt JSON or a definition this version cannot read
            spec = InvalidSchedule(f"schedule {row.id!r}: stored definition unusable: {exc}")
        if len(self._specs) > 200_000:
            self._specs.clear()
        self._specs[row.id] = (row.version, row.spec, spec)
        return spec

    def _queue(self, name: str) -> TaskQueue:
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = TaskQueue(name, redis=self.redis, prefix=self.prefix)
        return queue

    async def _max_ages(self, queues: set[str]) -> dict[str, float]:
        """How old a tick may be and still be offered, per queue: the queue's dedup
        window, less the time a decision may take to reach Redis, so a finished tick's
        id is always still reserved when it is offered again. Windows are cached for
        SETTINGS_TTL; the ones missing are read concurrently (a cold pass over 1,000
        queues read them one after another)."""
        now = time.monotonic()
        missing = [q for q in queues if q not in self._dedup or self._dedup[q][0] < now]
        read = await asyncio.gather(*(self._dedup_window(q) for q in missing), return_exceptions=True)
        for queue, window in zip(missing, read):
            if isinstance(window, BaseException):
                raise window
            self._dedup[queue] = (now + SETTINGS_TTL, window)
        windows = {q: self._dedup[q][1] for q in queues}
        return {q: max(w - 2 * PLAN_MAX_AGE, w / 2) for q, w in windows.items()}

    async def _dedup_window(self, queue_name: str) -> float:
        async with self._in_flight:  # see OFFERS_IN_FLIGHT
            stored = (await self._queue(queue_name).settings()).get("dedup_window")
        return stored if stored else DEFAULT_DEDUP_WINDOW


class _Decider:
    """Turns due rows into decisions within one group of a pass: pure, no I/O (the
    queues' max ages are read before)."""

    def __init__(self, scheduler: Scheduler, report: TickReport):
        self.scheduler = scheduler
        self.report = report
        self.settled: list[Outcome] = []  # outcomes decided without an offer
        # Schedules with the same cron, zone and policy usually share their cursor (the
        # last tick they all fired at): the decision is made once for all of them.
        self._plans: dict[tuple, policy.Plan] = {}

    def __call__(self, now: int, rows: list[Row], specs: list[ScheduleSpec | InvalidSchedule],
                 max_ages: dict[str, float]) -> list["_Decision"]:
        """Decisions at Redis time `now` for the rows (and their parsed definitions) to offer."""
        decisions = []
        for row, spec in zip(rows, specs):
            if row.cursor_ms is None and not isinstance(spec, InvalidSchedule):
                spec = InvalidSchedule(f"schedule {row.id!r}: stored cursor is not a number of milliseconds")
            if isinstance(spec, InvalidSchedule) or row.cursor_ms is None:
                self.settled.append(self.scheduler._failure(row, str(spec), now, self.report))
                continue
            if spec.suspend:  # a suspended schedule has no business in the due set
                self.settled.append(Outcome(row.id, row.version, row.cursor_ms, row.cursor_ms, None))
                continue
            max_age = max_ages[spec.queue]
            plan = self._plan(spec, row, now, max_age)
            if row.decided_ms is not None and row.decided_ms < now and plan.ticks \
                    and now - plan.ticks[0].at * 1000 > max_age * 1000:
                # Redoing that decision would offer a tick the queue may have forgotten (its
                # dedup window): decided afresh instead, as before decisions were recorded.
                plan = self._plan(spec, row, now, max_age, fresh=True)
            decisions.append(_Decision(row, spec, plan, [spec.offer(t, now) for t in plan.ticks], now))
        return decisions

    def _plan(self, spec: ScheduleSpec, row: Row, now: int, max_age: float, *, fresh: bool = False) -> policy.Plan:
        """The decision from the row's cursor, made with the Redis time its first reader
        recorded (the same ticks, spans and counts for every pass from that cursor, also
        one redoing a pass that stopped between its offers and its cursor update), or
        with `now` when there is none (or it is later: Redis time went back) or `fresh`."""
        assert row.cursor_ms is not None
        at = now if fresh or row.decided_ms is None or not row.cursor_ms <= row.decided_ms <= now else row.decided_ms
        key = (at, spec.timeline, spec.missed_policy, row.cursor_ms, max_age, row.suspended)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = policy.plan(spec.timeline, row.cursor_ms, at, spec.missed_policy,
                                                  max_age=max_age, suspended=row.suspended)
        return plan


class _Outbox:
    """Decisions waiting for their queue's offer: one leaves when it is full
    (OFFER_SIZE ticks) or ripe (RIPE_OFFER, when asked), the rest when the group is
    decided: for thinly spread ticks, one round trip per queue per group rather than
    per slice."""

    def __init__(self, send: Callable[[str, Decisions], Awaitable[dict[str, str] | None]]):
        self._send = send
        self._waiting: dict[str, Decisions] = defaultdict(list)
        self._ticks: dict[str, int] = defaultdict(int)
        self.groups: list[Decisions] = []  # what each sent offer carries
        self._sent: list[asyncio.Future] = []

    @property
    def waiting(self) -> int:
        """Queues whose offer is not sent yet."""
        return len(self._waiting)

    def add(self, decision: "_Decision") -> None:
        queue = decision.spec.queue
        self._waiting[queue].append(decision)
        self._ticks[queue] += len(decision.items)
        if self._ticks[queue] >= OFFER_SIZE:
            self._post(queue)

    def post_ripe(self) -> None:
        for queue in [q for q, ticks in self._ticks.items() if ticks >= RIPE_OFFER]:
            self._post(queue)

    def flush(self) -> None:
        for queue in list(self._waiting):
            self._post(queue)

    def _post(self, queue: str) -> None:
        del self._ticks[queue]
        self.groups.append(self._waiting.pop(queue))
        self._sent.append(asyncio.ensure_future(self._send(queue, self.groups[-1])))

    async def answers(self) -> list[Any]:
        """Each sent offer's answer (see Scheduler._offer) or exception, in order."""
        return await asyncio.gather(*self._sent, return_exceptions=True)

    async def cancel(self) -> None:
        for sent in self._sent:
            sent.cancel()
        await asyncio.gather(*self._sent, return_exceptions=True)


class _StaleDecision(Exception):
    """A decision older than PLAN_MAX_AGE: it must not be offered any more."""


@dataclass
class _Decision:
    """One due schedule in a pass: what was decided and the offers that carry it out."""

    row: Row
    spec: ScheduleSpec
    plan: policy.Plan
    items: list[dict]  # TaskQueue.offer_many items, one per planned tick
    now: int  # the Redis time (ms) it was decided at

    def outcome(self) -> Outcome:
        plan = self.plan
        return Outcome(
            self.row.id, self.row.version, self.row.cursor_ms, plan.cursor_ms, plan.next_fire_ms,
            last_tick=plan.ticks[-1].at * 1000 if plan.ticks else None,
            task=self.items[-1]["task_id"] if self.items else "",
            materialized=len(plan.ticks), skipped=plan.skipped, coalesced=plan.coalesced,
            backfilled=plan.backfilled,
        )


def _earliest(report: TickReport, ms: int | None) -> None:
    if ms is None:
        return
    at = utc_from_ms(ms)
    if report.next_due is None or at < report.next_due:
        report.next_due = at
