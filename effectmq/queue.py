"""The engine: `TaskQueue` and `Lease`, the fenced-lease protocol over Redis.

Every state transition is one Lua script (see ``lua/``); this module validates
input, encodes it, calls the script and turns the reply into records or errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Iterable, Sequence

import redis.asyncio as aioredis

from . import codec, models, protocol, retry as retry_policies
from .errors import (
    CANCELED, DEFECT, STALLED, AlreadySettled, CorruptValue, ErrorInfo, InvalidOption, InvalidPayload, LeaseLost,
    TaskError, TaskFailed, TaskNotFound,
)
from .aio import cancel_and_wait
from .connection import OwnsConnection, RedisErrors, connect
from .keys import INDEXES, QueueKeys, check_queue_name
from .models import MaintenanceReport, Offered, QueueStats, TaskInfo
from .protocol import MAX_ACQUIRE, MAX_DELAY, MAX_MAINTAIN_BATCH, Outcome
from .scripts import ScriptRunner

# How long an explicit task id stays reserved after its record expired (lib.lua `forget`).
DEFAULT_DEDUP_WINDOW = 604_800.0
MAX_PRIORITY = 1000
MAX_ID_LENGTH = 512
# Settings a queue keeps in Redis so that producers, workers and the operator agree.
SETTINGS = {
    "paused": "paused",
    "max_active": "max_active",
    "max_retries": "max_retries",
    "max_stalled_count": "max_stalled_count",
    "lock_timeout": "lock_timeout_ms",
    "retention_completed": "retention_completed_ms",
    "retention_failed": "retention_failed_ms",
    "dedup_window": "dedup_window_ms",
    "events_maxlen": "events_maxlen",
    "retry": "retry",
}
_SECONDS_SETTINGS = {"lock_timeout", "retention_completed", "retention_failed", "dedup_window"}


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def _retention_ms(seconds: float | None) -> int:
    """Retention in ms for the scripts; None or a negative value keeps records forever."""
    return -1 if seconds is None or seconds < 0 else _ms(seconds)


def _check_number(name: str, value: Any, *, minimum: float = 0, integer: bool = False, allow_none=True,
                  maximum: float | None = None):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise InvalidOption(f"{name} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise InvalidOption(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise InvalidOption(f"{name} must be <= {maximum:g}, got {value!r}")
    return value


OFFER_WIDTH = 9  # ARGV values per task in offer.lua


def offer_argv(task_name: str, payload: Any, *, task_id: str | None = None, delay: float | None = None,
               priority: int = 0, max_retries: int | None = None, max_stalled_count: int | None = None,
               retry: Any = None, timeout: float | None = None) -> tuple[str, list]:
    """Validate one offer and encode it as the OFFER_WIDTH ARGV values offer.lua expects."""
    if not isinstance(task_name, str) or not task_name or len(task_name) > 200:
        raise InvalidOption(f"task name must be a non-empty string of at most 200 characters, got {task_name!r}")
    explicit = task_id is not None
    if explicit and (not isinstance(task_id, str) or not task_id or len(task_id) > MAX_ID_LENGTH):
        raise InvalidOption(f"task_id must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    _check_number("delay", delay, maximum=MAX_DELAY)
    _check_number("priority", priority, minimum=-MAX_PRIORITY, integer=True, allow_none=False)
    if priority > MAX_PRIORITY:
        raise InvalidOption(f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}")
    _check_number("max_retries", max_retries, integer=True)
    _check_number("max_stalled_count", max_stalled_count, integer=True)
    _check_number("timeout", timeout, minimum=0.001)
    options: dict[str, Any] = {}
    if retry is not None:
        options["retry"] = retry_policies.to_json(retry)
    if timeout is not None:
        options["timeout"] = timeout
    tid = task_id if explicit else uuid.uuid4().hex
    return tid, [
        tid, 1 if explicit else 0, task_name, codec.dumps(payload, f"payload of {task_name!r}"),
        _ms(delay or 0), priority,
        -1 if max_retries is None else max_retries,
        -1 if max_stalled_count is None else max_stalled_count,
        codec.dumps(options) if options else "",
    ]


def error_info(error: Any, declared: Sequence[type[BaseException]] = ()) -> tuple[ErrorInfo, bool]:
    """Turn what a handler raised (or a caller passed) into a stored error and retryability."""
    if isinstance(error, ErrorInfo):
        return error, True
    if isinstance(error, TaskError):
        return ErrorInfo(error.error_tag(), str(error), error.data), error.retryable
    if isinstance(error, BaseException):
        if declared and isinstance(error, tuple(declared)):
            return ErrorInfo(type(error).__name__, str(error)), True
        return ErrorInfo(DEFECT, f"{type(error).__name__}: {error}"), True
    if isinstance(error, str):
        return ErrorInfo(error), True
    if isinstance(error, dict) and "tag" in error:
        return ErrorInfo.from_json(error), True
    raise InvalidOption(f"fail() takes an exception, an ErrorInfo, a tag string or a dict with 'tag', got {error!r}")


def error_json(info: ErrorInfo) -> str:
    """The stored form of an error; data that is not JSON is kept as its repr, so a
    failure always settles."""
    try:
        return codec.dumps(info.to_json(), "error")
    except InvalidPayload:
        return codec.dumps(ErrorInfo(info.tag, info.message, repr(info.data), info.kind).to_json(), "error")


def retry_delay(policies: Sequence[Any], failures: int) -> tuple[float, str | None]:
    """The first delay among `policies` that is finite and in range; and, when the first
    policy raised or gave none, why (that failure then is a Defect of the attempt)."""
    problem = None
    for policy in policies:
        try:
            delay = float(policy(failures))
            if math.isfinite(delay) and 0 <= delay <= MAX_DELAY:
                return delay, problem
            problem = problem or f"retry policy returned an invalid delay {delay!r}"
        except Exception as exc:  # noqa: BLE001 - a user's policy may raise anything
            problem = problem or f"retry policy raised {type(exc).__name__}: {exc}"
    return float(retry_policies.DEFAULT_POLICY(failures)), problem


class Lease:
    """Ownership of one attempt of a task. Every write is fenced by `token`."""

    __slots__ = (
        "queue", "task_id", "token", "attempt", "name", "_raw_payload", "handler_failure_count",
        "stalled_attempt_count", "max_retries", "options", "priority", "deadline_ms",
        "confirmed_until", "lock_timeout", "requested_lock_timeout", "corrupt", "raw", "_wire_id",
    )

    def __init__(self, queue: "TaskQueue", fields: protocol.RawFields, deadline_ms: int, confirmed_until: float,
                 lock_timeout: float, requested_lock_timeout: float | None = None):
        v = fields.values
        self.queue = queue
        self.task_id = str(v["id"])
        self._wire_id = protocol.wire(self.task_id)
        self.token = str(v["token"])
        self.name = str(v["name"] or "")
        self.attempt = int(v["attempt"] or 0)
        self.handler_failure_count = int(v["handler_failure_count"] or 0)
        self.stalled_attempt_count = int(v["stalled_attempt_count"] or 0)
        self.max_retries = models._optional_int(v["max_retries"])
        self.priority = int(v["priority"] or 0)
        # Values that could not be read: the worker fails the attempt as a Defect.
        self.corrupt: dict[str, str] = {name: "not UTF-8" for name in fields.undecodable}
        self.raw = dict(fields.undecodable)
        self._raw_payload = fields.undecodable.get("payload", v["payload"])
        try:
            options = codec.loads(v["options"], "options") if "options" not in self.corrupt else {}
            if not isinstance(options, (dict, type(None))):
                raise CorruptValue(f"stored options are not a JSON object: {options!r}")
            self.options = options or {}
        except CorruptValue as exc:
            self.corrupt["options"] = str(exc)
            self.options = {}
        self.deadline_ms = deadline_ms
        # Local monotonic instant by which the lease is certainly still ours.
        self.confirmed_until = confirmed_until
        self.lock_timeout = lock_timeout  # the lease the server granted
        self.requested_lock_timeout = requested_lock_timeout or lock_timeout  # asked again on renewal

    @property
    def payload(self) -> Any:
        """The decoded payload; raises CorruptValue when the stored value is not UTF-8 JSON."""
        if isinstance(self._raw_payload, bytes):
            raise CorruptValue(f"stored payload of task {self.task_id!r} is not UTF-8")
        return codec.loads(self._raw_payload, f"payload of task {self.task_id!r}")

    @property
    def raw_payload(self) -> str | bytes | None:
        return self._raw_payload

    def __repr__(self) -> str:
        return f"Lease(task_id={self.task_id!r}, name={self.name!r}, attempt={self.attempt})"

    def _settled(self, operation: str, outcome: int, wanted: Sequence[Outcome]) -> Outcome:
        """The outcome a settling call got, or the error for a token that no longer owns the task."""
        outcome = Outcome(int(outcome))
        if outcome in wanted:
            return outcome
        if outcome is Outcome.LOST:
            raise LeaseLost(self.task_id, operation)
        raise AlreadySettled(self.task_id, operation, outcome.label)

    async def renew(self) -> None:
        """Extend the lease; raises LeaseLost when this attempt is no longer the owner."""
        owned = await self.queue._renew([self])
        if not owned[0]:
            raise LeaseLost(self.task_id, "renew")

    async def complete(self, result: Any = None) -> None:
        """Settle as completed. Sending it again (after a lost reply) is answered the same way."""
        outcome = (await self.queue.complete_many([(self, codec.dumps(result, "result"))]))[0]
        self._settled("complete", outcome, (Outcome.COMPLETED,))

    async def fail(self, error: Any, *, retryable: bool | None = None, retry: Any = None,
                   declared: Sequence[type[BaseException]] = ()) -> bool:
        """Record a typed failure. Returns True when a retry was scheduled.

        The next attempt's delay comes from `retry` (a handler's policy), else the
        task's own policy, else the queue's; `retryable=False` ends the task now. A
        policy that raises or gives no finite delay makes this failure a Defect (the
        queue's policy then decides the delay). Sent again, it gives the same answer.
        """
        q = self.queue
        info, can_retry = error_info(error, declared)
        if retryable is not None:
            can_retry = retryable
        delay = -1.0
        if can_retry:
            policy = retry or retry_policies.from_json(self.options.get("retry")) or q.retry_policy
            delay, problem = retry_delay((policy, q.retry_policy), self.handler_failure_count + 1)
            if problem:
                info = ErrorInfo(DEFECT, f"{problem} (after {info.tag}: {info.message})", kind=info.kind)
        argv = [self._wire_id, self.token, error_json(info), _ms(delay) if delay >= 0 else -1, q.max_retries,
                _retention_ms(q.retention_failed)]
        outcome, _failures, _retry_at = await q._call("fail", argv)
        return self._settled("fail", outcome, (Outcome.RETRY, Outcome.FAILED)) is Outcome.RETRY

    async def release(self, *, delay: float = 0) -> None:
        """Give the task back without counting a failure (shutdown, not my kind of task)."""
        _check_number("delay", delay, allow_none=False, maximum=MAX_DELAY)
        outcome = await self.queue._call("release", [self._wire_id, self.token, _ms(delay)])
        self._settled("release", outcome, (Outcome.RELEASED,))

    async def progress(self, value: Any) -> None:
        if await self.queue._call("progress", [self._wire_id, self.token, codec.dumps(value, "progress")]) == 0:
            raise LeaseLost(self.task_id, "progress")


class WakeSignal:
    """Set whenever the queue may have become ready (offer, release, resume, recovery).

    Subscribed before the first acquire, so an offer between an empty acquire and
    the wait is never missed; a lost subscription sets the event (caller re-checks).
    """

    def __init__(self, queue: "TaskQueue"):
        self.queue = queue
        self.event = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def start(self) -> "WakeSignal":
        self._task = asyncio.create_task(self._listen(), name=f"effectmq-wake-{self.queue.name}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5)
        return self

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            pubsub = self.queue.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.queue.keys.wake_channel)
                self._ready.set()
                backoff = 0.05
                async for _message in pubsub.listen():
                    self.event.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.event.set()  # we may have missed a signal: let the owner look
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)

    async def close(self, timeout: float = 2.0) -> None:
        if self._task:
            await cancel_and_wait([self._task], timeout)


class TaskQueue(OwnsConnection):
    """One named queue on Redis: offer, acquire under a lease, inspect, maintain."""

    def __init__(self, name: str, *, redis: aioredis.Redis | None = None, url: str | None = None,
                 prefix: str = "emq", lock_timeout: float = 30.0, max_retries: int = 3,
                 max_stalled_count: int = 1, retry: Any = None, retention_completed: float | None = 86400.0,
                 retention_failed: float | None = 604800.0, promote_batch: int = 100,
                 max_connections: int | None = None, socket_timeout: float = 15.0):
        self.name = check_queue_name(name)
        _check_number("lock_timeout", lock_timeout, minimum=0.01, allow_none=False)
        _check_number("max_retries", max_retries, integer=True, allow_none=False)
        _check_number("max_stalled_count", max_stalled_count, integer=True, allow_none=False)
        _check_number("promote_batch", promote_batch, minimum=1, integer=True, allow_none=False)
        self.keys = QueueKeys(prefix, self.name)
        self.redis, self._owns_client, self.url = connect(redis, url, max_connections=max_connections,
                                                          socket_timeout=socket_timeout)
        self.lock_timeout = float(lock_timeout)
        self.max_retries = max_retries
        self.max_stalled_count = max_stalled_count
        self.retry_policy = retry or retry_policies.DEFAULT_POLICY
        self.retention_completed = retention_completed
        self.retention_failed = retention_failed
        self.promote_batch = promote_batch
        self._scripts = ScriptRunner(self.redis, self.keys.script_keys)
        self._redis_errors = RedisErrors(self.redis, f"at {self.url} (queue {self.name!r})")
        self._token_prefix = secrets.token_hex(6)

    def __repr__(self) -> str:
        return f"TaskQueue({self.name!r})"

    async def _call(self, operation: str, argv: list) -> Any:
        with self._redis_errors:
            return await self._scripts(operation, argv)

    # -- producers ---------------------------------------------------------

    async def offer(self, task_name: str, payload: Any = None, *, task_id: str | None = None,
                    delay: float | None = None, priority: int = 0, max_retries: int | None = None,
                    max_stalled_count: int | None = None, retry: Any = None,
                    timeout: float | None = None) -> Offered:
        """Add a task. The same task_id twice gives created=False and leaves the task untouched."""
        tid, argv = offer_argv(task_name, payload, task_id=task_id, delay=delay, priority=priority,
                               max_retries=max_retries, max_stalled_count=max_stalled_count,
                               retry=retry, timeout=timeout)
        created = await self._call("offer", [1, *argv])
        return Offered(tid, bool(created[0]))

    async def offer_many(self, tasks: Iterable[Any]) -> list[Offered]:
        """Offer a batch. Items: (name, payload), (name, payload, options) or dicts
        {"name": ..., "payload": ..., **options}. All are validated before anything is sent.

        Each script call stores at most OFFER_CHUNK tasks, atomically; the chunks of up to
        OFFER_WINDOW * OFFER_CHUNK tasks travel in one round trip. If an error interrupts
        a batch, some chunks may be stored: offering the same ids again is safe (an
        existing id is left untouched), so give task_ids when a batch must be resent.
        """
        ids: list[str] = []
        argvs: list[list] = []
        chunk: list = []
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
                tid, one = offer_argv(name, payload, **options)
            except TypeError as exc:
                raise InvalidOption(f"invalid offer options {sorted(options)}: {exc}") from None
            ids.append(tid)
            chunk.extend(one)
            if len(chunk) == protocol.OFFER_CHUNK * OFFER_WIDTH:
                argvs.append([protocol.OFFER_CHUNK, *chunk])
                chunk = []
        if chunk:
            argvs.append([len(chunk) // OFFER_WIDTH, *chunk])
        created: list = []
        for i in range(0, len(argvs), protocol.OFFER_WINDOW):
            with self._redis_errors:
                for reply in await self._scripts.many("offer", argvs[i:i + protocol.OFFER_WINDOW]):
                    created.extend(reply)
        return [Offered(tid, bool(c)) for tid, c in zip(ids, created)]

    # -- workers -----------------------------------------------------------

    async def acquire(self, *, lock_timeout: float | None = None) -> Lease | None:
        """Lease the next ready task, or None when nothing is ready (or the queue is paused)."""
        leases, _ = await self.acquire_many(1, lock_timeout=lock_timeout)
        return leases[0] if leases else None

    async def acquire_many(self, count: int, *, lock_timeout: float | None = None) -> tuple[list[Lease], float | None]:
        """Lease up to `count` (at most MAX_ACQUIRE) ready tasks in one round trip.

        Returns the leases and the seconds until the next delayed task is due
        (None when there is none), so an idle worker knows how long it may sleep.
        Values are decoded per task: one that is not UTF-8 marks its lease `corrupt`.
        """
        _check_number("count", count, minimum=1, integer=True, allow_none=False)
        lt = self.lock_timeout if lock_timeout is None else lock_timeout
        _check_number("lock_timeout", lt, minimum=0.01, allow_none=False)
        sent = time.monotonic()
        argv = [min(count, MAX_ACQUIRE), _ms(lt), self._token_prefix, self.promote_batch]
        with self._redis_errors:
            reply = await self._scripts("acquire", argv, raw=True)
        now, deadline, next_due = int(reply[0]), int(reply[1]), int(reply[2])
        granted = (deadline - now) / 1000  # the server's lease length (queue settings win)
        width = protocol.LEASE_WIDTH
        leases = [
            Lease(self, protocol.decode_fields(protocol.LEASE_FIELDS, reply[i:i + width]), deadline,
                  sent + granted, granted, lt)
            for i in range(4, len(reply), width)
        ]
        return leases, (max(0.0, (next_due - now) / 1000) if next_due >= 0 else None)

    async def _renew(self, leases: Sequence[Lease]) -> list[bool]:
        """Renew many leases (one round trip per requested lease length); updates each
        lease's confirmed deadline and the length the server granted."""
        groups: dict[float, list[int]] = {}
        for i, lease in enumerate(leases):
            groups.setdefault(lease.requested_lock_timeout, []).append(i)
        owned = [False] * len(leases)
        for requested, members in groups.items():
            argv: list = [_ms(requested)]
            for i in members:
                argv += [leases[i]._wire_id, leases[i].token]
            sent = time.monotonic()
            reply = await self._call("renew", argv)
            now, deadline = int(reply[0]), int(reply[1])
            granted = (deadline - now) / 1000
            for i, ok in zip(members, reply[2:]):
                if ok:
                    lease = leases[i]
                    owned[i] = True
                    lease.deadline_ms = deadline
                    lease.confirmed_until = sent + granted
                    lease.lock_timeout = granted
        return owned

    async def complete_many(self, settled: Sequence[tuple[Lease, str]]) -> list[int]:
        """Complete many leases in one round trip; results already JSON-encoded.

        Returns one Outcome per lease: COMPLETED (also for a resent acknowledgement of
        the same token), LOST, or how that token settled before. Each token is checked
        on its own.
        """
        argv: list = [_retention_ms(self.retention_completed)]
        for lease, result_json in settled:
            argv += [lease._wire_id, lease.token, result_json]
        return [Outcome(int(code)) for code in await self._call("complete", argv)]

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

        Subscribes before reading the stored state, so a completion between the
        two is never missed.
        """
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            with self._redis_errors:
                await pubsub.subscribe(self.keys.done_channel(task_id))
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
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
                    await pubsub.get_message(timeout=min(remaining or 5.0, 5.0))
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def cancel(self, task_id: str) -> str | None:
        """Cancel a waiting, delayed or active task (an active attempt loses its lease).

        Returns the state the task was in, or None when there is no such task.
        """
        err = codec.dumps(ErrorInfo(CANCELED, "canceled by request", kind="cancel").to_json())
        was = await self._call("cancel", [task_id, err, _retention_ms(self.retention_failed)])
        return was or None

    async def retry(self, task_id: str) -> str | None:
        """Send a failed or canceled task back to waiting with fresh failure counters.

        Returns the state the task was in, or None when there is no such task.
        """
        return (await self._call("retry", [task_id])) or None

    async def configure(self, **settings: Any) -> None:
        """Write queue-level settings read by every producer, worker and script.

        Keys: paused, max_active, max_retries, max_stalled_count, lock_timeout,
        retention_completed, retention_failed, dedup_window, events_maxlen, retry.
        A value of None resets that setting to the default.
        """
        argv: list = []
        for key, value in settings.items():
            if key not in SETTINGS:
                raise InvalidOption(f"unknown queue setting {key!r}; known: {', '.join(SETTINGS)}")
            if value is None:
                encoded = ""
            elif key == "paused":
                encoded = "1" if value else "0"
            elif key == "retry":
                encoded = codec.dumps(retry_policies.to_json(value))
            elif key in _SECONDS_SETTINGS:
                _check_number(key, value, minimum=-1 if key.startswith("retention") else 0.001)
                encoded = str(_retention_ms(value) if key.startswith("retention") else _ms(value))
            else:
                _check_number(key, value, integer=True)
                encoded = str(value)
            argv += [SETTINGS[key], encoded]
        if argv:
            await self._call("configure", argv)

    async def settings(self) -> dict[str, Any]:
        """Queue-level settings currently stored in Redis (seconds for durations)."""
        with self._redis_errors:
            raw = await self.redis.hgetall(self.keys.key("meta"))
        out: dict[str, Any] = {}
        for key, field in SETTINGS.items():
            if field not in raw:
                continue
            value = raw[field]
            if key == "paused":
                out[key] = value == "1"
            elif key == "retry":
                out[key] = retry_policies.from_json(codec.loads(value, "retry setting"))
            elif key in _SECONDS_SETTINGS:
                out[key] = int(value) / 1000 if int(value) >= 0 else None
            else:
                out[key] = int(value)
        return out

    async def refresh_settings(self) -> dict[str, Any]:
        """Adopt the stored queue-level defaults (used by long-running workers)."""
        stored = await self.settings()
        for key in ("max_retries", "max_stalled_count", "lock_timeout", "retention_completed", "retention_failed"):
            if key in stored and stored[key] is not None:
                setattr(self, key, stored[key])
        if stored.get("retry"):
            self.retry_policy = stored["retry"]
        return stored

    async def pause(self) -> None:
        await self.configure(paused=True)

    async def resume(self) -> None:
        await self.configure(paused=False)

    async def stats(self) -> QueueStats:
        return models.parse_stats(self.name, await self._call("stats", []))

    async def maintain(self, *, batch: int = 100) -> MaintenanceReport:
        """One bounded pass: recover expired leases, promote due tasks, expire records."""
        _check_number("batch", batch, minimum=1, integer=True, allow_none=False, maximum=MAX_MAINTAIN_BATCH)
        err = codec.dumps(ErrorInfo(STALLED, "lease expired too many times", kind="stall").to_json())
        reply = await self._call("maintain", [batch, self.max_stalled_count, err,
                                              _retention_ms(self.retention_failed)])
        return models.parse_maintenance(reply)

    async def list_tasks(self, state: str, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        """Tasks in one state index, in index order (bounded by `limit`)."""
        if state not in INDEXES:
            raise InvalidOption(f"unknown state {state!r}; known: {', '.join(INDEXES)}")
        _check_number("limit", limit, minimum=1, integer=True, allow_none=False)
        with self._redis_errors:
            ids = await self.redis.zrange(self.keys.key(state), offset, offset + limit - 1)
            async with self.redis.pipeline(transaction=False) as pipe:
                for tid in ids:
                    pipe.execute_command("HGETALL", self.keys.task(tid), NEVER_DECODE=True)
                hashes = await pipe.execute()
        return [models.parse_task(tid, protocol.decode_hash(h)) for tid, h in zip(ids, hashes) if h]

    async def dead_letters(self, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        """Tasks that failed for good (handler failures past max_retries, stalls, defects)."""
        return await self.list_tasks("failed", limit=limit, offset=offset)

    async def events(self, *, since: str = "$", block: float = 5.0, count: int = 100) -> AsyncIterator[dict]:
        """Follow the lifecycle event stream (created, active, progress, completed, failed, ...)."""
        last = since
        while True:
            with self._redis_errors:
                reply = await self.redis.xread({self.keys.key("events"): last}, count=count, block=_ms(block))
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    yield {"event_id": entry_id, **fields}

    async def worker_beat(self, name: str, in_flight: int, concurrency: int, ttl: float) -> None:
        """Announce a worker's load (in_flight < 0: it is leaving)."""
        await self._call("workers", [name, in_flight, concurrency, _ms(ttl)])

    async def workers(self) -> dict[str, tuple[int, int]]:
        """Live workers of this queue: name -> (in_flight, concurrency)."""
        flat = await self._call("workers", ["", 0, 0, 0])
        return {flat[i]: (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)}

    async def ping(self) -> None:
        with self._redis_errors:
            await self.redis.ping()
