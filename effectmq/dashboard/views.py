"""What the dashboard shows, computed from engine records: pure functions, no I/O.

Pages and the JSON API render the same dicts (`web` turns them into HTML or JSON),
so what one shows the other shows, and the hiding rules of a sensitive queue live
here once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

from ..protocol import codec
from ..errors import CANCELED, STALLED, TIMEOUT
from ..protocol.keys import INDEXES
from ..client.models import GroupStats, QueueStats, TaskInfo, ThroughputPoint
from ..client.queue import check_group
from ..protocol.protocol import MAX_COUNT, POISON_KILLS

# What a sensitive queue's values are shown as (payload, result, progress, error data).
HIDDEN = "hidden: the queue is marked sensitive"
# What a sensitive queue's error messages are shown as: a message may quote the payload
# (a schema check, a Python exception, a handler's own text).
HIDDEN_MESSAGE = "hidden: the queue is marked sensitive (a message may quote the payload)"
# Errors whose messages the engine writes itself, from no value: shown on every queue.
ENGINE_TAGS = frozenset({STALLED, CANCELED, TIMEOUT})
# Task fields that carry user values (hidden on a sensitive queue).
VALUE_FIELDS = ("payload", "result", "progress")
# The task hash fields a row of a list shows (read with HMGET: never a payload).
LIST_FIELDS = ("name", "state", "group", "attempt", "priority", "handler_failure_count", "stalled_attempt_count",
               "error", "created_at", "finished_at")
# Stored JSON fields of a task hash.
# Values nested deeper are not shown: JSON encoding inside a page would hit Python's recursion limit.
MAX_SHOWN_DEPTH = 100
# Event fields shown; any other field an event carries (e.g. a progress value) is not.
EVENT_FIELDS = ("event", "id", "at", "attempt", "was", "name", "kind", "retry_at", "stalled_attempt_count")
# The list of tasks whose attempts killed their worker's pod POISON_KILLS times or more
# (the queue's poison set, most recent first), shown beside the state lists.
POISON = "poison"
# The list of tasks parked by their group's cap or pause (state waiting, out of the waiting
# index): by group name, each group's in the order they go back (TaskQueue.parked_ids).
PARKED = "parked"
LISTS = (*INDEXES, POISON, PARKED)
DEFAULT_PAGE = 50
MAX_PAGE = 500
MAX_OFFSET = MAX_COUNT  # where a list may start (Redis takes int64; the engine bounds offsets so)
# The groups section: the busiest groups first (TaskQueue.groups), a page of them; each
# costs its page a few reads.
DEFAULT_GROUPS_PAGE = 20
MAX_GROUPS_PAGE = 200
# A group's columns: every GroupStats field (a field added there shows as a column).
GROUP_COLUMNS = tuple(f.name for f in dataclasses.fields(GroupStats) if f.name != "group")


def iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def human_age(seconds: float) -> str:
    """A short age for people: 0s, 42s, 3m 5s, 2h 7m, 3d 4h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def failure_rate(points: Sequence[ThroughputPoint]) -> float | None:
    """Failed for good over everything settled in these minutes; None when nothing settled."""
    completed = sum(p.completed for p in points)
    failed = sum(p.failed for p in points)
    return None if completed + failed == 0 else failed / (completed + failed)


def throughput_series(points: Sequence[ThroughputPoint]) -> dict:
    """The chart's columns: epoch seconds, completed and failed per minute."""
    return {"t": [int(p.minute.timestamp()) for p in points],
            "completed": [p.completed for p in points], "failed": [p.failed for p in points]}


def rate_limit_shown(stats: QueueStats) -> str:
    """The rate limit as a queue's facts show it: "100 per 1 s · 37 in the window", a hold
    of starts after it ("held 12s"); "none" when there is neither."""
    parts = []
    if stats.rate_limit is not None:
        tasks, period = stats.rate_limit
        parts.append(f"{tasks} per {period:g} s · {stats.rate_window_starts} in the window")
    if stats.starts_held_for > 0:
        parts.append(f"held {human_age(math.ceil(stats.starts_held_for))}")
    return " · ".join(parts) or "none"


