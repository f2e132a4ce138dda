"""Handlers of the cluster chaos run (bench/chaos_cluster.py), baked into a worker image.

Every attempt is recorded in a side store no fault touches: a Redis on the host that
the pods reach at EFFECTMQ_CHAOS_STORE, one RPUSH of a JSON line to ``runs`` at the
start and at the end of each attempt:
  {"ev": "start"|"done"|"cancel", "task", "attempt", "token": a hash of the lease
   token, "pod", "t": wall clock}
The result names the attempt, token hash and pod, so the checks can tell whose
acknowledgement Redis accepted.
The pod is EFFECTMQ_CHAOS_POD when set (worker processes on one host, bench/chaos_failover.py).

``work``: sleeps payload["sleep"]; with payload["oom"] its first attempt allocates past
the container's memory limit (the kernel OOM-kills the container).
``tick``: what the Schedule offers; the result carries the payload's tick.
``doomed`` (the stall-cause tests of tests/cluster/test_chaos.py; records nothing): its first
attempt dies with its worker's container. After payload["after"] seconds, with payload["oom"]
it allocates past the memory limit; with payload["hold"] it sleeps that long and ignores the
worker's drain, so a pod deleted or evicted under it is killed holding the lease. Later
attempts return at once; the result names the attempt and the pod.
EFFECTMQ_CHAOS_PLANT=drop-done (a planted defect for the harness's own test): the store
loses the end of every third task's attempts, as a lossy recorder would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import time
import zlib

import redis

import effectmq

app = effectmq.App()
POD = os.environ.get("EFFECTMQ_CHAOS_POD") or socket.gethostname()  # processes on one host name themselves
_store = redis.Redis.from_url(os.environ.get("EFFECTMQ_CHAOS_STORE", "redis://127.0.0.1:6379/0"),
                              socket_timeout=5, socket_connect_timeout=5)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def record(event: str, ctx) -> None:
    if (event == "done" and os.environ.get("EFFECTMQ_CHAOS_PLANT") == "drop-done"
            and zlib.crc32(ctx.task_id.encode()) % 3 == 0):
        return
    line = json.dumps({"ev": event, "task": ctx.task_id, "attempt": ctx.attempt,
                       "token": token_hash(ctx.lease.token), "pod": POD, "t": round(time.time(), 4)})
    for attempt in range(5):  # the store is never faulted; this only rides out a slow start
        try:
            _store.rpush("runs", line)
            return
        except redis.RedisError:
            if attempt == 4:
                raise
            time.sleep(0.5)


async def exhaust_memory() -> None:
    hog = []
    for _ in range(96):  # 768 MiB, touched page by page: past any limit the run sets
        hog.append(bytearray(b"x" * (8 << 20)))
        await asyncio.sleep(0)


def result(ctx, **extra) -> dict:
    return {"attempt": ctx.attempt, "token": token_hash(ctx.lease.token), "pod": POD, **extra}


@app.task
async def work(payload, ctx):
    record("start", ctx)
    try:
        if (payload or {}).get("oom") and ctx.attempt == 1:
            await exhaust_memory()
        await asyncio.sleep((payload or {}).get("sleep", 0))
    except asyncio.CancelledError:
        record("cancel", ctx)
        raise
    record("done", ctx)
    return result(ctx)


@app.task
async def tick(payload, ctx):
    record("start", ctx)
    record("done", ctx)
    return result(ctx, tick=(payload or {}).get("tick"))


@app.task
async def doomed(payload, ctx):
    payload = payload or {}
    if ctx.attempt == 1:
        await asyncio.sleep(payload.get("after", 0))
        if payload.get("oom"):
            await exhaust_memory()
        deadline = time.monotonic() + payload.get("hold", 0)
        while (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.sleep(left)
            except asyncio.CancelledError:  # the drain's: ignored, as a handler stuck in a call would
                pass
    return {"attempt": ctx.attempt, "pod": POD}
