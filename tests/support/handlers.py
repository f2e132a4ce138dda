"""Handlers run by real worker processes in tests.

Each attempt appends "start|done <task_id> <attempt> <pid> <wall clock>" to the file
named by EFFECTMQ_TEST_EFFECTS, so a test can count executions independently of Redis.
"""

import asyncio
import os
import time

import effectmq

app = effectmq.App()


def record(event: str, ctx) -> None:
    path = os.environ.get("EFFECTMQ_TEST_EFFECTS")
    if path:
        line = f"{event} {ctx.task_id} {ctx.attempt} {os.getpid()} {time.time():.3f}\n"
        with open(path, "a") as f:
            f.write(line)


@app.task
async def work(payload, ctx):
    record("start", ctx)
    await asyncio.sleep((payload or {}).get("sleep", 0))
    record("done", ctx)
    return {"attempt": ctx.attempt, "pid": os.getpid()}


@app.task
async def loop_kind(payload, ctx):
    """The module of the event loop this worker runs on."""
    return type(asyncio.get_running_loop()).__module__