def queue_summary(stats: QueueStats, settings: Mapping[str, Any], workers: Mapping[str, tuple[int, int]],
                  points: Sequence[ThroughputPoint], poison: int = 0) -> dict:
    """One queue's line of the overview; `poison`: how many tasks its poison list holds."""
    rate = failure_rate(points)
    return {
        "name": stats.queue,
        "counts": {state: getattr(stats, state) for state in INDEXES},
        "poison": poison,
        "parked": stats.parked,
        "group_caps": stats.group_caps,
        "oldest_waiting_seconds": round(stats.oldest_waiting_seconds, 3),
        "oldest_waiting": human_age(stats.oldest_waiting_seconds) if stats.waiting else "-",
        "paused": stats.paused,
        "max_active": stats.max_active if stats.max_active > 0 else None,
        "rate_limit": rate_limit_shown(stats),
        "sensitive": bool(settings.get("sensitive")),
        "workers": [{"name": name, "in_flight": in_flight, "concurrency": concurrency}
                    for name, (in_flight, concurrency) in sorted(workers.items())],
        "worker_count": len(workers),
        "in_flight": sum(in_flight for in_flight, _ in workers.values()),
        "concurrency": sum(concurrency for _, concurrency in workers.values()),
        "throughput": throughput_series(points),
        "completed_last_hour": sum(p.completed for p in points),
        "failed_last_hour": sum(p.failed for p in points),
        "failure_rate": None if rate is None else round(rate, 4),
    }


def error_message(error: Any, sensitive: bool) -> str:
    """An error's message as shown: on a sensitive queue only the engine's own."""
    if sensitive and error.tag not in ENGINE_TAGS:
        return HIDDEN_MESSAGE
    return codec.text(error.message)


def _error(error: Any, sensitive: bool) -> dict | None:
    if error is None:
        return None
    shown = error.to_json()
    shown["message"] = error_message(error, sensitive)
    if sensitive and "data" in shown:
        shown["data"] = HIDDEN
    elif "data" in shown:
        shown["data"] = shown_value(shown["data"])
    return shown


def task_row(info: TaskInfo, *, sensitive: bool = False) -> dict:
    """A task in a list: no values; on a sensitive queue no message either."""
    return {
        "task_id": codec.text(info.task_id), "name": codec.text(info.name), "state": info.state,
        "group": None if info.group is None else codec.text(info.group),
        "attempt": info.attempt, "priority": info.priority, "handler_failure_count": info.handler_failure_count,
        "stalled_attempt_count": info.stalled_attempt_count,
        "error": {"tag": codec.text(info.error.tag), "message": error_message(info.error, sensitive)}
        if info.error else None,
        "created_at": iso(info.created_at), "finished_at": iso(info.finished_at),
    }


def decode_id(raw: bytes | str) -> str:
    """A task id as Redis holds it: one that is not UTF-8 keeps its bytes (surrogateescape),
    so it names the same key again (protocol.wire); shown through codec.text."""
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode(errors="surrogateescape")


