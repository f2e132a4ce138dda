"""The wire protocol between Python and the Lua scripts in ``lua/``.

One dataclass per script's arguments (`.argv()` gives its ARGV in the order of the
script's header) and one per reply (`.parse(reply)`); repeated records are NamedTuples
whose fields are their values, so record sizes follow from the fields. Also here: the
bounds every call respects, the named outcome codes, the queue settings' defaults
(written into every script as the Lua table DEFAULTS) and the per-field decoding of
raw replies (a value that is not UTF-8 spoils its own task, never the batch).
tests/runtime/test_protocol.py holds the script headers against these classes.

Every key a script touches is declared in its KEYS (lib.lua): the queue's keys, then
the task hashes of `task_ids()`. Those ids are the call's own arguments, or, where the
script picks tasks (acquire, maintain), ids the caller learnt before the call: from an
earlier acquire reply (`AcquireReply.ready`, `.due`) or from plain reads (maintain).
"""

from __future__ import annotations

import base64
import itertools
import secrets
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, ClassVar, Generic, NamedTuple, Sequence, TypeVar

from .keys import FORENSIC_KEYS, GROUP_KEYS, GROUP_RATE_KEYS, RATE_KEYS

# One offer script call handles at most this many tasks (Redis runs a script alone:
# a bounded call keeps every other client's latency bounded too).
OFFER_CHUNK = 500
# offer_many writes this many chunk calls before reading their replies.
OFFER_WINDOW = 16
MAX_ACQUIRE = 1000  # leases per acquire call
MAX_MAINTAIN_BATCH = 5000  # items per sweep of one maintain call
# Ids an acquire reply names for the next call: at least ACQUIRE_PEEK, twice the most
# leases one call asked for. A candidate is leased while among the first ACQUIRE_WINDOW
# peeks of waiting ids: how far competing workers' named ids reach past the head.
ACQUIRE_PEEK = 16
ACQUIRE_WINDOW = 8
MAX_DELAY = 10 * 365 * 86400.0  # seconds: ten years is "later", 1e12 is a mistake
# Every number a user gives is bounded where it enters (runtime rule 8: InvalidOption
# names the limit). Durations, in seconds, are at most ten years: Redis time in ms plus
# any of them stays far below 2^53, where Lua's numbers and its '%d' are exact (a
# retention of sys.maxsize used to print as a negative expiry: the record was dropped).
MAX_DURATION = MAX_DELAY  # 315,360,000 s
MAX_LOCK_TIMEOUT = MAX_DURATION
MAX_RETENTION = MAX_DURATION  # retention_completed / retention_failed (None or -1: keep)
MAX_DEDUP_WINDOW = MAX_DURATION
MAX_COUNT = 2**31 - 1  # max_retries, max_stalled_count, max_active, events_maxlen, offsets (the CRD's int32)
MAX_PROMOTE_BATCH = 1000  # due ids an acquire reply names; the next call unpacks them (Lua's limit: ~8,000)
# A queue's rate limit (settings rate_limit): at most MAX_RATE_TASKS starts per window, the
# entries of its log of starts (acquire.lua); a window of 1 ms (Redis time's grain) to a
# day (daily quotas). A hold of starts (TaskQueue.hold_starts, a 429's Retry-After) lasts
# at most MAX_HOLD seconds.
MAX_RATE_TASKS = 100_000
MIN_RATE_PERIOD = 0.001
MAX_RATE_PERIOD = 86400.0
MAX_HOLD = 86400.0
# Parked tasks one configure_group call hands back at most (lua/configure_group.lua): the
# client calls again while it answers `more`.
GROUP_HAND_BACK = 1000
# A start counts for its period and a guard of 1 % of it, at most this many ms: the varying
# delay from a lease to its handler's start, so that the handler starts a downstream
# service sees keep to the window too (lua/includes/rate.lua rate_span).
RATE_GUARD = 20
MAX_LIST = 10_000  # records one listing call reads (list_tasks, events, task_events)
# A stored error (engine.error_json) is at most MAX_ERROR_BYTES of JSON, as fail.lua keeps
# it; its data at most MAX_ERROR_DATA_BYTES and MAX_ERROR_DEPTH levels deep, its integers
# within +-MAX_JSON_INT (Lua reads numbers as doubles). Else the data becomes a placeholder.
MAX_ERROR_BYTES = 1 << 20
MAX_ERROR_DATA_BYTES = 1 << 19
MAX_ERROR_DEPTH = 32
MAX_ERROR_TAG = 1024  # characters of a tag kept
MAX_JSON_INT = 2**53
# Stall forensics (lua/includes/forensics.lua). The causes of a stall, the metric's label and
# a history entry's cause.kind, in this order; those that say the pod died under the attempt
# count towards a poison task (POISON_KILLS such stalls put it in the queue's poison set).
STALL_CAUSES = ("oom_killed", "evicted", "error_exit", "deleted", "node_lost", "drained", "unknown")
POD_DEATHS = ("oom_killed", "error_exit", "evicted", "deleted", "node_lost")
POISON_KILLS = 2
POISON_KEPT = 1000  # ids the poison set keeps at most (the most recent pod deaths)
ENDINGS_KEPT = 4  # endings remembered per pod uid (one per run of its container)
FORENSICS_RETENTION_MS = 3_600_000  # endings and announced pods are forgotten after an hour without news
MAX_K8S_NAME = 253  # bytes of a pod, node or uid name (a DNS subdomain at most)
MAX_ENDING_MESSAGE = 256  # characters of an ending's message kept (4 bytes each at most in UTF-8)
MAX_EXIT_CODE = 2**31 - 1  # a container's exit code is an int32


