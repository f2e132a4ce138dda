"""Producers, inspection and administration: `TaskQueue`, one named queue on Redis.

Every state transition is one Lua script (see ``lua/``); this module validates
input, encodes it as the typed arguments of `protocol`, runs the script and turns
the reply into records or errors. The worker protocol (acquire, renew, settle) is
`engine.LeaseEngine`, reached through the same names on `TaskQueue` and `Lease`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
import unicodedata
import uuid
from typing import Any, AsyncIterator, Iterable, Sequence, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ..errors import CANCELED, STALLED, ErrorInfo, InvalidOption, NotReplicated, TaskFailed, TaskNotFound
from ..transport import redispy
from ..transport.clock import server_time_ms
from ..transport.connection import OwnsConnection, RedisErrors, client_settings, connect
from ..protocol import codec, protocol
from ..protocol.keys import INDEXES, QueueKeys, check_queue_name
from ..protocol.protocol import (MAX_ACQUIRE, MAX_COUNT, MAX_DELAY, MAX_DURATION, MAX_LIST,
                                 MAX_MAINTAIN_BATCH, MAX_PROMOTE_BATCH, ms, retention_ms)
from ..protocol.scripts import Confirmation
from ..protocol.routing import patience, script_runner, subscriber
from ..protocol.settings import BY_FIELD, META_FIELDS, STORED, Kind, QueueSettings, decode_rate, default
from . import models, retry as retry_policies, tracing
from .checks import check_below_socket_timeout, check_number
from .engine import Lease, LeaseEngine, WakeSignal
from .models import (GroupStats, MaintenanceReport, Offered, PodIdentity, QueueStats, TaskInfo, ThroughputPoint,
                     WorkerEnding)

# Importers (scheduler, tests) read these names here.
__all__ = ["TaskQueue", "Lease", "offer_argv", "DEFAULT_DEDUP_WINDOW", "MAX_ACQUIRE", "MAX_MAINTAIN_BATCH"]

# How long an explicit task id stays reserved after its record expired (lib.lua `forget`).
DEFAULT_DEDUP_WINDOW = default("dedup_window")
MAX_PRIORITY = 1000
MAX_ID_LENGTH = 512
MAX_GROUP_BYTES = 128  # a task group's name, in bytes of UTF-8
# The digits of a parked task's position in its backlog member (lua/includes/group_caps.lua).
PARKED_POSITION_DIGITS = 16
# Groups a groups() page lists at most.
MAX_GROUPS_PAGE = 1000
# The largest payload an offer takes, in bytes of its JSON (UTF-8), unless the TaskQueue
# says otherwise (max_payload_bytes; None: no cap). Every list and page that shows a task
# reads it back, so it is bounded like a stored error (protocol.MAX_ERROR_BYTES).
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20
MAX_PAYLOAD_CAP = 512 << 20  # Redis's own limit for one value (proto-max-bulk-len)
# Durable offers (replicas_to_confirm): the replicas WAIT may be asked for (more than any
# deployment runs), and how long it waits for them by default.
MAX_REPLICAS_TO_CONFIRM = 100
DEFAULT_CONFIRM_TIMEOUT = 2.0
# Settings a queue keeps in Redis so that producers, workers and the operator agree
# (settings.TABLE: names, kinds, defaults, bounds, meta fields).
SETTINGS = META_FIELDS
MAX_RETRY_FACTOR = 1000.0
# offer_many builds its answers in slices of this many, letting the event loop run between.
_ANSWER_SLICE = 10 * protocol.OFFER_CHUNK
# Indexes whose due members are task ids: maintain declares their hashes (lib.lua).
TASK_SWEEPS = ("active", "delayed", "completed", "failed", "canceled")
# Indexes maintain.lua sweeps by itself (their members touch no task hash).
OWN_SWEEPS = ("dedup", "settled", "waiters")
# Poison ids (the oldest) a maintain call that runs anyway also declares: one whose record
# was deleted by a script that does not touch the poison set (a completion kept for 0 s)
# leaves it then.
POISON_CHECKED = 2
# The history entry of a stall, and the error of a task that stalled past max_stalled_count
STALL_RETRIED = codec.dumps(ErrorInfo(STALLED, "lease expired; the task went back to waiting", kind="stall").to_json())
STALLED_TOO_OFTEN = codec.dumps(ErrorInfo(STALLED, "lease expired too many times", kind="stall").to_json())
# How long a registered waiter counts as waiting (wait() registers again after half of
# it); and how often wait() reads the state again without a message.
WAITER_TTL = 60.0
WAIT_RECHECK = 5.0
# How long one want_events() keeps lifecycle events written (events() asks again after
# half of it); how far task_events() looks back in the stream.
EVENTS_INTEREST = 60.0
EVENTS_SCAN = 10_000
MINUTE_SLOTS = 180  # lib.lua: the per-minute counts kept


def retry_json(policy: Any, name: str = "retry") -> dict | None:
    """The JSON form of a Fixed or Exponential policy, its delays bounded by MAX_DELAY
    (a longer one would make every failure a Defect, see engine.retry_delay)."""
    spec = retry_policies.to_json(policy)
    for key in ("initialDelaySeconds", "maxDelaySeconds"):
        if spec and key in spec:
            check_number(f"{name}.{key}", spec[key], maximum=MAX_DELAY, allow_none=False)
    if spec and "factor" in spec:
        check_number(f"{name}.factor", spec["factor"], minimum=1, maximum=MAX_RETRY_FACTOR, allow_none=False)
    return spec


def rate_limit_value(value: Any, name: str = "rate_limit") -> tuple[int, float] | None:
    """A rate limit as given (None, or (tasks, period seconds)) checked against the bounds of
    the table's rateLimit rows: (tasks, period) as stored."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise InvalidOption(f"{name} must be None or (tasks, period_seconds), got {value!r}")
    tasks, period = value
    rows = BY_FIELD["rateLimit.tasks"], BY_FIELD["rateLimit.periodSeconds"]
    check_number(f"{name} tasks", tasks, minimum=rows[0].minimum or 1, maximum=rows[0].maximum, integer=True,
                 allow_none=False)
    check_number(f"{name} period_seconds", period, minimum=rows[1].minimum or 0, maximum=rows[1].maximum,
                 allow_none=False)
    return tasks, float(period)


