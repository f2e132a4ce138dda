"""Cron parsing and wall-clock matching, checked against croniter as an oracle."""

from datetime import datetime, timedelta

import pytest
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from effectmq.scheduler import InvalidSchedule
from effectmq.scheduler.cron import parse_cron
from effectmq.errors import InvalidOption

EPOCH = datetime(1970, 1, 1)


def wall(dt: datetime) -> int:
    return int((dt - EPOCH).total_seconds())


def naive(w: int) -> datetime:
    return EPOCH + timedelta(seconds=w)


@pytest.mark.parametrize("expr, field", [
    ("61 * * * *", "minute"),
    ("* 24 * * *", "hour"),
    ("* * 0 * *", "day-of-month"),
    ("* * 32 * *", "day-of-month"),
    ("* * 15W * *", "day-of-month"),
    ("* * * 13 *", "month"),
    ("* * * FOO *", "month"),
    ("* * * * 8", "day-of-week"),
    ("* * * * 5L", "day-of-week"),
    ("* * * * 1#6", "day-of-week"),
    ("*/0 * * * *", "minute"),
    ("*/61 * * * *", "minute"),
    ("H * * * *", "minute"),
    ("60 * * * * *", "second"),
    ("* 60 * * * *", "minute"),
    ("* * * * $", "day-of-week"),
])
def test_invalid_fields_are_named(expr, field):
    with pytest.raises(InvalidSchedule, match=f"invalid {field} field") as info:
        parse_cron(expr)
    assert isinstance(info.value, InvalidOption)  # InvalidSchedule is an InvalidOption


@pytest.mark.parametrize("expr, message", [
    ("", "non-empty"),
    ("* * * *", "has 4 fields"),
    ("* * * * * * *", "has 7 fields"),
    ("@reboot", "unknown macro"),
    ("@every_5m", "unknown macro"),
    ("0 0 30 2 *", "never fires"),
    ("0 0 31 4,6,9,11 *", "never fires"),
    ("0 0 1 * 1#2", "cannot be combined"),
])
def test_invalid_expressions(expr, message):
    with pytest.raises(InvalidSchedule, match=message):
        parse_cron(expr)


@pytest.mark.parametrize("macro, same_as", [
    ("@yearly", "0 0 1 1 *"), ("@annually", "0 0 1 1 *"), ("@monthly", "0 0 1 * *"),
    ("@weekly", "0 0 * * 0"), ("@daily", "0 0 * * *"), ("@midnight", "0 0 * * *"), ("@hourly", "0 * * * *"),
    ("@HOURLY", "0 * * * *"),
])
def test_macros(macro, same_as):
    start = wall(datetime(2024, 2, 27, 13, 17))
    a, b = parse_cron(macro), parse_cron(same_as)
    w = start
    for _ in range(5):
        w = a.next_at_or_after(w + 1)
        assert w == b.next_at_or_after(w)


def test_six_fields_put_seconds_first():
    cron = parse_cron("*/20 30 9 * * *")  # second minute hour ...
    start = wall(datetime(2024, 5, 1, 0, 0))
    got = []
    w = start
    for _ in range(4):
        w = cron.next_at_or_after(w + 1)
        got.append(naive(w))
    assert got == [datetime(2024, 5, 1, 9, 30, 0), datetime(2024, 5, 1, 9, 30, 20),
                   datetime(2024, 5, 1, 9, 30, 40), datetime(2024, 5, 2, 9, 30, 0)]
    assert not parse_cron("0 9 * * *").has_seconds and cron.has_seconds


def test_last_day_nth_weekday_and_day_or():
    last = parse_cron("0 12 L * *")
    w = wall(datetime(2024, 1, 31, 13, 0))
    assert naive(last.next_at_or_after(w)) == datetime(2024, 2, 29, 12, 0)  # leap year
    second_monday = parse_cron("0 9 * * 1#2")
    assert naive(second_monday.next_at_or_after(wall(datetime(2024, 3, 1)))) == datetime(2024, 3, 11, 9, 0)
    # both restricted: the 13th OR a Friday, as in Vixie cron and croniter
    either = parse_cron("0 0 13 * 5")
    assert naive(either.next_at_or_after(wall(datetime(2024, 9, 7)))) == datetime(2024, 9, 13, 0, 0)
    assert naive(either.next_at_or_after(wall(datetime(2024, 9, 14)))) == datetime(2024, 9, 20, 0, 0)


def test_sparse_expression_is_found_across_years():
    feb29 = parse_cron("0 0 29 2 *")
    assert naive(feb29.next_at_or_after(wall(datetime(2096, 3, 1)))) == datetime(2104, 2, 29)
    assert naive(feb29.prev_at_or_before(wall(datetime(2104, 2, 28)))) == datetime(2096, 2, 29)


# -- croniter as an oracle for the wall clock --------------------------------------

def _field(values: list[str]):
    return st.sampled_from(values)


expressions = st.builds(
    lambda m, h, dom, mon, dow: f"{m} {h} {dom} {mon} {dow}",
    _field(["*", "0", "*/7", "5-20/5", "0,30", "59", "10-12"]),
    _field(["*", "0", "*/3", "9-17", "23", "1,2,3"]),
    _field(["*", "1", "L", "15", "*/10", "28-31", "1,15"]),
    _field(["*", "2", "*/4", "JAN-MAR", "11,12", "6"]),
    _field(["*", "0", "MON-FRI", "1#2", "5", "SAT,SUN", "2#5"]),
)
expressions = expressions.filter(lambda e: not ("#" in e and e.split()[2] != "*"))  # refused, see above
starts = st.datetimes(min_value=datetime(1999, 1, 1), max_value=datetime(2060, 1, 1)).map(
    lambda d: d.replace(microsecond=0))


@settings(max_examples=300, deadline=None)
@given(expressions, starts)
def test_next_and_previous_match_croniter(expr, start):
    cron = parse_cron(expr)
    w = wall(start)
    assert naive(cron.next_at_or_after(w + 1)) == croniter(expr, start).get_next(datetime)
    assert naive(cron.prev_at_or_before(w - 1)) == croniter(expr, start).get_prev(datetime)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["*/20 * * * * *", "0 */5 * * * *", "30 0 9-17 * * MON-FRI", "* 0 0 1 * *"]), starts)
def test_seconds_field_matches_croniter(expr, start):
    w = wall(start)
    it = croniter(expr, start, second_at_beginning=True)
    assert naive(parse_cron(expr).next_at_or_after(w + 1)) == it.get_next(datetime)


@settings(max_examples=150, deadline=None)
@given(expressions, starts, st.integers(min_value=0, max_value=40 * 86400))
def test_count_equals_enumeration(expr, start, length):
    cron = parse_cron(expr)
    a = wall(start)
    b = a + length
    expected, w = 0, cron.next_at_or_after(a + 1)
    while w is not None and w <= b:
        expected += 1
        w = cron.next_at_or_after(w + 1)
    assert cron.count_between(a, b) == expected