def depth_exceeds(value: Any, limit: int) -> bool:
    """Whether lists and dicts nest deeper than `limit` in `value` (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def shown_value(value: Any) -> Any:
    """A stored value as pages show it: one nested deeper than MAX_SHOWN_DEPTH is described."""
    if isinstance(value, (list, dict)) and depth_exceeds(value, MAX_SHOWN_DEPTH):
        return f"not shown: nested deeper than {MAX_SHOWN_DEPTH} levels"
    return value


def task_detail(info: TaskInfo, *, sensitive: bool) -> dict:
    """Everything known about one task; a sensitive queue's values and messages are
    replaced by HIDDEN and HIDDEN_MESSAGE."""
    shown = info.to_json()
    shown["task_id"] = codec.text(info.task_id)
    shown["error"] = _error(info.error, sensitive)
    shown["attempts"] = [{**a.to_json(), "error": _error(a.error, sensitive)} for a in info.attempts]
    if sensitive:
        for name in VALUE_FIELDS:
            shown[name] = HIDDEN
        if shown.get("corrupt"):  # a decoding problem may describe the value
            shown["corrupt"] = "a stored value could not be decoded"
    else:
        for name in (*VALUE_FIELDS, "options"):
            shown[name] = shown_value(shown[name])
    shown["attempt_rows"] = attempt_rows(shown)
    # its attempts killed their worker's pod more than once (a stall's cause: the Kubernetes
    # pod's fate, never a user value, so shown on a sensitive queue too)
    shown["poison"] = info.pod_kills >= POISON_KILLS
    shown["sensitive"] = sensitive
    shown["can_retry"] = info.state in ("failed", "canceled")
    # offered on a running task too: the engine refuses it, and the page says why
    shown["show_retry"] = info.state in ("failed", "canceled", "active")
    shown["can_cancel"] = info.state in ("waiting", "delayed", "active")
    return shown


def attempt_rows(task: Mapping[str, Any]) -> list[dict]:
    """Every attempt, oldest first: the recorded ones (attempts that ended without
    success) and the current or final one from the task itself, unless the records
    already hold it (a task that failed for good records its last attempt too)."""
    rows = [{**a, "current": False} for a in task["attempts"]]
    recorded = {a["attempt"] for a in rows}
    if task["attempt"] > 0 and task["attempt"] not in recorded:
        rows.append({"attempt": task["attempt"], "outcome": task["state"], "error": task["error"],
                     "finished_at": task["finished_at"], "current": True})
    elif rows:
        rows[-1]["current"] = True
    return rows


def task_events(events: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Lifecycle events for display: known fields only (a progress event's value is left
    out: progress is shown from the task record, where a sensitive queue hides it)."""
    shown = []
    for event in events:
        fields = {k: event[k] for k in EVENT_FIELDS if k in event}
        for name in ("at", "retry_at"):  # Redis time in ms; retry_at -1: no retry follows
            if str(fields.get(name, "")).isdigit():
                fields[name] = datetime.fromtimestamp(int(fields[name]) / 1000, tz=timezone.utc).isoformat()
            elif name == "retry_at" and name in fields:
                del fields[name]
        shown.append(fields)
    return shown


@dataclass(frozen=True)
class Page:
    """One page of a state list: which rows, and where the neighbours start."""

    offset: int
    limit: int
    total: int

    @property
    def previous(self) -> int | None:
        return max(0, self.offset - self.limit) if self.offset > 0 else None

    @property
    def next(self) -> int | None:
        return self.offset + self.limit if self.offset + self.limit < self.total else None

    @property
    def first_shown(self) -> int:
        return min(self.total, self.offset + 1)

    @property
    def last_shown(self) -> int:
        return min(self.total, self.offset + self.limit)

    def to_json(self) -> dict:
        return {"offset": self.offset, "limit": self.limit, "total": self.total,
                "previous": self.previous, "next": self.next}


class BadRequest(ValueError):
    """A query parameter outside what the dashboard accepts (HTTP 400)."""


def _paging(query: Mapping[str, str], prefix: str, default: int, most: int) -> tuple[int, int]:
    """offset and limit, under their names with `prefix`, of a query string."""
    names = f"{prefix}offset", f"{prefix}limit"
    try:
        offset = int(query.get(names[0]) or 0)
        limit = int(query.get(names[1]) or default)
    except ValueError:
        raise BadRequest(f"{names[0]} and {names[1]} must be integers") from None
    if not 0 <= offset <= MAX_OFFSET or not 1 <= limit <= most:
        raise BadRequest(f"{names[0]} must be between 0 and {MAX_OFFSET} and {names[1]} between 1 and {most}")
    return offset, limit


def parse_group(query: Mapping[str, str]) -> str | None:
    """The group a page names (?group=): it narrows the parked list and is looked up in
    the groups section; None: none."""
    group = query.get("group")
    if not group:
        return None
    try:
        return check_group(group)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def parse_listing(query: Mapping[str, str]) -> tuple[str, int, int, str, str | None]:
    """state (a state index, POISON or PARKED), offset, limit, search and group (parse_group)
    of a list's query string."""
    state = query.get("state") or "waiting"
    if state not in LISTS:
        raise BadRequest(f"unknown state {state!r}; known: {', '.join(LISTS)}")
    offset, limit = _paging(query, "", DEFAULT_PAGE, MAX_PAGE)
    return state, offset, limit, (query.get("search") or "").strip(), parse_group(query)


