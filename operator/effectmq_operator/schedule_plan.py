"""The Schedule side's decisions, computed without I/O from what was observed.

`plan` turns the facts one reconcile gathered (the definition parsed, the Queue
found, the outcome of storing it in the Queue's Redis, the tick passes there) into
the status to write and the Events to post, as `queue_plan.plan` does for a Queue.
`unwanted` is garbage collection's verdict on one stored schedule, and `due_mirror`
which changed schedules the status mirror writes now and which it holds back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Mapping, Sequence, TypeVar

from effectmq.scheduler.errors import InvalidSchedule
from effectmq.scheduler.model import ScheduleSpec

from . import builders
from .runtime.registry import Key
from .api import Event
from .status import Check, Problem, conditions, problem_event

T = TypeVar("T")  # a Redis, as the caller names it
MIRROR_EVERY = 30.0  # a Schedule that fires more often gets its status written at most this often
RESTORED = Event("Warning", "ScheduleRestored", (
    "the schedule was missing from its Queue's Redis (removed outside this Schedule: by hand, by another operator, "
    "or the Redis lost its data) and was stored again; ticks due while it was missing were not materialized"))


def definition(namespace: str, name: str, spec: Mapping[str, Any]) -> ScheduleSpec | InvalidSchedule:
    """The scheduler's definition of a Schedule resource, or why it has none."""
    try:
        return ScheduleSpec.from_json(builders.schedule_spec(namespace, name, dict(spec)))
    except InvalidSchedule as exc:
        return exc


def schedule_key(schedule_id: str) -> Key:
    """The resource of an operator schedule id "<namespace>/<name>" (a foreign id finds none)."""
    namespace, _, name = schedule_id.partition("/")
    return namespace, name


def queue_ref(body: Mapping[str, Any]) -> str:
    name: str = ((body.get("spec") or {}).get("queueRef") or {}).get("name", "")
    return name


@dataclass(frozen=True)
class Stored:
    """The definition is in the Queue's Redis (`restored`: it had gone and was put back)."""

    progress: Mapping[str, Any] = field(default_factory=dict)  # the scheduler's state, as status fields
    restored: bool = False


@dataclass(frozen=True)
class Missing:
    """The stored record had gone and storing it again failed, for `cause`."""

    cause: Problem


@dataclass(frozen=True)
class Unreachable:
    """Storing, reading or removing the definition failed."""

    problem: Problem


Outcome = Stored | Missing | Unreachable


@dataclass(frozen=True)
class ScheduleFacts:
    """What one reconcile of a Schedule observed."""

    definition: ScheduleSpec | InvalidSchedule
    queue: str  # "<namespace>/<name>" of the Queue it refers to
    queue_found: bool  # the Queue exists and is not being deleted
    queue_problem: Problem | None = None  # the Queue's Redis cannot be told (an invalid Queue, a missing Secret)
    outcome: Outcome | None = None  # None: nothing was stored, read or removed
    ticks_problem: Problem | None = None  # why the tick passes on its Redis fail, while they do


@dataclass(frozen=True)
class SchedulePlan:
    status: dict[str, Any]
    write: bool  # the status differs from the one shown
    events: list[Event]
    retry: bool  # the outcome failed: again with backoff


