"""Redis instructions per worker call, from callgrind: what one complete+acquire costs.

    python bench/script_cost.py               # k = 1 6 20 completions (and leases) per call
    python bench/script_cost.py --k 1 10 --rounds 200
    python bench/script_cost.py --k 1 10 --overhead   # and what a call pays before its own work
    python bench/script_cost.py --k 10 --small        # and an offer of one task, a renew of one lease
    python bench/script_cost.py --k 10 --profile --redis-server "$(bash bench/redis_symbols.sh)"
                                                      # where a call of 10 + 10 goes, by part and command

Starts its own redis-server under `valgrind --tool=callgrind` (Debian's valgrind), fills
a queue, then for each k times `rounds` calls of `complete_and_acquire` with k
completions and k leases, as a busy worker sends them. Counting is zeroed and dumped
around those calls only (callgrind_control), so the figure is redis-server's own
instructions per call: deterministic, unlike CPU time on a shared machine. The fit
splits it into a fixed cost per call and a cost per task. `--profile` splits the calls of
the largest k by where Redis spent them (bench/_callgrind.py), which needs a redis-server
with symbols (bench/redis_symbols.sh: Debian's own source package, built once).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis.asyncio as aioredis

from bench import _callgrind
from bench._redis import start_redis
from effectmq.protocol import scripts
from effectmq.client.queue import TaskQueue


class Callgrind:
    """redis-server under callgrind on a free port; `zero()`, then `dumped()` gives the
    instructions it ran in between."""

    def __init__(self, redis_server: str | None = None) -> None:
        for tool in ("valgrind", "callgrind_control"):
            if shutil.which(tool) is None:
                raise SystemExit(f"{tool} not found (Debian package valgrind)")
        self.dir = tempfile.mkdtemp(prefix="effectmq-callgrind-")
        self.proc, self.port, _ = start_redis(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.dir}/out.%p"], wait=25.0,
            binary=redis_server)
        self.last_dump = ""

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.proc.pid)], check=True, capture_output=True)

    def zero(self) -> None:
        self._control("-z")

    def dumped(self) -> int:
        """Instructions since the last zero()."""
        self._control("-d")
        latest = max(glob.glob(f"{self.dir}/out.{self.proc.pid}*"), key=os.path.getmtime)
        self.last_dump = latest
        for line in open(latest):
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
        raise RuntimeError(f"no totals in {latest}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def busy_worker(client, k: int, calls: int) -> Callable[[], Awaitable[None]]:
    """A queue with tasks enough for `calls` calls of k completions and k leases, as a busy
    worker sends them, warmed up (the next ids known, the script loaded); returns the call."""
    await client.flushall()
    q = TaskQueue("cost", redis=client, retention_completed=0)
    total = 2 * k * (calls + 10) + 100  # a call also passes over the ids it was named but did not declare
    for start in range(0, total, 500):
        await q.offer_many([("t", {"i": i}) for i in range(start, min(total, start + 500))])
    leases: list = []
    while len(leases) < k:
        more, _ = await q.acquire_many(k - len(leases))
        leases += more

    async def call() -> None:
        nonlocal leases
        _, leases = await q.engine.complete_and_acquire([(lease, "null") for lease in leases], k)
        if len(leases) != k:
            raise RuntimeError(f"a call leased {len(leases)} of {k}")

    for _ in range(5):
        await call()
    return call


async def per_call(grind: Callgrind, k: int, rounds: int) -> float:
    client = aioredis.Redis(port=grind.port, decode_responses=True)
    call = await busy_worker(client, k, rounds)
    grind.zero()
    for _ in range(rounds):
        await call()
    instructions = grind.dumped()
    await client.aclose()
    return instructions / rounds


def print_profile(dump: str, k: int, rounds: int) -> None:
    """Where the last calls went (bench/_callgrind.py), per call."""
    parts = _callgrind.breakdown(_callgrind.parse(dump))
    if not any(name.startswith("  ") for name, _ in parts):
        raise SystemExit("no script commands named in the profile: this redis-server has no symbols "
                         "(build one with bench/redis_symbols.sh and pass --redis-server)")
    total = parts[0][1]
    print(f"where a call of {k} + {k} goes (instructions per call, share of all):")
    for name, cost in parts:
        print(f"  {name:<62} {cost / rounds:10,.0f} {100 * cost / total:5.1f} %")


async def overhead(grind: Callgrind, rounds: int) -> dict[str, float]:
    """Instructions per call of what every script call pays before its own work: an
    EVALSHA of `return 1` with a 1 + 1 call's keys and arguments, and the same after
    lib.lua (the helpers every script runs first: closures and tables, on each call)."""
    client = aioredis.Redis(port=grind.port, decode_responses=True)
    keys = [f"{{emq:cost}}:k{i}" for i in range(19)]  # the queue's 16, a completion's, a lease's, a receipt
    argv = [str(i) for i in range(12)]
    costs = {}
    for name, body in (("EVALSHA of return 1", "return 1"),
                       ("lib.lua, then return 1", scripts.prelude() + "return 1")):
        sha = await client.script_load(body)
        await client.evalsha(sha, len(keys), *keys, *argv)
        grind.zero()
        for _ in range(rounds):
            await client.evalsha(sha, len(keys), *keys, *argv)
        costs[name] = grind.dumped() / rounds
    await client.aclose()
    return costs


async def small_calls(grind: Callgrind, rounds: int) -> dict[str, float]:
    """Instructions per call of the calls that carry one task: a producer's `offer`, a
    heartbeat's renew of one lease, and a lone complete (each call defines the lib.lua
    helpers it uses)."""
    client = aioredis.Redis(port=grind.port, decode_responses=True)
    await client.flushall()
    q = TaskQueue("small", redis=client, retention_completed=0)
    costs = {}
    await q.offer("t", {"i": 0})  # the script loaded
    grind.zero()
    for i in range(rounds):
        await q.offer("t", {"i": i})
    costs["offer of one task"] = grind.dumped() / rounds
    lease = await q.acquire()
    await q.engine.renew([lease])
    grind.zero()
    for _ in range(rounds):
        await q.engine.renew([lease])
    costs["renew of one lease"] = grind.dumped() / rounds
    await q.offer_many([("t", {"i": i}) for i in range(rounds + 1)])
    leases, _ = await q.acquire_many(rounds + 1)
    await leases[0].complete(None)  # the script loaded
    grind.zero()
    for lease in leases[1:]:
        await lease.complete(None)
    costs["complete of one lease"] = grind.dumped() / rounds
    await client.aclose()
    return costs


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 6, 20], help="completions and leases per call")
    parser.add_argument("--rounds", type=int, default=100, help="calls measured per k")
    parser.add_argument("--overhead", action="store_true",
                        help="also what a call pays before its own work (EVALSHA, lib.lua)")
    parser.add_argument("--small", action="store_true",
                        help="also an offer of one task, a renew and a complete of one lease")
    parser.add_argument("--profile", action="store_true",
                        help="split the calls of the largest k by part and command (needs symbols)")
    parser.add_argument("--redis-server", help="the redis-server to run (default: the one on PATH)")
    args = parser.parse_args()
    grind = Callgrind(args.redis_server)
    try:
        if args.overhead:
            for name, cost in (await overhead(grind, args.rounds)).items():
                print(f"{name}: {cost:10,.0f} instructions per call", flush=True)
        if args.small:
            for name, cost in (await small_calls(grind, args.rounds)).items():
                print(f"{name}: {cost:10,.0f} instructions per call", flush=True)
        costs = {}
        for k in sorted(args.k):
            costs[k] = await per_call(grind, k, args.rounds)
            print(f"k={k:4d}: {costs[k]:10,.0f} instructions per call, {costs[k] / k:9,.0f} per task", flush=True)
        if len(costs) > 1:
            low, high = min(costs), max(costs)
            per_task = (costs[high] - costs[low]) / (high - low)
            print(f"fit: {costs[low] - low * per_task:,.0f} per call + {per_task:,.0f} per task")
        if args.profile:
            print_profile(grind.last_dump, max(costs), args.rounds)
    finally:
        grind.close()


if __name__ == "__main__":
    asyncio.run(main())
