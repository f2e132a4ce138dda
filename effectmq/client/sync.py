"""A synchronous facade for producers in sync code (Django, Flask, scripts).

    q = effectmq.SyncTaskQueue("emails", url="redis://localhost:6379/0")
    q.offer("send_email", {"to": "a@example.com"})

The engine runs on a private event loop in a daemon thread; every method blocks
until the matching `TaskQueue` coroutine finished, and raises what it raises. The
signatures are the TaskQueue's own (documented there), so editors and type checkers
see them.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Iterable, TypeVar

from .models import GroupStats, MaintenanceReport, Offered, QueueStats, TaskInfo
from .queue import TaskQueue

T = TypeVar("T")


class SyncTaskQueue:
    def __init__(self, name: str, **options: Any):
        """The options are TaskQueue's (url, redis, prefix, lock_timeout, replicas_to_confirm, ...)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"effectmq-sync-{name}", daemon=True)
        self._thread.start()
        self._queue: TaskQueue = self._run(self._create(name, options))
        self.name = self._queue.name

    @staticmethod
    async def _create(name: str, options: dict) -> TaskQueue:
        return TaskQueue(name, **options)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def offer(self, task_name: str, payload: Any = None, *, task_id: str | None = None, delay: float | None = None,
              priority: int = 0, max_retries: int | None = None, max_stalled_count: int | None = None,
              retry: Any = None, timeout: float | None = None, group: str | None = None) -> Offered:
        return self._run(self._queue.offer(task_name, payload, task_id=task_id, delay=delay, priority=priority,
                                           max_retries=max_retries, max_stalled_count=max_stalled_count,
                                           retry=retry, timeout=timeout, group=group))

    def offer_many(self, tasks: Iterable[Any]) -> list[Offered]:
        return self._run(self._queue.offer_many(list(tasks)))

    def group_stats(self, group: str) -> GroupStats:
        return self._run(self._queue.group_stats(group))

    def groups(self, *, offset: int = 0, count: int = 100, busiest: bool = True) -> list[GroupStats]:
        return self._run(self._queue.groups(offset=offset, count=count, busiest=busiest))

    def configure_group(self, group: str, *, max_active: int | None = None,
                        rate_limit: tuple[int, float] | int | None = None) -> GroupStats:
        return self._run(self._queue.configure_group(group, max_active=max_active, rate_limit=rate_limit))

    def pause_group(self, group: str) -> GroupStats:
        return self._run(self._queue.pause_group(group))

    def resume_group(self, group: str) -> GroupStats:
        return self._run(self._queue.resume_group(group))

    def get(self, task_id: str) -> TaskInfo | None:
        return self._run(self._queue.get(task_id))

    def wait(self, task_id: str, *, timeout: float | None = None) -> Any:
        return self._run(self._queue.wait(task_id, timeout=timeout))

    def cancel(self, task_id: str) -> str | None:
        return self._run(self._queue.cancel(task_id))

    def retry(self, task_id: str) -> str | None:
        return self._run(self._queue.retry(task_id))

    def pause(self) -> None:
        self._run(self._queue.pause())

    def resume(self) -> None:
        self._run(self._queue.resume())

    def stats(self) -> QueueStats:
        return self._run(self._queue.stats())

    def configure(self, **settings: Any) -> None:
        self._run(self._queue.configure(**settings))

    def hold_starts(self, seconds: float) -> float:
        return self._run(self._queue.hold_starts(seconds))

    def settings(self) -> dict[str, Any]:
        return self._run(self._queue.settings())

    def maintain(self, *, batch: int = 100) -> MaintenanceReport:
        return self._run(self._queue.maintain(batch=batch))

    def sweep(self, *, batch: int = 100, budget: float = 1.0) -> MaintenanceReport:
        return self._run(self._queue.sweep(batch=batch, budget=budget))

    def list_tasks(self, state: str, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        return self._run(self._queue.list_tasks(state, limit=limit, offset=offset))

    def dead_letters(self, *, limit: int = 100, offset: int = 0) -> list[TaskInfo]:
        return self._run(self._queue.dead_letters(limit=limit, offset=offset))

    def ping(self) -> None:
        self._run(self._queue.ping())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._queue.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> "SyncTaskQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
