"""Plain records returned by the engine, and their parsing from Redis replies."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, NamedTuple

from ..errors import CorruptValue, ErrorInfo, InvalidOption
from ..protocol import codec
from ..protocol.protocol import MAX_ENDING_MESSAGE, MAX_EXIT_CODE, MAX_K8S_NAME, RawFields
from ..protocol.protocol import POD_DEATHS as POD_DEATHS, STALL_CAUSES as STALL_CAUSES  # public here

TERMINAL_STATES = ("completed", "failed", "canceled")
# A pod, node or uid name as the scripts take it (forensics.lua k8s_name).
_K8S_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
# finished_at_ms below 10^14 (the year 5138): the scripts' JSON keeps 14 digits exactly.
MAX_FINISHED_AT_MS = 10**14 - 1
# How a cause's kind reads in a sentence (what Kubernetes calls it).
CAUSE_WORDS = {"oom_killed": "OOMKilled", "evicted": "Evicted", "error_exit": "Error", "deleted": "deleted",
               "node_lost": "lost with its node", "drained": "drained", "unknown": "cause unknown"}


def _k8s_name(what: str, value: Any, *, may_be_empty: bool = False) -> str:
    if not isinstance(value, str) or (value == "" and not may_be_empty) or len(value.encode(errors="replace")) > \
            MAX_K8S_NAME or (value and not _K8S_NAME.fullmatch(value)):
        raise InvalidOption(f"{what} must be {'empty or ' if may_be_empty else ''}1 to {MAX_K8S_NAME} letters, "
                            f"digits and . - _ : (a Kubernetes name), got {value!r:.80}")
    return value


@dataclass(frozen=True)
class PodIdentity:
    """The pod a worker process runs in (EFFECTMQ_POD_NAME, EFFECTMQ_POD_UID,
    EFFECTMQ_NODE_NAME, set by the operator from the downward API). A worker announces it
    with its lease tokens' prefix, so that a stall of its attempts names the pod."""

    name: str
    uid: str
    node: str = ""

    ENV = ("EFFECTMQ_POD_NAME", "EFFECTMQ_POD_UID", "EFFECTMQ_NODE_NAME")

    def __post_init__(self) -> None:
        _k8s_name("pod name", self.name)
        _k8s_name("pod uid", self.uid)
        _k8s_name("node name", self.node, may_be_empty=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "PodIdentity | None":
        """The identity the environment gives; None outside Kubernetes (no pod name or uid)."""
        name, uid, node = (environ.get(var, "").strip() for var in cls.ENV)
        if not name or not uid:
            return None
        return cls(name, uid, node)


@dataclass(frozen=True)
class WorkerEnding:
    """How a worker pod (or one run of its container) ended, as the operator saw it:
    `TaskQueue.record_worker_ending` keeps it for the stalls of the attempts it held."""

    pod: str  # pod name
    uid: str  # pod uid
    node: str  # node name ('' when unknown)
    cause: str  # one of STALL_CAUSES except 'unknown'
    exit_code: int | None = None
    message: str = ""  # e.g. the eviction message; truncated to MAX_ENDING_MESSAGE characters
    finished_at_ms: int | None = None  # the container's finishedAt (ms since epoch) when known

    def checked(self) -> "WorkerEnding":
        """This ending with its message truncated; InvalidOption names the first bad field."""
        _k8s_name("pod", self.pod)
        _k8s_name("uid", self.uid)
        _k8s_name("node", self.node, may_be_empty=True)
        if self.cause not in STALL_CAUSES or self.cause == "unknown":
            raise InvalidOption(f"unknown worker ending cause {self.cause!r:.80}; known: "
                                f"{', '.join(c for c in STALL_CAUSES if c != 'unknown')}")
        if self.exit_code is not None and (not isinstance(self.exit_code, int) or isinstance(self.exit_code, bool)
                                           or not -MAX_EXIT_CODE - 1 <= self.exit_code <= MAX_EXIT_CODE):
            raise InvalidOption(f"exit_code must be None or an integer of 32 bits, got {self.exit_code!r:.80}")
        if self.finished_at_ms is not None and (
                not isinstance(self.finished_at_ms, int) or isinstance(self.finished_at_ms, bool)
                or not 0 <= self.finished_at_ms <= MAX_FINISHED_AT_MS):
            raise InvalidOption(f"finished_at_ms must be None or ms since the epoch, 0 to {MAX_FINISHED_AT_MS}, "
                                f"got {self.finished_at_ms!r:.80}")
        if not isinstance(self.message, str):
            raise InvalidOption(f"message must be a string, got {type(self.message).__name__}")
        message = self.message[:MAX_ENDING_MESSAGE]
        try:
            message.encode()
        except UnicodeEncodeError:
            raise InvalidOption("message must be text that UTF-8 can encode (it holds lone surrogates)") from None
        return WorkerEnding(self.pod, self.uid, self.node, self.cause, self.exit_code, message, self.finished_at_ms)


def stall_cause_text(cause: Mapping[str, Any] | None) -> str:
    """A stall's cause (a history entry's `cause`) in a line: `pod emails-worker-7d9f-x2
    OOMKilled (exit 137) on node n1`, or `cause unknown (last heartbeat 41 s before)`."""
    if not isinstance(cause, Mapping):
        return "cause unknown"
    kind = str(cause.get("kind") or "unknown")
    pod, node = cause.get("pod"), cause.get("node")
    if kind == "unknown":
        age = cause.get("heartbeat_age_ms")
        text = "cause unknown"
        if isinstance(age, (int, float)) and not isinstance(age, bool) and math.isfinite(age):
            text += f" (last heartbeat {round(age / 1000)} s before)"
        if pod:
            text += f", pod {pod}" + (f" on node {node}" if node else "")
        return text
    text = (f"pod {pod} " if pod else "") + CAUSE_WORDS.get(kind, kind)
    exit_code = cause.get("exit_code")
    if isinstance(exit_code, int) and not isinstance(exit_code, bool):
        text += f" (exit {exit_code})"
    if node:
        text += f" on node {node}"
    message = cause.get("message")
    if isinstance(message, str) and message:
        text += f": {message}"
    return text


def stall_counts(fields: Mapping[str, str | None], current_minute: int, minutes: int, slots: int) -> dict[str, int]:
    """Stalls by cause over the last `minutes` (the current one included) from the
    stall_minutes ring ("m:<slot>" names the minute a slot counts, "<cause>:<slot>" its
    stalls): only causes with a count."""
    out: dict[str, int] = {}
    for minute in range(current_minute - minutes + 1, current_minute + 1):
        slot = minute % slots
        if fields.get(f"m:{slot}") != str(minute):
            continue
        for cause in STALL_CAUSES:
            value = fields.get(f"{cause}:{slot}")
            if value and value.isdigit() and int(value) > 0:
                out[cause] = out.get(cause, 0) + int(value)
    return out


class Offered(NamedTuple):
    task_id: str
    created: bool


def _ms_to_datetime(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromtimestamp(int(value) / 1000, tz=timezone.utc)


@dataclass(frozen=True)
class AttemptRecord:
    """An attempt that ended without success: failed (handler error), stalled (its lease
    ran out) or released (given back)."""

    attempt: int
    outcome: str
    error: ErrorInfo | None
    finished_at: datetime | None
    cause: dict | None = None  # a stall's cause (maintain.lua): {"kind", "pod", "node", ...}

    @property
    def cause_text(self) -> str | None:
        """A stall's cause in a line (stall_cause_text); None for other outcomes."""
        return stall_cause_text(self.cause) if self.outcome == "stalled" else None

    def to_json(self) -> dict:
        shown = {"attempt": self.attempt, "outcome": self.outcome,
                 "error": self.error.to_json() if self.error else None,
                 "finished_at": self.finished_at.isoformat() if self.finished_at else None}
        if self.outcome == "stalled":
            shown["cause"] = self.cause
            shown["cause_text"] = self.cause_text
        return shown


@dataclass(frozen=True)
class ThroughputPoint:
    """Tasks settled in one minute (UTC): completed, and failed for good."""

    minute: datetime
    completed: int
    failed: int


@dataclass
class TaskInfo:
    task_id: str
    name: str
    state: str
    payload: Any
    attempt: int
    handler_failure_count: int
    stalled_attempt_count: int
    priority: int
    group: str | None = None  # its group (TaskQueue.offer), None: none
    pod_kills: int = 0  # stalls whose cause says the worker's pod died under the attempt (POD_DEATHS)
    result: Any = None
    error: ErrorInfo | None = None
    progress: Any = None
    max_retries: int | None = None
    max_stalled_count: int | None = None
    options: dict = field(default_factory=dict)
    created_at: datetime | None = None
    ready_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    lease_deadline: datetime | None = None
    attempts: list[AttemptRecord] = field(default_factory=list)  # oldest first, at most 20
    corrupt: str | None = None  # why a stored value could not be decoded
    raw: dict[str, bytes] = field(default_factory=dict)  # the bytes of values that are not UTF-8

    @property
    def raw_payload(self) -> bytes | None:
        return self.raw.get("payload")

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_json(self) -> dict:
        def ts(value: datetime | None) -> str | None:
            return value.isoformat() if value else None

        return {
            "task_id": self.task_id, "name": self.name, "state": self.state,
            "payload": self.payload, "attempt": self.attempt,
            "handler_failure_count": self.handler_failure_count,
            "stalled_attempt_count": self.stalled_attempt_count, "priority": self.priority, "group": self.group,
            "pod_kills": self.pod_kills, "result": self.result, "error": self.error.to_json() if self.error else None,
            "progress": self.progress, "max_retries": self.max_retries,
            "max_stalled_count": self.max_stalled_count, "options": self.options,
            "created_at": ts(self.created_at), "ready_at": ts(self.ready_at),
            "started_at": ts(self.started_at), "finished_at": ts(self.finished_at),
            "lease_deadline": ts(self.lease_deadline) if self.state == "active" else None,
            "attempts": [a.to_json() for a in self.attempts],
            "corrupt": self.corrupt,
        }


def throughput_points(counts: Mapping[str, str], current_minute: int, minutes: int,
                      slots: int) -> list[ThroughputPoint]:
    """The per-minute counts of lib.lua's ring ("m:<slot>" names the minute a slot counts)
    as one point per minute, oldest first; a slot that counts another minute is zero."""
    points = []
    for minute in range(current_minute - minutes + 1, current_minute + 1):
        slot = minute % slots
        fresh = counts.get(f"m:{slot}") == str(minute)
        points.append(ThroughputPoint(datetime.fromtimestamp(minute * 60, tz=timezone.utc),
                                      int(counts.get(f"c:{slot}", 0)) if fresh else 0,
                                      int(counts.get(f"f:{slot}", 0)) if fresh else 0))
    return points


def ready_since_ms(ready_at: str | None, created_at: str | None) -> str | None:
    """When a task became ready (ms, as stored): a record writes ready_at only once it
    differs from created_at."""
    return ready_at or created_at


def _optional_int(value: str | None) -> int | None:
    if value is None or value == "" or int(value) < 0:
        return None
    return int(value)


def _attempts(value: Any) -> list[AttemptRecord]:
    if not isinstance(value, list):
        return []
    out = []
    for entry in value:
        if isinstance(entry, dict):
            error, cause = entry.get("error"), entry.get("cause")
            out.append(AttemptRecord(int(entry.get("attempt") or 0), str(entry.get("outcome", "")),
                                     ErrorInfo.from_json(error) if isinstance(error, dict) else None,
                                     _ms_to_datetime(entry.get("at")), cause if isinstance(cause, dict) else None))
    return out


def parse_task(task_id: str, fields: "RawFields | dict[str, str]") -> TaskInfo:
    """Build a TaskInfo from a task hash; corrupt JSON or bytes are reported, not raised."""
    problems: list[str] = []
    raw = fields.undecodable if isinstance(fields, RawFields) else {}
    h: Mapping[str, Any] = fields.values if isinstance(fields, RawFields) else fields

    def decode(name: str) -> Any:
        if name in raw:
            problems.append(f"stored {name} is not UTF-8")
            return None
        try:
            return codec.loads(h.get(name), name)
        except CorruptValue as exc:
            problems.append(str(exc))
            return h.get(name)

    error = decode("error")
    options = decode("options")
    attempts = decode("attempts")
    return TaskInfo(
        task_id=task_id,
        name=h.get("name", ""),
        state=h.get("state", "?"),
        payload=decode("payload"),
        attempt=int(h.get("attempt", 0)),
        handler_failure_count=int(h.get("handler_failure_count", 0)),
        stalled_attempt_count=int(h.get("stalled_attempt_count", 0)),
        priority=int(h.get("priority", 0)),
        group=h.get("group") or None,
        pod_kills=int(h.get("pod_kills") or 0),
        result=decode("result"),
        error=ErrorInfo.from_json(error) if isinstance(error, dict) else None,
        progress=decode("progress"),
        max_retries=_optional_int(h.get("max_retries")),
        max_stalled_count=_optional_int(h.get("max_stalled_count")),
        options=options if isinstance(options, dict) else {},
        attempts=_attempts(attempts),
        created_at=_ms_to_datetime(h.get("created_at")),
        ready_at=_ms_to_datetime(ready_since_ms(h.get("ready_at"), h.get("created_at"))),
        started_at=_ms_to_datetime(h.get("started_at")),
        finished_at=_ms_to_datetime(h.get("finished_at")),
        lease_deadline=_ms_to_datetime(h.get("lock_until")),
        corrupt="; ".join(problems) or None,
        raw=dict(raw),
    )


@dataclass(frozen=True)
class QueueStats:
    queue: str
    waiting: int
    delayed: int
    active: int
    completed: int
    failed: int
    canceled: int
    oldest_waiting_seconds: float
    paused: bool
    max_active: int
    rate_limit: tuple[int, float] | None = None  # (tasks, period seconds) stored; None: no limit
    rate_window_starts: int = 0  # attempts started in the rate limit's window that ends now
    starts_held_for: float = 0.0  # seconds until a hold of starts (TaskQueue.hold_starts) ends; 0: none
    parked: int = 0  # waiting tasks held back by their group's cap or pause (not in `waiting`)
    group_caps: bool = False  # a group cap or pause was ever set on the queue (TaskQueue.configure_group)

    @property
    def backlog(self) -> int:
        """Tasks that want a worker now or hold one: ready plus in flight."""
        return self.waiting + self.active

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class GroupStats:
    group: str
    waiting: int  # its tasks in the waiting index (delayed, active and parked ones are not counted)
    active: int = 0  # its attempts running, counted since the queue's first group cap or pause
    parked: int = 0  # its tasks held back by its cap or pause (state waiting)
    max_active: int = 0  # its cap in force (its own, else the queue's group_max_active); 0: none
    paused: bool = False
    # (tasks, period seconds): its rate limit in force (its own, else the queue's group_rate_limit); None: none
    rate_limit: tuple[int, float] | None = None

    def to_json(self) -> dict:
        return {"group": self.group, "waiting": self.waiting, "active": self.active, "parked": self.parked,
                "max_active": self.max_active, "paused": self.paused,
                "rate_limit": list(self.rate_limit) if self.rate_limit else None}


@dataclass(frozen=True)
class MaintenanceReport:
    recovered: int  # expired leases handed back to waiting (one stall counted each)
    stalled_failed: int  # expired leases that exceeded max_stalled_count
    promoted: int  # delayed tasks that became due
    expired_records: int  # terminal records removed after their retention
    expired_reservations: int  # dedup reservations whose window ended
    more: bool  # a sweep hit its batch: call again soon
    stall_causes: Mapping[str, int] = field(default_factory=dict)  # the stalls counted, by cause (STALL_CAUSES)

    @property
    def touched(self) -> int:
        return self.recovered + self.stalled_failed + self.promoted + self.expired_records + self.expired_reservations

    def __add__(self, later: "MaintenanceReport") -> "MaintenanceReport":
        """Two passes in a row: counts summed; `more` is what the later one left."""
        causes = dict(self.stall_causes)
        for cause, n in later.stall_causes.items():
            causes[cause] = causes.get(cause, 0) + n
        return MaintenanceReport(self.recovered + later.recovered, self.stalled_failed + later.stalled_failed,
                                 self.promoted + later.promoted, self.expired_records + later.expired_records,
                                 self.expired_reservations + later.expired_reservations, later.more, causes)

    def to_json(self) -> dict:
        return {k: dict(v) if k == "stall_causes" else v for k, v in
                ((k, getattr(self, k)) for k in self.__dataclass_fields__)}
