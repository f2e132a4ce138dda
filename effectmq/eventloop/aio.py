"""Small asyncio helpers shared by the worker and the wake-up listener."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable

log = logging.getLogger("effectmq")


async def cancel_and_wait(tasks: Iterable[asyncio.Task], timeout: float) -> set[asyncio.Task]:
    """Cancel `tasks` and wait for them, at most `timeout` seconds in all.

    A cancel can be lost (on Python 3.11, `asyncio.wait_for` inside redis-py swallows
    one that lands just after the awaited write finished), so it is sent again until
    the task ends; never an unbounded await. Returns the tasks still running.
    """
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _done, pending = await asyncio.wait(pending, timeout=min(0.05, left))
    for task in pending:
        log.error("task %s did not stop within %.1fs; left behind", task.get_name(), timeout)
    return pending
