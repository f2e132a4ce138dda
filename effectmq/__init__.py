"""EffectMQ: a Redis task queue with at-least-once execution and fenced ownership."""

from importlib import metadata as _metadata

from .errors import (
    CANCELED, DEFECT, STALLED, TIMEOUT, CorruptValue, EffectMQError, ErrorInfo, InvalidOption,
    InvalidPayload, LeaseLost, AlreadySettled, NotReplicated, RateLimited, RedisRefused, RedisUnavailable, TaskError,
    TaskFailed, TaskNotFound, UnknownTask,
)
from .client.models import (STALL_CAUSES, AttemptRecord, MaintenanceReport, Offered, PodIdentity, QueueStats, TaskInfo,
                            ThroughputPoint, WorkerEnding)
from .client.queue import Lease, TaskQueue
from .client.retry import Exponential, Fixed
from .client.sync import SyncTaskQueue
from .client.app import App, TaskDef
from .worker.worker import TaskContext, Worker

try:  # one source: pyproject.toml's version, as the installed package's metadata has it
    __version__ = _metadata.version("effectmq")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "TaskQueue", "Lease", "SyncTaskQueue", "App", "TaskDef", "Worker", "TaskContext",
    "Offered", "TaskInfo", "QueueStats", "MaintenanceReport", "AttemptRecord", "ThroughputPoint",
    "WorkerEnding", "PodIdentity", "STALL_CAUSES",
    "LeaseLost", "AlreadySettled", "RedisRefused", "TaskFailed", "TaskNotFound", "TaskError", "ErrorInfo",
    "EffectMQError",
    "InvalidOption", "InvalidPayload", "RedisUnavailable", "NotReplicated", "CorruptValue", "UnknownTask",
    "RateLimited",
    "Fixed", "Exponential", "STALLED", "CANCELED", "TIMEOUT", "DEFECT",
]
