"""Every queue setting in one table: its Python name, Queue resource field, kind, default,
bounds, Redis field and description.

Read from here: `TaskQueue`'s defaults and validation (`queue.py`), the defaults the
scripts fall back on (`LUA_DEFAULTS`), the operator's spec defaults and
bounds (`effectmq_operator.spec`). Written from here by `tooling/sync_settings.py`: the
CRD schema's defaults, bounds and descriptions (both copies) and `docs/settings.md`;
`tests/runtime/test_settings_table.py` fails while they differ. Changing a default is
one edit here, then `python tooling/sync_settings.py`.

A pure module: no I/O, imports only constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any, Mapping

from .protocol import (MAX_COUNT, MAX_DEDUP_WINDOW, MAX_DURATION, MAX_LOCK_TIMEOUT, MAX_RATE_PERIOD, MAX_RATE_TASKS,
                       MAX_RETENTION, MIN_RATE_PERIOD)


class Kind(Enum):
    FLAG = "flag"  # yes/no; Redis "1" / "0"
    COUNT = "count"  # integer; Redis as is
    SECONDS = "seconds"  # Python seconds (float); Redis milliseconds
    RETENTION = "retention"  # seconds, None or -1 keeps forever; Redis ms, -1 keeps
    RETRY = "retry"  # a retry policy; Redis its JSON
    RATE = "rate"  # (tasks, period seconds) or None; Redis "<tasks> <period_ms>"
    ENUM = "enum"  # one of `choices` (resource only)


@dataclass(frozen=True)
class Setting:
    """One queue setting. `name` is the Python keyword (TaskQueue, configure, the worker),
    None for what only the operator reads; `field` its path under a Queue's spec, None when
    the resource has no such field; `redis` the field of the queue's meta hash that carries
    it to every producer, worker and script, None when it does not travel through Redis."""

    name: str | None
    field: str | None
    kind: Kind
    default: Any
    description: str
    minimum: float | None = None
    maximum: float | None = None
    redis: str | None = None
    unit: str = ""
    field_minimum: int | None = None  # the resource's own lower bound, when whole seconds make it differ
    field_default: bool = True  # False: the CRD leaves the field unset (the runtime's default applies)
    lua: bool = False  # scripts fall back on the default (LUA_DEFAULTS) when meta has none
    choices: tuple[str, ...] = ()

    def encode(self, value: Any) -> str:
        """The meta hash form of a value (already validated)."""
        if self.kind is Kind.FLAG:
            return "1" if value else "0"
        if self.kind is Kind.SECONDS:
            return str(int(round(value * 1000)))
        if self.kind is Kind.RETENTION:
            return "-1" if value is None or value < 0 else str(int(round(value * 1000)))
        if self.kind is Kind.RATE:
            tasks, period = value
            return f"{tasks} {max(1, int(round(period * 1000)))}"
        return str(value)

    def clamp(self, value: float) -> float:
        """A stored value within bounds, whoever wrote it."""
        low = -math.inf if self.minimum is None else self.minimum
        high = math.inf if self.maximum is None else self.maximum
        return min(max(value, low), high)

    @property
    def resource_minimum(self) -> float | None:
        return self.minimum if self.field_minimum is None else self.field_minimum


TEN_YEARS = int(MAX_DURATION)
_S = Setting
TABLE: tuple[Setting, ...] = (
    # -- travel through Redis: every producer, worker and script reads them ------------
    _S("paused", "paused", Kind.FLAG, False, redis="paused", lua=True,
       description="Workers acquire no new tasks while true (the attempts they hold finish); producers may "
                   "still offer. The operator scales a paused queue down to scaling.minReplicas, keeping "
                   "pods that still run attempts until they drain."),
    _S("sensitive", "sensitive", Kind.FLAG, False, redis="sensitive",
       description="The dashboard shows no payload, result or progress of this queue's tasks."),
    _S("max_active", "maxActive", Kind.COUNT, 0, minimum=0, maximum=MAX_COUNT, redis="max_active", lua=True,
       unit="attempts",
       description="Cap on tasks active (leased) at once across all workers of the queue; 0 means no cap. It "
                   "caps the replicas too: no more pods than maxActive / (worker.concurrency + "
                   "worker.prefetch), rounded up."),
    _S("max_retries", "maxRetries", Kind.COUNT, 3, minimum=0, maximum=MAX_COUNT, redis="max_retries",
       field_default=False, unit="failures",
       description="Handler failures retried before a task fails for good (0: never retried), each after the "
                   "delay of retry. A task may override it (offer's max_retries, a Schedule's "
                   "task.maxRetries)."),
    _S("max_stalled_count", "maxStalledCount", Kind.COUNT, 1, minimum=0, maximum=MAX_COUNT,
       redis="max_stalled_count", unit="stalls",
       description="Expired leases (a worker died or stopped renewing, see lockTimeoutSeconds) tolerated per "
                   "task: each one puts the task back to waiting, the next one fails it as stalled "
                   "(~effectmq/Error/Stalled)."),
    _S("lock_timeout", "lockTimeoutSeconds", Kind.SECONDS, 30.0, minimum=0.01, maximum=MAX_LOCK_TIMEOUT,
       field_minimum=1, redis="lock_timeout_ms", unit="s",
       description="Lease length of an attempt, in seconds: a worker renews its leases every "
                   "lockRefreshSeconds, and a lease not renewed for this long expires (the task counts as "
                   "stalled, see maxStalledCount)."),
    _S("retention_completed", "retention.completedSeconds", Kind.RETENTION, 86400.0, minimum=-1,
       maximum=MAX_RETENTION, field_minimum=0, redis="retention_completed_ms", unit="s",
       description="Seconds a completed task's record (its result included) is kept after it completed; 0 "
                   "deletes it at once."),
    _S("retention_failed", "retention.failedSeconds", Kind.RETENTION, 604800.0, minimum=-1,
       maximum=MAX_RETENTION, field_minimum=0, redis="retention_failed_ms", unit="s",
       description="Seconds a failed or canceled task's record (its error included) is kept after it "
                   "settled; 0 deletes it at once."),
    _S("dedup_window", None, Kind.SECONDS, 604800.0, minimum=0.001, maximum=MAX_DEDUP_WINDOW,
       redis="dedup_window_ms", lua=True, unit="s",
       description="How long an explicit task id stays reserved after its record expired."),
    _S("events_maxlen", None, Kind.COUNT, 10_000, minimum=0, maximum=MAX_COUNT, redis="events_maxlen",
       lua=True, unit="events", description="Lifecycle events kept in the queue's stream (approximately)."),
    _S("events_always", None, Kind.FLAG, False, redis="events_always", lua=True,
       description="Write lifecycle events even while nobody reads them (by default only while a reader "
                   "asked within the last minute)."),
    _S("retry", "retry", Kind.RETRY, None, redis="retry",
       description="The delay before each retry of a failed attempt (maxRetries says how many). Unset fields "
                   "take their defaults."),
    _S("rate_limit", "rateLimit", Kind.RATE, None, redis="rate_limit", field_default=False,
       description="At most rateLimit.tasks attempts start in any window of rateLimit.periodSeconds, across all "
                   "workers of the queue, by Redis time (acquire keeps a log of the starts); unset: no limit. "
                   "Workers then hold no leases ahead (prefetch): a held lease would start its handler later "
                   "than its lease, and the window the downstream service sees would no longer hold."),
    _S("group_max_active", "groups.maxActive", Kind.COUNT, 0, minimum=0, maximum=MAX_COUNT, redis="group_max_active",
       unit="attempts",
       description="Cap on the attempts of each task group active at once, across all workers; 0 means no cap. "
                   "A group's own cap (TaskQueue.configure_group) wins. Acquire parks a task "
                   "of a group at its cap, and hands it back when one of the group's attempts ends; parked "
                   "tasks are no demand for more replicas."),
    _S("group_rate_limit", "groups.rateLimit", Kind.RATE, None, redis="group_rate_limit", field_default=False,
       description="At most groups.rateLimit.tasks attempts of each task group start in any window of "
                   "groups.rateLimit.periodSeconds, across all workers, by Redis time; unset: no limit. A "
                   "group's own limit (TaskQueue.configure_group) wins. Acquire parks a task of a group at "
                   "its limit, goes on to other groups, and hands it back when the group's window allows."),
    # -- the retry policy's fields, as a Queue resource spells them ---------------------
    _S(None, "retry.backoff", Kind.ENUM, "Exponential", choices=("Fixed", "Exponential"),
       description="Fixed: always initialDelaySeconds. Exponential: doubling from initialDelaySeconds "
                   "up to maxDelaySeconds."),
    _S(None, "retry.initialDelaySeconds", Kind.COUNT, 1, minimum=0, maximum=TEN_YEARS, unit="s",
       description="Seconds before the first retry (Fixed: before every retry); at most maxDelaySeconds."),
    _S(None, "retry.maxDelaySeconds", Kind.COUNT, 300, minimum=0, maximum=TEN_YEARS, unit="s",
       description="Seconds of the longest delay between retries: where Exponential stops doubling."),
    _S(None, "retry.jitter", Kind.FLAG, True,
       description="Spread each delay at random over its upper half, so failures of a burst do not retry "
                   "together."),
    # -- the rate limit's fields, as a Queue resource spells them -------------------------
    _S(None, "rateLimit.tasks", Kind.COUNT, None, minimum=1, maximum=MAX_RATE_TASKS, unit="tasks",
       description="Attempts that may start in one window; the log of starts holds at most this many "
                   "entries."),
    _S(None, "rateLimit.periodSeconds", Kind.SECONDS, None, minimum=MIN_RATE_PERIOD, maximum=MAX_RATE_PERIOD,
       unit="s", description="Length of the sliding window, in seconds (the grain of Redis time, 1 ms, up to a "
                             "day)."),
    _S(None, "groups.rateLimit.tasks", Kind.COUNT, None, minimum=1, maximum=MAX_RATE_TASKS, unit="tasks",
       description="Attempts of one group that may start in one window."),
    _S(None, "groups.rateLimit.periodSeconds", Kind.SECONDS, None, minimum=MIN_RATE_PERIOD, maximum=MAX_RATE_PERIOD,
       unit="s", description="Length of each group's sliding window, in seconds (1 ms up to a day)."),
    # -- read by the operator only -------------------------------------------------------
    _S(None, "redis.tls.enabled", Kind.FLAG, False, description="Connect with TLS (a rediss:// URL does too)."),
    _S(None, "redis.tls.insecureSkipVerify", Kind.FLAG, False,
       description="Do not verify the server certificate (testing only)."),
    _S(None, "lockRefreshSeconds", Kind.COUNT, 10, minimum=1, maximum=TEN_YEARS, unit="s",
       description="How often, in seconds, a worker renews its leases; must be less than lockTimeoutSeconds "
                   "(a third of it survives two failed renewals)."),
    _S("concurrency", "worker.concurrency", Kind.COUNT, 10, minimum=1, unit="attempts",
       description="Attempts one worker pod runs at once. Scaling counts concurrency plus prefetch as the "
                   "leases one pod takes."),
    _S(None, "worker.terminationGracePeriodSeconds", Kind.COUNT, 60, minimum=0, maximum=86400, unit="s",
       description="Seconds a stopping worker pod may drain (it stops acquiring, finishes or hands back its "
                   "attempts) before it is killed; the worker is told to finish draining a margin earlier "
                   "(a sixth, at least 5 s)."),
    _S(None, "worker.progressDeadlineSeconds", Kind.COUNT, 600, minimum=1, maximum=86400, unit="s",
       description="Seconds a rollout of the worker Deployment, or a worker pod of its current template, may "
                   "take to become available before it counts as failed (Ready=False, Stalled=True). "
                   "Crash-looping pods count as failed sooner, after 3 restarts."),
    _S(None, "scaling.minReplicas", Kind.COUNT, 0, minimum=0, unit="pods",
       description="The fewest worker pods, whatever the backlog; 0 lets an idle queue scale to zero (after "
                   "cooldownSeconds)."),
    _S(None, "scaling.maxReplicas", Kind.COUNT, 10, minimum=0, unit="pods",
       description="The most worker pods, whatever the backlog; maxActive may cap them lower."),
    _S(None, "scaling.targetTasksPerReplica", Kind.COUNT, 50, minimum=1, unit="tasks",
       description="Tasks (waiting plus active) one pod is expected to carry: the operator asks for "
                   "(waiting + active) / targetTasksPerReplica pods, rounded up, within minReplicas and "
                   "maxReplicas, and never fewer than the work in flight occupies."),
    _S(None, "scaling.activationTasks", Kind.COUNT, 1, minimum=0, unit="tasks",
       description="Waiting tasks needed to scale from zero to one pod; fewer wait until more arrive (or "
                   "minReplicas is above 0)."),
    _S(None, "scaling.pollIntervalSeconds", Kind.COUNT, 10, minimum=1, maximum=3600, unit="s",
       description="Seconds between the operator's reads of the backlog, each followed by a decision on the "
                   "replicas (status.lastPollTime shows the last one)."),
    _S(None, "scaling.scaleDownStabilizationSeconds", Kind.COUNT, 300, minimum=0, maximum=3600, unit="s",
       description="Seconds of recent decisions remembered: the operator scales down only to the highest "
                   "replica count it wanted within them (as a HorizontalPodAutoscaler's scale-down "
                   "stabilization window)."),
    _S(None, "scaling.cooldownSeconds", Kind.COUNT, 300, minimum=0, maximum=86400, unit="s",
       description="Seconds without any waiting or active task before the last pod goes (scaling to zero, "
                   "when minReplicas is 0)."),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in TABLE if s.name}
BY_FIELD: dict[str, Setting] = {s.field: s for s in TABLE if s.field}
# What TaskQueue.configure() takes: the settings a queue keeps in its meta hash.
STORED: dict[str, Setting] = {s.name: s for s in TABLE if s.name and s.redis}
META_FIELDS: dict[str, str] = {s.name: s.redis for s in TABLE if s.name and s.redis}


def default(name: str) -> Any:
    """The default of a setting, by Python name."""
    return BY_NAME[name].default


@dataclass(frozen=True)
class QueueSettings:
    """The stored settings a process acts on for one queue (`TaskQueue.config`): what the
    TaskQueue was given, then what `refresh_settings()` read from the queue's meta hash.
    Frozen and replaced whole, so a reader (the engine settling a lease, maintenance)
    sees all of one refresh or all of the one before, never a mix. Field names are the
    table's; `retry` is a policy object (client/retry.py)."""

    lock_timeout: float
    max_retries: int
    max_stalled_count: int
    retention_completed: float | None
    retention_failed: float | None
    retry: Any
    # (tasks, period seconds): the TaskQueue's own, never a stored one (acquire.lua reads
    # that itself, and this one only while none is stored, so removing it lifts the limit).
    rate_limit: tuple[int, float] | None = None

    def adopt(self, stored: Mapping[str, Any]) -> QueueSettings:
        """These settings with those stored (`TaskQueue.settings()`) taken over, numbers
        clamped within the table's bounds whoever wrote them; one not stored is kept."""
        changes: dict[str, Any] = {f.name: BY_NAME[f.name].clamp(stored[f.name]) for f in fields(self)
                   if f.name not in ("retry", "rate_limit") and stored.get(f.name) is not None}
        if stored.get("retry"):
            changes["retry"] = stored["retry"]
        return replace(self, **changes)


