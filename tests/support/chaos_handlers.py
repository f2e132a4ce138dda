"""The handler of the chaos test (tests/runtime/test_chaos.py), run by real worker processes.

Each attempt appends JSON lines to the file named by EFFECTMQ_TEST_EFFECTS, one
os.write each (O_APPEND: lines from concurrent processes never interleave):
  {"ev": "start"|"done"|"cancel", "task", "attempt", "token", "pid", "t": wall clock,
   "deadline": the lease deadline (Redis clock, seconds) the worker knew at that moment}
The result embeds the attempt number and lease token from the TaskContext, so the
test can tell which attempt's acknowledgement Redis accepted.
"""

import asyncio
import json
import os
import time

import effectmq

app = effectmq.App()


def record(event: str, ctx) -> None:
    path = os.environ.get("EFFECTMQ_TEST_EFFECTS")
    if not path:
        return
    line = json.dumps({"ev": event, "task": ctx.task_id, "attempt": ctx.attempt, "token": ctx.lease.token,
                       "pid": os.getpid(), "t": round(time.time(), 4),
                       "deadline": ctx.lease.deadline_ms / 1000}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@app.task
async def chaos(payload, ctx):
    record("start", ctx)
    try:
        await asyncio.sleep((payload or {}).get("sleep", 0))
    except asyncio.CancelledError:
        record("cancel", ctx)
        raise
    record("done", ctx)
    return {"attempt": ctx.attempt, "token": ctx.lease.token, "pid": os.getpid()}