def _check_setting(key: str, value: Any, allow_none: bool = True) -> None:
    """A stored setting's value within its bounds (settings.TABLE)."""
    setting = STORED[key]
    if setting.kind is Kind.FLAG:
        return
    if setting.kind is Kind.RATE:
        rate_limit_value(value, key)
        return
    check_number(key, value, minimum=0 if setting.minimum is None else setting.minimum, maximum=setting.maximum,
                 allow_none=allow_none, integer=setting.kind is Kind.COUNT)


def offer_argv(task_name: str, payload: Any, *, task_id: str | None = None, delay: float | None = None,
               priority: int = 0, max_retries: int | None = None, max_stalled_count: int | None = None,
               retry: Any = None, timeout: float | None = None,
               max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
               trace: str = "", group: str | None = None) -> tuple[str, protocol.OfferTask]:
    """Validate one offer and encode it as the task record offer.lua expects; a payload
    whose JSON is longer than `max_payload_bytes` (None: no cap) is refused. `trace`: the
    task's creation context in its stored form (tracing.carrier), '' for none. `group`:
    the task's group (check_group), None for none."""
    if not isinstance(task_name, str) or not task_name or len(task_name) > 200:
        raise InvalidOption(f"task name must be a non-empty string of at most 200 characters, got {task_name!r}")
    check_utf8("task name", task_name)
    explicit = task_id is not None
    if explicit and (not isinstance(task_id, str) or not task_id or len(task_id) > MAX_ID_LENGTH):
        raise InvalidOption(f"task_id must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    if task_id is not None:
        check_utf8("task_id", task_id)
    check_number("delay", delay, maximum=MAX_DELAY)
    check_number("priority", priority, minimum=-MAX_PRIORITY, integer=True, allow_none=False)
    if priority > MAX_PRIORITY:
        raise InvalidOption(f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}")
    check_number("max_retries", max_retries, integer=True, maximum=MAX_COUNT)
    check_number("max_stalled_count", max_stalled_count, integer=True, maximum=MAX_COUNT)
    check_number("timeout", timeout, minimum=0.001, maximum=MAX_DURATION)
    if group is not None:
        check_group(group)
    options: dict[str, Any] = {}
    if retry is not None:
        options["retry"] = retry_json(retry)
    if timeout is not None:
        options["timeout"] = timeout
    encoded = codec.dumps(payload, f"payload of {task_name!r}")
    if max_payload_bytes is not None and len(encoded) > max_payload_bytes // 4:  # else it fits, even all 4-byte
        size = len(encoded) if encoded.isascii() else len(encoded.encode())
        if size > max_payload_bytes:
            raise InvalidOption(f"payload of {task_name!r} is {size:,} bytes of JSON; at most "
                                f"{codec.human_size(max_payload_bytes)} (max_payload_bytes)")
    tid = task_id if task_id is not None else uuid.uuid4().hex
    return tid, protocol.OfferTask(
        tid, 1 if explicit else 0, task_name, encoded,
        ms(delay or 0), priority,
        -1 if max_retries is None else max_retries,
        -1 if max_stalled_count is None else max_stalled_count,
        codec.dumps(options) if options else "",
        tracing.check_trace(trace),
        group or "",
    )


def parked_id(member: str) -> str:
    """The task id in a member of the backlog: group.."\0"..position (PARKED_POSITION_DIGITS)..id
    (a member that is not UTF-8 decoded with surrogateescape: its id names its key again)."""
    return member.split("\0", 1)[1][PARKED_POSITION_DIGITS:]


def check_utf8(what: str, text: str) -> None:
    """Refuse text that cannot be sent (a lone surrogate), before anything is."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise InvalidOption(f"{what} must be UTF-8 text, got {text!r}") from None


def check_group(group: Any) -> str:
    """A task group's name: 1 to MAX_GROUP_BYTES bytes of UTF-8 without control characters
    (it is a field name in Redis and a word in logs, never a metric label)."""
    if not isinstance(group, str) or not group:
        raise InvalidOption(f"group must be a non-empty string, got {group!r}")
    check_utf8("group", group)
    size = len(group.encode())
    if size > MAX_GROUP_BYTES:
        raise InvalidOption(f"group is {size} bytes of UTF-8; at most MAX_GROUP_BYTES = {MAX_GROUP_BYTES}")
    if any(unicodedata.category(c) == "Cc" for c in group):
        raise InvalidOption(f"group must not contain control characters, got {group!r}")
    return group


class TaskQueue(OwnsConnection):
    """One named queue on Redis: offer, acquire under a lease, inspect, maintain.

    replicas_to_confirm: durable offers. offer() and offer_many() return only once Redis
    WAIT counted at least this many replicas holding the tasks, waiting at most
    confirm_timeout seconds (below the socket timeout) per round trip, else raise
    NotReplicated (the tasks are stored on the primary; offering the same ids again is
    safe). Costs one replication round trip per offer call. 0 (default): the primary's
    reply is enough, as for every other write.
    """

    def __init__(self, name: str, *, redis: aioredis.Redis | None = None, url: str | None = None,
                 prefix: str = "emq", lock_timeout: float = default("lock_timeout"),
                 max_retries: int = default("max_retries"), max_stalled_count: int = default("max_stalled_count"),
                 replicas_to_confirm: int = 0, confirm_timeout: float = DEFAULT_CONFIRM_TIMEOUT,
                 retry: Any = None, retention_completed: float | None = default("retention_completed"),
                 retention_failed: float | None = default("retention_failed"), promote_batch: int = 100,
                 max_connections: int | None = None, socket_timeout: float = 15.0,
                 max_payload_bytes: int | None = DEFAULT_MAX_PAYLOAD_BYTES,
                 rate_limit: tuple[int, float] | None = None):
        """max_payload_bytes: the largest payload offer() and offer_many() take, in bytes
        of its JSON (default DEFAULT_MAX_PAYLOAD_BYTES, 1 MiB; None: no cap).
        rate_limit: (tasks, period_seconds): at most `tasks` attempts start in any window of
        `period_seconds`, by Redis time, across every worker (None: no limit). As with
        lock_timeout, a limit stored with configure(rate_limit=...) wins; this one applies to
        this process's acquire calls while none is stored."""
        self.name = check_queue_name(name)
        for key, value in (("lock_timeout", lock_timeout), ("max_retries", max_retries),
                           ("max_stalled_count", max_stalled_count)):
            _check_setting(key, value, allow_none=False)
        check_number("promote_batch", promote_batch, minimum=1, integer=True, allow_none=False,
                     maximum=MAX_PROMOTE_BATCH)
        _check_setting("retention_completed", retention_completed)
        _check_setting("retention_failed", retention_failed)
        check_number("max_connections", max_connections, minimum=1, integer=True, maximum=MAX_COUNT)
        check_number("socket_timeout", socket_timeout, minimum=0.001, maximum=MAX_DURATION)
        check_number("max_payload_bytes", max_payload_bytes, minimum=1, integer=True, maximum=MAX_PAYLOAD_CAP)
        check_number("replicas_to_confirm", replicas_to_confirm, integer=True, allow_none=False,
                     maximum=MAX_REPLICAS_TO_CONFIRM)
        check_number("confirm_timeout", confirm_timeout, minimum=0.001, allow_none=False, maximum=MAX_DURATION)
        if isinstance(retry, (retry_policies.Fixed, retry_policies.Exponential)):
            retry_json(retry)
        self.keys = QueueKeys(prefix, self.name)
        self.redis, self._owns_client, self.url = connect(redis, url, max_connections=max_connections,
                                                          socket_timeout=socket_timeout)
        # The stored settings this process acts on: one frozen value, replaced whole by refresh_settings().
        self.config = QueueSettings(lock_timeout=float(lock_timeout), max_retries=max_retries,
                                    max_stalled_count=max_stalled_count, retention_completed=retention_completed,
                                    retention_failed=retention_failed, retry=retry or retry_policies.DEFAULT_POLICY,
                                    rate_limit=rate_limit_value(rate_limit))
        self.promote_batch = promote_batch
        self.max_payload_bytes = max_payload_bytes
        self.replicas_to_confirm = replicas_to_confirm
        self.confirm_timeout = float(confirm_timeout)
        if replicas_to_confirm:
            check_below_socket_timeout("confirm_timeout", confirm_timeout,
                                       client_settings(self.redis).get("socket_timeout"))
        self._redis_errors = RedisErrors(self.redis, f"at {self.url} (queue {self.name!r})")
        self._scripts = script_runner(self.redis, self.keys.script_keys, self._redis_errors)
        self.engine = LeaseEngine(self, self._scripts)

    def __repr__(self) -> str:
        return f"TaskQueue({self.name!r})"

    # -- producers ---------------------------------------------------------

    async def offer(self, task_name: str, payload: Any = None, *, task_id: str | None = None,
                    delay: float | None = None, priority: int = 0, max_retries: int | None = None,
                    max_stalled_count: int | None = None, retry: Any = None,
                    timeout: float | None = None, group: str | None = None) -> Offered:
        """Add a task. The same task_id twice gives created=False and leaves the task untouched.
        `group` (a tenant, a customer): groups take turns at acquire (docs/concepts.md, Groups)."""
        tid, task = offer_argv(task_name, payload, task_id=task_id, delay=delay, priority=priority,
                               max_retries=max_retries, max_stalled_count=max_stalled_count,
                               retry=retry, timeout=timeout, max_payload_bytes=self.max_payload_bytes,
                               group=group)
        if (tracer := tracing.tracer()) is None:
            (reply,) = await self._send_offers([protocol.OfferArgs([task])])
        else:
            with tracing.sending(tracer, self.name, tid) as span:
                (reply,) = await self._send_offers([protocol.OfferArgs([task._replace(trace=tracing.carrier(span))])])
        if reply.created[0] and not task.delay_ms:
            self.engine.learn_ready([tid])  # this process may be the one to acquire it
        return Offered(tid, reply.created[0])

    async def offer_many(self, tasks: Iterable[Any]) -> list[Offered]:
        """Offer a batch. Items: (name, payload), (name, payload, options) or dicts
        {"name": ..., "payload": ..., **options}. All are validated before anything is sent.

        An explicit task_id given again later in the same batch is answered as a re-offer
        would be (created=False; that entry's name, payload and options are not used)
        and is not sent. Validation yields to the event loop after every OFFER_CHUNK
        items, so a large batch never holds up the caller's other coroutines for long.

        Each script call stores at most OFFER_CHUNK tasks, atomically; the chunks of up to
        OFFER_WINDOW * OFFER_CHUNK tasks travel in one round trip. If an error interrupts
        a batch, some chunks may be stored: offering the same ids again is safe (an
        existing id is left untouched), so give task_ids when a batch must be resent.

        Traced (a TracerProvider installed), the batch is one `send` span whose context
        each task carries, unless an item brings its own (option `trace`, as schedule
        ticks do): the span links to those.
        """
        if (tracer := tracing.tracer()) is None:
            return await self._offer_many(tasks, None)
        with tracing.sending(tracer, self.name) as span:
            return await self._offer_many(tasks, tracing.BatchSend(span))

    async def _offer_many(self, tasks: Iterable[Any], batch: tracing.BatchSend | None) -> list[Offered]:
        ids: list[str] = []
        sent: list[int] = []  # for each task sent, its place in the batch
        seen: set[str] = set()  # the ids sent so far: a repeat in the batch is not sent
        calls: list[protocol.OfferArgs] = []
        chunk: list[protocol.OfferTask] = []
        for item in tasks:
            if isinstance(item, dict):
                item = dict(item)
                name = item.pop("name", None) or item.pop("task_name", None)
                payload = item.pop("payload", None)
                options = item
            elif isinstance(item, (tuple, list)) and len(item) in (2, 3):
                name, payload = item[0], item[1]
                options = dict(item[2]) if len(item) == 3 else {}
            else:
                raise InvalidOption(f"offer_many items are (name, payload[, options]) or dicts, got {item!r}")
            try:
                tid, task = offer_argv(name, payload, **options, max_payload_bytes=self.max_payload_bytes)
            except TypeError as exc:
                raise InvalidOption(f"invalid offer options {sorted(options)}: {exc}") from None
            if batch is not None:
                task = batch.stamp(task)
            ids.append(tid)
            if tid in seen:
                continue
            seen.add(tid)
            sent.append(len(ids) - 1)
            chunk.append(task)
            if len(chunk) == protocol.OFFER_CHUNK:
                calls.append(protocol.OfferArgs(chunk))
                chunk = []
                await asyncio.sleep(0)  # let the loop run between chunks: a 200k offer_many must not block it
        if chunk:
            calls.append(protocol.OfferArgs(chunk))
        created: list[bool] = []
        first = calls[0].tasks if calls else ()
        windows = [calls[i:i + protocol.OFFER_WINDOW] for i in range(0, len(calls), protocol.OFFER_WINDOW)]
        calls.clear()  # each window is dropped once sent: fewer objects for the collector to walk
        windows.reverse()
        while windows:
            for reply in await self._send_offers(windows.pop()):
                created.extend(reply.created)
        self.engine.learn_ready([task.id for task, new in zip(first, created)
                                 if new and not task.delay_ms])  # the first chunk's: this process may acquire them
        answers = [False] * len(ids)
        for place, new in zip(sent, created):
            answers[place] = new
        if batch is not None:
            batch.sent(len(ids))
        offered: list[Offered] = []
        for start in range(0, len(ids), _ANSWER_SLICE):  # the loop runs between slices
            if start:
                await asyncio.sleep(0)
            offered.extend(Offered(tid, new) for tid, new in zip(ids[start:start + _ANSWER_SLICE],
                                                                 answers[start:start + _ANSWER_SLICE]))
        return offered

    async def _send_offers(self, calls: Sequence[protocol.OfferArgs]) -> list[protocol.OfferReply]:
        """Offer calls in one round trip; durable (replicas_to_confirm), WAIT follows them on
        their connection and too few replicas raise NotReplicated naming every task sent."""
        if not self.replicas_to_confirm:
            return await self._scripts.run_many(calls)
        confirm = Confirmation(self.replicas_to_confirm, ms(self.confirm_timeout), self.keys.write_probe)
        replies = await self._scripts.run_many(calls, confirm)
        if confirm.acknowledged < self.replicas_to_confirm:
            raise NotReplicated([str(task.id) for call in calls for task in call.tasks], confirm.acknowledged,
                                self.replicas_to_confirm, self.confirm_timeout)
        return replies

    # -- workers -----------------------------------------------------------

    async def acquire(self, *, lock_timeout: float | None = None) -> Lease | None:
        """Lease the next ready task, or None when nothing is ready (or the queue is paused)."""
        leases, _ = await self.acquire_many(1, lock_timeout=lock_timeout)
        return leases[0] if leases else None

    async def acquire_many(self, count: int, *, lock_timeout: float | None = None) -> tuple[list[Lease], float | None]:
        """Lease up to `count` (at most MAX_ACQUIRE) ready tasks, usually in one round
        trip (two when no ready ids are known yet: a script declares every task hash
        it touches, see `LeaseEngine.acquire_many`).

        Returns the leases and the seconds until the next delayed task is due, or the
        next group held back by its rate limit (None when there is none; 0 when ready
        tasks are known that other workers took first: look again now), so an idle worker
        knows how long it may sleep.
        Values are decoded per task: one that is not UTF-8 marks its lease `corrupt`.
        """
        _check_setting("lock_timeout", lock_timeout)
        return await self.engine.acquire_many(count, lock_timeout=lock_timeout)

    async def complete_many(self, settled: Sequence[tuple[Lease, str]]) -> list[protocol.Outcome]:
        """Complete many leases in one round trip; results already JSON-encoded.

        Returns one Outcome per lease: COMPLETED (also for a resent acknowledgement of
        the same token), LOST, or how that token settled before. Each token is checked
        on its own.
        """
        return await self.engine.complete_many(settled)

    def wake_signal(self) -> WakeSignal:
        return WakeSignal(self)

    # -- inspection and administration --------------------------------------

    async def get(self, task_id: str) -> TaskInfo | None:
        """The task's record; a stored value that cannot be read is reported in `corrupt`."""
        with self._redis_errors:
            flat = await self.redis.execute_command("HGETALL", self.keys.task(task_id), NEVER_DECODE=True)
        return models.parse_task(task_id, protocol.decode_hash(flat)) if flat else None

    async def wait(self, task_id: str, *, timeout: float | None = None) -> Any:
        """The task's result once it completed; raises TaskFailed, TaskNotFound or TimeoutError.

        A settlement publishes on the task's channel only while somebody is registered
        as waiting (the queue's waiters index; a PUBLISH reaches every node of a
        cluster). So: subscribe, register, then read the stored state; a settlement
        between any two of these is never missed.
        """
        pubsub = subscriber(self.redis, self.keys.done_channel(task_id))
        try:
            with self._redis_errors:
                await pubsub.subscribe(self.keys.done_channel(task_id))
                deadline = None if timeout is None else time.monotonic() + timeout
                registered = -WAITER_TTL
                while True:
                    if time.monotonic() - registered >= WAITER_TTL / 2:  # before it can run out
                        registered = time.monotonic()
                        await self._register_waiter(task_id)
                    info = await self.get(task_id)
                    if info is None:
                        raise TaskNotFound(f"task {task_id!r} not found in queue {self.name!r}")
                    if info.state == "completed":
                        return info.result
                    if info.state in ("failed", "canceled"):
                        raise TaskFailed(task_id, info.state, info.error)
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"task {task_id!r} still {info.state} after {timeout}s")
                    # A bounded wait doubles as a re-check if the subscription dropped.
                    await pubsub.get_message(timeout=min(remaining or WAIT_RECHECK, WAIT_RECHECK))
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _register_waiter(self, task_id: str) -> None:
        """Mark `task_id` as waited on until WAITER_TTL from now by Redis time (never
        shortened by another waiter); maintain removes the entries that ran out."""
        expiry = await server_time_ms(self.redis, self.keys.base) + ms(WAITER_TTL)
        await self.redis.zadd(self.keys.key("waiters"), {task_id: expiry}, gt=True)

    async def cancel(self, task_id: str) -> str | None:
        """Cancel a waiting, delayed or active task (an active attempt loses its lease).

        Returns the state the task was in, or None when there is no such task.
        """
        err = codec.dumps(ErrorInfo(CANCELED, "canceled by request", kind="cancel").to_json())
        reply = await self._scripts.run(protocol.CancelArgs(task_id, err, retention_ms(self.config.retention_failed),
                                                            secrets.token_hex(8)))
        return reply.previous_state

    async def retry(self, task_id: str) -> str | None:
        """Send a failed or canceled task back to waiting with fresh failure counters.

        Returns the state the task was in, or None when there is no such task.
        """
        return (await self._scripts.run(protocol.RetryArgs(task_id, secrets.token_hex(8)))).previous_state

    async def configure(self, **settings: Any) -> None:
        """Write queue-level settings read by every producer, worker and script.

        Keys: paused, max_active, rate_limit ((tasks, period_seconds): at most `tasks`
        attempts start in any window of `period_seconds`), max_retries, max_stalled_count,
        lock_timeout, retention_completed, retention_failed, dedup_window, events_maxlen, retry,
        events_always (write lifecycle events even while nobody reads them; by default
        they are written only while a reader asked within the last minute, see
        want_events), sensitive (payloads, results and progress are not shown by the
        dashboard). A value of None resets that setting to the default.
        """
        written: list[protocol.Setting] = []
        for key, value in settings.items():
            if key not in SETTINGS:
                raise InvalidOption(f"unknown queue setting {key!r}; known: {', '.join(SETTINGS)}")
            setting = STORED[key]
            if value is None:
                encoded = ""
            elif setting.kind is Kind.RETRY:
                encoded = codec.dumps(retry_json(value))
            else:
                _check_setting(key, value, allow_none=False)
                encoded = setting.encode(value)
            written.append(protocol.Setting(SETTINGS[key], encoded))
        more_room = False  # a larger queue-wide group cap or rate limit, or none: parked tasks may go back
        if "group_rate_limit" in settings:  # one in force changed (a lower one holds at the next pick)
            with self._redis_errors:
                more_room = await self.redis.hexists(self.keys.key("meta"), META_FIELDS["group_rate_limit"])
        if "group_max_active" in settings and not more_room:
            with self._redis_errors:
                before = int(await self.redis.hget(self.keys.key("meta"), META_FIELDS["group_max_active"]) or 0)
            after_cap = settings["group_max_active"] or 0
            more_room = before > 0 and (after_cap == 0 or after_cap > before)
        if written:
            await self._scripts.run(protocol.ConfigureArgs(written))
        after = b""
        while more_room:  # in calls of at most protocol.GROUP_HAND_BACK tasks
            after = (await self._scripts.run(protocol.ConfigureGroupArgs("", after=after))).more
            more_room = bool(after)

    async def settings(self) -> dict[str, Any]:
        """Queue-level settings currently stored in Redis (seconds for durations)."""
        with self._redis_errors:
            raw = await self.redis.hgetall(self.keys.key("meta"))
        out: dict[str, Any] = {key: False for key, s in STORED.items() if s.kind is Kind.FLAG and key != "paused"}
        for key, setting in STORED.items():
            if setting.redis not in raw:
                continue
            value = raw[setting.redis]
            if setting.kind is Kind.FLAG:
                out[key] = value == "1"
            elif setting.kind is Kind.RETRY:
                out[key] = retry_policies.from_json(codec.loads(value, "retry setting"))
            elif setting.kind in (Kind.SECONDS, Kind.RETENTION):
                out[key] = int(value) / 1000 if int(value) >= 0 else None
            elif setting.kind is Kind.RATE:
                out[key] = decode_rate(value)
            else:
                out[key] = int(value)
        return out

    async def refresh_settings(self) -> dict[str, Any]:
        """Adopt the stored queue-level defaults (used by long-running workers): `config`
        is replaced by one new value, never changed field by field."""
        stored = await self.settings()
        self.config = self.config.adopt(stored)
        return stored

    async def pause(self) -> None:
        await self.configure(paused=True)

    async def resume(self) -> None:
        await self.configure(paused=False)

    async def stats(self) -> QueueStats:
        r = await self._scripts.run(protocol.StatsArgs())
        oldest = 0.0
        if r.heads:  # each band's first waiting task waited longest in its band
            with self._redis_errors:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for task_id in r.heads:
                        pipe.hmget(self.keys.task(task_id), "state", "ready_at", "created_at")
                    heads = await pipe.execute()
            ready = [int(since) for state, *stamps in heads
                     if state == "waiting" and (since := models.ready_since_ms(*stamps))]
            if ready:
                oldest = max(0.0, (r.now - min(ready)) / 1000)
        return QueueStats(self.name, r.waiting, r.delayed, r.active, r.completed, r.failed, r.canceled, oldest,
                          r.paused, r.max_active,
                          rate_limit=(r.rate_tasks, r.rate_period_ms / 1000) if r.rate_tasks else None,
                          rate_window_starts=r.rate_started,
                          starts_held_for=max(0.0, (r.held_until - r.now) / 1000) if r.held_until >= 0 else 0.0,
                          parked=r.parked, group_caps=r.counting)

    async def hold_starts(self, seconds: float) -> float:
        """Start no task of this queue, on any worker, for `seconds` from now by Redis time
        (a downstream service answered 429 with Retry-After: a handler raises
        effectmq.RateLimited, which calls this). Attempts already running go on. A hold is
        only ever extended: a shorter one while a longer holds changes nothing. Returns the
        seconds until the hold in force ends. At most protocol.MAX_HOLD (a day)."""
        check_number("seconds", seconds, maximum=protocol.MAX_HOLD, allow_none=False)
        reply = await self._scripts.run(protocol.HoldArgs(ms(seconds)))
        return (reply.held_until - reply.now) / 1000

    async def group_stats(self, group: str) -> GroupStats:
        """One group's counts, cap, rate limit and pause (a group nobody configured and with
        nothing waiting, running or parked counts 0, under the queue's group_max_active and
        group_rate_limit)."""
        check_group(group)
        return (await self._group_stats([group]))[0]

    async def _group_stats(self, groups: Sequence[str]) -> list[GroupStats]:
        """The groups' stats read in one round trip (plain reads: lua/includes/group_caps.lua has the layout)."""
        ctl, backlog = self.keys.key("group_ctl"), self.keys.key("backlog")
        with self._redis_errors:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hmget(self.keys.key("meta"), META_FIELDS["group_max_active"], META_FIELDS["group_rate_limit"])
                for group in groups:
                    pipe.zscore(self.keys.key("groups"), group)
                    pipe.hmget(ctl, f"a:{group}", f"m:{group}", f"p:{group}", f"r:{group}")
                    pipe.zlexcount(backlog, f"[{group}\0", f"({group}\x01")
                (default, default_rate), *replies = await pipe.execute()
        out = []
        for n, group in enumerate(groups):
            waiting, (active, own, paused, own_rate), parked = replies[3 * n:3 * n + 3]
            cap = STORED["group_max_active"].clamp(int(own if own is not None else default or 0))
            out.append(GroupStats(group, int(waiting or 0), max(0, int(active or 0)), int(parked), int(cap),
                                  paused == "1", decode_rate(own_rate if own_rate is not None else default_rate)))
        return out

    async def groups(self, *, offset: int = 0, count: int = 100, busiest: bool = True) -> list[GroupStats]:
        """A page of the groups that have waiting tasks: the busiest first (else the least
        busy first), at most `count` (MAX_GROUPS_PAGE) from `offset` on."""
        check_number("offset", offset, integer=True, allow_none=False, maximum=MAX_COUNT)
        check_number("count", count, minimum=1, integer=True, allow_none=False, maximum=MAX_GROUPS_PAGE)
        with self._redis_errors:
            page = await self.redis.zrange(self.keys.key("groups"), offset, offset + count - 1, desc=busiest,
                                           withscores=True)
        names = [str(group) for group, _ in cast("list[tuple[str, float]]", page)]
        return await self._group_stats(names) if names else []

    async def parked_ids(self, group: str | None = None, *, limit: int = 100, offset: int = 0) -> list[str]:
        """The ids of parked tasks (held back by their group's cap, rate limit or pause, still in state
        waiting) in the backlog's order: by group name, each group's in the order they go
        back; `group`: that group's only. At most `limit` (MAX_LIST) from `offset` on."""
        check_number("limit", limit, minimum=1, integer=True, allow_none=False, maximum=MAX_LIST)
        check_number("offset", offset, minimum=0, integer=True, allow_none=False, maximum=MAX_COUNT)
        if group is None:
            command = ["ZRANGE", self.keys.key("backlog"), offset, offset + limit - 1]
        else:  # a group's members are a lex range (lua/includes/group_caps.lua has the layout)
            check_group(group)
            command = ["ZRANGE", self.keys.key("backlog"), f"[{group}\0", f"({group}\x01", "BYLEX", "LIMIT",
                       offset, limit]
        with self._redis_errors:  # undecoded: an id written by another client may not be UTF-8
            members: Any = await self.redis.execute_command(*command, NEVER_DECODE=True)
        return [parked_id(member.decode(errors="surrogateescape")) for member in members]

    async def parked_tasks(self, group: str | None = None, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        """The parked tasks of parked_ids, whole (a parked task says state waiting); the
        counts are QueueStats.parked and GroupStats.parked."""
        return await self._read_tasks(await self.parked_ids(group, limit=limit, offset=offset))

    async def configure_group(self, group: str, *, max_active: int | None = None,
                              rate_limit: tuple[int, float] | int | None = None) -> GroupStats:
        """Cap the attempts of `group` running at once, across every worker: max_active > 0 a
        cap, 0 no cap for this group, -1 back to the queue's group_max_active. Its tasks beyond
        the cap wait, parked (out of the waiting index: other groups run on), and go back as
        its attempts end; a cap raised or removed hands back as many as it allows at once.
        rate_limit: (tasks, period_seconds): at most `tasks` of its attempts start in any window
        of `period_seconds`, by Redis time (its tasks beyond wait parked, and go back when the
        window allows); 0 no limit for this group, -1 back to the queue's group_rate_limit.
        None leaves either unchanged. The queue's first cap, rate limit or pause starts the
        counting: attempts running then finish uncounted. Returns the group's stats after the change."""
        check_group(group)
        if max_active is None and rate_limit is None:
            raise InvalidOption("configure_group needs max_active or rate_limit")
        if max_active is not None:
            check_number("max_active", max_active, minimum=-1, integer=True, allow_none=False, maximum=MAX_COUNT)
        rate = ""
        if rate_limit in (0, -1) and not isinstance(rate_limit, bool):
            rate = str(rate_limit)
        elif rate_limit is not None:
            rate = STORED["group_rate_limit"].encode(rate_limit_value(rate_limit, "rate_limit"))
        return await self._control_group(group, max_active="" if max_active is None else str(max_active), rate=rate)

    async def pause_group(self, group: str) -> GroupStats:
        """Start no more tasks of `group` (its running attempts finish); other groups run on."""
        check_group(group)
        return await self._control_group(group, paused="1")

    async def resume_group(self, group: str) -> GroupStats:
        """Start tasks of `group` again: its parked tasks go back to waiting, as many as its cap allows."""
        check_group(group)
        return await self._control_group(group, paused="0")

    async def _control_group(self, group: str, *, max_active: str = "", paused: str = "",
                             rate: str = "") -> GroupStats:
        """One configure_group call, then more while it has parked tasks to hand back (each
        call hands back at most protocol.GROUP_HAND_BACK)."""
        reply = await self._scripts.run(protocol.ConfigureGroupArgs(group, max_active, paused, rate_limit=rate))
        while reply.more:
            reply = await self._scripts.run(protocol.ConfigureGroupArgs(group, after=reply.more))
        return GroupStats(group, reply.waiting, reply.active, reply.parked, reply.max_active, reply.paused,
                          (reply.rate_tasks, reply.rate_period_ms / 1000) if reply.rate_tasks else None)

    async def maintain(self, *, batch: int = 100) -> MaintenanceReport:
        """One bounded pass: recover expired leases, promote due tasks, expire records.

        The script may touch only the task hashes it declares, so the due ids are read
        first with plain commands, bounded by Redis time (at most `batch` per index);
        the script checks each again. Nothing due: no script call at all."""
        check_number("batch", batch, minimum=1, integer=True, allow_none=False, maximum=MAX_MAINTAIN_BATCH)
        async def read_due() -> list:
            now = await server_time_ms(self.redis, self.keys.base)
            async with self.redis.pipeline(transaction=False) as pipe:  # the due ids; of OWN_SWEEPS, whether any
                for index, most in [(i, batch) for i in TASK_SWEEPS] + [(i, 1) for i in OWN_SWEEPS]:
                    pipe.zrange(self.keys.key(index), "-inf", now, byscore=True, offset=0, num=most)
                pipe.zrange(self.keys.key("poison"), 0, POISON_CHECKED - 1)
                return await pipe.execute()

        with self._redis_errors:
            if isinstance(self.redis, RedisCluster):
                due = await redispy.riding_out_a_move(read_due, patience(self.redis, ()))
            else:
                due = await read_due()
            *due, poison = due
            if not any(due):
                return MaintenanceReport(0, 0, 0, 0, 0, False)
            candidates = [task_id for ids in due[:len(TASK_SWEEPS)] for task_id in ids]
            candidates += [task_id for task_id in poison if task_id not in candidates]
            cut_short = any(len(ids) == batch for ids in due[:len(TASK_SWEEPS)])
        config = self.config
        reply = await self._scripts.run(protocol.MaintainArgs(batch, config.max_stalled_count, STALLED_TOO_OFTEN,
                                                              retention_ms(config.retention_failed), STALL_RETRIED,
                                                              ms(config.lock_timeout), candidates=candidates))
        if reply.stalls and (tracer := tracing.tracer()) is not None:
            tracing.stalls_recovered(tracer, self.name, reply.stalls)
        causes: dict[str, int] = {}
        for stall in reply.stalls:
            causes[stall.cause] = causes.get(stall.cause, 0) + 1
        counts = {f.name: getattr(reply, f.name) for f in dataclasses.fields(MaintenanceReport)
                  if f.name != "stall_causes"}
        return MaintenanceReport(**{**counts, "more": reply.more or cut_short, "stall_causes": causes})

    async def sweep(self, *, batch: int = 100, budget: float = 1.0) -> MaintenanceReport:
        """maintain() again while a call reports more, until `budget` seconds have passed
        (the call in flight finishes): expired work is cleared as fast as it falls due,
        while every call stays bounded by `batch`. The reports summed; `more`: work is left."""
        check_number("budget", budget, minimum=0, allow_none=False, maximum=MAX_DURATION)
        deadline = time.monotonic() + budget
        report = await self.maintain(batch=batch)
        while report.more and time.monotonic() < deadline:
            report += await self.maintain(batch=batch)
        return report

    async def list_tasks(self, state: str, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        """Tasks in one state index, in index order (bounded by `limit`)."""
        if state not in INDEXES:
            raise InvalidOption(f"unknown state {state!r}; known: {', '.join(INDEXES)}")
        check_number("limit", limit, minimum=1, integer=True, allow_none=False, maximum=MAX_LIST)
        check_number("offset", offset, minimum=0, integer=True, allow_none=False, maximum=MAX_COUNT)
        with self._redis_errors:  # undecoded: an id written by another client may not be UTF-8
            ids: Any = await self.redis.execute_command("ZRANGE", self.keys.key(state), offset, offset + limit - 1,
                                                        NEVER_DECODE=True)
        return await self._read_tasks([tid.decode(errors="surrogateescape") for tid in ids])

    async def _read_tasks(self, ids: Sequence[str]) -> list[TaskInfo]:
        """The tasks' whole records, in one round trip; ids whose record is gone are left out."""
        if not ids:
            return []
        with self._redis_errors:
            async with self.redis.pipeline(transaction=False) as pipe:
                for tid in ids:
                    pipe.execute_command("HGETALL", protocol.wire(self.keys.task(tid)), NEVER_DECODE=True)
                hashes = await pipe.execute()
        return [models.parse_task(tid, protocol.decode_hash(h)) for tid, h in zip(ids, hashes) if h]

    async def dead_letters(self, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        """Tasks that failed for good (handler failures past max_retries, stalls, defects)."""
        return await self.list_tasks("failed", limit=limit, offset=offset)

    async def want_events(self) -> None:
        """Have lifecycle events written for the next minute (EVENTS_INTEREST). Events
        cost Redis work on every transition, so by default scripts write them only while
        some reader asks (events() does so by itself), or always with
        configure(events_always=True)."""
        with self._redis_errors:
            now = await server_time_ms(self.redis, self.keys.base)
            await self.redis.hset(self.keys.key("meta"), "events_until", now + ms(EVENTS_INTEREST))

    async def events(self, *, since: str = "$", block: float = 5.0, count: int = 100) -> AsyncIterator[dict]:
        """Follow the lifecycle event stream (created, active, progress, completed, failed, ...);
        events are written while this iterator runs (it calls want_events)."""
        check_number("count", count, minimum=1, integer=True, allow_none=False, maximum=MAX_LIST)
        check_number("block", block, minimum=0, allow_none=False, maximum=MAX_DURATION)
        last = since
        asked = 0.0
        while True:
            if time.monotonic() - asked > EVENTS_INTEREST / 2:
                await self.want_events()
                asked = time.monotonic()
            with self._redis_errors:
                reply: Any = await self.redis.xread({self.keys.key("events"): last}, count=count,
                                                    block=ms(min(block, EVENTS_INTEREST / 2)))
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    yield {"event_id": entry_id, **fields}

    async def task_events(self, task_id: str, *, limit: int = 200) -> list[dict]:
        """The lifecycle events of one task still in the event stream (it keeps the last
        events_maxlen of the queue, and only while events were wanted), oldest first."""
        check_number("limit", limit, minimum=0, integer=True, allow_none=False, maximum=MAX_LIST)
        found: list[dict] = []
        end, seen = "+", 0
        with self._redis_errors:
            while seen < EVENTS_SCAN and len(found) < limit:
                chunk: Any = await self.redis.xrevrange(self.keys.key("events"), max=end, min="-", count=1000)
                if not chunk:
                    break
                seen += len(chunk)
                found.extend({"event_id": entry_id, **fields} for entry_id, fields in chunk
                             if fields and fields.get("id") == task_id)
                end = "(" + str(chunk[-1][0])
        return list(reversed(found[:limit]))

    async def throughput(self, *, minutes: int = 60) -> list[ThroughputPoint]:
        """Tasks completed and failed for good per minute over the last `minutes` (at
        most 180), oldest first, one point per minute (the current one included)."""
        check_number("minutes", minutes, minimum=1, maximum=MINUTE_SLOTS, integer=True, allow_none=False)
        with self._redis_errors:
            now = await server_time_ms(self.redis, self.keys.base)
            counts: Any = await self.redis.hgetall(self.keys.key("minutes"))
        return models.throughput_points(counts, now // 60_000, minutes, MINUTE_SLOTS)

    async def worker_beat(self, name: str, in_flight: int, concurrency: int, ttl: float, *,
                          pod: PodIdentity | None = None) -> None:
        """Announce a worker's load (in_flight < 0: it is leaving). With its `pod`, also
        which pod this process's leases belong to (their token prefix): a stall of one of
        them then names the pod and how it ended (record_worker_ending)."""
        check_number("in_flight", in_flight, minimum=-1, integer=True, allow_none=False, maximum=MAX_COUNT)
        check_number("concurrency", concurrency, integer=True, allow_none=False, maximum=MAX_COUNT)
        check_number("ttl", ttl, minimum=0.001, allow_none=False, maximum=MAX_DURATION)
        if pod is None:
            await self._scripts.run(protocol.WorkersArgs(name, in_flight, concurrency, ms(ttl)))
            return
        if not isinstance(pod, PodIdentity):
            raise InvalidOption(f"pod must be a PodIdentity, got {type(pod).__name__}")
        await self._scripts.run(protocol.WorkersArgs(name, in_flight, concurrency, ms(ttl), self.engine.token_prefix,
                                                     pod.name, pod.uid, pod.node))

    # -- stall forensics (lua/includes/forensics.lua) ------------------------------

    async def record_worker_ending(self, ending: WorkerEnding) -> None:
        """Remember how a worker pod (or one run of its container) ended, for the stalls of
        attempts it held. Idempotent for the same (uid, finished_at_ms, cause). Bounded in
        Redis: at most ENDINGS_KEPT endings per pod, forgotten after an hour
        (FORENSICS_RETENTION_MS). An ending without finished_at_ms counts from when it is
        recorded (Redis time). A bad field raises InvalidOption and writes nothing."""
        if not isinstance(ending, WorkerEnding):
            raise InvalidOption(f"record_worker_ending takes a WorkerEnding, got {type(ending).__name__}")
        e = ending.checked()
        await self._scripts.run(protocol.WorkerEndingArgs(
            e.uid, e.pod, e.node, e.cause, "" if e.exit_code is None else str(e.exit_code), e.message,
            -1 if e.finished_at_ms is None else e.finished_at_ms))

    async def recent_stalls(self, window_seconds: int = 600) -> dict[str, int]:
        """Stalls recovered in the last `window_seconds` (Redis time, minute resolution: the
        current minute and those before it that the window reaches into; at most
        MINUTE_SLOTS minutes), by cause (only causes with a count > 0)."""
        check_number("window_seconds", window_seconds, minimum=1, maximum=MINUTE_SLOTS * 60, allow_none=False)
        minutes = max(1, -(-int(window_seconds) // 60))
        with self._redis_errors:
            now = await server_time_ms(self.redis, self.keys.base)
            current = now // 60_000
            names = [f"{cause}:{minute % MINUTE_SLOTS}" for minute in range(current - minutes + 1, current + 1)
                     for cause in ("m", *models.STALL_CAUSES)]
            values: Any = await self.redis.hmget(self.keys.key("stall_minutes"), names)
        return models.stall_counts(dict(zip(names, values)), current, minutes, MINUTE_SLOTS)

    async def poison_count(self) -> int:
        """How many ids the poison set holds (poison_tasks; some records may be gone)."""
        with self._redis_errors:
            return int(await self.redis.zcard(self.keys.key("poison")))

    async def poison_tasks(self, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        """Tasks whose attempts killed their worker's pod POISON_KILLS times or more (OOMKilled,
        evicted, an error exit, deleted, node lost), the most recent first. An id whose
        record is gone (deleted at once by a completion with retention 0) is left out."""
        check_number("limit", limit, minimum=1, integer=True, allow_none=False, maximum=MAX_LIST)
        check_number("offset", offset, minimum=0, integer=True, allow_none=False, maximum=MAX_COUNT)
        with self._redis_errors:
            ids: Any = await self.redis.zrevrange(self.keys.key("poison"), offset, offset + limit - 1)
            async with self.redis.pipeline(transaction=False) as pipe:
                for tid in ids:
                    pipe.execute_command("HGETALL", self.keys.task(tid), NEVER_DECODE=True)
                hashes = await pipe.execute()
        return [models.parse_task(tid, protocol.decode_hash(h)) for tid, h in zip(ids, hashes) if h]

    async def workers(self) -> dict[str, tuple[int, int]]:
        """Live workers of this queue: name -> (in_flight, concurrency)."""
        reply = await self._scripts.run(protocol.LiveWorkersArgs())
        return {w.name: (w.in_flight, w.concurrency) for w in reply.workers}

    async def ping(self) -> None:
        with self._redis_errors:
            await self.redis.ping()

    async def check_writes(self) -> None:
        """Raise RedisUnavailable when Redis refuses a write that may grow memory, as it
        refuses offers then: full at maxmemory (noeviction), a failing RDB save
        (MISCONF), a read-only replica, too few replicas. Reads, settlements and
        maintenance may still go through. Writes one key that expires within a minute."""
        with self._redis_errors:
            await self.redis.set(self.keys.write_probe, "1", px=60_000)

    async def eviction_policy(self) -> str | None:
        """Redis's maxmemory-policy, or None when Redis does not say (managed services often
        disable CONFIG)."""
        try:  # redis-py 5 to 8 answer {name: str}, RESP2 and RESP3 alike
            return (await self.redis.config_get("maxmemory-policy")).get("maxmemory-policy")
        except Exception:  # refused, renamed or not answered: nothing to tell
            return None
