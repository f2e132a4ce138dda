"""The pure pacing of the worker's maintenance loop (effectmq.worker.maintenance)."""

from __future__ import annotations

import pytest

from effectmq.worker.maintenance import Pacing

DEFAULT = Pacing(interval=5.0, batch=100)


@pytest.mark.parametrize("found, accrued_over, took, left_over, gap", [
    (0, 5.0, 0.001, False, 5.0),  # a quiet queue: the interval
    (50, 5.0, 0.002, False, 5.0),  # less than a batch per interval: the interval
    (500, 5.0, 0.01, False, 1.0),  # 100/s due: when a batch is due again
    (10_000, 5.0, 0.2, False, 0.25),  # 2,000/s due: a twentieth of the interval at most
    (60_000, 7.0, 1.0, True, 1.0),  # the budget ran out with work left: rest as long as it swept
    (5, 0.0, 0.0, False, 5.0),  # nothing to judge a rate by
])
def test_gap(found, accrued_over, took, left_over, gap):
    assert DEFAULT.gap(found, accrued_over, took, left_over) == pytest.approx(gap)


def test_budget_is_a_second_or_half_a_short_interval():
    assert DEFAULT.budget == 1.0
    assert Pacing(interval=0.1, batch=100).budget == pytest.approx(0.05)
    assert Pacing(interval=0.1, batch=100).gap(10**6, 0.1, 0.05, True) == pytest.approx(0.05)


@pytest.mark.parametrize("due_per_second, settles_at", [(100, 1.0), (2_000, 0.25), (1, 5.0)])
def test_passes_settle_where_about_a_batch_falls_due_between_them(due_per_second, settles_at):
    """Fed what a steady load leaves, the gap settles in a few passes (no jitter here)."""
    gap, took = DEFAULT.interval, 0.01
    for _ in range(5):
        found = round(due_per_second * (gap + took))
        gap = DEFAULT.gap(found, gap + took, took, False)
    assert gap == pytest.approx(settles_at, rel=0.02)
