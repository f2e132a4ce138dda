"""Cron schedules that materialize ticks as ordinary, idempotent queue tasks.

    from effectmq.scheduler import Scheduler, ScheduleSpec

    async with Scheduler("redis://localhost:6379/0", namespace="prod") as scheduler:
        await scheduler.put(ScheduleSpec(id="reports/nightly", queue="reports", cron="0 2 * * *",
                                         timezone="Europe/Berlin", task="send_report"))
        await scheduler.run()          # or one pass: await scheduler.tick()

A scheduler never runs handlers: each tick becomes a task with the id
``<schedule id>/<UTC instant>`` that ordinary workers process.
"""

from .errors import InvalidSchedule
from .model import Materialized, ScheduleSpec, ScheduleStatus, TickReport
from .policy import BACKFILL, COALESCE, SKIP
from .scheduler import Scheduler
from .store import DEFAULT_NAMESPACE
from .timeline import Timeline, timeline

__all__ = [
    "Scheduler", "ScheduleSpec", "ScheduleStatus", "TickReport", "Materialized", "InvalidSchedule",
    "Timeline", "timeline", "SKIP", "COALESCE", "BACKFILL", "DEFAULT_NAMESPACE",
]
