"""A cancel that was dropped on its way still ends the loop it was meant for."""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise CancelledError when the current task was cancelled and that cancel was
    dropped before it reached the task: Python 3.11's asyncio.wait_for returns the
    result of a call that finishes just as its caller is cancelled, and redis-py (8.2)
    finishes a command it was cancelled in and returns its reply. Each of the
    operator's loops calls this once a round; else a loop cancelled at a lost
    leadership or at shutdown went on, and whoever waited for it waited forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
