"""The ticks of a cron expression in an IANA time zone, as UTC instants (pure).

A tick is a wall-clock time the expression matches, turned into a real instant:
- a wall time that does not exist (spring-forward gap) fires once, at the first
  instant after the gap; several such times (and the gap's end itself) are one tick;
- a wall time that occurs twice (fall-back overlap) fires once, at its first
  occurrence; the repeated hour fires nothing.
croniter gets the gap right but fires repeated wall times twice, so instants are
computed here from zoneinfo offsets, never by croniter.

All instants are integer seconds since the Unix epoch. Every operation is bounded
by days, not by ticks: counting 100,000 per-second ticks touches about two days.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .cron import CronExpression, parse_cron
from .errors import InvalidSchedule

_NAIVE_EPOCH = datetime(1970, 1, 1)
# Offsets are sampled at this step to find transitions; zones never change twice
# within one step (tzdata's closest pairs are weeks apart).
_SCAN_STEP = 6 * 3600


@lru_cache(maxsize=1024)
def load_zone(name: str) -> ZoneInfo:
    """The IANA zone `name`; raises InvalidSchedule when it is unknown here."""
    if not isinstance(name, str) or not name:
        raise InvalidSchedule(f"timezone must be an IANA zone name such as 'Europe/Berlin', got {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):
        raise InvalidSchedule(
            f"timezone {name!r} is not a known IANA time zone (e.g. 'UTC', 'Europe/Berlin')") from None


def _offset(zone: ZoneInfo, t: int) -> int:
    offset = datetime.fromtimestamp(t, zone).utcoffset()
    return int(offset.total_seconds()) if offset is not None else 0


@lru_cache(maxsize=1024)
def _fixed_offset(zone: ZoneInfo) -> int | None:
    """The zone's offset if it never changes in 1970-2100 (UTC and friends), else None."""
    first = _offset(zone, 0)
    for month in range(0, 131 * 12, 1):
        if _offset(zone, month * 2_629_746) != first:  # an average month
            return None
    return first


class Timeline:
    """Tick instants of one expression in one zone: next, latest, count."""

    __slots__ = ("cron", "zone", "_fixed")

    def __init__(self, cron: CronExpression, zone: ZoneInfo):
        self.cron = cron
        self.zone = zone
        self._fixed = _fixed_offset(zone)

    def __repr__(self) -> str:
        return f"Timeline({self.cron.text!r}, {self.zone.key!r})"

    # -- wall clock <-> instants ----------------------------------------------

    def _transition(self, lo: int, hi: int) -> int:
        """The first instant in (lo, hi] whose offset differs from lo's (one must exist)."""
        before = _offset(self.zone, lo)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _offset(self.zone, mid) == before:
                lo = mid
            else:
                hi = mid
        return hi

    def resolve(self, wall: int) -> int:
        """The instant a matching wall second fires at (gap -> gap end, overlap -> first)."""
        naive = _NAIVE_EPOCH + timedelta(seconds=wall)
        first = int(naive.replace(tzinfo=self.zone).timestamp())
        if first + _offset(self.zone, first) == wall:
            return first  # exists; fold=0 is the first occurrence when it is ambiguous
        # In a gap fold=0 reads the wall time with the offset before the transition
        # (an instant after the gap) and fold=1 with the one after (before the gap).
        before_gap = int(naive.replace(tzinfo=self.zone, fold=1).timestamp())
        return self._transition(before_gap, first)

    def _wall_bound(self, t: int) -> int:
        """The largest wall second whose tick fires at or before instant t."""
        wall = t + _offset(self.zone, t)
        first = self.resolve(wall)
        if first < t:
            # t is the second occurrence of a repeated wall time: every wall second
            # up to the end of the overlap already fired (at its first occurrence).
            change = self._transition(first, t)
            return change + _offset(self.zone, first) - 1
        return wall

    # -- ticks -------------------------------------------------------------------

    def next_after(self, t: int) -> int | None:
        """The first tick strictly after instant t."""
        if self._fixed is not None:
            w = self.cron.next_at_or_after(t + self._fixed + 1)
            return None if w is None else w - self._fixed
        w = self.cron.next_at_or_after(self._wall_bound(t) + 1)
        while w is not None:
            at = self.resolve(w)
            if at > t:
                return at
            w = self.cron.next_at_or_after(w + 1)  # pragma: no cover - bound makes this unreachable
        return None

    def latest_at_or_before(self, t: int) -> int | None:
        """The last tick at or before instant t."""
        if self._fixed is not None:
            w = self.cron.prev_at_or_before(t + self._fixed)
            return None if w is None else w - self._fixed
        w = self.cron.prev_at_or_before(self._wall_bound(t))
        return None if w is None else self.resolve(w)

    def count(self, a: int, b: int) -> int:
        """How many ticks lie in (a, b]."""
        if b <= a:
            return 0
        if self._fixed is not None:
            return self.cron.count_between(a + self._fixed, b + self._fixed)
        n = self.cron.count_between(self._wall_bound(a), self._wall_bound(b))
        # Matches inside a gap, and the gap's end, all fire at one instant.
        for change, before, after in self._gaps(a, b):
            start, end = change + before, change + after
            collapsed = self.cron.count_between(start - 1, end)
            if collapsed > 1:
                n -= collapsed - 1
        return n

    def _gaps(self, a: int, b: int):
        """(instant, offset before, offset after) of each spring-forward in (a, b]."""
        lo, before = a, _offset(self.zone, a)
        while lo < b:
            hi = min(lo + _SCAN_STEP, b)
            after = _offset(self.zone, hi)
            if after != before:
                change = self._transition(lo, hi)
                if after > before:
                    yield change, before, after
                before = after
            lo = hi


@lru_cache(maxsize=4096)
def timeline(cron: str, zone: str = "UTC") -> Timeline:
    """The (cached) timeline of a cron expression in a zone; raises InvalidSchedule."""
    return Timeline(parse_cron(cron), load_zone(zone))


@lru_cache(maxsize=8192)
def iso(t: int) -> str:
    """An instant as UTC ISO 8601 with seconds, e.g. 2024-03-31T01:00:00Z."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