class Outcome(IntEnum):
    """How an attempt settled; the scripts return these numbers (lib.lua OUTCOME_*)."""

    LOST = 0  # not settled by this token: another attempt owns the task, or it stalled
    COMPLETED = 1
    RETRY = 2  # a handler failure with a retry scheduled
    FAILED = 3  # a handler failure that ended the task
    RELEASED = 4

    @property
    def label(self) -> str:
        return self.name.lower()


class AcquireStatus(StrEnum):
    """Why acquire leased what it did (acquire.lua)."""

    OK = "ok"
    PAUSED = "paused"
    LIMITED = "limited"  # max_active reached
    RATE_LIMITED = "rate_limited"  # the rate limit allows no start now, or starts are held


def ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def retention_ms(seconds: float | None) -> int:
    """Retention in ms for the scripts; None or a negative value keeps records forever."""
    return -1 if seconds is None or seconds < 0 else ms(seconds)


# The values of one lease in the acquire reply, in order (acquire.lua).
LEASE_FIELDS = ("id", "token", "attempt", "name", "payload", "handler_failure_count",
                "stalled_attempt_count", "max_retries", "options", "priority", "trace")
LEASE_WIDTH = len(LEASE_FIELDS)


@dataclass
class RawFields:
    """Fields of a reply decoded one by one; `undecodable` keeps the bytes of the others."""

    values: dict[str, Any]  # str (or int for integer replies, None when absent)
    undecodable: dict[str, bytes] = field(default_factory=dict)


def raw_json(undecodable: dict[str, bytes]) -> dict[str, str]:
    """Undecodable values, base64-encoded, for an error record."""
    return {name: base64.b64encode(raw).decode() for name, raw in undecodable.items()}


def decode_fields(names: tuple[str, ...], raw: list) -> RawFields:
    out = RawFields({})
    for name, value in zip(names, raw):
        if isinstance(value, bytes):
            try:
                value = value.decode()
            except UnicodeDecodeError:
                out.undecodable[name] = value
                value = value.decode(errors="surrogateescape")
        out.values[name] = value
    return out


def decode_hash(flat: dict | list) -> RawFields:
    """An HGETALL reply read without decoding."""
    items = flat.items() if isinstance(flat, dict) else zip(flat[::2], flat[1::2])
    names, values = [], []
    for k, v in items:
        names.append(k.decode(errors="replace") if isinstance(k, bytes) else k)
        values.append(v)
    return decode_fields(tuple(names), values)


def wire(text: str) -> bytes | str:
    """A string decoded with surrogateescape goes back to Redis as its original bytes."""
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode(errors="surrogateescape")


# -- repeated records: a NamedTuple's values are the record's ARGV values, in order --------

class OfferTask(NamedTuple):
    id: str | bytes
    explicit_id: int  # 1 | 0
    name: str
    payload: str  # JSON
    delay_ms: int
    priority: int
    max_retries: int  # -1 = the queue's value
    max_stalled_count: int  # -1 = the queue's value
    options: str  # JSON object, or ''
    trace: str = ""  # the creation context: a JSON object of trace propagation fields, or ''
    group: str = ""  # the task's group (fair turns between groups: lua/includes/groups.lua), or ''


