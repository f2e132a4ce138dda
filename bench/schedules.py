"""Cost of scheduler passes: one due tick for each of 10,000 schedules, and a pass
when nothing is due.

    python bench/schedules.py                       # private redis-server, 10,000 schedules
    python bench/schedules.py --schedules 50000 --url redis://127.0.0.1:6379/0

Schedules are per-minute crons spread over 10 queues, half in UTC and half in
Europe/Berlin. "One due tick each" is set up by moving every cursor to just before
the latest minute boundary (the way downtime is simulated in the tests), then one
`Scheduler.tick()` is timed: cold (a fresh Scheduler that parses every definition)
and warm (definitions cached). The idle pass is timed right after, while no
schedule is due; its Redis commands come from INFO commandstats.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from bench._redis import calls_delta, command_calls, private_redis
from effectmq.scheduler import Scheduler, ScheduleSpec, timeline
from effectmq.scheduler.policy import MissedPolicy, plan
from tests.scheduler.support import make_one_tick_due

NAMESPACE = "bench"


def specs(n: int) -> list[ScheduleSpec]:
    return [ScheduleSpec(id=f"bench/{i:06d}", queue=f"bench-{i % 10}", cron="* * * * *", task="report",
                         timezone="UTC" if i % 2 else "Europe/Berlin", payload={"n": i}) for i in range(n)]


async def empty_queues(scheduler: Scheduler) -> None:
    """Delete the target queues, so the timed pass creates every task (a put that
    crossed a minute boundary, or the previous pass, already offered that tick)."""
    keys = [k async for k in scheduler.redis.scan_iter(match="{emq:bench-*", count=10_000)]
    if keys:
        await scheduler.redis.delete(*keys)


async def timed_tick(scheduler: Scheduler) -> tuple[float, object]:
    started = time.perf_counter()
    report = await scheduler.tick()
    return time.perf_counter() - started, report


def decision_cost(zone: str, n: int) -> float:
    """Seconds per `policy.plan` call with one due tick, each with its own cursor (no sharing)."""
    tl = timeline("* * * * *", zone)
    now = (int(time.time()) // 60 * 60 + 10) * 1000
    started = time.perf_counter()
    for i in range(n):
        plan(tl, now - 10_001 - i, now, MissedPolicy())
    return (time.perf_counter() - started) / n


async def run(url: str, n: int, batch: int, idle_passes: int) -> dict:
    sync = redis.Redis.from_url(url)
    out: dict = {"schedules": n, "batch": batch}
    all_specs = specs(n)
    ids = [s.id for s in all_specs]
    async with Scheduler(url, namespace=NAMESPACE, batch=batch) as admin:
        await admin.redis.flushdb()
        started = time.perf_counter()
        for i in range(0, n, 50):  # Scheduler.put: store, then settle (next fire time)
            await asyncio.gather(*(admin.put(s) for s in all_specs[i:i + 50]))
        out["put_per_schedule_ms"] = (time.perf_counter() - started) / n * 1000

        async with Scheduler(url, namespace=NAMESPACE, batch=batch) as cold:
            await empty_queues(cold)
            boundary = await make_one_tick_due(cold, ids, period=60, margin=20)
            before = command_calls(sync)
            seconds, report = await timed_tick(cold)
            delta = calls_delta(before, command_calls(sync))
            assert report.created == n and not report.errors, (report.created, list(report.errors.items())[:3])
            assert {int(m.tick.timestamp()) for m in report.materialized} == {boundary}
            out["due_pass_cold_s"] = seconds
            out["round_trips_due_pass"] = delta.get("evalsha", 0)
            out["redis_commands_per_tick"] = sum(delta.values()) / n

            # again with definitions cached
            await empty_queues(cold)
            await make_one_tick_due(cold, ids, period=60, margin=20)
            seconds, report = await timed_tick(cold)
            assert report.created == n, report.created
            out["due_pass_warm_s"] = seconds

            durations = []
            before = command_calls(sync)
            for _ in range(idle_passes):
                seconds, report = await timed_tick(cold)
                assert report.examined == 0, "a schedule became due during the idle measurement"
                durations.append(seconds)
            delta = calls_delta(before, command_calls(sync))
            durations.sort()
            out["idle_pass_ms_median"] = statistics.median(durations) * 1000
            out["idle_pass_ms_p99"] = durations[int(len(durations) * 0.99) - 1] * 1000
            out["idle_pass_redis_commands"] = {k: v / idle_passes for k, v in sorted(delta.items())}
    out["decision_us"] = {zone: decision_cost(zone, n) * 1e6 for zone in ("UTC", "Europe/Berlin")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=1000, help="schedules per round trip")
    parser.add_argument("--idle-passes", type=int, default=200)
    parser.add_argument("--url", help="an existing Redis (its database is flushed); default: a private server")
    args = parser.parse_args()
    with private_redis(args.url) as url:
        r = asyncio.run(run(url, args.schedules, args.batch, args.idle_passes))
    n = r["schedules"]
    print(f"schedules: {n} (per-minute cron, 10 queues, UTC and Europe/Berlin), batch {r['batch']}")
    print(f"put (store + settle):              {r['put_per_schedule_ms']:.3f} ms per schedule")
    print(f"one due tick each, cold scheduler: {r['due_pass_cold_s'] * 1000:.0f} ms "
          f"({r['due_pass_cold_s'] / n * 1e6:.1f} us per tick, {r['round_trips_due_pass']} script calls, "
          f"{r['redis_commands_per_tick']:.1f} Redis commands per tick)")
    print(f"one due tick each, warm scheduler: {r['due_pass_warm_s'] * 1000:.0f} ms "
          f"({r['due_pass_warm_s'] / n * 1e6:.1f} us per tick)")
    print("decision alone (policy.plan, one due tick, no shared cursor): "
          + ", ".join(f"{zone} {us:.1f} us" for zone, us in r["decision_us"].items()))
    print(f"pass with nothing due:             median {r['idle_pass_ms_median']:.3f} ms, "
          f"p99 {r['idle_pass_ms_p99']:.3f} ms; Redis commands per pass: "
          + ", ".join(f"{k} {v:g}" for k, v in r["idle_pass_redis_commands"].items()))


if __name__ == "__main__":
    main()
