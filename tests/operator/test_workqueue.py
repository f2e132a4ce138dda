"""The work queue's timing: when a key runs again after its reconcile's result.

The rule (`next_run`) is a table; the queue itself runs real tasks on the loop and is
seen to follow what each reconcile returns."""

from __future__ import annotations

import asyncio
import time

import pytest

from effectmq_operator.runtime.workqueue import DONE, RETRY, Reconciled, WorkQueue, next_run

INTERVAL, CAP = 10.0, 30.0


@pytest.mark.parametrize("result, failures, expected", [
    # done: the key's interval, or the time it asked for; the failures are forgotten
    (DONE, 0, (10.0, 0)),
    (DONE, 4, (10.0, 0)),
    (Reconciled(requeue_after=2.5), 0, (2.5, 0)),
    (Reconciled(requeue_after=0.0), 3, (0.0, 0)),
    (Reconciled(requeue_after=120.0), 0, (120.0, 0)),  # later than the interval: as asked
    # failed: backoff from 1 s (the first failure), doubling, up to the interval (and the cap)
    (RETRY, 0, (1.0, 1)),
    (RETRY, 1, (2.0, 2)),
    (RETRY, 3, (8.0, 4)),
    (RETRY, 4, (10.0, 5)),
    (RETRY, 50, (10.0, 51)),
    # failed, asking to be seen within a time: the backoff stops there
    (Reconciled(requeue_after=3.0, retry=True), 3, (3.0, 4)),
    (Reconciled(requeue_after=300.0, retry=True), 9, (30.0, 10)),  # never past the cap
    # the reconcile raised (no result): as a failure within the interval
    (None, 0, (1.0, 1)),
    (None, 6, (10.0, 7)),
])
def test_next_run(result, failures, expected):
    assert next_run(result, failures, INTERVAL, CAP) == expected


def test_next_run_caps_a_long_interval_with_the_retry_cap():
    assert next_run(RETRY, 9, 600.0, CAP) == (30.0, 10)


async def test_the_queue_runs_a_key_again_when_its_result_asks():
    runs: list[float] = []
    results = iter([Reconciled(requeue_after=0.05), Reconciled(requeue_after=0.05), DONE])

    async def work(key) -> Reconciled:
        runs.append(time.monotonic())
        return next(results)

    queue = WorkQueue(work, interval=lambda key: 60.0)
    key = ("shop", "emails")
    try:
        deadline = time.monotonic() + 5
        while len(runs) < 3 and time.monotonic() < deadline:
            queue.start_due([key])
            await asyncio.sleep(0.01)
        assert len(runs) == 3, f"ran {len(runs)} times in 5 s"
        assert all(later - earlier >= 0.05 for earlier, later in zip(runs, runs[1:]))
        await asyncio.sleep(0.01)
        assert queue.due(key) > time.monotonic() + 50  # DONE: the 60 s interval
    finally:
        await queue.stop()


async def test_a_failed_run_backs_off_and_a_nudge_runs_it_at_once():
    outcomes: list[bool] = []

    async def work(key) -> Reconciled:
        return RETRY

    queue = WorkQueue(work, interval=lambda key: 60.0)
    queue.on_finished = lambda key, ok: outcomes.append(ok)
    key = ("shop", "emails")
    try:
        await queue.run_due([key])
        assert outcomes == [False]
        assert 0.5 < queue.due(key) - time.monotonic() <= 1.0  # the first failure: 1 s
        queue.nudge(key)
        await queue.run_due([key])
        assert outcomes == [False, False]
        assert 1.5 < queue.due(key) - time.monotonic() <= 2.0  # the second in a row: 2 s
    finally:
        await queue.stop()
