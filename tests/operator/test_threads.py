"""The daemon thread pool that runs the operator's blocking API calls."""

from __future__ import annotations

import asyncio
import time

from effectmq_operator.runtime.threads import DaemonThreadPool


async def test_a_burst_of_calls_runs_side_by_side_up_to_the_size():
    pool = DaemonThreadPool(16, "test")
    await pool.run(time.sleep, 0)  # one thread now waits idle for work, as between two passes
    started = time.monotonic()
    await asyncio.gather(*[pool.run(time.sleep, 0.2) for _ in range(32)])  # handed in at once, as a pass does
    took = time.monotonic() - started
    assert 0.4 <= took < 0.4 + 0.3, f"32 calls of 0.2 s on 16 threads took {took:.2f}s"


async def test_a_failing_call_raises_in_the_caller():
    pool = DaemonThreadPool(1, "test")
    try:
        await pool.run(int, "not a number")
    except ValueError:
        pass
    else:
        raise AssertionError("the ValueError was lost")
    assert await pool.run(int, "7") == 7
