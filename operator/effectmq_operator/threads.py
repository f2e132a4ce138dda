"""Blocking API calls on daemon threads.

The kubernetes client is synchronous. `asyncio.to_thread` would share the loop's
default executor (6 threads on 2 cores) with everything else and, worse, its
threads are joined at exit: one call hung on a blackholed TCP connection would
keep the process alive after SIGTERM. Daemon threads are never joined, and each
pool bounds its own concurrency, so the leader's Lease renewals never queue
behind a thousand status patches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from typing import Any, Callable


class DaemonThreadPool:
    def __init__(self, size: int, name: str):
        if size < 1:
            raise ValueError("a thread pool needs at least one thread")
        self.size = size
        self.name = name
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def _worker(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, call = self._work.get()
            with self._lock:
                self._idle -= 1
            if not future.set_running_or_notify_cancel():
                continue  # the awaiting coroutine was cancelled before the call started
            try:
                result = call()
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _grow(self) -> None:
        with self._lock:
            if self._idle > 0 or len(self._threads) >= self.size:
                return
            thread = threading.Thread(target=self._worker, name=f"{self.name}-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
        thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((future, functools.partial(fn, *args, **kwargs)))
        self._grow()
        return await asyncio.wrap_future(future)