def decode_rate(text: str | bytes | None) -> tuple[int, float] | None:
    """A stored rate limit ("<tasks> <period_ms>") as (tasks, period seconds), clamped within
    the table's bounds as acquire.lua clamps it; None when unset or unreadable (no limit)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    parts = (text or "").split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    tasks = int(BY_FIELD["rateLimit.tasks"].clamp(int(parts[0])))
    return tasks, BY_FIELD["rateLimit.periodSeconds"].clamp(int(parts[1]) / 1000)


# The meta fields scripts fall back on when the hash has none, in their stored form.
# scripts.py writes them into every script as the Lua table DEFAULTS (every script emits
# events, most may forget a record); per-call defaults travel in each script's ARGV.
LUA_DEFAULTS: dict[str, int] = {s.redis: int(s.encode(s.default)) for s in TABLE if s.lua and s.redis}


def lua_defaults() -> str:
    """The Lua source of the DEFAULTS table."""
    entries = ", ".join(f"{name} = {value}" for name, value in LUA_DEFAULTS.items())
    return f"local DEFAULTS = {{{entries}}}\n"


def resource_defaults() -> dict[str, Any]:
    """Schema defaults of a Queue's spec, by field path."""
    return {s.field: s.default for s in TABLE if s.field and s.field_default and s.default is not None}


def _whole(bound: float) -> float:
    """A schema bound: an integer unless it has a fraction (rateLimit.periodSeconds' 0.001)."""
    return int(bound) if float(bound).is_integer() else bound


def resource_maxima() -> dict[str, float]:
    """Schema maxima of a Queue's spec, by field path (int32 counts are the schema's own type bound)."""
    return {s.field: _whole(s.maximum) for s in TABLE
            if s.field and s.maximum is not None and s.kind is not Kind.FLAG and s.maximum != MAX_COUNT}


def resource_minima() -> dict[str, float]:
    return {s.field: _whole(s.resource_minimum) for s in TABLE
            if s.field and s.resource_minimum is not None and s.kind is not Kind.FLAG}