def parse_groups_page(query: Mapping[str, str]) -> tuple[int, int]:
    """offset and limit of the groups section (?groups_offset=&groups_limit=)."""
    return _paging(query, "groups_", DEFAULT_GROUPS_PAGE, MAX_GROUPS_PAGE)


def group_fact(name: str, value: Any) -> str:
    """One GroupStats value as a cell shows it."""
    if name == "max_active":
        return str(value) if value else "none"
    if name == "rate_limit":  # [tasks, period_seconds], as the JSON says it
        return f"{value[0]} per {value[1]:g}s" if value else "none"
    if isinstance(value, bool):
        return "yes" if value else ""
    return "-" if value is None else str(value)


def group_row(stats: GroupStats) -> dict:
    """A group's line: its GroupStats (as its JSON says them) and `shown`, each column's text."""
    values = stats.to_json()
    return {**values, "shown": {name: group_fact(name, values.get(name, getattr(stats, name)))
                                for name in GROUP_COLUMNS}}


def groups_section(groups: Sequence[GroupStats], page: Page, looked_up: GroupStats | None) -> dict:
    """The queue page's groups: a page of the busiest (`page.total`: the groups with waiting
    tasks), and the group the page names, if any (it may have none waiting: all parked)."""
    return {"columns": list(GROUP_COLUMNS), "rows": [group_row(g) for g in groups], "page": page.to_json(),
            "group": group_row(looked_up) if looked_up is not None else None}


@dataclass(frozen=True)
class ActionResult:
    """What an action did: the HTTP status and a message for people."""

    status: int
    message: str
    previous_state: str | None = None

    def to_json(self) -> dict:
        return {"ok": self.status == 200, "message": self.message, "previous_state": self.previous_state}


def retry_result(task_id: str, previous_state: str | None) -> ActionResult:
    """TaskQueue.retry's answer (the state the task was in) as the dashboard reports it:
    only failed and canceled tasks go back to waiting; anything else was left alone."""
    if previous_state is None:
        return ActionResult(404, f"no task {task_id!r} in this queue")
    if previous_state in ("failed", "canceled"):
        return ActionResult(200, f"task {task_id!r} was {previous_state}, now waiting", previous_state)
    if previous_state == "active":
        return ActionResult(409, f"task {task_id!r} is running: only failed or canceled tasks can be retried "
                                 "(cancel it first, or wait until it settles)", previous_state)
    return ActionResult(409, f"task {task_id!r} is {previous_state}: only failed or canceled tasks can be "
                             "retried", previous_state)


def cancel_result(task_id: str, previous_state: str | None) -> ActionResult:
    """TaskQueue.cancel's answer: only waiting, delayed and active tasks are canceled."""
    if previous_state is None:
        return ActionResult(404, f"no task {task_id!r} in this queue")
    if previous_state in ("waiting", "delayed", "active"):
        return ActionResult(200, f"task {task_id!r} was {previous_state}, now canceled", previous_state)
    return ActionResult(409, f"task {task_id!r} already {previous_state}: only waiting, delayed or running "
                             "tasks can be canceled", previous_state)


def schedule_view(status: Any) -> dict:
    """A schedule's line (a ScheduleStatus); its payload is not shown (it may be sensitive)."""
    spec = status.spec
    return {
        "id": status.id,
        "queue": spec.queue if spec else None,
        "task": spec.task if spec else None,
        "cron": spec.cron if spec else None,
        "timezone": spec.timezone if spec else None,
        "missed": spec.missed if spec else None,
        "suspended": status.suspended,
        "next_tick": iso(status.next_tick), "last_tick": iso(status.last_tick),
        "last_task_id": status.last_task_id, "materialized": status.materialized,
        "last_error": status.last_error, "last_error_at": iso(status.last_error_at),
        "readable": spec is not None,
    }