def plan(facts: ScheduleFacts, *, generation: int | None, previous: Mapping[str, Any]) -> SchedulePlan:
    """The status (conditions, and the scheduler's progress once stored) and Events of a
    Schedule. The first problem found, in the order checked, is Ready's reason."""
    checks: list[Check] = []
    problems: list[Problem] = []
    if isinstance(facts.definition, InvalidSchedule):
        problems.append(Problem("InvalidSchedule", str(facts.definition), permanent=True))
        checks.append(Check.of("ScheduleValid", False, "InvalidSchedule", str(facts.definition)))
    else:
        spec = facts.definition
        checks.append(Check.of("ScheduleValid", True, "Valid", f"{spec.cron} in {spec.timezone}"))
    if not facts.queue_found:
        problems.append(Problem("QueueNotFound", f"Queue {facts.queue} not found", permanent=True))
        checks.append(Check.of("QueueFound", False, problems[-1].reason, problems[-1].message))
    else:
        checks.append(Check.of("QueueFound", True, "Found", f"Queue {facts.queue}"))
        if facts.queue_problem is not None:
            problems.append(facts.queue_problem)
            checks.append(_unreachable(facts.queue_problem))
    notices: list[Event] = []
    progress: Mapping[str, Any] = {}
    outcome = facts.outcome
    if isinstance(outcome, Stored):
        progress = outcome.progress
        notices += [RESTORED] if outcome.restored else []
        failing = facts.ticks_problem
        checks.append(Check.of("RedisReachable", True, "Connected", "schedule stored in the Queue's Redis"))
        checks.append(Check.of("TicksMaterialized", failing is None, failing.reason if failing else "Materializing",
                               failing.message if failing else "the tick passes on its Redis succeed"))
        problems += [failing] if failing else []
    elif isinstance(outcome, Missing):
        checks.append(_unreachable(outcome.cause))
        problems.append(Problem("ScheduleMissing", "the schedule is missing from its Queue's Redis (removed outside "
                                f"this Schedule) and could not be stored again: {outcome.cause.message}"))
    elif isinstance(outcome, Unreachable):
        checks.append(_unreachable(outcome.problem))
        problems.append(outcome.problem)
    problem = problems[0] if problems else None
    shown = previous.get("conditions") or ()
    status = {**progress, "observedGeneration": generation,
              "conditions": conditions(checks, problem, generation, shown)}
    warning = problem_event(problem, shown)
    return SchedulePlan(status=status, write=any(previous.get(k) != v for k, v in status.items()),
                        events=[*notices, *([warning] if warning else [])],
                        retry=isinstance(outcome, (Missing, Unreachable)))


def _unreachable(problem: Problem) -> Check:
    return Check.of("RedisReachable", False, problem.reason, problem.message)


@dataclass(frozen=True)
class OtherRedis(Generic[T]):
    """A stored schedule whose Queue's Redis is reached through another URL: it stays if
    both reach the same store."""

    queue_redis: T


def unwanted(schedule: Mapping[str, Any] | None, queue: str, queue_exists: bool, queue_redis: T | None,
             here: T) -> str | OtherRedis[T] | None:
    """Why a schedule stored through `here` should go (None: it stays). `schedule` is its
    live resource, `queue` ("<namespace>/<name>") its Queue, `queue_redis` where that
    Queue's Redis was last resolved. It stays when that is not resolved yet: nothing
    valid is removed on a guess."""
    if schedule is None:
        return "no live Schedule resource"
    if not queue_exists:
        return f"its Queue {queue} does not exist"
    if queue_redis is None or queue_redis == here:
        return None
    return OtherRedis(queue_redis)


def due_mirror(changed: Sequence[str], held: Sequence[str], mirrored_at: Mapping[str, float | None],
               now: float) -> tuple[list[str], set[str]]:
    """Of the schedules that changed (and those held back before), in order and once each:
    those whose status is written now, and those held back because a change of theirs
    was written less than MIRROR_EVERY ago. A schedule absent from `mirrored_at` is not
    one of this Redis' (another namespace, a standalone schedule, or gone): neither."""
    due: list[str] = []
    later: set[str] = set()
    for schedule_id in dict.fromkeys([*changed, *held]):
        if schedule_id not in mirrored_at:
            continue
        at = mirrored_at[schedule_id]
        if at is not None and now - at < MIRROR_EVERY:
            later.add(schedule_id)
        else:
            due.append(schedule_id)
    return due, later


def progress_differs(progress: Mapping[str, Any], shown: Mapping[str, Any]) -> bool:
    """Whether the scheduler's state shows anything the status does not."""
    return any(shown.get(k) != v for k, v in progress.items())
