"""A synchronous facade for producers in sync code (Django, Flask, scripts).

    q = effectmq.SyncTaskQueue("emails", url="redis://localhost:6379/0")
    q.offer("send_email", {"to": "a@example.com"})

The engine runs on a private event loop in a daemon thread; every method blocks
until the matching `TaskQueue` coroutine finished, and raises what it raises.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from .queue import TaskQueue

_DELEGATED = (
    "offer", "offer_many", "get", "wait", "cancel", "retry", "pause", "resume", "stats",
    "configure", "settings", "maintain", "dead_letters", "list_tasks", "ping",
)


class SyncTaskQueue:
    def __init__(self, name: str, **options: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"effectmq-sync-{name}", daemon=True)
        self._thread.start()
        self._queue: TaskQueue = self._run(self._create(name, options))
        self.name = self._queue.name

    @staticmethod
    async def _create(name: str, options: dict) -> TaskQueue:
        return TaskQueue(name, **options)

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, attr: str) -> Any:
        if attr not in _DELEGATED:
            raise AttributeError(attr)
        method = getattr(self._queue, attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._run(method(*args, **kwargs))

        call.__doc__ = method.__doc__
        call.__name__ = attr
        return call

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._queue.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> "SyncTaskQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