class LeaseRef(NamedTuple):
    id: str | bytes
    token: str


class Completion(NamedTuple):
    id: str | bytes
    token: str
    result: str  # JSON


class Setting(NamedTuple):
    field: str
    value: str  # '' removes the field


class StalledTask(NamedTuple):
    id: str
    attempt: int  # the attempt that stalled
    stalled_attempt_count: int  # the task's stalls now
    failed: bool  # the count passed its max_stalled_count: the task failed (else it waits again)
    trace: str | None  # its creation context (OfferTask.trace), None when it has none
    cause: str = "unknown"  # one of STALL_CAUSES
    pod: str = ""  # the pod of the worker that held the lease ('' unknown)
    node: str = ""  # its node ('' unknown)


class WorkerLoad(NamedTuple):
    name: str
    in_flight: int
    concurrency: int


OFFER_WIDTH = len(OfferTask._fields)
WORKER_WIDTH = len(WorkerLoad._fields)

R = TypeVar("R")


class ScriptArgs(Generic[R]):
    """The arguments of one script call: `argv()` for the call, `parse()` for its reply,
    `task_ids()` for the tasks whose hashes it declares after the queue's keys."""

    operation: ClassVar[str]
    Reply: ClassVar[Any]  # the reply dataclass, with a `from_reply` classmethod
    raw: ClassVar[bool] = False  # strings in the reply stay bytes (decoded per field)
    # Queue keys (keys.QueueKeys.key parts) only this script touches: declared last, after
    # the task hashes and receipts, so that the other scripts' key lists stay short
    # (includes/forensics.lua declared_last).
    last_keys: ClassVar[tuple[str, ...]] = ()
    # Of those, the last ones a caller leaves out until it learns that the queue needs them:
    # the group keys, until a script answers that the queue counts its groups
    # (lua/includes/group_caps.lua group_key_count; scripts.ScriptRunner.group_keys).
    optional_keys: ClassVar[tuple[str, ...]] = ()

    def argv(self) -> list:
        raise NotImplementedError

    def task_ids(self) -> Sequence[str | bytes]:
        return ()

    def receipt_ids(self) -> Sequence[str]:
        """The receipts whose keys it declares after the task hashes (lib.lua's use_receipts)."""
        return ()

    def parse(self, reply: Any) -> R:
        return self.Reply.from_reply(reply)


def _flat(records: Sequence[tuple]) -> list:
    return list(itertools.chain.from_iterable(records))


def _receipts(own: str, resent: str) -> list[str]:
    """A call's receipt ids in KEYS order: its own, then those it names."""
    return ([own] if own else []) + resent.split()


def declared_keys() -> Any:
    """A field that travels in KEYS (as task hashes), not in ARGV."""
    return field(default=(), metadata={"keys": True})


# -- replies -------------------------------------------------------------------

@dataclass(frozen=True)
class OfferReply:
    created: list[bool]  # per task; False: the id was known (idempotent re-offer)

    @classmethod
    def from_reply(cls, reply: list) -> "OfferReply":
        return cls([bool(c) for c in reply])


@dataclass(frozen=True)
class AcquireReply:
    now: int
    deadline: int
    next_due: int  # -1 = no delayed task and no rate-limited group due (lua/includes/group_caps.lua)
    status: AcquireStatus
    ready: tuple[bytes, ...]  # waiting ids the next call may declare
    due: tuple[bytes, ...]  # delayed ids due now, for the next call to promote
    outcomes: tuple[Outcome, ...]  # of the completions sent along, in order
    leases: list[RawFields]

    @classmethod
    def from_reply(cls, reply: list) -> "AcquireReply":
        status = reply[3].decode() if isinstance(reply[3], bytes) else reply[3]
        leases = [decode_fields(LEASE_FIELDS, reply[i:i + LEASE_WIDTH]) for i in range(7, len(reply), LEASE_WIDTH)]
        return cls(int(reply[0]), int(reply[1]), int(reply[2]), AcquireStatus(status), tuple(reply[4]),
                   tuple(reply[5]), tuple(Outcome(int(code)) for code in reply[6]), leases)

    @property
    def granted(self) -> float:
        """The lease length the server granted, in seconds (queue settings win)."""
        return (self.deadline - self.now) / 1000

    @property
    def next_due_in(self) -> float | None:
        return max(0.0, (self.next_due - self.now) / 1000) if self.next_due >= 0 else None


