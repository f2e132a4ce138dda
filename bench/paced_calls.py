"""Redis CPU per worker call, back to back and with Redis idle between calls.

    python bench/paced_calls.py                       # k = 10; pauses of 0, 1, 5, 10 ms
    python bench/paced_calls.py --k 1 10 20 --pauses 0 10 --calls 400

Sends the same complete_and_acquire call (k completions and k leases, as
bench/script_cost.py) `calls` times to a private redis-server: back to back, or with a
pause between calls, as a worker whose handlers take that long sends them. Redis CPU is
INFO's used_cpu_user + used_cpu_sys around the calls; what Redis spends while idle (its
timers) is measured alone first and shown apart. Where a call costs more after a pause
than back to back, the difference is what Redis idling between calls adds: the work per
call is the same (bench/script_cost.py counts it).

`--references` first sends two calls that do none of our work the same way: a PING (what
waking an idle Redis costs by itself) and a script of pure Lua arithmetic with no memory
to speak of (how much slower the same instructions run just after a wake-up).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench._redis import private_client
from bench.script_cost import busy_worker


async def redis_cpu(client) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[10], help="completions and leases per call")
    parser.add_argument("--pauses", type=float, nargs="+", default=[0, 1, 5, 10], help="ms between calls")
    parser.add_argument("--calls", type=int, default=400, help="calls measured per k and pause")
    parser.add_argument("--references", action="store_true",
                        help="also a PING and a pure-CPU script, paced the same way")
    args = parser.parse_args()
    async with private_client() as client:
        before = await redis_cpu(client)
        await asyncio.sleep(3)
        idle = (await redis_cpu(client) - before) / 3
        print(f"idle redis-server: {idle * 1e3:.1f} ms of CPU per second")

        async def paced(call: Callable[[], Awaitable[object]], pause: float) -> tuple[float, float]:
            """Redis CPU per call, without its idle time, and that idle time (us)."""
            before, started = await redis_cpu(client), time.monotonic()
            for _ in range(args.calls):
                await call()
                if pause:
                    await asyncio.sleep(pause / 1000)
            spent = await redis_cpu(client) - before
            idle_part = idle * (time.monotonic() - started)
            return (spent - idle_part) / args.calls * 1e6, idle_part / args.calls * 1e6

        if args.references:
            arithmetic = await client.script_load("local x = 0 for i = 1, 300000 do x = x + i end return x")
            for name, call in (("PING", client.ping), ("Lua arithmetic", lambda: client.evalsha(arithmetic, 0))):
                for pause in args.pauses:
                    per_call, _ = await paced(call, pause)
                    print(f"{name:>14s} pause {pause:4g} ms: {per_call:7.1f} us per call", flush=True)
        for k in args.k:
            for pause in args.pauses:
                call = await busy_worker(client, k, args.calls)
                per_call, idle_part = await paced(call, pause)
                print(f"k={k:3d} pause {pause:4g} ms: {per_call:7.1f} us per call, {per_call / k:6.1f} per task "
                      f"(and {idle_part:5.1f} us per call of idle time)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
