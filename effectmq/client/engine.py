"""The worker side of the protocol: `Lease` and the engine that acquires, renews and
settles leases, plus the wake signal idle workers block on.

`TaskQueue` keeps the public names (`acquire`, `acquire_many`, `complete_many`) and
delegates here. Every script call goes through the queue's `ScriptRunner`, the one
place where redis-py's errors become `RedisUnavailable` or `RedisRefused`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import (
    DEFECT, AlreadySettled, CorruptValue, ErrorInfo, InvalidOption, LeaseLost, RedisRefused,
    RedisUnavailable, TaskError,
)
from ..transport.connection import RETRYABLE_REPLIES
from ..eventloop.aio import cancel_and_wait
from ..protocol import codec, protocol
from ..protocol.protocol import (ACQUIRE_PEEK, ACQUIRE_WINDOW, MAX_ACQUIRE, MAX_DELAY, AcquireStatus, Outcome, ms,
                                 retention_ms)
from ..protocol.routing import subscriber
from ..protocol.scripts import ScriptRunner
from ..protocol.settings import STORED
from . import models, retry as retry_policies
from .checks import check_number

if TYPE_CHECKING:
    from .queue import TaskQueue

log = logging.getLogger("effectmq")

# Calls one acquire_many makes at most: a first one that only learns which ids are ready,
# and more while other workers took the ids it declared.
ACQUIRE_ROUNDS = 4
# Acquire calls whose reply was lost, remembered until a reclaim gets through (the oldest
# beyond this are forgotten: their leases stall, as they all did before reclaim).
LOST_CALLS = 64
RECLAIM_AT_ONCE = 1.0  # seconds: the reclaim right after a lost call waits no longer (else: the next call's)
# Ids a wake message says wait ahead of those named (a group's tasks: lua/includes/groups.lua
# FRONT_WAKE_IDS) that a process keeps to declare first.
MAX_FIRST = 64
# A task is handed back without a stall this many times per process at most: a task whose
# lease never reaches this process (a reply too large to arrive in time, a caller that
# always gives up first) then stalls, and max_stalled_count ends it, as it did before.
RECLAIMS_PER_TASK = 3
RECLAIMS_REMEMBERED = 4096  # task ids counted for RECLAIMS_PER_TASK (the least recent forgotten)
RATE_LIMIT = STORED["rate_limit"]


def may_have_run(exc: BaseException) -> bool:
    """Whether an acquire call that raised `exc` may have leased tasks nobody got: after a
    lost connection, a timeout or a cancellation the script may have run, and Redis keeps
    what a script wrote before it failed (runtime rule 7 makes that nothing; reclaiming
    after a script error costs one call on a path that is rare). Not after an error reply
    that refuses a call before it runs (OOM, BUSY, TRYAGAIN, ...), nor after a reply that
    came but could not be read: those leases stall and count, so a record that breaks the
    reader is not handed back and leased again for ever."""
    if isinstance(exc, RedisUnavailable):
        return exc.code not in RETRYABLE_REPLIES
    return isinstance(exc, (RedisRefused, TimeoutError, asyncio.CancelledError))


def call_prefix(token: str) -> str:
    """The token prefix of the acquire call that minted `token` (prefix:seq)."""
    return token.rpartition(":")[0]


LEAD = object()  # what an _Ask's future is given when its caller is to make the next call


class LookAgainNow(float):
    """acquire_many's hint, in place of the seconds until the next delayed task is due, to
    a caller given fewer leases than it asked for while ready tasks were known (other
    callers took them first): look again now, do not sleep. A float (0 s), so a caller
    that only sleeps until the next due task reads it as it reads those seconds."""

    def __new__(cls) -> "LookAgainNow":
        return super().__new__(cls, 0.0)

    def __repr__(self) -> str:
        return "LOOK_AGAIN_NOW"


LOOK_AGAIN_NOW = LookAgainNow()


class RateLimitedFor(float):
    """acquire_many's hint, in place of the seconds until the next delayed task is due, when
    the queue's rate limit allows no start now or its starts are held (acquire answered
    rate_limited): the seconds until the next start is allowed, by Redis time. Nothing
    offered meanwhile can start sooner, so a worker sleeps that long without listening for
    wake signals (a herd of idle workers would only be told no)."""

    def __repr__(self) -> str:
        return f"RateLimitedFor({float(self)})"


class _Ask:
    """One acquire_many caller's share of a call made for several (LeaseEngine.acquire_many)."""

    __slots__ = ("count", "lock_timeout", "future", "again")

    def __init__(self, count: int, lock_timeout: float):
        self.count = count
        self.lock_timeout = lock_timeout
        self.again = False  # given nothing once while ready tasks were known: in the next call too
        self.wait()

    def wait(self) -> None:
        # (leases, next_due) once served, LEAD when its caller makes the next call
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