@dataclass(frozen=True)
class RenewReply:
    now: int
    deadline: int
    owned: list[bool]  # per lease

    @classmethod
    def from_reply(cls, reply: list) -> "RenewReply":
        return cls(int(reply[0]), int(reply[1]), [bool(ok) for ok in reply[2:]])

    @property
    def granted(self) -> float:
        return (self.deadline - self.now) / 1000


@dataclass(frozen=True)
class CompleteReply:
    outcomes: list[Outcome]  # per completion

    @classmethod
    def from_reply(cls, reply: list) -> "CompleteReply":
        return cls([Outcome(int(code)) for code in reply])


@dataclass(frozen=True)
class FailReply:
    outcome: Outcome
    handler_failure_count: int  # -1 for a resent acknowledgement
    retry_at: int  # ms, -1 = no retry

    @classmethod
    def from_reply(cls, reply: list) -> "FailReply":
        return cls(Outcome(int(reply[0])), int(reply[1]), int(reply[2]))


@dataclass(frozen=True)
class OutcomeReply:
    outcome: Outcome

    @classmethod
    def from_reply(cls, reply: int) -> "OutcomeReply":
        return cls(Outcome(int(reply)))


@dataclass(frozen=True)
class ReclaimReply:
    reclaimed: int  # tasks handed back to waiting

    @classmethod
    def from_reply(cls, reply: int) -> "ReclaimReply":
        return cls(int(reply))


@dataclass(frozen=True)
class StoredReply:
    stored: bool  # False: lease lost

    @classmethod
    def from_reply(cls, reply: int) -> "StoredReply":
        return cls(bool(reply))


@dataclass(frozen=True)
class PreviousStateReply:
    previous_state: str | None  # None: no such task

    @classmethod
    def from_reply(cls, reply: str) -> "PreviousStateReply":
        return cls(reply or None)


@dataclass(frozen=True)
class MaintainReply:
    recovered: int
    stalled_failed: int
    promoted: int
    expired_records: int
    expired_reservations: int  # also counts remembered settlements and waiters that ended
    more: bool  # a sweep was cut short by its batch
    stalls: Sequence[StalledTask] = ()  # the stalls counted by this call (recovered and failed)

    @classmethod
    def from_reply(cls, reply: list) -> "MaintainReply":
        r = [int(x) for x in reply[:6]]
        width = len(StalledTask._fields)
        stalls = [StalledTask(str(reply[i]), int(reply[i + 1]), int(reply[i + 2]), bool(reply[i + 3]), reply[i + 4],
                              str(reply[i + 5]), str(reply[i + 6] or ""), str(reply[i + 7] or ""))
                  for i in range(6, len(reply), width)]
        return cls(r[0], r[1], r[2], r[3], r[4], bool(r[5]), tuple(stalls))


@dataclass(frozen=True)
class StatsReply:
    now: int
    waiting: int
    delayed: int
    active: int
    completed: int
    failed: int
    canceled: int
    paused: bool
    max_active: int
    rate_tasks: int  # 0: no rate limit
    rate_period_ms: int
    rate_started: int  # leases started in the window that ends now
    held_until: int  # Redis time (ms) a hold of starts ends, -1 = none
    parked: int  # waiting tasks held back by their group's cap or pause (lua/includes/group_caps.lua)
    counting: bool  # a group cap or pause was set: attempts count against their groups
    heads: list[str]  # the first waiting id of each priority band

    @classmethod
    def from_reply(cls, reply: list) -> "StatsReply":
        r = [int(x) for x in reply[:15]]
        return cls(r[0], r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]), r[8], r[9], r[10], r[11], r[12], r[13],
                   bool(r[14]), [x.decode() if isinstance(x, bytes) else str(x) for x in reply[15:]])


