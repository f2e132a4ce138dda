"""The handler a rate-limit bench worker process runs (`effectmq worker bench._rate_handlers:app`):
a no-op that appends the wall-clock time it started (ns) and its task id to a file of its
own process beside EFFECTMQ_BENCH_STARTS (a side store: when handlers started, as the
downstream service would see them; every process runs on the bench's host, one clock)."""

import os
import time

import effectmq

app = effectmq.App()
_starts = None


def _file():
    global _starts
    if _starts is None:  # line-buffered: what a killed process started is on disk
        _starts = open(f"{os.environ['EFFECTMQ_BENCH_STARTS']}.{os.getpid()}", "a", buffering=1)
    return _starts


@app.task
async def noop(_payload, ctx):
    _file().write(f"{time.time_ns()} {ctx.task_id}\n")