def error_info(error: Any, declared: Sequence[type[BaseException]] = ()) -> tuple[ErrorInfo, bool]:
    """Turn what a handler raised (or a caller passed) into a stored error and retryability.
    Whatever a handler raised becomes an ErrorInfo: a __str__ that raises is described instead."""
    if isinstance(error, ErrorInfo):
        return error, True
    if isinstance(error, TaskError):
        try:
            tag = error.error_tag()
        except Exception:  # a subclass may override it badly
            tag = type(error).__name__
        return ErrorInfo(tag, codec.text(error), getattr(error, "data", None)), error.retryable
    if isinstance(error, BaseException):
        if declared and isinstance(error, tuple(declared)):
            return ErrorInfo(type(error).__name__, codec.text(error)), True
        return ErrorInfo(DEFECT, f"{type(error).__name__}: {codec.text(error)}"), True
    if isinstance(error, str):
        return ErrorInfo(error), True
    if isinstance(error, dict) and "tag" in error:
        return ErrorInfo.from_json(error), True
    raise InvalidOption(f"fail() takes an exception, an ErrorInfo, a tag string or a dict with 'tag', got {error!r}")


def error_json(info: ErrorInfo) -> str:
    """The stored form of an error. Never raises, so a handler failure always settles as
    one, and gives JSON that Redis's Lua cjson reads and writes back unchanged, at most
    protocol.MAX_ERROR_BYTES (1 MiB, as fail.lua keeps it):

    - tag, message and kind are text: anything else is str()-ed, a lone surrogate is kept
      as its escape (\\udcXX), a tag longer than MAX_ERROR_TAG characters is cut ("...").
    - data is kept when it is plain JSON, at most MAX_ERROR_DEPTH (32) levels deep, its
      integers within +-2**53, its floats finite, at most MAX_ERROR_DATA_BYTES (512 KiB)
      of JSON. Else it becomes the placeholder string
      "~unstorable: <why>; was <a short preview>" (errors.UNSTORABLE; ErrorInfo.unstorable
      reads it back), e.g. "~unstorable: nested deeper than 32 levels; was [[[[[[...]]]]]]".
    - a message that does not fit in what is left of MAX_ERROR_BYTES is cut and ends
      " ... [truncated from <n> bytes: a stored error is at most 1 MiB]".
    """
    try:
        tag = codec.text(info.tag)
        if len(tag) > protocol.MAX_ERROR_TAG:
            tag = tag[:protocol.MAX_ERROR_TAG - 3] + "..."
        kind = codec.text(info.kind)[:protocol.MAX_ERROR_TAG]
        message = codec.text(info.message)
        out: dict[str, Any] = {"tag": tag, "message": "", "kind": kind}
        if info.data is not None:
            out["data"], _ = codec.storable(info.data, max_depth=protocol.MAX_ERROR_DEPTH,
                                            max_int=protocol.MAX_JSON_INT, max_bytes=protocol.MAX_ERROR_DATA_BYTES)
        room = protocol.MAX_ERROR_BYTES - len(codec.dumps(out, "error").encode())
        out["message"] = codec.fitted(message, room, f"a stored error is at most "
                                                     f"{codec.human_size(protocol.MAX_ERROR_BYTES)}")
        return codec.dumps(out, "error")
    except Exception:  # each part above is made safe: this is the last resort
        tag = info.tag if isinstance(info.tag, str) and info.tag.isascii() else DEFECT
        return json.dumps({"tag": tag[:protocol.MAX_ERROR_TAG], "message": "the error could not be stored",
                           "kind": "handler"})


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
        except Exception as exc:  # a user's policy may raise anything
            problem = problem or f"retry policy raised {type(exc).__name__}: {exc}"
    return float(retry_policies.DEFAULT_POLICY(failures)), problem


