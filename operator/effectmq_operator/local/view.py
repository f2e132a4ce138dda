"""The live terminal view of the local runner (pure: state in, text out)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class QueueRow:
    name: str
    stats: Any
    replicas: int
    last_scale: str
    last_scale_age: float | None = None  # seconds since: its counts are of then, the row's of now


def render(redis_url: str, rows: list[QueueRow], ticks: list[str], failures: list[str], logs: Path,
           redis_problem: str | None = None, dashboard: str | None = None) -> str:
    lines = [f"EffectMQ local  |  Redis {redis_url}  |  Ctrl-C drains workers and stops"]
    if dashboard:
        lines.append(f"dashboard: {dashboard}  (read-only)")
    lines.append("")
    if redis_problem:
        lines += [f"Redis refuses for now (retrying): {redis_problem}", ""]
    lines.append(f"{'QUEUE':<28} {'WAITING':>7} {'DELAYED':>7} {'ACTIVE':>6} {'DONE':>7} {'FAILED':>6} {'WORKERS':>7}")
    for r in rows:
        s = r.stats
        lines.append(f"{r.name:<28} {s.waiting:>7} {s.delayed:>7} {s.active:>6} {s.completed:>7} {s.failed:>6} "
                     f"{r.replicas:>7}")
        if r.last_scale:
            when = "" if r.last_scale_age is None else f", {r.last_scale_age:.0f} s ago"
            lines.append(f"  last scaling{when}: {r.last_scale}")
    lines += ["", "recent ticks:"] + [f"  {t}" for t in ticks or ["(none yet)"]]
    lines += ["", "recent failures:"] + [f"  {f}" for f in failures or ["(none)"]]
    lines += ["", f"worker logs: {logs}"]
    return "\n".join(lines)


def status_line(rows: list[QueueRow], ticks: int) -> str:
    """One line per refresh when the output is not a terminal (logs, tests)."""
    return " | ".join(f"{r.name} waiting={r.stats.waiting} active={r.stats.active} completed={r.stats.completed} "
                      f"failed={r.stats.failed} workers={r.replicas}" for r in rows) + f" | ticks={ticks}"
