"""The worker's event-loop watchdog: an async handler that blocks the loop stops every
heartbeat of the process, so the worker says so, once per block, with the stuck stack."""

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

import effectmq
from effectmq.eventloop.loopwatch import newly_blocked
from tests.support.inprocess import make_worker, running

LAG = "effectmq_worker_event_loop_lag_seconds"


def lag_samples(queue: str) -> tuple[float, float]:
    """Ticks observed for `queue`, and those at most 1 s late."""
    count = REGISTRY.get_sample_value(f"{LAG}_count", {"queue": queue}) or 0.0
    on_time = REGISTRY.get_sample_value(f"{LAG}_bucket", {"queue": queue, "le": "1.0"}) or 0.0
    return count, on_time


def block_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("event loop blocked")]


async def test_a_handler_that_blocks_the_loop_is_reported_with_where_it_is_stuck(make_queue, caplog):
    queue = make_queue("blocking", lock_timeout=30)
    caplog.set_level(logging.WARNING, logger="effectmq")

    async def resize_image(payload):
        time.sleep(1.6)  # a sync call inside an async handler
        return "done"

    before = lag_samples("blocking")
    async with running(make_worker(queue, {"resize": resize_image})):
        await queue.offer("resize", None, task_id="r1")
        assert await queue.wait("r1", timeout=10) == "done"
    count, on_time = lag_samples("blocking")

    (warning,) = block_warnings(caplog)
    assert "time.sleep(1.6)" in warning and "in resize_image" in warning
    assert "1 attempts in flight (resize)" in warning
    assert "base_events.py" not in warning  # from the task's code in, not the loop's own frames
    (again,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event loop ran again")]
    assert 1.5 <= float(again.split()[5]) < 3  # "event loop ran again after X s blocked"
    assert float(warning.split()[4]) >= 1.0  # "event loop blocked for X s"
    assert count - before[0] > 0
    assert (count - before[0]) - (on_time - before[1]) == 1  # the one late tick, 1.6 s late


async def test_two_blocks_are_two_warnings_and_awaiting_is_none(make_queue, caplog):
    queue = make_queue("twice", lock_timeout=30)
    caplog.set_level(logging.WARNING, logger="effectmq")

    async def patient(payload):
        await asyncio.sleep(1.5)

    async def stuck(payload):
        time.sleep(1.3)

    async with running(make_worker(queue, {"patient": patient, "stuck": stuck}, concurrency=1)):
        await queue.offer("patient", None, task_id="p")
        await queue.wait("p", timeout=10)
        assert block_warnings(caplog) == []
        for i in range(2):
            await queue.offer("stuck", None, task_id=f"s{i}")
            await queue.wait(f"s{i}", timeout=10)
    assert len(block_warnings(caplog)) == 2


async def test_the_watchdog_can_be_turned_off(make_queue, caplog):
    queue = make_queue("unwatched", lock_timeout=30)
    caplog.set_level(logging.WARNING, logger="effectmq")

    async def stuck(payload):
        time.sleep(1.3)

    async with running(make_worker(queue, {"stuck": stuck}, loop_block_warning=None)):
        await queue.offer("stuck", None, task_id="s")
        await queue.wait("s", timeout=10)
    assert block_warnings(caplog) == []
    assert lag_samples("unwatched") == (0.0, 0.0)


@pytest.mark.parametrize("bad", [0, -1, "1", float("nan")])
def test_a_bad_threshold_is_refused(make_queue, bad):
    with pytest.raises(effectmq.InvalidOption, match="loop_block_warning"):
        make_worker(make_queue("bad"), {"x": lambda p: p}, loop_block_warning=bad)


def test_a_block_is_reported_once_however_long_it_lasts():
    last = 100.0
    assert not newly_blocked(100.9, last, 1.0, None)
    assert newly_blocked(101.0, last, 1.0, None)
    assert not newly_blocked(105.0, last, 1.0, warned_for=last)
    assert newly_blocked(107.0, 106.0, 1.0, warned_for=last)  # the loop ticked since: a new block


async def test_a_paused_process_is_told_apart_from_a_blocking_handler(redis_url, tmp_path):
    # SIGSTOP, CPU throttling under a pod's limit or a paused VM stop the whole process:
    # the loop was waiting for I/O, no handler blocked it. The warning said "blocking
    # code in an async handler" and showed the selector's frame.
    import signal

    from tests.support.processes import WorkerProcess

    worker = WorkerProcess(redis_url, "paused", tmp_path, args=["--loop-block-warning", "0.5"], name="paused")
    try:
        async with asyncio.timeout(30):  # serving: idle, waiting on Redis (a loaded machine starts it late)
            while "serving queue" not in worker.log():
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        worker.signal(signal.SIGSTOP)
        await asyncio.sleep(1.5)
        worker.signal(signal.SIGCONT)
        await asyncio.sleep(1.0)
    finally:
        worker.signal(signal.SIGCONT)
        worker.stop()
    lines = [line for line in worker.log().splitlines() if "event loop" in line]
    assert lines, worker.log()[-2000:]
    text = "\n".join(lines)
    assert "async handler" not in text, text
    # (the watcher thread or the loop may run first after SIGCONT: the loop's own line has no stack)
    assert all("the whole process was paused or starved of CPU" in line for line in lines if "blocked for" in line)


def test_a_loop_waking_up_is_not_reported_as_blocked_by_its_own_tick(caplog):
    # After SIGCONT the loop's first tick and the watcher raced: the watcher still saw the
    # old tick time, found the loop inside the tick's own logging call and blamed "blocking
    # code in an async handler" at that line.
    import threading

    from effectmq.eventloop.loopwatch import LoopWatch

    inside_tick, release = threading.Event(), threading.Event()

    class HeldLag:  # holds the loop thread inside _tick, as a slow logging call would
        def observe(self, value):
            inside_tick.set()
            release.wait(5)

    class NoLoop:
        def call_later(self, *args):
            return None

    watch = LoopWatch(0.5, lag=HeldLag(), logger=logging.getLogger("effectmq.test"), consequence="", advice="ADVICE")
    watch._last_tick = time.monotonic() - 2.0  # the loop stood still for 2 s
    watch._stop.set()
    loop_thread = threading.Thread(target=watch._tick, args=(NoLoop(), time.monotonic()))
    caplog.set_level(logging.WARNING, logger="effectmq.test")
    loop_thread.start()
    try:
        assert inside_tick.wait(5)
        watch._loop_thread = loop_thread.ident
        watch._report(2.0)
    finally:
        release.set()
        loop_thread.join(5)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith("event loop blocked")], messages
    assert [m for m in messages if m.startswith("event loop ran again after 2.")], messages