class Lease:
    """Ownership of one attempt of a task. Every write is fenced by `token`."""

    __slots__ = (
        "queue", "engine", "task_id", "token", "attempt", "name", "_raw_payload", "handler_failure_count",
        "stalled_attempt_count", "max_retries", "options", "priority", "deadline_ms",
        "confirmed_until", "lock_timeout", "requested_lock_timeout", "corrupt", "raw", "_wire_id", "_receipts",
        "trace", "retry_at_ms",
    )

    def __init__(self, engine: "LeaseEngine", fields: protocol.RawFields, deadline_ms: int, confirmed_until: float,
                 lock_timeout: float, requested_lock_timeout: float | None = None):
        v = fields.values
        self.engine = engine
        self.queue = engine.queue
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
        self.corrupt: dict[str, str] = {name: "not UTF-8" for name in fields.undecodable if name != "trace"}
        self.raw = dict(fields.undecodable)
        self._raw_payload = fields.undecodable.get("payload", v["payload"])
        try:
            stored = v["options"]
            no_options = stored in (None, "", "{}") or "options" in self.corrupt
            options = None if no_options else codec.loads(stored, "options")
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
        self._receipts: tuple[str, ...] = ()  # the calls that carried its completion (LeaseEngine.receipt)
        # The task's creation context (client/tracing.py); one that cannot be read is only lost.
        self.trace: str | None = None if "trace" in fields.undecodable else v.get("trace")
        self.retry_at_ms = -1  # Redis time of the retry a failure scheduled (fail)

    @property
    def payload(self) -> Any:
        """The decoded payload; raises CorruptValue when the stored value is not UTF-8 JSON."""
        if isinstance(self._raw_payload, bytes):
            raise CorruptValue(f"stored payload of task {self.task_id!r} is not UTF-8")
        return codec.loads(self._raw_payload, f"payload of task {self.task_id!r}")

    @property
    def raw_payload(self) -> str | bytes | None:
        return self._raw_payload

    @property
    def ref(self) -> protocol.LeaseRef:
        return protocol.LeaseRef(self._wire_id, self.token)

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
        owned = await self.engine.renew([self])
        if not owned[0]:
            raise LeaseLost(self.task_id, "renew")

    async def complete(self, result: Any = None) -> None:
        """Settle as completed. Sending it again (after a lost reply) is answered the same way."""
        outcome = (await self.engine.complete_many([(self, codec.dumps(result, "result"))]))[0]
        self._settled("complete", outcome, (Outcome.COMPLETED,))

    async def fail(self, error: Any, *, retryable: bool | None = None, retry: Any = None,
                   declared: Sequence[type[BaseException]] = ()) -> bool:
        """Record a typed failure. Returns True when a retry was scheduled.

        The next attempt's delay comes from `retry` (a handler's policy), else the
        task's own policy, else the queue's; `retryable=False` ends the task now. A
        policy that raises or gives no finite delay makes this failure a Defect (the
        queue's policy then decides the delay). Sent again, it gives the same answer.
        """
        outcome = await self.engine.fail(self, error, retryable=retryable, retry=retry, declared=declared)
        return self._settled("fail", outcome, (Outcome.RETRY, Outcome.FAILED)) is Outcome.RETRY

    async def release(self, *, delay: float = 0, ran: bool = True) -> None:
        """Give the task back without counting a failure (shutdown, not my kind of task).
        `ran=False`: its handler never started (a lease taken ahead): not an attempt, so
        the task's attempt number goes back and its history gets no entry."""
        self._settled("release", await self.engine.release(self, delay, ran), (Outcome.RELEASED,))

    async def progress(self, value: Any) -> None:
        if not await self.engine.progress(self, value):
            raise LeaseLost(self.task_id, "progress")


