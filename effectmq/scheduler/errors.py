"""The scheduler's own exception."""

from __future__ import annotations

from ..errors import InvalidOption


class InvalidSchedule(InvalidOption):
    """A schedule definition that cannot run: bad cron, unknown time zone, bad payload, ...

    The message names the offending field, so it can be shown as is (CLI error,
    Schedule condition, status `last_error`).
    """
