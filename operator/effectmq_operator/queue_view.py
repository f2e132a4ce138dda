"""What the Schedule side reads of the Queue side: a narrow interface, not the controller.

A Schedule needs its Queue's resource (to find its Redis), the Redis each Queue was
last resolved to (where its schedules live, and where tick loops run), whether the
Queues have been listed once (before that, a missing Queue proves nothing), and to
hear when a Queue changes. `QueueController` provides it.
"""

from __future__ import annotations

from typing import Callable, Protocol

from .redis_pool import RedisTarget
from .runtime.registry import Key


class QueueView(Protocol):
    def listed(self) -> bool:
        """Whether the Queues have been listed once (until then, a missing one proves nothing)."""

    def queue(self, key: Key) -> dict | None:
        """The Queue resource, as last watched or listed (None: there is none)."""

    def redis_of(self, key: Key) -> RedisTarget | None:
        """The Redis the Queue was last resolved to (None: not resolved yet)."""

    def redis_targets(self) -> set[RedisTarget]:
        """Every Redis some Queue was last resolved to."""

    def on_change(self, listener: Callable[[Key], None]) -> None:
        """Call `listener` with a Queue's key when it appears, its spec changes, or it goes."""