class LeaseEngine:
    """Acquire, renew and settle leases of one queue (internal: reached through
    `TaskQueue.engine` and `Lease.engine`). The queue's settings (`TaskQueue.config`,
    replaced whole by `refresh_settings`) decide the lease length, retries and retention."""

    def __init__(self, queue: "TaskQueue", scripts: ScriptRunner):
        self.queue = queue
        self.scripts = scripts
        self.token_prefix = secrets.token_hex(6)  # unique per process; each acquire call's tokens are prefix.n:seq
        self._call_seq = itertools.count(1)
        # (call prefix, declared ids) of acquire calls that may have leased tasks nobody
        # got (their reply was lost): `reclaim_lost` hands those back.
        self._lost: collections.deque[tuple[str, tuple[str | bytes, ...]]] = collections.deque(maxlen=LOST_CALLS)
        self._reclaims: collections.OrderedDict[str | bytes, int] = collections.OrderedDict()  # per task id
        # What the last acquire reply named: the next call declares these as candidates.
        self._ready: list[bytes] = []
        # Of those, the ids a wake message said wait ahead of the ids named so far (a
        # group's tasks, learn_ready(first=True)): they stay first until declared, at most
        # MAX_FIRST beside the others.
        self._first: set[bytes] = set()
        self._due: list[bytes] = []
        self._largest = 1  # the most leases one call asked for: the next call may ask as many
        # One acquire at a time per process: each starts from the ids the last one learnt,
        # and this process's callers never compete for them.
        self._acquiring = asyncio.Lock()
        # acquire_many callers waiting for the next call (oldest first), and whether one of
        # them (the leader) is making a call: those who come meanwhile share the next one.
        self._asks: collections.deque[_Ask] = collections.deque()
        self._leading = False
        self._receipt_seq = itertools.count(1)

    def receipt(self, settled: Sequence[tuple[Lease, str]]) -> tuple[str, str]:
        """A new receipt id for a call that carries these completions, and the receipts of
        the earlier calls that carried any of them (space-separated): where a resend finds
        the completions a call whose reply was lost made (lib.lua's use_receipts)."""
        receipt = f"{self.token_prefix}-{next(self._receipt_seq)}"
        earlier: list[str] = []
        for lease, _ in settled:
            if lease._receipts:
                earlier += [r for r in lease._receipts if r not in earlier]
            lease._receipts += (receipt,)
        return receipt, " ".join(earlier)

    async def acquire_many(self, count: int, *, lock_timeout: float | None = None) -> tuple[list[Lease], float | None]:
        """Lease up to `count` ready tasks, in two phases. A script may touch only the task
        hashes it declares (Redis Cluster routes on them), so a call cannot read the head
        of waiting and lease it at once: each call leases among the ids it declares (ids
        an earlier reply named, `learn_ready`'s, due delayed ones) and names the next ones
        for the next call; a call that knows none only learns them (`_acquire_rounds`).

        What it keeps, the head-of-line property (acquire.lua; test_acquire_order.py):
        a call's leases are in head order (priority, then FIFO), all in the head's
        priority band and among the first `window` waiting tasks (ACQUIRE_WINDOW times
        the ids named per call), and a call leases nothing without the head, the oldest
        waiting task of the highest priority, unless a reply named the head to some
        caller (it comes no later than the last id named, and was waiting then): that
        caller may be about to lease it, and the others go on with the tasks after it.
        So no lease passes a task of higher priority, or one further than `window` from
        the head, and the head waits only while a caller was told of it.

        Returns the leases and the seconds until the next delayed task is due (None:
        none), or LOOK_AGAIN_NOW when ready tasks were known but others took them."""
        check_number("count", count, minimum=1, integer=True, allow_none=False)
        lt = self.queue.config.lock_timeout if lock_timeout is None else lock_timeout
        check_number("lock_timeout", lt, minimum=0.01, allow_none=False)
        # Callers of one process take turns (one call at a time), and those who come while
        # a call is out share the next one: one script call for all of them, not one each.
        ask = _Ask(min(count, MAX_ACQUIRE), lt)
        self._asks.append(ask)
        if not self._leading:
            self._leading = True
            served = await self._lead(ask)
        else:
            served = await self._wait_for_turn(ask)
        while served is None:  # given nothing while ready tasks were known: in the next call too
            served = await self._wait_for_turn(ask)
        return served

    async def _wait_for_turn(self, ask: _Ask) -> tuple[list[Lease], float | None] | None:
        """Wait in line: served by another caller's call, or make the next call (None: in
        line again)."""
        try:
            served = await ask.future
        except asyncio.CancelledError:
            self._withdraw(ask)
            raise
        return await self._lead(ask) if served is LEAD else served

    async def _lead(self, ask: _Ask) -> tuple[list[Lease], float | None] | None:
        """Make one call for `ask` (first in line) and the asks after it with the same lease
        length (within MAX_ACQUIRE), give each its share in order, and hand the next call
        to the first ask in line. An ask given nothing while ready tasks were known goes
        back first in line, once (None when it is `ask`'s own)."""
        group: list[_Ask] = []
        passed: list[_Ask] = []
        total = 0
        while self._asks:
            other = self._asks.popleft()
            if other.future.cancelled():
                continue
            if other.lock_timeout == ask.lock_timeout and total + other.count <= MAX_ACQUIRE:
                group.append(other)
                total += other.count
            else:
                passed.append(other)
        self._asks.extendleft(reversed(passed))
        try:
            async with self._acquiring:
                leases, next_due = await self._acquire_rounds(total, ask.lock_timeout)
        except asyncio.CancelledError:
            # The leader's caller is cancelled, not the others: they wait for the next call.
            self._asks.extendleft(reversed([other for other in group if other is not ask]))
            self._pass_lead()
            raise
        except Exception as exc:
            for other in group:
                if other is not ask and not other.future.done():
                    other.future.set_exception(exc)
            self._pass_lead()
            raise
        mine: tuple[list[Lease], float | None] | None = None
        again: list[_Ask] = []
        for other in group:
            share, leases = leases[:other.count], leases[other.count:]
            if other is not ask and other.future.done():  # cancelled meanwhile: nobody has these
                self._forget_leases(share)
            elif not share and isinstance(next_due, LookAgainNow) and not other.again:
                other.again = True
                if other is ask:
                    ask.wait()
                again.append(other)
            elif other is ask:
                mine = share, next_due
            else:
                other.future.set_result((share, next_due))
        self._asks.extendleft(reversed(again))
        self._pass_lead()
        return mine

    def _pass_lead(self) -> None:
        """The first ask in line makes the next call; none: the next caller does."""
        while self._asks:
            if not self._asks[0].future.done():
                self._asks[0].future.set_result(LEAD)  # it stays first in line
                return
            self._asks.popleft()  # cancelled
        self._leading = False

    def _withdraw(self, ask: _Ask) -> None:
        """A waiting caller was cancelled: its share of a call goes back, and so does the lead."""
        future = ask.future
        if future.done() and not future.cancelled() and future.exception() is None:
            served = future.result()
            if served is LEAD:
                if ask in self._asks:
                    self._asks.remove(ask)
                self._pass_lead()
            else:
                self._forget_leases(served[0])  # served as it was cancelled: nobody runs them
        elif ask in self._asks:
            self._asks.remove(ask)

    async def complete_and_acquire(self, settled: Sequence[tuple[Lease, str]], count: int, *,
                                   lock_timeout: float | None = None) -> tuple[list[Outcome], list[Lease]]:
        """Complete finished attempts (as complete_many) and lease up to `count` more, in
        one call: a busy worker's steady state, one round trip and one script per batch.
        A lost reply is as for both: the completions may be sent again (their receipts
        find how they settled), the leases are handed back (`reclaim_lost`)."""
        check_number("count", count, minimum=0, integer=True, allow_none=False)
        lt = self.queue.config.lock_timeout if lock_timeout is None else lock_timeout
        completions = [protocol.Completion(lease._wire_id, lease.token, result_json) for lease, result_json in settled]
        async with self._acquiring:
            self._largest = max(self._largest, count)
            receipt = self.receipt(settled) if settled else ("", "")
            reply, leases = await self._acquire_once(min(count, MAX_ACQUIRE), lt, completions, receipt)
        return list(reply.outcomes), leases

    async def _acquire_once(self, want: int, lt: float,
                            completions: Sequence[protocol.Completion] = (),
                            receipt: tuple[str, str] = ("", "")) -> tuple[protocol.AcquireReply, list[Lease]]:
        """One acquire call: declare the ids known (the first `want` and a half more, then
        the due ones), lease among them, and keep the ids its reply names for the next
        call. A call whose reply is lost may have leased some of them: handed back."""
        if self._lost:  # leases of a call whose reply was lost: back to the queue first
            with contextlib.suppress(RedisUnavailable):  # kept for the next call; this one may still work
                await self.reclaim_lost()
        peek = self._peek()
        # Some spare: the script leases the first still waiting, so ids another
        # process took meanwhile cost no call (a short reply splits a worker's slots
        # into waves that each cost a call). Twice as many cost more than they save.
        candidates = self._ready[:want + (want + 1) // 2] + self._due if want else []
        prefix = f"{self.token_prefix}.{next(self._call_seq)}"  # this call's tokens: reclaim finds them by it
        sent = time.monotonic()
        try:
            reply = await self.scripts.run(protocol.AcquireArgs(
                want, ms(lt), prefix, self.queue.promote_batch, window=ACQUIRE_WINDOW * peek, peek=peek,
                candidates=candidates, retention_ms=retention_ms(self.queue.config.retention_completed),
                receipt=receipt[0], resent=receipt[1], rate_limit=self._rate_limit(), completions=completions))
            granted = reply.granted
            leases = [Lease(self, fields, reply.deadline, sent + granted, granted, lt) for fields in reply.leases]
        except BaseException as exc:
            if not (candidates and may_have_run(exc)):
                raise
            # Redis may have leased some of the candidates to this call, and nobody has
            # them: hand them back now (a cancelled call cannot wait: the next call does).
            self._lose(prefix, candidates)
            if self._lost and not isinstance(exc, asyncio.CancelledError):
                with contextlib.suppress(Exception):  # the call's own error is the one to raise
                    async with asyncio.timeout(RECLAIM_AT_ONCE):
                        await self.reclaim_lost()
            raise
        if reply.status is AcquireStatus.OK:  # paused or limited: the ids known stay known
            # The ids it names, then those known but not declared (learnt while it was out, or
            # beyond its slice): the script names only ids after the last one it named.
            declared, named = set(candidates), set(reply.ready)
            kept = [i for i in self._ready if i not in declared and i not in named]
            ready = list(reply.ready) + kept
            keep = max(peek, len(reply.ready))
            if self._first:
                self._first &= set(ready)
                ready = [i for i in ready if i in self._first] + [i for i in ready if i not in self._first]
                keep += len(self._first)
            self._ready, self._due = ready[:keep], list(reply.due)
        return reply, leases

    def _rate_limit(self) -> str:
        """This process's rate limit as acquire's ARGV takes it ('' = none; meta's wins)."""
        limit = self.queue.config.rate_limit
        return "" if limit is None else RATE_LIMIT.encode(limit)

    async def reclaim_lost(self) -> int:
        """Hand back what acquire calls whose reply was lost leased: each task still active
        under a token of such a call goes back to waiting, its attempt not counted and no
        stall (lua/reclaim.lua). Best effort: a call that cannot be sent now is kept for the
        next acquire; a refused one is given up (its leases stall, as all did before).
        Returns how many tasks went back."""
        reclaimed = 0
        while self._lost:
            prefix, ids = self._lost.popleft()
            try:
                reclaimed += (await self.scripts.run(protocol.ReclaimArgs(prefix, ids))).reclaimed
            except (RedisUnavailable, TimeoutError, asyncio.CancelledError):
                self._lost.appendleft((prefix, ids))  # not now: for the next call
                raise
            except Exception as exc:  # refused (or unreadable): sending it again will not help
                log.warning("queue %r: the leases of an acquire call whose reply was lost were not handed back "
                            "(they run out and count a stall): %s", self.queue.name, exc)
        if reclaimed:
            log.info("queue %r: %d leases of acquire calls whose reply was lost handed back", self.queue.name,
                     reclaimed)
        return reclaimed

    def lost_calls(self) -> int:
        """Acquire calls whose leases may still wait for `reclaim_lost`."""
        return len(self._lost)

    async def _acquire_rounds(self, count: int, lt: float) -> tuple[list[Lease], float | None]:
        """Up to ACQUIRE_ROUNDS calls for `count` leases: the first may only learn the ready
        ids, the next lease them, and more follow while other processes took the ids
        declared and more are named. LOOK_AGAIN_NOW when it stopped short of `count` with
        ids still known (or after an error, with the earlier rounds' leases)."""
        self._largest = max(self._largest, count)
        leases: list[Lease] = []
        for _ in range(ACQUIRE_ROUNDS):
            try:
                reply, got = await self._acquire_once(count - len(leases), lt)
            except asyncio.CancelledError:
                # The caller will never see the leases of the earlier rounds: hand them back.
                self._forget_leases(leases)
                raise
            except Exception:
                if not leases:
                    raise
                # The earlier rounds' leases are the caller's to run; the failed round was
                # handed back (or is, by the next call), and the next call sees the error again.
                return leases, LOOK_AGAIN_NOW
            leases += got
            if reply.status is not AcquireStatus.OK:
                break
            if len(leases) >= count or not (self._ready or self._due):
                break
        if len(leases) < count and reply.status is AcquireStatus.OK and (self._ready or self._due):
            return leases, LOOK_AGAIN_NOW
        due_in = reply.next_due_in
        if reply.status is AcquireStatus.RATE_LIMITED:
            return leases, RateLimitedFor(due_in or 0.0)
        if reply.status is not AcquireStatus.OK and due_in is not None and due_in <= 0:
            # Paused or at max_active, a due task cannot start before the queue resumes or a
            # slot frees, and both wake idle workers (wake.lua): asking now would spin.
            return leases, None
        return leases, due_in

    def _forget_leases(self, leases: Sequence[Lease]) -> None:
        """Leases no caller will get: reclaimed as those of a lost call (by the next call)."""
        calls: dict[str, list[str | bytes]] = {}
        for lease in leases:
            calls.setdefault(call_prefix(lease.token), []).append(lease._wire_id)
        for prefix, ids in calls.items():
            self._lose(prefix, ids)

    def _lose(self, prefix: str, ids: Sequence[str | bytes]) -> None:
        """Remember an acquire call whose leases of `ids` nobody got, for `reclaim_lost`;
        each id at most RECLAIMS_PER_TASK times."""
        kept = []
        for task_id in ids:
            times = self._reclaims.pop(task_id, 0)
            if times < RECLAIMS_PER_TASK:
                kept.append(task_id)
                times += 1
            self._reclaims[task_id] = times  # the most recent last
        while len(self._reclaims) > RECLAIMS_REMEMBERED:
            self._reclaims.popitem(last=False)
        if kept:
            self._lost.append((prefix, tuple(kept)))

    def learn_ready(self, task_ids: Sequence[str | bytes], *, first: bool = False) -> None:
        """Ids said to be waiting (this process's own offers, a wake message), in the
        order they became ready: the next acquire declares them after the ids it knew
        (those came first; `first`: before them, for tasks said to wait ahead of them),
        and the script checks each."""
        if first:  # at most MAX_FIRST, beside the `keep` others
            fresh = [i.encode() if isinstance(i, str) else i for i in task_ids[:MAX_FIRST]]
            ahead = set(fresh)
            old = [i for i in self._ready if i in self._first and i not in ahead][:MAX_FIRST - len(fresh)]
            self._first = ahead | set(old)
            self._ready = fresh + old + [i for i in self._ready if i not in self._first][:self._peek()]
            return
        keep = self._peek()
        fresh = [i.encode() if isinstance(i, str) else i for i in task_ids[:keep]]
        known = set(self._ready)
        self._ready = (self._ready + [i for i in fresh if i not in known])[:keep]

    def _peek(self) -> int:
        """How many ids a reply names (and `learn_ready` keeps): twice the most leases one
        call asked for, at least ACQUIRE_PEEK; a call may lease among the first
        ACQUIRE_WINDOW times as many waiting tasks."""
        return min(MAX_ACQUIRE, max(ACQUIRE_PEEK, 2 * self._largest))

    async def renew(self, leases: Sequence[Lease]) -> list[bool]:
        """Renew many leases (one round trip per requested lease length); updates each
        lease's confirmed deadline and the length the server granted."""
        groups: dict[float, list[int]] = {}
        for i, lease in enumerate(leases):
            groups.setdefault(lease.requested_lock_timeout, []).append(i)
        owned = [False] * len(leases)
        for requested, members in groups.items():
            sent = time.monotonic()
            reply = await self.scripts.run(protocol.RenewArgs(ms(requested), [leases[i].ref for i in members]))
            for i, ok in zip(members, reply.owned):
                if ok:
                    lease = leases[i]
                    owned[i] = True
                    lease.deadline_ms = reply.deadline
                    lease.confirmed_until = sent + reply.granted
                    lease.lock_timeout = reply.granted
        return owned

    async def complete_many(self, settled: Sequence[tuple[Lease, str]]) -> list[Outcome]:
        completions = [protocol.Completion(lease._wire_id, lease.token, result_json) for lease, result_json in settled]
        args = protocol.CompleteArgs(retention_ms(self.queue.config.retention_completed), *self.receipt(settled),
                                     completions)
        return (await self.scripts.run(args)).outcomes

    async def fail(self, lease: Lease, error: Any, *, retryable: bool | None, retry: Any,
                   declared: Sequence[type[BaseException]]) -> Outcome:
        config = self.queue.config  # one refresh's settings for the whole decision
        info, can_retry = error_info(error, declared)
        if retryable is not None:
            can_retry = retryable
        delay = -1.0
        if can_retry:
            policy = retry or retry_policies.from_json(lease.options.get("retry")) or config.retry
            delay, problem = retry_delay((policy, config.retry), lease.handler_failure_count + 1)
            if problem:
                info = ErrorInfo(DEFECT, f"{problem} (after {info.tag}: {info.message})", kind=info.kind)
        args = protocol.FailArgs(lease._wire_id, lease.token, error_json(info), ms(delay) if delay >= 0 else -1,
                                 config.max_retries, retention_ms(config.retention_failed), " ".join(lease._receipts))
        reply = await self.scripts.run(args)
        lease.retry_at_ms = reply.retry_at
        return reply.outcome

    async def release(self, lease: Lease, delay: float, ran: bool = True) -> Outcome:
        check_number("delay", delay, allow_none=False, maximum=MAX_DELAY)
        args = protocol.ReleaseArgs(lease._wire_id, lease.token, ms(delay), " ".join(lease._receipts), int(ran))
        return (await self.scripts.run(args)).outcome

    async def progress(self, lease: Lease, value: Any) -> bool:
        args = protocol.ProgressArgs(lease._wire_id, lease.token, codec.dumps(value, "progress"))
        return (await self.scripts.run(args)).stored


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
        self._denied = False  # the subscription was refused by an ACL (warned once)

    async def start(self) -> "WakeSignal":
        self._task = asyncio.create_task(self._listen(), name=f"effectmq-wake-{self.queue.name}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5)
        return self

    async def _listen(self) -> None:
        backoff = 0.05
        while True:
            pubsub = subscriber(self.queue.redis, self.queue.keys.wake_channel)
            try:
                await pubsub.subscribe(self.queue.keys.wake_channel)
                self._ready.set()
                backoff = 0.05
                async for message in pubsub.listen():
                    self._learn(message.get("data"))
                    self.event.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._denied and "NOPERM" in str(exc).upper().replace(" ", ""):
                    self._denied = True  # said once: it stays so until the ACL changes
                    log.warning("queue %s: this Redis user may not subscribe to %s (%s): idle workers look "
                                "for tasks every 2 s instead of at once; grant the channels &%s* "
                                "(docs/protocol.md)", self.queue.name, self.queue.keys.wake_channel, exc,
                                self.queue.keys.base)
                self.event.set()  # we may have missed a signal: let the owner look
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _learn(self, data: Any) -> None:
        """A wake message may name the ids it is about (lib.lua `wake`), or ids to declare
        first ({"f": [...]}: tasks of a group that entered waiting before the ids named
        so far, groups.lua `wake_groups`); only a hint."""
        if isinstance(data, str) and data.startswith(("[", "{")):
            with contextlib.suppress(ValueError):
                ids = json.loads(data)
                front = isinstance(ids, dict)
                if front:
                    ids = ids.get("f")
                if isinstance(ids, list) and all(isinstance(i, str) for i in ids):
                    self.queue.engine.learn_ready(ids, first=front)

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)

    async def close(self, timeout: float = 2.0) -> None:
        if self._task:
            await cancel_and_wait([self._task], timeout)

