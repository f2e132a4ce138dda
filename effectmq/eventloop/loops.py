"""The event loops a process may run on (`--loop`), and timers that fall due on time.

epoll counts its timeout in whole milliseconds, rounded up, so on asyncio's own loop
every timer fires up to 1 ms late (0.5 ms on average): a handler's `asyncio.sleep`,
its timeouts, and the worker's own sub-millisecond waits for a batch to fill. With
10 ms handlers that is 5 % of a slot's time. The selector below waits on the epoll
descriptor with select(), which takes microseconds, and then collects the events
without waiting: one more system call per wait, and timers within the kernel's
timer slack (50 µs).
"""

from __future__ import annotations

import asyncio
import select
import selectors
from typing import Callable

from ..errors import EffectMQError

LOOPS = ("auto", "uvloop", "asyncio")


class PreciseEpollSelector(selectors.EpollSelector):
    def select(self, timeout: float | None = None):
        if timeout is not None and timeout > 0:
            try:
                select.select([self.fileno()], [], [], timeout)  # the epoll descriptor: ready or timed out
            except ValueError:  # a descriptor above FD_SETSIZE: epoll's millisecond wait
                return super().select(timeout)
            timeout = 0
        return super().select(timeout)


def precise_event_loop() -> asyncio.AbstractEventLoop:
    """asyncio's own loop, with PreciseEpollSelector where epoll exists."""
    if not hasattr(selectors, "EpollSelector"):
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(PreciseEpollSelector())


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop `--loop` asks for. uvloop spends less worker CPU per I/O call,
    the handlers' own I/O included; it is not the default: before prefetch its
    completions came back in smaller batches, and the rounds since are too few
    (docs/performance.md)."""
    if choice not in LOOPS:  # argparse checks the flag, not the environment's default
        raise EffectMQError(f"EFFECTMQ_LOOP must be one of {', '.join(LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return precise_event_loop
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise EffectMQError(f"--loop uvloop: uvloop cannot be imported ({exc})") from None
        return precise_event_loop
    return uvloop.new_event_loop
