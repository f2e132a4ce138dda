"""Conditions following the kstatus conventions, computed without I/O.

Every resource carries `Ready` plus kstatus' abnormal-true pair: `Reconciling`
(work in progress, will settle by itself) and `Stalled` (cannot progress without
a change from outside: an invalid spec, a missing Secret, a failed rollout), so
Flux, Argo CD, cli-utils and `kubectl wait` agree without configuration.
`lastTransitionTime` moves only when a condition's status changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

from .api import MESSAGE_LIMIT, Event


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Check:
    """One condition's verdict: status "True", "False" or "Unknown"."""

    type: str
    status: str
    reason: str
    message: str

    @classmethod
    def of(cls, type_: str, ok: bool, reason: str, message: str) -> "Check":
        return cls(type_, "True" if ok else "False", reason, message)


@dataclass(frozen=True)
class Problem:
    """Why a resource is not Ready; `permanent` problems need a change from outside (Stalled)."""

    reason: str
    message: str
    permanent: bool = False


def problem_event(problem: Problem | None, previous: Iterable[dict[str, Any]] = ()) -> Event | None:
    """A Warning for a problem not reported yet, judged by Ready's reason (so a problem is
    posted once, not on every poll): a transient one once per outage, however its detail
    moves (a connection closed, then refused); a permanent one again when its message
    changes (the spec was edited into another mistake)."""
    if problem is None:
        return None
    was = next((c for c in previous or () if c.get("type") == "Ready"), None)
    if was is not None and was.get("reason") == problem.reason and (
            not problem.permanent or was.get("message") == problem.message[:MESSAGE_LIMIT]):
        return None
    return Event("Warning", problem.reason, problem.message)


def condition(check: Check, generation: int | None, previous: Iterable[dict[str, Any]] = (),
              now: datetime | None = None) -> dict[str, Any]:
    before = next((c for c in previous or () if c.get("type") == check.type), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == check.status else None
    return {
        "type": check.type, "status": check.status, "reason": check.reason, "message": check.message[:MESSAGE_LIMIT],
        "observedGeneration": generation, "lastTransitionTime": since or now_iso(now),
    }


def conditions(checks: list[Check], problem: Problem | None, generation: int | None,
               previous: Iterable[dict[str, Any]] = (), now: datetime | None = None) -> list[dict[str, Any]]:
    """`Ready`, `Reconciling`, `Stalled` from the first problem, then the specific checks."""
    if problem is None:
        summary = [Check("Ready", "True", "Ready", "all checks pass"),
                   Check("Reconciling", "False", "Ready", "nothing to do"),
                   Check("Stalled", "False", "Ready", "nothing is blocked")]
    else:
        summary = [Check("Ready", "False", problem.reason, problem.message),
                   Check("Reconciling", "False" if problem.permanent else "True", problem.reason, problem.message),
                   Check("Stalled", "True" if problem.permanent else "False", problem.reason,
                         problem.message if problem.permanent else "not stalled: retrying")]
    previous = list(previous or ())
    return [condition(c, generation, previous, now) for c in summary + checks]


def _iso(value: datetime | None) -> str | None:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else None


def schedule_progress(state: Any) -> dict[str, Any]:
    """Status fields mirrored from the scheduler's record of a schedule."""
    return {
        "lastTickTime": _iso(state.last_tick),
        "lastTaskID": state.last_task_id,
        "nextTickTime": _iso(state.next_tick),
        "missedTicks": {"skipped": state.skipped, "coalesced": state.coalesced, "backfilled": state.backfilled},
        "lastError": state.last_error,
    }
