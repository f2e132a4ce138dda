"""Status and conditions (kstatus conventions), computed without I/O."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterable


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None,
              previous: Iterable[dict] = (), now: datetime | None = None) -> dict[str, Any]:
    """One condition; lastTransitionTime only moves when the status flips."""
    status = "True" if ok else "False"
    before = next((c for c in previous or () if c.get("type") == type_), None)
    since = before["lastTransitionTime"] if before and before.get("status") == status else now_iso(now)
    return {
        "type": type_, "status": status, "reason": reason, "message": message,
        "observedGeneration": generation, "lastTransitionTime": since,
    }


def with_ready(conditions: list[dict], generation: int | None, previous: Iterable[dict] = (),
               now: datetime | None = None) -> list[dict]:
    """Add `Ready`: true when every other condition is, else the first failing one's reason."""
    failing = next((c for c in conditions if c["status"] != "True"), None)
    if failing is None:
        ready = condition("Ready", True, "Reconciled", "all conditions are met", generation, previous, now)
    else:
        ready = condition("Ready", False, failing["reason"], failing["message"], generation, previous, now)
    return [ready, *conditions]


def queue_status(*, generation: int | None, previous: dict, redis_ok: bool, redis_reason: str, redis_message: str,
                 deployment_ok: bool, deployment_message: str, now: datetime | None = None) -> dict[str, Any]:
    """Status written after reconciling a Queue's spec."""
    prev = previous.get("conditions") or []
    conditions = [
        condition("RedisReachable", redis_ok, redis_reason, redis_message, generation, prev, now),
        condition("WorkersDeployed", deployment_ok, "DeploymentApplied" if deployment_ok else "DeploymentFailed",
                  deployment_message, generation, prev, now),
    ]
    return {"observedGeneration": generation, "conditions": with_ready(conditions, generation, prev, now)}


def backlog_status(stats: Any, replicas: int, ready_replicas: int, desired: int) -> dict[str, Any]:
    """Status written after each poll: what the queue holds and what the workers do."""
    return {
        "backlog": {"waiting": stats.waiting, "delayed": stats.delayed, "active": stats.active,
                    "failed": stats.failed, "completed": stats.completed},
        "oldestWaitingSeconds": round(stats.oldest_waiting_seconds, 3),
        "replicas": replicas,
        "readyReplicas": ready_replicas,
        "desiredReplicas": desired,
    }


def replace_condition(conditions: list[dict], new: dict, generation: int | None,
                      now: datetime | None = None) -> list[dict]:
    """Swap one condition in, recomputing Ready from the rest."""
    others = [c for c in conditions if c.get("type") not in (new["type"], "Ready")]
    return with_ready(others + [new], generation, conditions, now)


def _iso(value) -> str | None:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ") if value is not None else None


def schedule_progress(state) -> dict[str, Any]:
    """Status fields mirrored from the scheduler's record of a schedule."""
    return {
        "lastTickTime": _iso(state.last_tick),
        "lastTaskId": state.last_task_id,
        "nextTickTime": _iso(state.next_tick),
        "missedTicks": {"skipped": state.skipped, "coalesced": state.coalesced, "backfilled": state.backfilled},
        "lastError": state.last_error,
    }


def schedule_status(*, generation: int | None, previous: dict, checks: list[tuple[str, bool, str, str]],
                    now: datetime | None = None) -> dict[str, Any]:
    """Conditions of a Schedule from (type, ok, reason, message) checks, plus Ready."""
    prev = previous.get("conditions") or []
    conditions = [condition(t, ok, reason, message, generation, prev, now) for t, ok, reason, message in checks]
    return {"observedGeneration": generation, "conditions": with_ready(conditions, generation, prev, now)}
