"""Redis key layout of a queue: every key shares the hash tag ``{<prefix>:<queue>}``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidOption

QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
INDEXES = ("waiting", "delayed", "active", "completed", "failed", "canceled")
# Queue keys only the scripts of stall forensics touch (lua/includes/forensics.lua): they
# declare them last (protocol.ScriptArgs.last_keys), the others never carry them.
FORENSIC_KEYS = ("pods", "endings", "stall_minutes", "poison")
# The log of a rate limit's starts (lua/includes/rate.lua): declared last by acquire and stats.
RATE_KEYS = ("starts",)
# A group's counted attempts, cap and pause, and the tasks parked by them
# (lua/includes/group_caps.lua): declared last by the scripts that start or end attempts.
GROUP_KEYS = ("group_ctl", "backlog")
# A group rate limit's starts and the groups it holds back until a time (group_caps.lua):
# declared by acquire and configure_group only, before GROUP_KEYS.
GROUP_RATE_KEYS = ("group_starts", "group_due")


def check_queue_name(name: str) -> str:
    if not isinstance(name, str) or not QUEUE_NAME.match(name):
        raise InvalidOption(
            f"invalid queue name {name!r}: 1-200 characters of letters, digits and . _ : / -, "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class QueueKeys:
    prefix: str
    queue: str

    @property
    def base(self) -> str:
        return f"{{{self.prefix}:{self.queue}}}:"

    def key(self, part: str) -> str:
        return self.base + part

    def task(self, task_id: str) -> str:
        return self.base + "t:" + task_id

    def done_channel(self, task_id: str) -> str:
        return self.base + "done:" + task_id

    @property
    def write_probe(self) -> str:
        """A short-lived key that TaskQueue.check_writes() writes, as an offer would."""
        return self.base + "probe"

    @property
    def wake_channel(self) -> str:
        return self.base + "wake"

    @property
    def script_keys(self) -> list[str]:
        """The queue's KEYS every script receives first, in the order lib.lua documents
        (the task hashes a call touches follow them)."""
        b = self.base
        parts = (*INDEXES, "dedup", "meta", "events", "seq", "minutes", "workers", "settled", "waiters", "peeked",
                 "groups", "group_clock")
        return [b] + [b + part for part in parts]