@dataclass(frozen=True)
class GroupReply:
    waiting: int
    active: int  # its attempts running, as counted since the queue's first cap or pause
    parked: int
    max_active: int  # its cap in force (its own, else the queue's group_max_active); 0 = none
    paused: bool
    more: bytes  # b'' = done; else call again (no group: with `after` = more)
    rate_tasks: int = 0  # its rate limit in force (its own, else the queue's group_rate_limit); 0 = none
    rate_period_ms: int = 0

    @classmethod
    def from_reply(cls, reply: list) -> "GroupReply":
        more = reply[5]
        return cls(int(reply[0]), int(reply[1]), int(reply[2]), int(reply[3]), bool(int(reply[4])),
                   more if isinstance(more, bytes) else str(more or "").encode(), int(reply[6]), int(reply[7]))


@dataclass(frozen=True)
class HoldReply:
    now: int
    held_until: int  # Redis time (ms) the hold ends (this one or a later one)

    @classmethod
    def from_reply(cls, reply: list) -> "HoldReply":
        return cls(int(reply[0]), int(reply[1]))


@dataclass(frozen=True)
class RecordedReply:
    recorded: bool  # False: known already (an idempotent repeat)

    @classmethod
    def from_reply(cls, reply: int) -> "RecordedReply":
        return cls(bool(reply))


@dataclass(frozen=True)
class ConfigureReply:
    written: int

    @classmethod
    def from_reply(cls, reply: int) -> "ConfigureReply":
        return cls(int(reply))


@dataclass(frozen=True)
class WorkersReply:
    workers: list[WorkerLoad]

    @classmethod
    def from_reply(cls, reply: list) -> "WorkersReply":
        return cls([WorkerLoad(reply[i], int(reply[i + 1]), int(reply[i + 2]))
                    for i in range(0, len(reply), WORKER_WIDTH)])


# -- arguments -----------------------------------------------------------------

@dataclass(frozen=True)
class OfferArgs(ScriptArgs[OfferReply]):
    operation = "offer"
    Reply = OfferReply
    count: int = field(init=False)
    nonce: str = field(init=False)  # a resend of this call (its reply lost) finds its own tasks
    tasks: Sequence[OfferTask]

    def __post_init__(self) -> None:
        object.__setattr__(self, "count", len(self.tasks))
        # An integer (compact in the task hash) of 53 random bits: 31 let a resend mistake a
        # task another call created for its own once in two billion resends.
        object.__setattr__(self, "nonce", str(1 + secrets.randbelow(1 << 53)))

    def argv(self) -> list:
        return [self.count, self.nonce, *_flat(self.tasks)]

    def task_ids(self) -> Sequence[str | bytes]:
        return [task.id for task in self.tasks]


@dataclass(frozen=True)
class AcquireArgs(ScriptArgs[AcquireReply]):
    operation = "acquire"
    Reply = AcquireReply
    raw = True  # payloads are decoded per lease
    count: int
    lock_timeout_ms: int
    token_prefix: str
    promote_batch: int
    window: int
    peek: int
    candidates: Sequence[str | bytes] = declared_keys()  # ids an earlier reply named
    retention_ms: int = -1  # of the completions
    receipt: str = ""  # of this call, as by CompleteArgs
    resent: str = ""
    rate_limit: str = ""  # "<tasks> <period_ms>" (settings.Setting.encode), '' = none
    completions: Sequence[Completion] = ()  # settled first, as by CompleteArgs
    last_keys = RATE_KEYS + GROUP_RATE_KEYS + GROUP_KEYS
    optional_keys = GROUP_RATE_KEYS + GROUP_KEYS

    def argv(self) -> list:
        return [self.count, self.lock_timeout_ms, self.token_prefix, self.promote_batch, self.window, self.peek,
                self.retention_ms, self.receipt, self.resent, self.rate_limit, *_flat(self.completions)]

    def task_ids(self) -> Sequence[str | bytes]:
        return [*(completion.id for completion in self.completions), *self.candidates]

    def receipt_ids(self) -> Sequence[str]:
        return _receipts(self.receipt, self.resent)


@dataclass(frozen=True)
class RenewArgs(ScriptArgs[RenewReply]):
    operation = "renew"
    Reply = RenewReply
    lock_timeout_ms: int
    leases: Sequence[LeaseRef]

    def argv(self) -> list:
        return [self.lock_timeout_ms, *_flat(self.leases)]

    def task_ids(self) -> Sequence[str | bytes]:
        return [lease.id for lease in self.leases]


