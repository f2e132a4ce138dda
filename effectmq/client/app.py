"""Task definitions: handlers registered on an `App`, with their options.

    app = effectmq.App("emails")

    @app.task(max_retries=5, timeout=30, errors=(MailboxFull,))
    async def send_email(payload, ctx):
        ...

    await send_email.offer({"to": "a@example.com"})
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, overload

from ..errors import InvalidOption, InvalidPayload, UnknownTask
from .models import Offered
from .queue import TaskQueue
from .retry import RetryPolicy


def _schema_validator(schema: dict | None):
    if schema is None:
        return None
    import jsonschema  # only needed by tasks that declare a schema

    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    return validator_cls(schema)


def _arity(fn: Callable) -> int:
    """How many positional arguments the handler takes (payload, then ctx)."""
    params = [
        p for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values()):
        return 2
    return min(len(params), 2)


@dataclass
class TaskDef:
    """A registered handler and the options that travel with it."""

    name: str
    fn: Callable
    app: "App | None" = None
    retry: RetryPolicy | None = None
    max_retries: int | None = None
    max_stalled_count: int | None = None
    timeout: float | None = None
    errors: Sequence[type[BaseException]] = ()
    schema: dict | None = None
    arity: int = field(init=False)
    is_async: bool = field(init=False)

    def __post_init__(self) -> None:
        self.arity = _arity(self.fn)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._validator = _schema_validator(self.schema)

    def validate(self, payload: Any) -> None:
        """Raise InvalidPayload when the payload does not match the declared schema."""
        if self._validator is None:
            return
        errors = sorted(self._validator.iter_errors(payload), key=lambda e: list(e.path))
        if errors:
            first = errors[0]
            where = "/".join(str(p) for p in first.path) or "(root)"
            raise InvalidPayload(f"payload of {self.name!r} does not match its schema at {where}: {first.message}")

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    async def offer(self, payload: Any = None, *, task_id: str | None = None, delay: float | None = None,
                    priority: int = 0, max_retries: int | None = None, max_stalled_count: int | None = None,
                    retry: RetryPolicy | None = None, timeout: float | None = None,
                    group: str | None = None) -> Offered:
        """Offer this task to its App's queue (App.offer: the task's own options apply
        unless given here)."""
        if self.app is None:
            raise InvalidOption(f"task {self.name!r} is not registered on an App")
        return await self.app.offer(self.name, payload, task_id=task_id, delay=delay, priority=priority,
                                    max_retries=max_retries, max_stalled_count=max_stalled_count, retry=retry,
                                    timeout=timeout, group=group)


class App:
    """A queue plus its handlers: what producers offer to and `effectmq worker` runs.

    The queue name and Redis URL default to EFFECTMQ_QUEUE and EFFECTMQ_REDIS_URL (or
    the file EFFECTMQ_REDIS_URL_FILE names), so the same handler module works under
    the operator, which sets them.
    """

    def __init__(self, queue: str | None = None, *, url: str | None = None, **queue_options: Any):
        self.queue_name = queue or os.environ.get("EFFECTMQ_QUEUE") or "default"
        self.url = url
        self.queue_options = queue_options
        self.tasks: dict[str, TaskDef] = {}
        self._queue: TaskQueue | None = None

    @overload
    def task(self, fn: Callable) -> TaskDef: ...

    @overload
    def task(self, *, name: str | None = None, retry: RetryPolicy | None = None, max_retries: int | None = None,
             max_stalled_count: int | None = None, timeout: float | None = None,
             errors: Sequence[type[BaseException]] = (), schema: dict | None = None) -> Callable[[Callable], TaskDef]:
        ...

    def task(self, fn: Callable | None = None, *, name: str | None = None, retry: RetryPolicy | None = None,
             max_retries: int | None = None, max_stalled_count: int | None = None, timeout: float | None = None,
             errors: Sequence[type[BaseException]] = (),
             schema: dict | None = None) -> TaskDef | Callable[[Callable], TaskDef]:
        """Register a handler: `@app.task`, or `@app.task(max_retries=5, ...)`.

        name: the task name producers offer (default: the function's name).
        retry: the retry schedule (effectmq.retry; default: exponential backoff).
        max_retries: failed attempts retried before the task fails (default: the queue's).
        max_stalled_count: stalled attempts (lease run out) before ~effectmq/Error/Stalled.
        timeout: seconds an attempt may run before it fails with ~effectmq/Error/Timeout.
        errors: exception types the handler declares: stored with their class name as the
            error tag (a TaskError says its own tag and whether it is retryable); any other
            exception is stored as ~effectmq/Error/Defect. Both are retried per `retry`.
        schema: a JSON Schema the payload must match, checked at offer and before running.
        """

        def register(f: Callable) -> TaskDef:
            task_name = name or f.__name__
            if task_name in self.tasks:
                raise InvalidOption(f"task {task_name!r} is registered twice")
            definition = TaskDef(task_name, f, self, retry=retry, max_retries=max_retries,
                                 max_stalled_count=max_stalled_count, timeout=timeout, errors=errors, schema=schema)
            self.tasks[task_name] = definition
            return definition

        return register(fn) if fn is not None else register

    @property
    def queue(self) -> TaskQueue:
        """The TaskQueue of this app, created on first use (inside the running loop)."""
        if self._queue is None:
            self._queue = TaskQueue(self.queue_name, url=self.url, **self.queue_options)
        return self._queue

    def use_queue(self, queue: TaskQueue) -> None:
        self._queue = queue

    async def offer(self, task_name: str, payload: Any = None, *, task_id: str | None = None,
                    delay: float | None = None, priority: int = 0, max_retries: int | None = None,
                    max_stalled_count: int | None = None, retry: RetryPolicy | None = None,
                    timeout: float | None = None, group: str | None = None) -> Offered:
        """Offer a registered task: unknown names and schema violations fail here. The
        task's own max_retries, max_stalled_count and timeout apply where none is given."""
        definition = self.tasks.get(task_name)
        if definition is None:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise UnknownTask(f"unknown task {task_name!r} for queue {self.queue_name!r} (registered: {known})")
        definition.validate(payload)
        return await self.queue.offer(
            task_name, payload, task_id=task_id, delay=delay, priority=priority, retry=retry,
            max_retries=definition.max_retries if max_retries is None else max_retries,
            max_stalled_count=definition.max_stalled_count if max_stalled_count is None else max_stalled_count,
            timeout=definition.timeout if timeout is None else timeout, group=group)

    async def close(self) -> None:
        if self._queue is not None:
            await self._queue.close()
            self._queue = None
