"""Exceptions raised by EffectMQ and the built-in error tags."""

from __future__ import annotations

from typing import Any

STALLED = "~effectmq/Error/Stalled"
CANCELED = "~effectmq/Error/Canceled"
TIMEOUT = "~effectmq/Error/Timeout"
DEFECT = "~effectmq/Error/Defect"
BUILTIN_TAGS = (STALLED, CANCELED, TIMEOUT, DEFECT)
# How error data that cannot be stored is replaced (engine.error_json): the string
# "~unstorable: <why>; was <a short preview of the value>". ErrorInfo.unstorable gives
# what follows the prefix.
UNSTORABLE = "~unstorable"


class EffectMQError(Exception):
    """Base class of every error EffectMQ raises."""


class LeaseLost(EffectMQError):
    """The caller no longer holds the task's current lease; nothing was changed."""

    def __init__(self, task_id: str, operation: str):
        super().__init__(f"lease lost: {operation} of task {task_id!r} rejected (not the current owner)")
        self.task_id = task_id
        self.operation = operation


class TaskFailed(EffectMQError):
    """`wait` on a task that ended failed or canceled."""

    def __init__(self, task_id: str, state: str, error: "ErrorInfo | None"):
        tag = error.tag if error else "?"
        message = error.message if error else ""
        super().__init__(f"task {task_id!r} {state}: {tag}: {message}")
        self.task_id = task_id
        self.state = state
        self.error = error


class TaskNotFound(EffectMQError, KeyError):
    """No record of this task id (never offered, or its record expired)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "task not found"


class InvalidPayload(EffectMQError, ValueError):
    """A payload, result or progress value that is not plain JSON."""


class InvalidOption(EffectMQError, ValueError):
    """An option outside its allowed range (negative delay, bad priority, ...)."""


class UnknownTask(EffectMQError, LookupError):
    """A task name with no registered handler."""


class RedisUnavailable(EffectMQError, ConnectionError):
    """Redis could not be reached, or refused for now (OOM, BUSY, READONLY, LOADING, ...):
    retry with backoff. After a transport error the operation may or may not have happened.

    `answered`: whether a Redis server's reply is behind it (effectmq.transport.connection.redis_answered)."""

    def __init__(self, message: str, code: str = "CONNECTION", retryable: bool = True, *, answered: bool = True):
        super().__init__(message)
        self.code = code
        self.retryable = retryable  # False: retrying will not help (no node of a Redis Cluster gives a slot map)
        self.answered = answered


class RedisRefused(EffectMQError):
    """Redis answered with an error that retrying will not fix (a wrong or missing password,
    NOPERM, WRONGTYPE, a script error): a configuration or programming problem; nothing was
    changed.
    (`answered` False: what answered does not speak Redis' protocol.)"""

    def __init__(self, message: str, code: str = "ERR", *, answered: bool = True):
        super().__init__(message)
        self.code = code
        self.answered = answered


class NotReplicated(EffectMQError):
    """A durable offer (TaskQueue(replicas_to_confirm=N)) that the Redis primary stored but
    that fewer than N replicas confirmed within confirm_timeout (Redis WAIT): the tasks may
    or may not survive a failover. Offering the same task ids again is safe (an existing id
    is left untouched) and confirms them again: `task_ids` (generated ids included)."""

    def __init__(self, task_ids: list[str], acknowledged: int, wanted: int, timeout: float):
        what = f"task {task_ids[0]!r}" if len(task_ids) == 1 else f"{len(task_ids)} tasks (first {task_ids[0]!r})"
        super().__init__(f"offer of {what} stored on the Redis primary, but only {acknowledged} of the "
                         f"{wanted} replicas asked for confirmed it within {timeout:g}s (WAIT): it may or may not "
                         f"survive a failover; offering the same task_id again is safe (offers are idempotent "
                         f"by id)")
        self.task_ids = task_ids
        self.acknowledged = acknowledged
        self.wanted = wanted
        self.timeout = timeout


class AlreadySettled(LeaseLost):
    """This attempt already settled otherwise (e.g. release() after its complete()):
    `outcome` says how ("completed", "retry", "failed", "released")."""

    def __init__(self, task_id: str, operation: str, outcome: str):
        EffectMQError.__init__(self, f"{operation} of task {task_id!r} rejected: this attempt already settled "
                                     f"as {outcome!r}")
        self.task_id = task_id
        self.operation = operation
        self.outcome = outcome


class RateLimited(EffectMQError):
    """Raised by a handler whose downstream service said "not now" (HTTP 429 with
    Retry-After): the queue starts no task, on any worker, for `retry_after` seconds by
    Redis time (TaskQueue.hold_starts), and this attempt's task goes back to waiting
    without counting a handler failure. `retry_after` is at most protocol.MAX_HOLD (a
    day); another value fails the attempt as a Defect."""

    def __init__(self, retry_after: float, message: str = ""):
        super().__init__(message or f"rate limited: retry after {retry_after!r}s")
        self.retry_after = retry_after


class CorruptValue(EffectMQError):
    """A stored value that is not valid JSON; it is reported, never executed."""


class ErrorInfo:
    """A stored error: its tag (declared name or built-in tag), message and data."""

    __slots__ = ("tag", "message", "data", "kind")

    def __init__(self, tag: str, message: str = "", data: Any = None, kind: str = "handler"):
        self.tag = tag
        self.message = message
        self.data = data
        self.kind = kind

    @property
    def unstorable(self) -> str | None:
        """Why the data could not be stored as given, then a preview of it ("nested deeper
        than 32 levels; was [[[[[[...]]]]]]"): the data is then a placeholder string that
        starts with UNSTORABLE. None when the data is what the failure carried."""
        prefix = UNSTORABLE + ": "
        if isinstance(self.data, str) and self.data.startswith(prefix):
            return self.data[len(prefix):]
        return None

    def to_json(self) -> dict:
        out = {"tag": self.tag, "message": self.message, "kind": self.kind}
        if self.data is not None:
            out["data"] = self.data
        return out

    @classmethod
    def from_json(cls, value: dict) -> "ErrorInfo":
        return cls(value.get("tag", DEFECT), value.get("message", ""), value.get("data"), value.get("kind", "handler"))

    def __repr__(self) -> str:
        return f"ErrorInfo(tag={self.tag!r}, message={self.message!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ErrorInfo) and self.to_json() == other.to_json()


class TaskError(EffectMQError):
    """Base for typed (declared) handler failures.

    Subclass it; the tag is the class's ``tag`` attribute or its name. A failure
    with ``retryable = False`` ends the task at once instead of following the
    retry schedule.
    """

    tag: str | None = None
    retryable: bool = True

    def __init__(self, message: str = "", data: Any = None):
        super().__init__(message)
        self.data = data

    @classmethod
    def error_tag(cls) -> str:
        return cls.tag or cls.__name__