@dataclass(frozen=True)
class CompleteArgs(ScriptArgs[CompleteReply]):
    operation = "complete"
    Reply = CompleteReply
    retention_ms: int
    receipt: str  # this call's receipt id ('' = none), unique per call
    resent: str  # space-separated receipt ids of earlier calls that carried any of these
    completions: Sequence[Completion]
    last_keys = GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return [self.retention_ms, self.receipt, self.resent, *_flat(self.completions)]

    def task_ids(self) -> Sequence[str | bytes]:
        return [completion.id for completion in self.completions]

    def receipt_ids(self) -> Sequence[str]:
        return _receipts(self.receipt, self.resent)


@dataclass(frozen=True)
class FailArgs(ScriptArgs[FailReply]):
    operation = "fail"
    Reply = FailReply
    id: str | bytes
    token: str
    error: str  # JSON
    retry_delay_ms: int  # -1 = not retryable
    max_retries: int
    retention_ms: int
    receipts: str = ""  # space-separated: the calls that carried a completion by this token
    last_keys = GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return [self.id, self.token, self.error, self.retry_delay_ms, self.max_retries, self.retention_ms,
                self.receipts]

    def task_ids(self) -> Sequence[str | bytes]:
        return [self.id]

    def receipt_ids(self) -> Sequence[str]:
        return self.receipts.split()


@dataclass(frozen=True)
class ReleaseArgs(ScriptArgs[OutcomeReply]):
    operation = "release"
    Reply = OutcomeReply
    id: str | bytes
    token: str
    delay_ms: int
    receipts: str = ""  # as FailArgs'
    ran: int = 1  # 0: its handler never started (release.lua: no attempt)
    last_keys = GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return [self.id, self.token, self.delay_ms, self.receipts, self.ran]

    def task_ids(self) -> Sequence[str | bytes]:
        return [self.id]

    def receipt_ids(self) -> Sequence[str]:
        return self.receipts.split()


@dataclass(frozen=True)
class ReclaimArgs(ScriptArgs[ReclaimReply]):
    """Hand back what an acquire call whose reply was lost leased: the tasks among `ids`
    still active under a token of `token_prefix` (that call's own) go back to waiting."""

    operation = "reclaim"
    Reply = ReclaimReply
    token_prefix: str  # the lost call's (AcquireArgs.token_prefix)
    ids: Sequence[str | bytes] = declared_keys()  # the candidates the lost call declared
    last_keys = GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return [self.token_prefix]

    def task_ids(self) -> Sequence[str | bytes]:
        return self.ids


@dataclass(frozen=True)
class ProgressArgs(ScriptArgs[StoredReply]):
    operation = "progress"
    Reply = StoredReply
    id: str | bytes
    token: str
    progress: str  # JSON

    def argv(self) -> list:
        return [self.id, self.token, self.progress]

    def task_ids(self) -> Sequence[str | bytes]:
        return [self.id]


@dataclass(frozen=True)
class CancelArgs(ScriptArgs[PreviousStateReply]):
    operation = "cancel"
    Reply = PreviousStateReply
    id: str
    error: str  # JSON
    retention_ms: int
    request: str = ""  # random per call: a resend (its reply lost) answers as the first send did
    last_keys = GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return [self.id, self.error, self.retention_ms, self.request]

    def task_ids(self) -> Sequence[str | bytes]:
        return [self.id]


@dataclass(frozen=True)
class RetryArgs(ScriptArgs[PreviousStateReply]):
    operation = "retry"
    Reply = PreviousStateReply
    id: str
    request: str = ""  # as CancelArgs'

    def argv(self) -> list:
        return [self.id, self.request]

    def task_ids(self) -> Sequence[str | bytes]:
        return [self.id]


@dataclass(frozen=True)
class MaintainArgs(ScriptArgs[MaintainReply]):
    operation = "maintain"
    Reply = MaintainReply
    batch: int
    max_stalled_count: int
    stalled_error: str  # JSON
    retention_ms: int
    retried_stall: str  # JSON
    lock_timeout_ms: int = 30_000  # the lease length a stall's heartbeat age assumes (meta lock_timeout_ms wins)
    poison_kept: int = POISON_KEPT
    poison_kills: int = POISON_KILLS
    candidates: Sequence[str | bytes] = declared_keys()  # ids read from the indexes first
    last_keys = FORENSIC_KEYS + GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return [self.batch, self.max_stalled_count, self.stalled_error, self.retention_ms, self.retried_stall,
                self.lock_timeout_ms, self.poison_kept, self.poison_kills]

    def task_ids(self) -> Sequence[str | bytes]:
        return self.candidates


