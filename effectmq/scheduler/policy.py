"""Which ticks to materialize, given the cursor and Redis time (pure).

A due tick is one after the cursor (the last settled instant) and at or before
`now`. Each due tick is in exactly one of three bands:
- stale: older than `starting_deadline` (or than what the queue's dedup window
  can protect): never materialized, counted as skipped;
- missed: overdue by at least `missed_after` seconds (scheduler down, suspended,
  Redis unreachable): the policy decides --
  `skip` materializes none, `coalesce` one task for the latest with the span it
  stands for, `backfill` the latest `max_backfill`, oldest first;
- on time: less overdue than that (a pass that ran a little late): materialized,
  at most MAX_ON_TIME per pass.
Work is bounded by those limits and by days of calendar (`Timeline.count`), never
by the number of missed ticks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .timeline import Timeline

SKIP, COALESCE, BACKFILL = "skip", "coalesce", "backfill"
MISSED_MODES = (SKIP, COALESCE, BACKFILL)
MAX_ON_TIME = 1000
MAX_BACKFILL = 1000


@dataclass(frozen=True)
class MissedPolicy:
    """What a schedule does with ticks it missed."""

    mode: str = COALESCE
    max_backfill: int = 10
    starting_deadline: float | None = None  # seconds; a tick older than this never runs
    missed_after: float = 60.0  # seconds overdue before a tick counts as missed


@dataclass(frozen=True)
class Span:
    """The missed ticks a coalesced task stands for (itself included)."""

    first: int
    last: int
    count: int


@dataclass(frozen=True)
class PlannedTick:
    at: int  # instant, seconds since the epoch
    span: Span | None = None  # set on the task that coalesces missed ticks


@dataclass(frozen=True)
class Plan:
    """The outcome of one decision: ticks to offer (ascending) and the cursor after them."""

    ticks: tuple[PlannedTick, ...]
    cursor_ms: int  # the new cursor: the latest due tick (unchanged if none was due)
    next_fire_ms: int | None  # the first tick after it
    skipped: int = 0
    coalesced: int = 0  # missed ticks folded into a coalesced task (not offered on their own)
    backfilled: int = 0  # missed ticks offered under backfill


def _latest_n(tl: Timeline, last: int | None, floor: int, n: int) -> list[int]:
    """Up to n ticks in (floor, last], ascending, where `last` is a tick (or None)."""
    out: list[int] = []
    t = last
    while t is not None and t > floor and len(out) < n:
        out.append(t)
        t = tl.latest_at_or_before(t - 1) if t - 1 > floor else None
    out.reverse()
    return out


def plan(tl: Timeline, cursor_ms: int, now_ms: int, policy: MissedPolicy, *,
         max_age: float | None = None) -> Plan:
    """Decide what to materialize at `now_ms` (Redis time) after `cursor_ms`.

    `max_age` (seconds) is a second deadline imposed by the caller: the scheduler
    passes what the target queue's dedup window can protect, so a re-offer of an
    old tick can never create its task twice.
    """
    cursor, now = cursor_ms // 1000, now_ms // 1000
    latest = tl.latest_at_or_before(now)
    if latest is None or latest <= cursor:
        nxt = tl.next_after(max(cursor, now))
        return Plan((), cursor_ms, None if nxt is None else nxt * 1000)

    deadlines = [d for d in (policy.starting_deadline, max_age) if d is not None]
    floor, skipped = cursor, 0
    if deadlines:
        stale_upto = (now_ms - round(min(deadlines) * 1000) - 1) // 1000  # older than the deadline
        if stale_upto > cursor:
            skipped += tl.count(cursor, min(stale_upto, latest))
            floor = stale_upto
    missed_upto = (now_ms - round(policy.missed_after * 1000)) // 1000

    on_time_floor = max(floor, missed_upto)
    on_time = _latest_n(tl, latest, on_time_floor, MAX_ON_TIME)
    if len(on_time) == MAX_ON_TIME:
        skipped += tl.count(on_time_floor, on_time[0] - 1)  # beyond MAX_ON_TIME

    missed: list[PlannedTick] = []
    coalesced = backfilled = 0
    missed_hi = min(missed_upto, latest)
    n_missed = tl.count(floor, missed_hi) if missed_hi > floor else 0
    if n_missed and policy.mode == SKIP:
        skipped += n_missed
    elif n_missed and policy.mode == COALESCE:
        first, last = tl.next_after(floor), tl.latest_at_or_before(missed_hi)
        assert first is not None and last is not None  # n_missed > 0 ticks lie between them
        missed = [PlannedTick(last, Span(first, last, n_missed))]
        coalesced = n_missed - 1
    elif n_missed:
        kept = _latest_n(tl, tl.latest_at_or_before(missed_hi), floor, policy.max_backfill)
        missed = [PlannedTick(t) for t in kept]
        backfilled = len(kept)
        skipped += n_missed - len(kept)

    nxt = tl.next_after(latest)
    return Plan(
        tuple(missed) + tuple(PlannedTick(t) for t in on_time),
        latest * 1000, None if nxt is None else nxt * 1000, skipped, coalesced, backfilled,
    )
