"""Plain records returned by the engine, and their parsing from Redis replies."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, NamedTuple

from . import codec
from .errors import CorruptValue, ErrorInfo
from .protocol import RawFields

TERMINAL_STATES = ("completed", "failed", "canceled")


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

    def to_json(self) -> dict:
        return {"attempt": self.attempt, "outcome": self.outcome,
                "error": self.error.to_json() if self.error else None,
                "finished_at": self.finished_at.isoformat() if self.finished_at else None}


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
            "stalled_attempt_count": self.stalled_attempt_count, "priority": self.priority,
            "result": self.result, "error": self.error.to_json() if self.error else None,
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
            error = entry.get("error")
            out.append(AttemptRecord(int(entry.get("attempt") or 0), str(entry.get("outcome", "")),
                                     ErrorInfo.from_json(error) if isinstance(error, dict) else None,
                                     _ms_to_datetime(entry.get("at"))))
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

    @property
    def backlog(self) -> int:
        """Tasks that want a worker now or hold one: ready plus in flight."""
        return self.waiting + self.active

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class MaintenanceReport:
    recovered: int  # expired leases handed back to waiting (one stall counted each)
    stalled_failed: int  # expired leases that exceeded max_stalled_count
    promoted: int  # delayed tasks that became due
    expired_records: int  # terminal records removed after their retention
    expired_reservations: int  # dedup reservations whose window ended
    more: bool  # a sweep hit its batch: call again soon

    @property
    def touched(self) -> int:
        return self.recovered + self.stalled_failed + self.promoted + self.expired_records + self.expired_reservations

    def __add__(self, later: "MaintenanceReport") -> "MaintenanceReport":
        """Two passes in a row: counts summed; `more` is what the later one left."""
        return MaintenanceReport(self.recovered + later.recovered, self.stalled_failed + later.stalled_failed,
                                 self.promoted + later.promoted, self.expired_records + later.expired_records,
                                 self.expired_reservations + later.expired_reservations, later.more)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
