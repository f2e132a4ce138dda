"""The interface every library adapter implements.

An adapter module `adapters/<lib>.py` runs inside that library's virtualenv (its
requirements are `adapters/<lib>.txt`). At import it reads the run's settings
from the environment (see `Settings`) and defines what the library's own worker
entry point loads: a handler that calls `work.run_async(i)` (or `work.run_sync(i)`
in sync workers), which records the start and does the run's workload, plus the
app/broker/settings object. It also defines `Adapter`, used by `scenario.py` to
prefill (the library's bulk way, `BULK` jobs per call), offer one at a time,
start workers and check that all jobs were acked.

Every job carries one number `i`; the handler does the same work for every library.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BULK = int(os.environ.get("BENCH_BULK", "100"))  # jobs per bulk call (prefill = the producer's bulk path)


@dataclass
class Settings:
    url: str  # BENCH_URL: the private redis-server of this run
    queue: str  # BENCH_QUEUE
    concurrency: int  # BENCH_CONCURRENCY: jobs in flight per worker process
    options: dict = field(default_factory=dict)  # BENCH_OPTIONS: the variant's settings (JSON)

    @classmethod
    def from_env(cls) -> "Settings":
        return cls(
            url=os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0"),
            queue=os.environ.get("BENCH_QUEUE", "bench"),
            concurrency=int(os.environ.get("BENCH_CONCURRENCY", "10")),
            options=json.loads(os.environ.get("BENCH_OPTIONS") or "{}"),
        )


class Adapter:
    """One library. Async methods run in scenario.py's event loop."""

    #: the distributions whose versions the report shows
    distributions: tuple[str, ...] = ()
    #: what the report says about the settings used to make the comparison equal
    notes: str = ""
    #: the library's documented way to offer many jobs (what `prefill` does, BULK per call)
    bulk_way: str = ""

    def __init__(self, settings: Settings):
        self.s = settings

    def worker_command(self, slot: int) -> list[str]:
        """argv of worker process `slot` (run with cwd = the checkout, PYTHONPATH set),
        using the library's own worker entry point where it has one."""
        raise NotImplementedError

    async def setup(self) -> None:
        """Anything the queue needs before the first offer (on an empty Redis)."""

    async def prefill(self, numbers: range) -> None:
        """Enqueue one job per number through the library's bulk way, BULK jobs per call."""
        raise NotImplementedError

    async def offer(self, i: int) -> None:
        """Enqueue one job the way a producer would; returns when the library says it is queued."""
        raise NotImplementedError

    async def offer_serial(self, numbers: range) -> None:
        """One offer at a time, each after the previous one returned (sync libraries
        override this to loop in one thread instead of one thread hop per offer)."""
        for i in numbers:
            await self.offer(i)

    async def drained(self) -> bool:
        """True when nothing is waiting or in progress (every job was acknowledged)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release the adapter's client connections."""

    def options_summary(self) -> dict:
        """The settings that matter for the comparison, as run."""
        return {}


def bin_path(name: str) -> str:
    """A console script of the running virtualenv."""
    return str(Path(sys.executable).parent / name)


async def gather_chunked(coros, chunk: int = BULK) -> None:
    """Await coroutines in bounded concurrent chunks (for libraries without bulk enqueue)."""
    batch = []
    for coro in coros:
        batch.append(coro)
        if len(batch) >= chunk:
            await asyncio.gather(*batch)
            batch = []
    if batch:
        await asyncio.gather(*batch)
