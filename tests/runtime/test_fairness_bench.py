"""bench/fairness.py, tiny: both parts run against real worker processes and report figures
that show the groups' turns (a plain queue's figures, for contrast)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.fairness import report, run


def args(**overrides) -> argparse.Namespace:
    base = dict(part="all", workers=2, concurrency=2, task_ms=0, backlog=3000, small=10, warmup=200, groups=20,
                per_group=10, no_groups=False, timeout=60)
    return argparse.Namespace(**{**base, **overrides})


async def test_a_small_group_finishes_while_the_large_one_still_waits(redis_url, tmp_path: Path):
    result = await run(redis_url, args())
    ls, many = result.large_small, result.many
    assert ls is not None and many is not None
    assert ls.a_waiting_after > 1000  # B's 10 were done while A had most of its backlog waiting
    # A's completed meanwhile: those interleaved, and those already leased or prefetched
    # (their completion falls in the same milliseconds): a few dozen of the 3,000
    assert ls.a_completed_meanwhile <= 100
    assert many.first_group_s <= many.p50_group_s <= many.p99_group_s <= many.last_group_s
    assert many.rate > 0 and "1,000 groups" not in report(result) and "20 groups x 10" in report(result)


async def test_without_groups_the_small_batch_waits_behind_the_backlog(redis_url):
    result = await run(redis_url, args(part="large-small", no_groups=True))
    assert result.large_small is not None and result.large_small.a_waiting_after < 100
