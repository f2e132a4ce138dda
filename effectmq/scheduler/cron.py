"""Cron expressions on the local wall clock (pure; no time zones here).

Parsing and field semantics come from croniter (names, ranges, steps, ``L`` for the
last day of the month, ``#`` for the n-th weekday, day-of-month OR day-of-week when
both are restricted); this module adds field-by-field error messages and fast
matching. Wall-clock instants are integer "wall seconds": seconds since
1970-01-01T00:00 on the local clock, so a day is always 86,400 of them. Turning
wall seconds into real instants (and DST) is `timeline.py`'s job.

Forms accepted:
- five fields: ``minute hour day-of-month month day-of-week``;
- six fields: ``second minute hour day-of-month month day-of-week`` (seconds first,
  as in Quartz, Spring and BullMQ's cron-parser);
- macros: @yearly @annually @monthly @weekly @daily @midnight @hourly.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from datetime import date
from functools import lru_cache

from croniter import croniter

from .errors import InvalidSchedule

DAY = 86_400
EPOCH_ORDINAL = date(1970, 1, 1).toordinal()
# The sparsest expressions fire decades apart (the 5th Tuesday of February: 2072,
# then 2128); one that matches nothing within 60 years is treated as never firing.
SEARCH_DAYS = 60 * 366

MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
_FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12), ("day-of-week", 0, 7))
_SECOND = ("second", 0, 59)
_FIELD_SYNTAX = re.compile(r"^[0-9A-Za-z*?/,#-]+$")
_STEP = re.compile(r"/(\d*)")
_NAMES = re.compile(r"SUN|MON|TUE|WED|THU|FRI|SAT|JAN|FEB|MAR|APR|MAY|JUN|JUL|AUG|SEP|OCT|NOV|DEC")
# Forms croniter parses but this scheduler refuses (croniter.expand drops W silently).
_UNSUPPORTED = {"W": "the nearest-weekday form (W) is not supported", "H": "hashed values (H) are not supported"}


def _month_days(year: int, month: int) -> int:
    if month == 12:
        return 31
    return (date(year, month + 1, 1) - date(year, month, 1)).days


class CronExpression:
    """A validated cron expression and its matching on wall seconds."""

    __slots__ = ("text", "has_seconds", "_s", "_m", "_h", "_months", "_dom", "_dom_last", "_dow",
                 "_nth", "_day_rule", "_per_day", "_hset", "_mset")

    def __init__(self, text: str, has_seconds: bool, seconds: list[int], minutes: list[int], hours: list[int],
                 dom: list, months: list[int], dow: list, nth: dict[int, set[int]]):
        self.text = text
        self.has_seconds = has_seconds
        self._s, self._m, self._h = tuple(seconds), tuple(minutes), tuple(hours)
        self._hset, self._mset = frozenset(hours), frozenset(minutes)
        self._months = frozenset(months)
        self._dom = frozenset(d for d in dom if d != "*" and d != "l")
        self._dom_last = "l" in dom
        self._dow = frozenset(d for d in dow if d != "*")
        self._nth = {k: frozenset(v) for k, v in nth.items()}
        dom_any, dow_any = dom == ["*"], dow == ["*"]
        # croniter's (and Vixie cron's) rule: both restricted -> either may match.
        self._day_rule = "any" if dom_any and dow_any else "dow" if dom_any else "dom" if dow_any else "or"
        self._per_day = len(self._s) * len(self._m) * len(self._h)

    def __repr__(self) -> str:
        return f"CronExpression({self.text!r})"

    # -- days ------------------------------------------------------------------

    def _day_ok(self, d: date) -> bool:
        rule = self._day_rule
        if rule == "any":
            return True
        dom_ok = dow_ok = False
        if rule != "dow":
            dom_ok = d.day in self._dom or (self._dom_last and d.day == _month_days(d.year, d.month))
            if dom_ok or rule == "dom":
                return dom_ok
        weekday = (d.weekday() + 1) % 7  # cron counts from Sunday = 0
        if weekday in self._dow:
            nth = self._nth.get(weekday)
            dow_ok = nth is None or (d.day - 1) // 7 + 1 in nth
        return dow_ok

    def day_matches(self, day: int) -> bool:
        """Does the expression fire at some time of this day (days since 1970-01-01)?"""
        d = date.fromordinal(EPOCH_ORDINAL + day)
        return d.month in self._months and self._day_ok(d)

    def _matching_days(self, first: int, end: int) -> int:
        """How many days in [first, end) match, skipping whole months that cannot."""
        count, day = 0, first
        while day < end:
            d = date.fromordinal(EPOCH_ORDINAL + day)
            if d.month not in self._months:
                day += _month_days(d.year, d.month) - d.day + 1
                continue
            if self._day_ok(d):
                count += 1
            day += 1
        return count

    # -- times of day (seconds since local midnight) ---------------------------

    def _next_tod(self, s: int) -> int | None:
        """The first matching time of day at or after `s`, or None."""
        H, M, S = self._h, self._m, self._s
        h, rem = divmod(s, 3600)
        m, sec = divmod(rem, 60)
        for hh in H[bisect_left(H, h):]:
            m0 = m if hh == h else 0
            for mm in M[bisect_left(M, m0):]:
                k = bisect_left(S, sec if (hh == h and mm == m) else 0)
                if k < len(S):
                    return hh * 3600 + mm * 60 + S[k]
        return None

    def _prev_tod(self, s: int) -> int | None:
        """The last matching time of day at or before `s`, or None."""
        H, M, S = self._h, self._m, self._s
        h, rem = divmod(s, 3600)
        m, sec = divmod(rem, 60)
        for hh in reversed(H[:bisect_right(H, h)]):
            m0 = m if hh == h else 59
            for mm in reversed(M[:bisect_right(M, m0)]):
                k = bisect_right(S, sec if (hh == h and mm == m) else 59) - 1
                if k >= 0:
                    return hh * 3600 + mm * 60 + S[k]
        return None

    def _tods_upto(self, s: int) -> int:
        """How many matching times of day are <= `s`."""
        h, rem = divmod(s, 3600)
        m, sec = divmod(rem, 60)
        n = bisect_left(self._h, h) * len(self._m) * len(self._s)
        if h in self._hset:
            n += bisect_left(self._m, m) * len(self._s)
            if m in self._mset:
                n += bisect_right(self._s, sec)
        return n

    # -- wall seconds ------------------------------------------------------------

    def next_at_or_after(self, w: int) -> int | None:
        """The first matching wall second >= w (None if nothing within 60 years)."""
        day, sod = divmod(w, DAY)
        limit = day + SEARCH_DAYS
        while day <= limit:
            d = date.fromordinal(EPOCH_ORDINAL + day)
            if d.month not in self._months:
                day += _month_days(d.year, d.month) - d.day + 1
                sod = 0
                continue
            if self._day_ok(d):
                t = self._next_tod(sod)
                if t is not None:
                    return day * DAY + t
            day += 1
            sod = 0
        return None

    def prev_at_or_before(self, w: int) -> int | None:
        """The last matching wall second <= w (None if nothing within 60 years)."""
        day, sod = divmod(w, DAY)
        limit = day - SEARCH_DAYS
        while day >= limit:
            d = date.fromordinal(EPOCH_ORDINAL + day)
            if d.month not in self._months:
                day -= d.day
                sod = DAY - 1
                continue
            if self._day_ok(d):
                t = self._prev_tod(sod)
                if t is not None:
                    return day * DAY + t
            day -= 1
            sod = DAY - 1
        return None

    def count_between(self, a: int, b: int) -> int:
        """How many matching wall seconds lie in (a, b]; O(days), not O(matches)."""
        if b <= a:
            return 0
        da, sa = divmod(a, DAY)
        db, sb = divmod(b, DAY)
        if da == db:
            return self._tods_upto(sb) - self._tods_upto(sa) if self.day_matches(da) else 0
        total = self._per_day - self._tods_upto(sa) if self.day_matches(da) else 0
        if self.day_matches(db):
            total += self._tods_upto(sb)
        return total + self._per_day * self._matching_days(da + 1, db)


def _field_error(expr: str, name: str, value: str, lo: int, hi: int, detail: str = "") -> InvalidSchedule:
    extra = {"day-of-month": ", L for the last day", "day-of-week": ", names SUN-SAT, n#k for the k-th weekday",
             "month": ", names JAN-DEC"}.get(name, "")
    why = f": {detail}" if detail else ""
    return InvalidSchedule(
        f"cron {expr!r}: invalid {name} field {value!r}{why} "
        f"(expected {lo}-{hi}, lists a,b, ranges a-b, steps */n{extra})"
    )


def _check_fields(expr: str, fields: list[str]) -> None:
    """Validate each field on its own so the error can name it."""
    layout = (_SECOND, *_FIELDS) if len(fields) == 6 else _FIELDS
    for i, (value, (name, lo, hi)) in enumerate(zip(fields, layout)):
        if not _FIELD_SYNTAX.match(value):
            raise _field_error(expr, name, value, lo, hi, "unexpected characters")
        letters = _NAMES.sub("", value.upper())
        for letter, why in _UNSUPPORTED.items():
            if letter in letters:
                raise _field_error(expr, name, value, lo, hi, why)
        for step in _STEP.findall(value):
            if not step or not 1 <= int(step) <= hi - lo:
                raise _field_error(expr, name, value, lo, hi, f"step must be between 1 and {hi - lo}")
        probe = ["*"] * len(fields)
        probe[i] = value
        try:
            croniter.expand(" ".join(probe), second_at_beginning=len(fields) == 6)
        except Exception:  # croniter raises several unrelated types; the field is what matters
            raise _field_error(expr, name, value, lo, hi) from None


def _values(expanded: list, lo: int, hi: int) -> list[int]:
    return list(range(lo, hi + 1)) if expanded == ["*"] else sorted({int(v) for v in expanded})


@lru_cache(maxsize=4096)
def parse_cron(expr: str) -> CronExpression:
    """Parse and validate; raises InvalidSchedule naming the field that is wrong."""
    if not isinstance(expr, str) or not expr.strip():
        raise InvalidSchedule(f"cron must be a non-empty string, got {expr!r}")
    text = " ".join(expr.split())
    if text.startswith("@"):
        if text.lower() not in MACROS:
            raise InvalidSchedule(f"cron {expr!r}: unknown macro; known: {', '.join(MACROS)}")
        text = MACROS[text.lower()]
    fields = text.split(" ")
    if len(fields) not in (5, 6):
        raise InvalidSchedule(
            f"cron {expr!r} has {len(fields)} fields; expected 5 (minute hour day-of-month month day-of-week) "
            "or 6 (second first)"
        )
    _check_fields(expr, fields)
    has_seconds = len(fields) == 6
    try:
        expanded, nth = croniter.expand(text, second_at_beginning=has_seconds)
    except Exception as exc:
        raise InvalidSchedule(f"cron {expr!r}: {exc}") from None
    if nth and expanded[2] != ["*"]:
        # croniter ignores the day-of-month here (or finds no date at all); refuse the ambiguity.
        raise InvalidSchedule(f"cron {expr!r}: a day-of-month cannot be combined with an n#k day-of-week")
    seconds = _values(expanded[5], 0, 59) if has_seconds else [0]
    cron = CronExpression(
        text, has_seconds, seconds, _values(expanded[0], 0, 59), _values(expanded[1], 0, 23),
        list(expanded[2]), _values(expanded[3], 1, 12), list(expanded[4]), nth,
    )
    if cron.next_at_or_after(0) is None:  # e.g. "0 0 30 2 *"
        raise InvalidSchedule(f"cron {expr!r} never fires (no matching date)")
    return cron
