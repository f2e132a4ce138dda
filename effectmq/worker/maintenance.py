"""When a worker sweeps: pure pacing of its maintenance loop (no I/O).

Expired records, ended reservations, due tasks and lost leases fall due at the rate
tasks settle, so a fixed number of bounded calls per interval falls behind any load
above it (ten calls of 100 every 5 s deleted about 200 records/s while one worker
completes 8,000/s). Instead a pass calls maintain() while the last call reported
more, within a time budget (`TaskQueue.sweep`), and the next pass comes when about
one call's worth (a batch) is due again, judged by what the last pass found: every
`interval` on a quiet queue, down to a twentieth of it under load. Each call stays
bounded by its batch; the budget and the rest after a cut-short pass bound the
share of time a backlog takes.
"""

from __future__ import annotations

from dataclasses import dataclass

PASS_BUDGET = 1.0  # seconds one pass sweeps at most (the call in flight finishes)
BUSY_SHARE = 0.5  # of wall time the passes may take while a backlog lasts
FASTEST = 1 / 20  # the shortest gap between passes, as a share of the interval


@dataclass(frozen=True)
class Pacing:
    interval: float  # seconds between passes while nothing falls due (the longest gap)
    batch: int  # items per sweep of one maintain call

    @property
    def budget(self) -> float:
        """Seconds one pass may keep calling maintain while calls report more."""
        return min(PASS_BUDGET, self.interval * BUSY_SHARE)

    def gap(self, found: int, accrued_over: float, took: float, left_over: bool) -> float:
        """Seconds from the end of a pass to the start of the next (before jitter).

        found: items the pass touched, which fell due over `accrued_over` seconds (since
        the previous pass ended); took: seconds the pass swept; left_over: its budget ran
        out with work left.
        """
        if left_over:  # rest as long as the pass swept (BUSY_SHARE), then go on
            return min(self.interval, took * (1 - BUSY_SHARE) / BUSY_SHARE)
        if found <= 0 or accrued_over <= 0:
            return self.interval
        due_per_second = found / accrued_over
        return min(self.interval, max(self.interval * FASTEST, self.batch / due_per_second))
