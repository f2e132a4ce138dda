"""Which ticks to materialize, given the cursor and Redis time (pure).

A due tick is one after the cursor (the last settled instant) and at or before
`now`. Each due tick is in exactly one of three bands:
- stale: older than `starting_deadline` (or than what the queue's dedup window
  can protect): never materialized, counted as skipped;
- missed: overdue by at least `missed_after` seconds (scheduler down, Redis
  unreachable), or fallen due while the schedule was suspended, whatever its age:
  the policy decides --
  `skip` materializes none, `coalesce` one task for the latest with the span it
  stands for, `backfill` the latest `max_backfill`, oldest first;
- on time: less overdue than that (a pass that ran a little late, an operator
  restart, a leader change): materialized, at most MAX_ON_TIME per pass.
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
    # seconds overdue before a tick counts as missed: the grace of a restart or leader
    # change (a tick fallen due while suspended is missed whatever its age)
    missed_after: float = 60.0


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
         max_age: float | None = None, suspended: tuple[int, int] | None = None) -> Plan:
    """Decide what to materialize at `now_ms` (Redis time) after `cursor_ms`.

    `max_age` (seconds) is a second deadline imposed by the caller: the scheduler
    passes what the target queue's dedup window can protect, so a re-offer of an
    old tick can never create its task twice.

    `suspended` is (suspended at, resumed at) in ms: the ticks after the first and at or
    before the second fell due while the schedule was suspended, so they are missed
    whatever their age. The ticks due before the suspension keep their band by age,
    except when older ones were missed too: then all are one missed stretch.
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
    # The missed ticks are those in (missed_lo, missed_hi]; the on-time ones lie above
    # them, and below them when a recent suspension left older ticks on time.
    missed_lo = floor
    missed_hi = max(floor, (now_ms - round(policy.missed_after * 1000)) // 1000)
    if suspended is not None:
        since, until = suspended[0] // 1000, suspended[1] // 1000  # t * 1000 > since_ms <=> t > since
        if until > max(since, floor):
            if since > missed_hi and tl.count(floor, missed_hi) == 0:
                missed_lo = since
            missed_hi = max(missed_hi, until)
    missed_hi = min(missed_hi, latest)

    on_time = _latest_n(tl, latest, missed_hi, MAX_ON_TIME)
    if len(on_time) == MAX_ON_TIME:
        skipped += tl.count(missed_hi, on_time[0] - 1)  # beyond MAX_ON_TIME
    early: list[int] = []  # on time, before a suspension
    if missed_lo > floor:
        early = _latest_n(tl, tl.latest_at_or_before(missed_lo), floor, MAX_ON_TIME - len(on_time))
        skipped += tl.count(floor, missed_lo) - len(early)

    missed: list[PlannedTick] = []
    coalesced = backfilled = 0
    n_missed = tl.count(missed_lo, missed_hi) if missed_hi > missed_lo else 0
    if n_missed and policy.mode == SKIP:
        skipped += n_missed
    elif n_missed and policy.mode == COALESCE:
        first, last = tl.next_after(missed_lo), tl.latest_at_or_before(missed_hi)
        assert first is not None and last is not None  # n_missed > 0 ticks lie between them
        missed = [PlannedTick(last, Span(first, last, n_missed))]
        coalesced = n_missed - 1
    elif n_missed:
        kept = _latest_n(tl, tl.latest_at_or_before(missed_hi), missed_lo, policy.max_backfill)
        missed = [PlannedTick(t) for t in kept]
        backfilled = len(kept)
        skipped += n_missed - len(kept)

    nxt = tl.next_after(latest)
    return Plan(
        tuple(PlannedTick(t) for t in early) + tuple(missed) + tuple(PlannedTick(t) for t in on_time),
        latest * 1000, None if nxt is None else nxt * 1000, skipped, coalesced, backfilled,
    )
