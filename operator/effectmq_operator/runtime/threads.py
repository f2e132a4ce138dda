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
        self._idle = 0  # threads waiting for a call
        self._queued = 0  # calls handed in and not yet taken by a thread
        self._lock = threading.Lock()

    def _worker(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, call = self._work.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            if not future.set_running_or_notify_cancel():
                continue  # the awaiting coroutine was cancelled before the call started
            try:
                result = call()
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _submit(self, item) -> None:
        # A thread more whenever the queued calls outnumber the idle threads (up to the
        # size): a burst handed in at once must not wait for the one thread that was idle.
        with self._lock:
            self._queued += 1
            grow = self._queued > self._idle and len(self._threads) < self.size
            if grow:
                thread = threading.Thread(target=self._worker, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
        self._work.put(item)
        if grow:
            thread.start()

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit((future, functools.partial(fn, *args, **kwargs)))
        return await asyncio.wrap_future(future)
