"""DST: a wall time skipped by spring-forward fires once, at the first instant after
the gap; a wall time repeated by fall-back fires once, at its first occurrence.

(croniter 7 gets the gap right but fires repeated wall times twice, e.g. "30 1 * * *"
in America/New_York at 05:30Z and 06:30Z on 2024-11-03; the timeline does not use
croniter for instants.)
"""

from datetime import datetime
from zoneinfo import ZoneInfo

from hypothesis import given, settings
from hypothesis import strategies as st

from effectmq.scheduler import timeline
from effectmq.scheduler.policy import MissedPolicy, plan

from .support import T, Z

# 2024 transitions:
#   Europe/Berlin     spring 03-31 02:00 CET -> 03:00 CEST (01:00Z); fall 10-27 03:00 CEST -> 02:00 CET (01:00Z)
#   America/New_York  spring 03-10 02:00 EST -> 03:00 EDT (07:00Z); fall 11-03 02:00 EDT -> 01:00 EST (06:00Z)


def ticks(expr: str, zone: str, after: str, until: str) -> list[str]:
    tl = timeline(expr, zone)
    out, t, end = [], T(after), T(until)
    while (t := tl.next_after(t)) <= end:
        out.append(Z(t))
    return out


# -- spring forward ------------------------------------------------------------------

def test_berlin_spring_forward_gap_fires_once_after_the_gap():
    assert ticks("30 2 * * *", "Europe/Berlin", "2024-03-29T12:00Z", "2024-04-01T12:00Z") == [
        "2024-03-30T01:30:00Z",  # 02:30 CET
        "2024-03-31T01:00:00Z",  # 02:30 does not exist: 03:00 CEST, the first instant after the gap
        "2024-04-01T00:30:00Z",  # 02:30 CEST
    ]


def test_new_york_spring_forward_gap_fires_once_after_the_gap():
    assert ticks("30 2 * * *", "America/New_York", "2024-03-09T00:00Z", "2024-03-11T00:00Z") == [
        "2024-03-09T07:30:00Z",  # 02:30 EST
        "2024-03-10T07:00:00Z",  # 02:30 does not exist: 03:00 EDT
    ]
    assert ticks("30 2 * * *", "America/New_York", "2024-03-10T12:00Z", "2024-03-11T12:00Z") == [
        "2024-03-11T06:30:00Z"]  # 02:30 EDT


def test_several_skipped_times_and_the_gap_end_are_one_tick():
    # 02:00, 02:15, 02:30, 02:45 do not exist; with 03:00 they are one instant.
    assert ticks("*/15 * * * *", "Europe/Berlin", "2024-03-31T00:40Z", "2024-03-31T01:20Z") == [
        "2024-03-31T00:45:00Z", "2024-03-31T01:00:00Z", "2024-03-31T01:15:00Z"]
    assert ticks("*/15 2 * * *", "America/New_York", "2024-03-10T00:00Z", "2024-03-11T00:00Z") == [
        "2024-03-10T07:00:00Z"]


# -- fall back -------------------------------------------------------------------------

def test_berlin_fall_back_repeated_time_fires_once():
    assert ticks("30 2 * * *", "Europe/Berlin", "2024-10-26T12:00Z", "2024-10-28T12:00Z") == [
        "2024-10-27T00:30:00Z",  # 02:30 CEST, the first occurrence; 02:30 CET (01:30Z) does not fire
        "2024-10-28T01:30:00Z",
    ]


def test_new_york_fall_back_repeated_time_fires_once():
    assert ticks("30 1 * * *", "America/New_York", "2024-11-02T12:00Z", "2024-11-04T12:00Z") == [
        "2024-11-03T05:30:00Z",  # 01:30 EDT; 01:30 EST (06:30Z) does not fire
        "2024-11-04T06:30:00Z",
    ]