@dataclass(frozen=True)
class StatsArgs(ScriptArgs[StatsReply]):
    operation = "stats"
    Reply = StatsReply
    last_keys = RATE_KEYS + GROUP_KEYS
    optional_keys = GROUP_KEYS

    def argv(self) -> list:
        return []


@dataclass(frozen=True)
class HoldArgs(ScriptArgs[HoldReply]):
    operation = "hold"
    Reply = HoldReply
    hold_ms: int

    def argv(self) -> list:
        return [self.hold_ms]


@dataclass(frozen=True)
class ConfigureArgs(ScriptArgs[ConfigureReply]):
    operation = "configure"
    Reply = ConfigureReply
    settings: Sequence[Setting]

    def argv(self) -> list:
        return _flat(self.settings)


@dataclass(frozen=True)
class ConfigureGroupArgs(ScriptArgs[GroupReply]):
    """A group's cap, rate limit and pause (TaskQueue.configure_group, pause_group,
    resume_group), or with no group: the parked tasks the caps and rate limits in force let go
    (after group_max_active or group_rate_limit changed)."""

    operation = "configure_group"
    Reply = GroupReply
    raw = True  # `more` may be a backlog member: bytes, sent back as they came
    group: str  # '' = every group
    max_active: str = ""  # '' = unchanged, '-1' = the queue's, '0' = no cap, 'N'
    paused: str = ""  # '' = unchanged, '1' | '0'
    batch: int = GROUP_HAND_BACK
    after: bytes = b""  # no group: the `more` of the call before
    rate_limit: str = ""  # '' = unchanged, '-1' = the queue's, '0' = none, '<tasks> <period_ms>'
    last_keys = GROUP_RATE_KEYS + GROUP_KEYS

    def argv(self) -> list:
        return [self.group, self.max_active, self.paused, self.batch, self.after, self.rate_limit]


@dataclass(frozen=True)
class WorkersArgs(ScriptArgs[WorkersReply]):
    operation = "workers"
    Reply = WorkersReply
    name: str  # '' = only list
    in_flight: int  # -1 = the worker is leaving
    concurrency: int
    ttl_ms: int
    token_prefix: str = ""  # the worker's lease tokens' (LeaseEngine.token_prefix); '' = no pod
    pod: str = ""  # the worker's pod identity ('' outside Kubernetes)
    uid: str = ""
    node: str = ""
    pod_retention_ms: int = FORENSICS_RETENTION_MS
    last_keys = ("pods",)

    def argv(self) -> list:
        return [self.name, self.in_flight, self.concurrency, self.ttl_ms, self.token_prefix, self.pod, self.uid,
                self.node, self.pod_retention_ms]


@dataclass(frozen=True)
class WorkerEndingArgs(ScriptArgs[RecordedReply]):
    operation = "worker_ending"
    Reply = RecordedReply
    uid: str
    pod: str
    node: str  # '' = unknown
    cause: str  # one of STALL_CAUSES but "unknown"
    exit_code: str  # an integer as text, '' = unknown
    message: str
    finished_at_ms: int  # -1 = unknown (Redis time of the record counts)
    retention_ms: int = FORENSICS_RETENTION_MS
    kept: int = ENDINGS_KEPT
    last_keys = ("endings",)

    def argv(self) -> list:
        return [self.uid, self.pod, self.node, self.cause, self.exit_code, self.message, self.finished_at_ms,
                self.retention_ms, self.kept]


@dataclass(frozen=True)
class LiveWorkersArgs(ScriptArgs[WorkersReply]):
    operation = "live_workers"
    Reply = WorkersReply

    def argv(self) -> list:
        return []


# Every script, by operation (its file is lua/<operation>.lua).
SCRIPTS: dict[str, type[ScriptArgs]] = {cls.operation: cls for cls in (
    OfferArgs, AcquireArgs, RenewArgs, CompleteArgs, FailArgs, ReleaseArgs, ReclaimArgs, ProgressArgs,
    CancelArgs, RetryArgs, MaintainArgs, StatsArgs, ConfigureArgs, WorkersArgs, LiveWorkersArgs, WorkerEndingArgs,
    HoldArgs, ConfigureGroupArgs,
)}
