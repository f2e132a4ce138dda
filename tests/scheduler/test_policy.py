"""Missed-tick policies, decided from explicit instants (pure)."""

import time

import pytest

from effectmq.scheduler import timeline
from effectmq.scheduler.policy import MAX_ON_TIME, MissedPolicy, Span, plan

from .support import T, Z

HOURLY = timeline("0 * * * *", "UTC")
PER_SECOND = timeline("* * * * * *", "UTC")


def decide(tl, cursor: str, now: str, **policy):
    return plan(tl, T(cursor) * 1000, T(now) * 1000, MissedPolicy(**policy))


def at(decision) -> list[str]:
    return [Z(t.at) for t in decision.ticks]


def test_nothing_due_keeps_the_cursor_and_names_the_next_tick():
    d = plan(HOURLY, T("2024-05-01T10:00:00Z") * 1000 + 123, T("2024-05-01T10:59:59Z") * 1000, MissedPolicy())
    assert d.ticks == () and d.cursor_ms == T("2024-05-01T10:00:00Z") * 1000 + 123
    assert Z(d.next_fire_ms // 1000) == "2024-05-01T11:00:00Z"


def test_a_tick_a_little_late_is_on_time():
    d = decide(HOURLY, "2024-05-01T10:00:00Z", "2024-05-01T11:00:59Z")
    assert at(d) == ["2024-05-01T11:00:00Z"] and d.ticks[0].span is None
    assert d.cursor_ms == T("2024-05-01T11:00:00Z") * 1000 and Z(d.next_fire_ms // 1000) == "2024-05-01T12:00:00Z"
    assert (d.skipped, d.coalesced, d.backfilled) == (0, 0, 0)


# Downtime 10:00 -> 15:30: ticks 11:00 ... 15:00 are all at least 30 minutes late.
DOWN = ("2024-05-01T10:00:00Z", "2024-05-01T15:30:00Z")


def test_skip_after_downtime():
    d = decide(HOURLY, *DOWN, mode="skip")
    assert d.ticks == () and d.skipped == 5
    assert d.cursor_ms == T("2024-05-01T15:00:00Z") * 1000 and Z(d.next_fire_ms // 1000) == "2024-05-01T16:00:00Z"


def test_coalesce_after_downtime():
    d = decide(HOURLY, *DOWN)  # coalesce is the default
    assert at(d) == ["2024-05-01T15:00:00Z"]
    assert d.ticks[0].span == Span(T("2024-05-01T11:00:00Z"), T("2024-05-01T15:00:00Z"), 5)
    assert (d.skipped, d.coalesced, d.backfilled) == (0, 4, 0)


@pytest.mark.parametrize("n, expected, skipped", [
    (3, ["13", "14", "15"], 2),
    (10, ["11", "12", "13", "14", "15"], 0),
    (1, ["15"], 4),
])
def test_backfill_after_downtime(n, expected, skipped):
    d = decide(HOURLY, *DOWN, mode="backfill", max_backfill=n)
    assert at(d) == [f"2024-05-01T{h}:00:00Z" for h in expected]
    assert (d.skipped, d.backfilled) == (skipped, len(expected))


def test_the_current_tick_still_runs_on_time_after_downtime():
    # 15:00 is 30 s late (on time); 11:00 ... 14:00 were missed
    now = "2024-05-01T15:00:30Z"
    assert at(decide(HOURLY, DOWN[0], now, mode="skip")) == ["2024-05-01T15:00:00Z"]
    d = decide(HOURLY, DOWN[0], now)
    assert at(d) == ["2024-05-01T14:00:00Z", "2024-05-01T15:00:00Z"]
    assert d.ticks[0].span.count == 4 and d.ticks[1].span is None
    assert at(decide(HOURLY, DOWN[0], now, mode="backfill", max_backfill=2)) == [
        "2024-05-01T13:00:00Z", "2024-05-01T14:00:00Z", "2024-05-01T15:00:00Z"]
    # with missed_after=0 every late tick is "missed"
    assert at(decide(HOURLY, DOWN[0], now, mode="skip", missed_after=0)) == []


def test_starting_deadline_drops_stale_ticks():
    # 2.5 h before 15:30 is 13:00: 11:00 and 12:00 are older, 13:00 is exactly that old (kept)
    d = decide(HOURLY, *DOWN, starting_deadline=9000)
    assert at(d) == ["2024-05-01T15:00:00Z"] and d.ticks[0].span == Span(T("2024-05-01T13:00:00Z"),
                                                                           T("2024-05-01T15:00:00Z"), 3)
    assert (d.skipped, d.coalesced) == (2, 2)
    d = decide(HOURLY, *DOWN, mode="backfill", max_backfill=10, starting_deadline=9000)
    assert at(d) == ["2024-05-01T13:00:00Z", "2024-05-01T14:00:00Z", "2024-05-01T15:00:00Z"] and d.skipped == 2
    # a deadline shorter than the lateness drops even an on-time tick
    d = decide(HOURLY, "2024-05-01T14:00:00Z", "2024-05-01T15:00:30Z", starting_deadline=10)
    assert d.ticks == () and d.skipped == 1 and d.cursor_ms == T("2024-05-01T15:00:00Z") * 1000


def test_max_age_acts_as_a_second_deadline():
    d = plan(HOURLY, T(DOWN[0]) * 1000, T(DOWN[1]) * 1000, MissedPolicy(mode="backfill", max_backfill=10),
             max_age=5400)
    assert at(d) == ["2024-05-01T14:00:00Z", "2024-05-01T15:00:00Z"] and d.skipped == 3


@pytest.mark.parametrize("missed", [100_000, 10 * 365 * 86400])
def test_huge_backlogs_are_decided_in_bounded_time(missed):
    now = T("2024-05-01T12:00:00Z")
    started = time.perf_counter()
    decisions = {mode: plan(PER_SECOND, (now - missed) * 1000, now * 1000, MissedPolicy(mode=mode, max_backfill=1000))
                 for mode in ("skip", "coalesce", "backfill")}
    assert time.perf_counter() - started < 5  # generous: it is milliseconds
    on_time = [now - 59 + i for i in range(60)]  # less than 60 s late
    n_missed = missed - 60
    skip, coalesce, backfill = decisions["skip"], decisions["coalesce"], decisions["backfill"]
    assert [t.at for t in skip.ticks] == on_time and skip.skipped == n_missed
    assert [t.at for t in coalesce.ticks] == [now - 60, *on_time]
    assert coalesce.ticks[0].span == Span(now - missed + 1, now - 60, n_missed) and coalesce.coalesced == n_missed - 1
    assert [t.at for t in backfill.ticks] == [now - 60 - 999 + i for i in range(1000)] + on_time
    assert backfill.skipped == n_missed - 1000 and backfill.backfilled == 1000
    for d in decisions.values():  # never wedged: the cursor reaches now, the next tick is the next second
        assert d.cursor_ms == now * 1000 and d.next_fire_ms == (now + 1) * 1000


def test_on_time_ticks_are_capped_per_pass():
    now = T("2024-05-01T12:00:00Z")
    d = plan(PER_SECOND, (now - 5000) * 1000, now * 1000, MissedPolicy(missed_after=3600))
    assert len(d.ticks) - 1 == MAX_ON_TIME  # one coalesced for the 1400 missed, then the cap
    assert d.ticks[0].span.count == 1400 and d.skipped == 3600 - MAX_ON_TIME
    assert d.ticks[-1].at == now and d.cursor_ms == now * 1000


def test_sub_second_cursor_and_now():
    # a new schedule's cursor is its creation time in ms; a tick equal to "now" is due
    d = plan(PER_SECOND, T("2024-05-01T12:00:00Z") * 1000 + 999, T("2024-05-01T12:00:01Z") * 1000, MissedPolicy())
    assert at(d) == ["2024-05-01T12:00:01Z"]
    d = plan(PER_SECOND, T("2024-05-01T12:00:01Z") * 1000, T("2024-05-01T12:00:01Z") * 1000 + 999, MissedPolicy())
    assert d.ticks == ()


# A suspension from 10:00:10.5 to 10:00:40.2 of a per-second schedule, decided at 10:00:45.
SUSPENDED = (T("2024-05-01T10:00:10Z") * 1000 + 500, T("2024-05-01T10:00:40Z") * 1000 + 200)


def seconds(first: str, last: str) -> list[str]:
    return [Z(t) for t in range(T(first), T(last) + 1)]


@pytest.mark.parametrize("mode", ["skip", "coalesce", "backfill"])
def test_ticks_due_while_suspended_are_missed_whatever_their_age(mode):
    """Every tick here is less than 60 s late, and those of the
    suspension are missed all the same; those before it and after the resume are on time."""
    d = plan(PER_SECOND, T("2024-05-01T10:00:00Z") * 1000, T("2024-05-01T10:00:45Z") * 1000,
             MissedPolicy(mode=mode, max_backfill=3), suspended=SUSPENDED)
    before = seconds("2024-05-01T10:00:01Z", "2024-05-01T10:00:10Z")  # due before the suspension, not settled
    after = seconds("2024-05-01T10:00:41Z", "2024-05-01T10:00:45Z")
    missed = {"skip": [], "coalesce": ["2024-05-01T10:00:40Z"],
              "backfill": seconds("2024-05-01T10:00:38Z", "2024-05-01T10:00:40Z")}[mode]
    assert at(d) == before + missed + after
    assert (d.skipped, d.coalesced, d.backfilled) == {"skip": (30, 0, 0), "coalesce": (0, 29, 0),
                                                      "backfill": (27, 0, 3)}[mode]
    if mode == "coalesce":
        assert d.ticks[len(before)].span == Span(T("2024-05-01T10:00:11Z"), T("2024-05-01T10:00:40Z"), 30)
    assert d.cursor_ms == T("2024-05-01T10:00:45Z") * 1000


def test_a_suspension_after_missed_ticks_makes_one_missed_stretch():
    # down since 09:58 (ticks up to 09:59:45 are 60 s late or more), then suspended: one span
    d = plan(PER_SECOND, T("2024-05-01T09:58:00Z") * 1000, T("2024-05-01T10:00:45Z") * 1000, MissedPolicy(),
             suspended=SUSPENDED)
    assert at(d) == ["2024-05-01T10:00:40Z"] + seconds("2024-05-01T10:00:41Z", "2024-05-01T10:00:45Z")
    assert d.ticks[0].span == Span(T("2024-05-01T09:58:01Z"), T("2024-05-01T10:00:40Z"), 160)


def test_a_settled_suspension_changes_nothing():
    cursor, now = T("2024-05-01T10:00:40Z") * 1000, T("2024-05-01T10:00:45Z") * 1000
    assert plan(PER_SECOND, cursor, now, MissedPolicy(mode="skip"), suspended=SUSPENDED) == \
        plan(PER_SECOND, cursor, now, MissedPolicy(mode="skip"))
    assert at(plan(PER_SECOND, cursor, now, MissedPolicy(mode="skip"), suspended=SUSPENDED)) == \
        seconds("2024-05-01T10:00:41Z", "2024-05-01T10:00:45Z")


def test_a_starting_deadline_still_drops_ticks_of_a_suspension():
    d = plan(PER_SECOND, T("2024-05-01T10:00:00Z") * 1000, T("2024-05-01T10:00:45Z") * 1000,
             MissedPolicy(starting_deadline=20), suspended=SUSPENDED)
    # 10:00:25 is exactly 20 s old (kept); older ones are stale, the rest of the suspension coalesces
    assert at(d) == ["2024-05-01T10:00:40Z"] + seconds("2024-05-01T10:00:41Z", "2024-05-01T10:00:45Z")
    assert d.ticks[0].span == Span(T("2024-05-01T10:00:25Z"), T("2024-05-01T10:00:40Z"), 16) and d.skipped == 24
