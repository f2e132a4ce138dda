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
from typing import Any, Callable, Sequence

from .errors import InvalidOption, InvalidPayload, UnknownTask
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

    async def offer(self, payload: Any = None, **options: Any) -> Offered:
        if self.app is None:
            raise InvalidOption(f"task {self.name!r} is not registered on an App")
        return await self.app.offer(self.name, payload, **options)


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

    def task(self, fn: Callable | None = None, *, name: str | None = None, **options: Any):
        """Register a handler; usable as @app.task or @app.task(name=..., retry=...)."""

        def register(f: Callable) -> TaskDef:
            task_name = name or f.__name__
            if task_name in self.tasks:
                raise InvalidOption(f"task {task_name!r} is registered twice")
            definition = TaskDef(task_name, f, self, **options)
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

    async def offer(self, task_name: str, payload: Any = None, **options: Any) -> Offered:
        """Offer a registered task: unknown names and schema violations fail here."""
        definition = self.tasks.get(task_name)
        if definition is None:
            known = ", ".join(sorted(self.tasks)) or "none"
            raise UnknownTask(f"unknown task {task_name!r} for queue {self.queue_name!r} (registered: {known})")
        definition.validate(payload)
        for key in ("max_retries", "max_stalled_count", "timeout"):
            if key not in options and getattr(definition, key) is not None:
                options[key] = getattr(definition, key)
        return await self.queue.offer(task_name, payload, **options)

    async def close(self) -> None:
        if self._queue is not None:
            await self._queue.close()
            self._queue = None
