"""What the operator is to the API server: its resources' group and version, the name it
writes under, and the Events it posts. A leaf: the runtime (runtime/kube.py) and the
domain (builders, status, the plans) both build on it, and it on nothing of theirs."""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "effectmq.io"
VERSION = "v1alpha1"
FIELD_MANAGER = "effectmq-operator"  # server-side apply's manager name, and the Events' reporting component
MESSAGE_LIMIT = 1024  # characters of a condition's or an Event's message


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str