def test_hourly_and_per_second_schedules_skip_the_repeated_hour():
    assert ticks("0 * * * *", "America/New_York", "2024-11-03T04:30Z", "2024-11-03T08:30Z") == [
        "2024-11-03T05:00:00Z", "2024-11-03T07:00:00Z", "2024-11-03T08:00:00Z"]  # 01:00 EDT, 02:00 EST, 03:00 EST
    tl = timeline("* * * * * *", "America/New_York")
    a, b = T("2024-11-03T05:59:57Z"), T("2024-11-03T07:00:01Z")
    assert tl.next_after(T("2024-11-03T05:59:59Z")) == T("2024-11-03T07:00:00Z")
    assert tl.count(a, b) == 4  # 05:59:58, 05:59:59, 07:00:00, 07:00:01
    # inside the repeated hour, the latest tick is the last one of its first pass
    assert tl.latest_at_or_before(T("2024-11-03T06:40:00Z")) == T("2024-11-03T05:59:59Z")
    assert timeline("*/30 1 * * *", "America/New_York").latest_at_or_before(T("2024-11-03T06:40:00Z")) == \
        T("2024-11-03T05:30:00Z")


def test_policy_materializes_dst_ticks_once():
    tl = timeline("30 2 * * *", "Europe/Berlin")
    decided = plan(tl, T("2024-03-30T12:00Z") * 1000, T("2024-03-31T01:00:30Z") * 1000, MissedPolicy())
    assert [Z(t.at) for t in decided.ticks] == ["2024-03-31T01:00:00Z"]
    tl = timeline("30 1 * * *", "America/New_York")
    decided = plan(tl, T("2024-11-03T05:30:00Z") * 1000, T("2024-11-03T06:30:10Z") * 1000, MissedPolicy())
    assert decided.ticks == () and Z(decided.next_fire_ms // 1000) == "2024-11-04T06:30:00Z"


# -- the rule, checked against a brute-force walk over real instants -----------------------

def reference(expr: str, zone: str, start: int, end: int) -> list[int]:
    """Ticks in (start, end]: walk instants minute by minute and fire when the wall
    clock reaches a matching time for the first time, or jumps over one (a gap)."""
    cron = timeline(expr, "UTC").cron
    tz = ZoneInfo(zone)

    def wall(t: int) -> int:
        return int((datetime.fromtimestamp(t, tz).replace(tzinfo=None) - datetime(1970, 1, 1)).total_seconds())

    out: list[int] = []
    highest = wall(start)
    for t in range(start + 60, end + 1, 60):
        w = wall(t)
        if w <= highest:
            continue  # a repeated wall time: it already had its chance
        first = cron.next_at_or_after(highest + 1)
        if first is not None and first <= w:
            out.append(t)
        highest = w
    return out


ZONES = ["Europe/Berlin", "America/New_York", "Australia/Sydney", "Australia/Lord_Howe", "America/Santiago",
         "Asia/Tehran", "UTC"]
TRANSITION_DAYS = {  # a day (UTC) with a transition in 2022-2024, per zone
    "Europe/Berlin": ["2024-03-31", "2024-10-27"], "America/New_York": ["2024-03-10", "2024-11-03"],
    "Australia/Sydney": ["2024-04-07", "2024-10-06"], "Australia/Lord_Howe": ["2024-04-06", "2024-10-05"],
    "America/Santiago": ["2024-04-07", "2024-09-08"], "Asia/Tehran": ["2022-03-21", "2022-09-21"],
    "UTC": ["2024-06-01"],
}
exprs = st.builds(lambda m, h: f"{m} {h} * * *",
                  st.sampled_from(["*", "0", "30", "*/15", "0,30", "5-10", "*/7", "45"]),
                  st.sampled_from(["*", "0", "1", "2", "3", "0-3", "*/2", "1,2", "22-23"]))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ZONES), exprs, st.data())
def test_timeline_agrees_with_brute_force_around_transitions(zone, expr, data):
    day = T(data.draw(st.sampled_from(TRANSITION_DAYS[zone])) + "T00:00:00Z")
    start = day - 86400 + data.draw(st.integers(0, 23)) * 3600
    end = start + 2 * 86400
    expected = reference(expr, zone, start, end)
    tl = timeline(expr, zone)
    got, t = [], start
    while (t := tl.next_after(t)) <= end:
        got.append(t)
    assert [Z(t) for t in got] == [Z(t) for t in expected]
    a = data.draw(st.integers(start, end))
    b = data.draw(st.integers(a, end))
    assert tl.count(a, b) == sum(1 for t in expected if a < t <= b)
    latest = tl.latest_at_or_before(b)
    before = [t for t in expected if t <= b]
    if before:
        assert latest == before[-1]
