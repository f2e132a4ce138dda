"""EffectMQ: a Redis task queue with at-least-once execution and fenced ownership."""

from .errors import (
    CANCELED, DEFECT, STALLED, TIMEOUT, CorruptValue, EffectMQError, ErrorInfo, InvalidOption,
    InvalidPayload, LeaseLost, AlreadySettled, RedisRefused, RedisUnavailable, TaskError, TaskFailed, TaskNotFound,
    UnknownTask,
)
from .models import AttemptRecord, MaintenanceReport, Offered, QueueStats, TaskInfo, ThroughputPoint
from .queue import Lease, TaskQueue
from .retry import Exponential, Fixed
from .sync import SyncTaskQueue
from .app import App, TaskDef
from .worker import TaskContext, Worker

__all__ = [
    "TaskQueue", "Lease", "SyncTaskQueue", "App", "TaskDef", "Worker", "TaskContext",
    "Offered", "TaskInfo", "QueueStats", "MaintenanceReport", "AttemptRecord", "ThroughputPoint",
    "LeaseLost", "AlreadySettled", "RedisRefused", "TaskFailed", "TaskNotFound", "TaskError", "ErrorInfo",
    "EffectMQError",
    "InvalidOption", "InvalidPayload", "RedisUnavailable", "CorruptValue", "UnknownTask",
    "Fixed", "Exponential", "STALLED", "CANCELED", "TIMEOUT", "DEFECT",
]
