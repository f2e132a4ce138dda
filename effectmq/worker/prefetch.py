"""How many leases a worker holds ahead of its running attempts (pure, no I/O).

A held lease starts the moment a handler returns, without waiting for that handler's
acknowledgement to come back with a new lease, and the calls that take leases grow
larger (fewer per task). That matters while handlers are short; with long handlers a
held task only waits for a slot that another worker might have given it at once.

`auto` (the default) holds `concurrency` leases ahead while handlers usually return
within AUTO_BELOW, none before the first has returned, and hands back a lease held
for HOLD_AT_MOST (a slow handler kept every slot): holding then stops until handlers
are short again. Nor does it hold any while the queue has a maxActive: a held lease
would take the budget of one another worker could run. A fixed number holds that
many, except under a rate limit (Celery's prefetch).

Under a rate limit none is held, whatever the setting: the limit counts a lease when it
starts, and a held one would start its handler later, so the starts the downstream
service sees would no longer keep to the window. Nor once the queue counts its groups
(a group's cap, pause or rate limit): a held lease takes its group's slot or start.
"""

from __future__ import annotations

from collections.abc import Callable

AUTO_BELOW = 0.05  # seconds: auto holds leases while handlers usually take less
HOLD_AT_MOST = 2.0  # seconds: auto hands back a lease held longer than this
SMOOTHING = 8  # the usual handler time moves 1/8 of the way to each new one


class Prefetch:
    def __init__(self, setting: int | None, concurrency: int, groups_counted: Callable[[], bool] = lambda: False):
        self.setting = setting  # None: auto
        self.concurrency = concurrency
        self.usual: float | None = None  # the usual handler time; None until one returned
        self.capped = False  # the queue has a maxActive
        self.rate_limited = False  # the queue has a rate limit
        # The queue counts its groups (a group's cap, pause or rate limit, none of them among
        # the settings a worker reads): a held lease would take its group's slot or start.
        self.groups_counted = groups_counted

    def ahead(self) -> int:
        """How many leases to hold ahead now."""
        if self.rate_limited or self.groups_counted():
            return 0
        if self.setting is not None:
            return self.setting
        if self.capped or self.usual is None or self.usual >= AUTO_BELOW:
            return 0
        return self.concurrency

    def returned(self, took: float) -> None:
        self.usual = took if self.usual is None else self.usual + (took - self.usual) / SMOOTHING

    def hand_back(self, held_for: float) -> bool:
        """Whether a lease held this long goes back to the queue (auto only); if so,
        holding stops until handlers are short again."""
        if self.setting is not None or held_for < HOLD_AT_MOST:
            return False
        self.usual = max(self.usual or 0.0, held_for)
        return True

    def describe(self) -> str:
        return "auto" if self.setting is None else str(self.setting)
