"""A watchdog for an event loop (the worker's, the operator's).

An async handler that blocks the loop (a sync HTTP call, time.sleep, heavy CPU) stops
every heartbeat of the process with it: all its leases run out and their tasks run
again elsewhere, which looks like stalls with no cause. In the operator, a blocked
loop stops every reconcile and the Lease renewals. The loop ticks a timestamp; a
daemon thread notices when the ticks stop and logs, once per block and while it
lasts, where the loop is stuck (its stack). Every tick's lateness goes into a
histogram (effectmq_worker_event_loop_lag_seconds, effectmq_operator_event_loop_lag_seconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback
from typing import Callable

TICK = 0.1  # seconds between the loop's ticks
STACK_FRAMES = 12  # innermost frames of the stuck loop's stack that a warning shows
ASYNCIO_DIR = os.sep + "asyncio" + os.sep


def newly_blocked(now: float, last_tick: float, warn_after: float, warned_for: float | None) -> bool:
    """Whether a block is to be reported now: the loop has not ticked for `warn_after`
    and this block (known by its last tick) was not reported yet."""
    return now - last_tick >= warn_after and warned_for != last_tick


# Said instead of the caller's advice when the loop was found waiting in its selector
PAUSED = ("It was waiting for I/O, no code blocked it: the whole process was paused or starved of CPU "
          "(SIGSTOP, CPU throttling under a container's limit, a paused VM). ")


class LoopWatch:
    """Ticks on `loop`, watched from a thread. A warning names what a block costs
    (`consequence`), what the loop held (`describe()`, called from the watching thread
    while the loop is stuck, so it must only read) and the usual cure (`advice`); every
    tick's lateness goes into `lag` (a histogram or one of its children)."""

    def __init__(self, warn_after: float, *, lag, logger: logging.Logger, consequence: str, advice: str = "",
                 describe: Callable[[], str] = lambda: "") -> None:
        self.warn_after = warn_after
        self.describe = describe
        self._lag = lag
        self._log = logger
        self._consequence = consequence
        self._advice = advice
        self._stop = threading.Event()
        self._last_tick = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread = 0  # the thread that runs the loop, known at start()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop_thread = threading.get_ident()
        self._last_tick = time.monotonic()
        self._handle = loop.call_later(TICK, self._tick, loop, self._last_tick + TICK)
        self._thread = threading.Thread(target=self._watch, name="effectmq-loopwatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = time.monotonic()
        last, self._last_tick = self._last_tick, now
        self._lag.observe(max(0.0, now - due))
        # a block the watcher reported while it lasted: now its length is known
        if newly_blocked(now, last, self.warn_after, None):
            self._log.warning("event loop ran again after %.1f s blocked", now - last)
        if not self._stop.is_set():
            self._handle = loop.call_later(TICK, self._tick, loop, now + TICK)

    def _watch(self) -> None:
        warned_for: float | None = None
        while not self._stop.wait(TICK / 2):
            last, now = self._last_tick, time.monotonic()
            if newly_blocked(now, last, self.warn_after, warned_for):
                warned_for = last
                self._report(now - last)

    def _report(self, blocked: float) -> None:
        frame = sys._current_frames().get(self._loop_thread)
        stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()
        if any(f.filename == __file__ and f.name == "_tick" for f in stack):
            return  # the loop woke up and is in its own tick, which reports the block's length
        frames = _handler_frames(stack)
        where = "".join(traceback.format_list(frames)) or "(no stack)\n"
        try:
            held = self.describe()
        except Exception as exc:  # the loop changed what describe reads meanwhile
            held = f"({type(exc).__name__} while describing)"
        # Stuck in the selector's wait: nothing ran, the process itself stood still.
        advice = PAUSED if frames and frames[-1].name == "select" else self._advice
        self._log.warning("event loop blocked for %.1f s: %s%s. %sThe loop is at:\n%s", blocked, self._consequence,
                          held, advice, where.rstrip("\n"))


def _handler_frames(frames: traceback.StackSummary) -> traceback.StackSummary:
    """The stuck stack from the frame asyncio's loop called (the task's code) inwards."""
    inside_loop = [i for i, f in enumerate(frames) if ASYNCIO_DIR in f.filename]
    start = inside_loop[-1] + 1 if inside_loop and inside_loop[-1] + 1 < len(frames) else 0
    return traceback.StackSummary.from_list(frames[start:][-STACK_FRAMES:])
