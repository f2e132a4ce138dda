"""What every library's handler does per job: the same code for all (one module, imported by each adapter).

The workload is named by $BENCH_WORKLOAD (read at import, in the worker process):

    noop       record the start, nothing else
    redis-rtt  one pipelined round trip to the measured Redis: INCR of a counter + SET
               of a key of the handler's own (HANDLER_COMMANDS commands per job), through
               one client per worker process (redis-py asyncio, or sync redis-py for
               threaded/forking workers, or the library's own client when it hands one
               to handlers: arq's ctx["redis"])
    sleep10ms  await asyncio.sleep(0.01) (time.sleep(0.01) in sync workers)
    cpu5ms     5 ms of pure-Python CPU: a busy loop of $BENCH_CPU_LOOPS iterations,
               calibrated once per run by run.py (`calibrate_loops`), so every library
               runs exactly the same loop

Every handler first calls probe.hit(i) (its start time), then the work.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass

from bench.peers import probe

HANDLER_COMMANDS = {"redis-rtt": 2}  # commands one handler sends per job (INCR + SET)
COUNTER_KEY = "bench:handler:count"  # the redis-rtt handlers' INCR target: checks that each job sent its round trip


@dataclass(frozen=True)
class Workload:
    name: str
    about: str
    jobs_factor: float = 1.0  # share of --jobs this workload runs (cpu5ms is slow by design)
    handler_seconds: float = 0.0  # time one job spends in the handler besides the library


WORKLOADS = {
    w.name: w for w in (
        Workload("noop", "no-op handler (records its start)"),
        Workload("redis-rtt", "one pipelined Redis round trip (INCR + SET) to the same Redis"),
        Workload("sleep10ms", "asyncio.sleep(0.01) / time.sleep(0.01)", handler_seconds=0.01),
        Workload("cpu5ms", "5 ms of pure-Python CPU (calibrated busy loop)", jobs_factor=0.2, handler_seconds=0.005),
    )
}

WORKLOAD = os.environ.get("BENCH_WORKLOAD", "noop")
CPU_LOOPS = int(os.environ.get("BENCH_CPU_LOOPS", "0") or 0)


def burn(loops: int) -> int:
    """Pure-Python CPU: the same arithmetic for every library (the result defeats nothing; it is returned)."""
    x = 0
    for k in range(loops):
        x = (x + k * k) % 1_000_003
    return x


def calibrate_loops(seconds: float = 0.005, rounds: int = 25) -> int:
    """Iterations of `burn` that take `seconds` of CPU on an undisturbed core: the fastest
    of `rounds` short rounds, because on a busy VM a preempted vCPU still counts as this
    thread's CPU time (a median drifted 2.5x with the load; the minimum stays within ~10 %)."""
    probe_loops = 20_000
    fastest = min(_timed(probe_loops) for _ in range(rounds))
    return max(1, round(seconds * probe_loops / fastest))


def _timed(loops: int) -> float:
    t = time.thread_time()
    burn(loops)
    return time.thread_time() - t


# -- the handler's Redis client: one per process (re-made after a fork, per event loop for asyncio) ----------

_async_client = None
_async_owner: tuple | None = None  # (pid, loop) the client belongs to
_sync_client = None
_sync_pid: int | None = None
_sync_lock = threading.Lock()


def _async_redis():
    global _async_client, _async_owner
    owner = (os.getpid(), asyncio.get_running_loop())
    if _async_owner != owner:
        from redis.asyncio import Redis
        _async_client, _async_owner = Redis.from_url(os.environ["BENCH_URL"]), owner
    return _async_client


def _sync_redis():
    global _sync_client, _sync_pid
    if _sync_pid != os.getpid():
        with _sync_lock:
            if _sync_pid != os.getpid():
                from redis import Redis
                _sync_client, _sync_pid = Redis.from_url(os.environ["BENCH_URL"]), os.getpid()
    return _sync_client


async def round_trip_async(i: int, client=None) -> None:
    pipe = (client or _async_redis()).pipeline(transaction=False)
    pipe.incr(COUNTER_KEY)
    pipe.set(f"bench:handler:last:{os.getpid()}", i)
    await pipe.execute()


def round_trip_sync(i: int) -> None:
    pipe = _sync_redis().pipeline(transaction=False)
    pipe.incr(COUNTER_KEY)
    pipe.set(f"bench:handler:last:{os.getpid()}", i)
    pipe.execute()


async def run_async(i: int, client=None) -> None:
    """The handler body of async workers; `client`: the library's own Redis client if it hands one out."""
    probe.hit(i)
    if WORKLOAD == "noop":
        return
    if WORKLOAD == "redis-rtt":
        await round_trip_async(i, client)
    elif WORKLOAD == "sleep10ms":
        await asyncio.sleep(0.01)
    elif WORKLOAD == "cpu5ms":
        burn(CPU_LOOPS)
    else:
        raise ValueError(f"unknown workload {WORKLOAD!r}")


def run_sync(i: int) -> None:
    """The handler body of sync workers (threads, forked children)."""
    probe.hit(i)
    if WORKLOAD == "noop":
        return
    if WORKLOAD == "redis-rtt":
        round_trip_sync(i)
    elif WORKLOAD == "sleep10ms":
        time.sleep(0.01)
    elif WORKLOAD == "cpu5ms":
        burn(CPU_LOOPS)
    else:
        raise ValueError(f"unknown workload {WORKLOAD!r}")
