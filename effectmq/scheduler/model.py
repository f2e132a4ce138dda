"""Schedule definitions, what a tick's task looks like, and the records the API returns.

A tick's task id is ``<schedule id>/<UTC instant>``, e.g.
``reports/nightly/2024-03-31T01:00:00Z``: the same tick always maps to the same
id, so any number of schedulers may offer it. Its payload is the schedule's
payload (a JSON object) plus ``"tick"`` (that instant) and, on a task that
coalesces missed ticks, ``"span": {"first", "last", "count"}``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, NamedTuple, overload

from ..protocol import codec
from ..errors import EffectMQError
from ..protocol.keys import check_queue_name
from ..client.queue import offer_argv
from .errors import InvalidSchedule
from .policy import MAX_BACKFILL, MISSED_MODES, MissedPolicy, PlannedTick
from .timeline import Timeline, iso, timeline

SCHEDULE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,199}$")
RESERVED_PAYLOAD_KEYS = ("tick", "span")
MAX_MISSED_AFTER = 86_400.0


def _number(value: Any, *, integer: bool = False) -> bool:
    if isinstance(value, bool):
        return False
    if integer:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: when (cron, timezone), what (queue, task, payload, options), and
    what to do with missed ticks. Constructing it validates it (InvalidSchedule)."""

    id: str
    queue: str
    cron: str
    task: str
    payload: dict | None = None
    timezone: str = "UTC"
    priority: int = 0
    max_retries: int | None = None
    max_stalled_count: int | None = None
    timeout: float | None = None
    delay: float | None = None  # the task becomes ready this long after its tick
    missed: str = "coalesce"  # skip | coalesce | backfill
    max_backfill: int = 10
    starting_deadline: float | None = None  # seconds: an older tick never runs (counted as skipped)
    # seconds late before a tick is missed (the policy decides): the grace of a restart or a
    # leader change. A tick that fell due while suspended is missed whatever its age.
    missed_after: float = 60.0
    suspend: bool = False
    group: str | None = None  # the tasks' group (TaskQueue.offer); stored only when set
    _timeline: Timeline = field(init=False, repr=False, compare=False)
    _missed_policy: MissedPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not SCHEDULE_ID.match(self.id):
            raise InvalidSchedule(
                f"schedule id {self.id!r} must be 1-200 characters of letters, digits and . _ : / @ -, "
                "starting with a letter or digit"
            )
        try:
            self._validate()
        except InvalidSchedule as exc:
            raise InvalidSchedule(f"schedule {self.id!r}: {exc}") from None
        except EffectMQError as exc:  # option checks shared with TaskQueue.offer
            raise InvalidSchedule(f"schedule {self.id!r}: {exc}") from None

    def _validate(self) -> None:
        try:
            check_queue_name(self.queue)
        except EffectMQError as exc:
            raise InvalidSchedule(f"queue: {exc}") from None
        object.__setattr__(self, "_timeline", timeline(self.cron, self.timezone))
        if self.payload is not None and not isinstance(self.payload, dict):
            raise InvalidSchedule(f"payload must be a JSON object or null, got {type(self.payload).__name__}")
        reserved = [k for k in RESERVED_PAYLOAD_KEYS if k in (self.payload or {})]
        if reserved:
            raise InvalidSchedule(f"payload keys {reserved} are reserved for tick metadata")
        if self.missed not in MISSED_MODES:
            raise InvalidSchedule(f"missed must be one of {', '.join(MISSED_MODES)}, got {self.missed!r}")
        if not _number(self.max_backfill, integer=True) or not 1 <= self.max_backfill <= MAX_BACKFILL:
            raise InvalidSchedule(
                f"max_backfill must be an integer from 1 to {MAX_BACKFILL}, got {self.max_backfill!r}")
        if self.starting_deadline is not None and (not _number(self.starting_deadline) or self.starting_deadline < 1):
            raise InvalidSchedule(f"starting_deadline must be at least 1 second, got {self.starting_deadline!r}")
        if not _number(self.missed_after) or not 0 <= self.missed_after <= MAX_MISSED_AFTER:
            raise InvalidSchedule(f"missed_after must be 0-{MAX_MISSED_AFTER:.0f} seconds, got {self.missed_after!r}")
        if self.delay is not None and (not _number(self.delay) or self.delay < 0):
            raise InvalidSchedule(f"delay must be >= 0 seconds, got {self.delay!r}")
        if not isinstance(self.suspend, bool):
            raise InvalidSchedule(f"suspend must be true or false, got {self.suspend!r}")
        object.__setattr__(self, "_missed_policy",
                           MissedPolicy(self.missed, self.max_backfill, self.starting_deadline, self.missed_after))
        # The task name, payload (plain JSON) and task options are checked exactly as an offer checks them.
        offer_argv(self.task, self.task_payload(PlannedTick(0)), task_id=self.task_id(0), **self._options(0, 0))

    # -- derived ----------------------------------------------------------------

    @property
    def timeline(self) -> Timeline:
        return self._timeline

    @property
    def missed_policy(self) -> MissedPolicy:
        return self._missed_policy

    @property
    def timing(self) -> str:
        """What decides the tick instants; the cursor restarts from now when it changes."""
        return f"{self.cron}|{self.timezone}"

    def task_id(self, at: int) -> str:
        return f"{self.id}/{iso(at)}"

    def task_payload(self, tick: PlannedTick) -> dict:
        payload = {**(self.payload or {}), "tick": iso(tick.at)}
        if tick.span is not None:
            payload["span"] = {"first": iso(tick.span.first), "last": iso(tick.span.last), "count": tick.span.count}
        return payload

    def _options(self, at: int, now_ms: int) -> dict:
        delay = None if self.delay is None else max(0.0, at + self.delay - now_ms / 1000)
        return {"delay": delay, "priority": self.priority, "max_retries": self.max_retries,
                "max_stalled_count": self.max_stalled_count, "timeout": self.timeout, "group": self.group}

    def offer(self, tick: PlannedTick, now_ms: int) -> dict:
        """The `TaskQueue.offer_many` item for one tick."""
        return {"name": self.task, "payload": self.task_payload(tick), "task_id": self.task_id(tick.at),
                **self._options(tick.at, now_ms)}

    # -- JSON -------------------------------------------------------------------

    def to_json(self) -> dict:
        # No group: no field, so that a version before groups reads the stored schedule.
        return {name: getattr(self, name) for name in _FIELDS if name != "group" or self.group is not None}

    @classmethod
    def from_json(cls, value: Any) -> "ScheduleSpec":
        """Build from a dict (stored spec, CLI, operator); unknown keys are an error."""
        if not isinstance(value, dict):
            raise InvalidSchedule(f"a schedule must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise InvalidSchedule(f"unknown schedule fields {unknown}; known: {', '.join(sorted(_FIELDS))}")
        missing = [k for k in ("id", "queue", "cron", "task") if k not in value]
        if missing:
            raise InvalidSchedule(f"schedule {value.get('id', '?')!r} lacks required fields {missing}")
        return cls(**value)

    def dumps(self) -> str:
        return codec.dumps(self.to_json(), f"schedule {self.id!r}")


_FIELDS = tuple(f.name for f in fields(ScheduleSpec) if f.init)


@overload
def utc_from_ms(ms: int) -> datetime: ...
@overload
def utc_from_ms(ms: None) -> None: ...
def utc_from_ms(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, timezone.utc)


class Materialized(NamedTuple):
    """One tick offered during a pass; created=False: its task already existed (or had run)."""

    schedule_id: str
    queue: str
    task_id: str
    tick: datetime
    created: bool


@dataclass
class ScheduleStatus:
    """What a schedule did and will do; under the operator, the Schedule's status."""

    id: str
    spec: ScheduleSpec | None  # None when the stored definition is unreadable
    suspended: bool
    cursor: datetime | None  # ticks at or before this are settled
    last_tick: datetime | None
    last_task_id: str | None
    next_tick: datetime | None
    materialized: int  # ticks offered (by the scheduler whose cursor update won)
    skipped: int
    coalesced: int
    backfilled: int
    last_error: str | None
    last_error_at: datetime | None
    created_at: datetime | None
    updated_at: datetime | None

    @property
    def healthy(self) -> bool:
        return self.spec is not None and self.last_error is None

    def to_json(self) -> dict:
        out = asdict(self)
        out["spec"] = self.spec.to_json() if self.spec else None
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat().replace("+00:00", "Z")
        return out


@dataclass
class TickReport:
    """The outcome of one scheduler pass."""

    now: datetime  # Redis time the pass decided with
    examined: int = 0  # due schedules looked at
    materialized: list[Materialized] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # schedule id -> message
    lost: int = 0  # schedules another scheduler advanced first (their offers were idempotent repeats)
    next_due: datetime | None = None  # earliest next fire time known after the pass
    more: bool = False  # left due work (fell due during the pass, or a stale decision): call again now

    @property
    def created(self) -> int:
        return sum(1 for m in self.materialized if m.created)

    def to_json(self) -> dict:
        def ts(value: datetime | None) -> str | None:
            return value.isoformat().replace("+00:00", "Z") if value else None

        return {
            "now": ts(self.now), "examined": self.examined, "created": self.created, "lost": self.lost,
            "materialized": [{"schedule": m.schedule_id, "queue": m.queue, "task_id": m.task_id,
                              "tick": ts(m.tick), "created": m.created} for m in self.materialized],
            "errors": self.errors, "next_due": ts(self.next_due), "more": self.more,
        }
