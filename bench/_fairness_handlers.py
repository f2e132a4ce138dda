"""The handler bench/fairness.py's worker processes run (`effectmq worker bench._fairness_handlers:app`)."""

import asyncio

import effectmq

app = effectmq.App()


@app.task
async def work(payload):
    """Sleeps `ms` milliseconds (none: returns at once)."""
    ms = (payload or {}).get("ms", 0)
    if ms:
        await asyncio.sleep(ms / 1000)
