"""One library's workload, run by `run.py` inside that library's virtualenv.

    python -m bench.peers.scenario --adapter taskiq --url redis://127.0.0.1:PORT/0 --workload noop --out result.json

Run with cwd and PYTHONPATH = a folder that holds only `bench` (run.py makes it), so
`effectmq` comes from the venv (this checkout, or a baseline commit), never from cwd.

Throughput: flush Redis, prefill N jobs through the library's bulk way (Redis
used_memory before and after gives memory per waiting task, INFO cpu the producer's
Redis CPU per task), start the worker processes (the
library's own entry point, one per slot, `concurrency` in flight each), wait until
every job's handler ran and the queue reports nothing waiting or in progress (all
acked), stop the workers. The handlers' probe records give the rate and prove that
every job ran (duplicates and missing jobs are counted). INFO commandstats and
INFO cpu deltas from just before the workers start until the queue is drained give
Redis commands and Redis CPU per job. Every handler runs the workload of
work.py; for redis-rtt the handler's own round trip is measured alone afterwards
(same pipeline, same width) so its Redis CPU can be left out of the library's.

Producer (--producer): on an empty queue and no workers, N offers one at a time;
rate, Redis commands and Redis CPU per offered task.

Latency (offer -> handler start), with fresh workers on an empty queue: an idle
queue (one offer at a time, each after the previous one started, plus a gap), then
open-loop load at each rate (offers at fixed times regardless of completion;
latency counts from the scheduled time, so a producer or queue that falls behind
shows it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.peers import probe, resp, work
from bench.peers.adapters.base import BULK, Settings

WARMUP_BASE = 10_000_000  # job numbers of the latency phases start here
MS = 1e6  # ns per ms
MEMORY_SETTLE_S = 3.5  # s: Redis frees the query buffer of a client idle for more than 2 whole seconds


def percentile(sorted_values: list, p: float) -> float | None:
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def sessions_cpu(sessions: set[int]) -> float:
    """CPU seconds (user + system, including reaped children such as RQ's forked
    job processes) of every live process in these sessions."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) in sessions:  # field 6 of stat: the session id
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / CLOCK_TICKS


class Workers:
    """The worker processes of one phase, each in its own process group (and session)."""

    def __init__(self, adapter, env: dict, count: int, logdir: Path, label: str):
        self.adapter, self.env, self.count, self.logdir, self.label = adapter, env, count, logdir, label
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self) -> None:
        for slot in range(self.count):
            log = self.logdir / f"{self.label}-w{slot}.log"
            self.logs.append(log)
            with open(log, "wb") as out:
                self.procs.append(subprocess.Popen(  # cwd: run.py's bench-only folder (see the docstring)
                    self.adapter.worker_command(slot), cwd=os.getcwd(), stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=dict(self.env, BENCH_WORKER_ID=str(slot)),
                    start_new_session=True))

    def cpu(self) -> float:
        return sessions_cpu({p.pid for p in self.procs})

    def dead(self) -> list[str]:
        out = []
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-1500:]
                out.append(f"worker {proc.args[:3]} exited with {proc.returncode}: {tail}")
        return out

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM each worker's process group, SIGKILL what is left after `grace`."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:  # the group too: pools and forked children
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


async def wait_for_count(directory: Path, target: int, timeout: float, poll: float = 0.0005) -> bool:
    deadline = time.monotonic() + timeout
    while probe.count(directory) < target:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll)
    return True


async def wait_drained(adapter, timeout: float) -> float | None:
    """Seconds until the library reports nothing waiting or in progress (None: timed out)."""
    start = time.monotonic()
    while not await adapter.drained():
        if time.monotonic() - start > timeout:
            return None
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def check_runs(records: list, expected: set[int]) -> dict:
    counts = collections.Counter(r[0] for r in records)
    seen = set(counts)
    return {
        "handler_runs": len(records),
        "unique": len(seen & expected),
        "missing": len(expected - seen),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "unexpected": len(seen - expected),
    }


def rates(records: list, launched_ns: int) -> dict:
    """Jobs/s measured three ways from the handler start times.

    steady: from the moment every worker slot has started handling to the last
    handler (the rate with all processes running); from_first: from the first
    handler to the last; with_boot: from launching the worker processes."""
    starts = sorted(r[1] for r in records)
    first_per_slot: dict[int, int] = {}
    per_slot: collections.Counter = collections.Counter()
    for _job, t, slot, _pid in records:
        per_slot[slot] += 1
        if slot not in first_per_slot or t < first_per_slot[slot]:
            first_per_slot[slot] = t
    first, last = starts[0], starts[-1]
    all_running = max(first_per_slot.values())
    in_window = sum(1 for t in starts if t > all_running)
    steady = in_window / ((last - all_running) / 1e9) if last > all_running and in_window >= 100 else None
    from_first = (len(starts) - 1) / ((last - first) / 1e9) if last > first else None
    return {
        "jobs_per_s": steady if steady is not None else from_first,
        "jobs_per_s_steady": steady,
        "jobs_per_s_from_first": from_first,
        "jobs_per_s_with_boot": len(starts) / ((last - launched_ns) / 1e9),
        "boot_s": (first - launched_ns) / 1e9,
        "all_slots_running_after_s": (all_running - first) / 1e9,
        "duration_s": (last - first) / 1e9,
        "jobs_per_slot": dict(sorted(per_slot.items())),
    }


async def throughput(adapter, args, client: resp.Resp, env: dict, probedir: Path, logdir: Path) -> dict:
    client.call("FLUSHALL")
    probe.clear(probedir)
    await adapter.setup()
    # One unmeasured bulk call first: the producer's connections and scripts are ready, as
    # in a producer that has been running; then an empty Redis again.
    await adapter.prefill(range(WARMUP_BASE, WARMUP_BASE + BULK))
    client.call("FLUSHALL")
    await adapter.setup()
    memory_before = await settled_memory(client) if args.memory else None
    snap = resp.snapshot(client)
    t = time.monotonic()
    await adapter.prefill(range(args.jobs))
    prefill_s = time.monotonic() - t
    prefill = resp.delta(snap, resp.snapshot(client))
    memory_after = await settled_memory(client) if args.memory else None
    out: dict = {"workload": args.workload, "jobs": args.jobs, "prefill_s": prefill_s,
                 "bulk": {"way": adapter.bulk_way, "batch": BULK, "tasks": args.jobs,
                          "tasks_per_s": args.jobs / prefill_s,
                          "redis_commands_per_task": sum(prefill["calls"].values()) / args.jobs,
                          "redis_cpu_us_per_task": prefill["cpu"] * 1e6 / args.jobs,
                          "redis_commands_top": dict(list(prefill["calls"].items())[:8])},
                 "prefill_commands_per_job": sum(prefill["calls"].values()) / args.jobs}
    if memory_before and memory_after:
        # without the clients' buffers (CLIENT LIST tot-mem): the figure the tables show
        out["memory_bytes_per_waiting_task"] = (memory_after["data"] - memory_before["data"]) / args.jobs
        out["used_memory_delta_per_waiting_task"] = \
            (memory_after["used_memory"] - memory_before["used_memory"]) / args.jobs
        out["memory"] = {"before": memory_before, "after": memory_after}
    workers = Workers(adapter, env, args.processes, logdir, "throughput")
    before = resp.snapshot(client)
    launched = time.monotonic_ns()
    workers.start()
    try:
        deadline = time.monotonic() + args.timeout
        last_count, last_change = 0, time.monotonic()
        cpu_first = None  # worker CPU when the first handlers ran (boot and imports left out)
        while (n := probe.count(probedir)) < args.jobs:
            now = time.monotonic()
            if cpu_first is None and n:
                cpu_first = (n, workers.cpu())
            if n != last_count:
                last_count, last_change = n, now
            if dead := workers.dead():
                raise RuntimeError("; ".join(dead))
            if now > deadline or now - last_change > args.stall:
                raise RuntimeError(f"only {n} of {args.jobs} handlers ran (timeout or no progress for {args.stall}s)")
            await asyncio.sleep(0.01)
        drained = await wait_drained(adapter, 30.0)
        after = resp.snapshot(client)
        cpu_end = workers.cpu()
        if drained is None:
            out["error"] = "the queue did not report drained (all acked) within 30 s after the last handler"
    finally:
        workers.stop()
    records = probe.records(probedir)
    out.update(check_runs(records, set(range(args.jobs))))
    out.update(rates(records, launched))
    d = resp.delta(before, after)
    total = sum(d["calls"].values())
    handler_commands = work.HANDLER_COMMANDS.get(args.workload, 0)
    if handler_commands:  # every job's round trip reached Redis (duplicates included)
        out["handler_round_trips"] = int(client.call("GET", work.COUNTER_KEY) or 0)
        out["handler_commands_per_job"] = handler_commands * out["handler_round_trips"] / args.jobs
        out["handler_alone"] = await handler_alone(client, args.jobs, args.processes * args.concurrency)
    out.update({
        "drained_after_last_handler_s": drained,
        "redis_commands_per_job": total / args.jobs,
        "redis_round_trips_per_job": None,  # not observable server-side for every library
        "redis_cpu_ms_per_job": d["cpu"] * 1000 / args.jobs,
        "redis_cpu_s": d["cpu"],
        "redis_commands_top": dict(list(d["calls"].items())[:12]),
        # time inside commands (a script's own entry includes the commands it ran)
        "redis_usec_per_job_top": {k: v / args.jobs for k, v in list(d["usec"].items())[:12]},
        "evalsha_per_job": sum(d["calls"].get(c, 0) for c in ("fcall", "evalsha", "eval")) / args.jobs,
    })
    redis_us = out["redis_cpu_ms_per_job"] * 1000
    out["redis_cpu_us_per_job"] = redis_us
    out["queue_ceiling_jobs_per_s"] = 1e6 / redis_us if redis_us > 0 else None  # per Redis core
    if handler_commands:
        own_us = redis_us - out["handler_alone"]["redis_cpu_us_per_round_trip"] * out["handler_round_trips"] / args.jobs
        out["redis_commands_per_job_excl_handler"] = out["redis_commands_per_job"] - out["handler_commands_per_job"]
        out["redis_cpu_us_per_job_excl_handler"] = own_us
        out["queue_ceiling_excl_handler_jobs_per_s"] = 1e6 / own_us if own_us > 0 else None
    if cpu_first is not None and args.jobs > cpu_first[0]:
        worker_ms = (cpu_end - cpu_first[1]) * 1000 / (args.jobs - cpu_first[0])
        out["worker_cpu_ms_per_job"] = worker_ms
        out["total_cpu_ms_per_job"] = worker_ms + out["redis_cpu_ms_per_job"]
    return out


async def settled_memory(client: resp.Resp) -> dict[str, int]:
    """used_memory once the producer's connections have been idle MEMORY_SETTLE_S: Redis
    frees an idle client's query buffer (clientsCron), so before and after the prefill
    the same idle connections weigh about the same and the delta is the tasks'."""
    await asyncio.sleep(MEMORY_SETTLE_S)
    return resp.used_memory(client)


async def handler_alone(client: resp.Resp, jobs: int, width: int) -> dict:
    """The redis-rtt handler's round trip without any queue: `width` concurrent callers
    (the run's in-flight budget) through one client, as in a worker. Its Redis CPU per
    round trip is what the library's figure leaves out in the excl-handler columns."""
    from redis.asyncio import Redis  # every library's venv has redis-py

    n = max(1000, min(jobs, 5000))
    redis = Redis.from_url(os.environ["BENCH_URL"], max_connections=width)
    try:
        await redis.ping()
        before = resp.snapshot(client)

        async def caller(share: range) -> None:
            for i in share:
                await work.round_trip_async(i, redis)

        await asyncio.gather(*(caller(range(k, n, width)) for k in range(width)))
        d = resp.delta(before, resp.snapshot(client))
    finally:
        await redis.aclose()
    return {"round_trips": n, "width": width, "redis_commands_per_round_trip": sum(d["calls"].values()) / n,
            "redis_cpu_us_per_round_trip": d["cpu"] * 1e6 / n}


async def producer(adapter, args, client: resp.Resp) -> dict:
    """Offers one at a time (each after the previous returned) on an empty queue, no workers."""
    client.call("FLUSHALL")
    await adapter.setup()
    n = args.producer_offers
    await adapter.offer_serial(range(WARMUP_BASE, WARMUP_BASE + 20))  # connections and scripts loaded
    before = resp.snapshot(client)
    t = time.monotonic()
    await adapter.offer_serial(range(n))
    elapsed = time.monotonic() - t
    d = resp.delta(before, resp.snapshot(client))
    client.call("FLUSHALL")
    return {"tasks": n, "tasks_per_s": n / elapsed, "redis_commands_per_task": sum(d["calls"].values()) / n,
            "redis_cpu_us_per_task": d["cpu"] * 1e6 / n, "redis_commands_top": dict(list(d["calls"].items())[:8])}


def summarize_latency(latencies_ns: list[int], offered: int, elapsed: float | None = None) -> dict:
    values = sorted(v / MS for v in latencies_ns)
    return {
        "offered": offered, "started": len(values),
        "p50_ms": percentile(values, 50), "p90_ms": percentile(values, 90), "p99_ms": percentile(values, 99),
        "max_ms": values[-1] if values else None,
        "offer_rate_achieved": offered / elapsed if elapsed else None,
    }


async def latency(adapter, args, client: resp.Resp, env: dict, probedir: Path, logdir: Path) -> dict:
    client.call("FLUSHALL")
    probe.clear(probedir)
    await adapter.setup()
    workers = Workers(adapter, env, args.processes, logdir, "latency")
    workers.start()
    out: dict = {}
    offered_at: dict[int, int] = {}  # open loop: the scheduled time
    sent_at: dict[int, int] = {}  # open loop: when the offer call actually began
    next_i = WARMUP_BASE
    done = 0  # handler starts expected so far

    def phase_latencies(ids: range, since: dict[int, int] | None = None) -> list[int]:
        since = offered_at if since is None else since
        starts = {}
        for job, t, _slot, _pid in probe.records(probedir):
            if job in ids and job not in starts:
                starts[job] = t
        return [starts[i] - since[i] for i in ids if i in starts and i in since]

    try:
        # Warm-up: every process imported, connected and idle-waiting. The workers get
        # `settle` seconds first (an RQ pool that gets a job while its members are still
        # starting can leave it in its intermediate list), and the first job waits for
        # slow boots (20 RQ processes take a while on a busy machine).
        await asyncio.sleep(args.settle)
        for k in range(args.warmup):
            await adapter.offer(next_i)
            next_i += 1
            done += 1
            limit = args.boot_timeout if k == 0 else 10.0
            if not await wait_for_count(probedir, done, limit):
                raise RuntimeError(f"warm-up job {k} not started within {limit} s; {workers.dead()}")
        await asyncio.sleep(0.5)

        # Idle: one offer at a time, the next one after the previous started plus a gap.
        ids_start, t_end = next_i, time.monotonic() + args.idle_time
        for _ in range(args.idle_offers):
            if time.monotonic() > t_end:
                break
            offered_at[next_i] = time.monotonic_ns()
            await adapter.offer(next_i)
            next_i += 1
            done += 1
            await wait_for_count(probedir, done, 5.0)
            await asyncio.sleep(args.idle_gap)
        out["idle"] = summarize_latency(phase_latencies(range(ids_start, next_i)), next_i - ids_start)
        out["idle"]["gap_ms"] = args.idle_gap * 1000

        for rate in args.rates:
            if dead := workers.dead():
                raise RuntimeError("; ".join(dead))
            # A lead-in at the same rate warms the producer's connection pool and the
            # workers' steady state; only the jobs after it are measured.
            lead = int(rate * args.lead_in)
            n = lead + int(rate * args.load_seconds)
            ids = range(next_i, next_i + n)
            measured = ids[lead:]
            next_i += n
            pending: set[asyncio.Task] = set()
            errors = 0
            error_kinds: collections.Counter = collections.Counter()
            lag_ns: list[int] = []

            slots = asyncio.Semaphore(args.producer_inflight)
            blocked = 0

            async def send(i: int, intended: int) -> None:
                nonlocal errors
                sent_at[i] = time.monotonic_ns()
                lag_ns.append(sent_at[i] - intended)
                try:
                    await adapter.offer(i)
                except Exception as exc:
                    errors += 1
                    error_kinds[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                finally:
                    slots.release()

            t0 = time.monotonic_ns() + 50_000_000
            for k, i in enumerate(ids):
                intended = t0 + k * 1_000_000_000 // rate
                offered_at[i] = intended
                delay = (intended - time.monotonic_ns()) / 1e9
                if delay > 0:
                    await asyncio.sleep(delay)
                if slots.locked():  # as many offers in flight as a producer may have: it falls behind
                    blocked += 1
                await slots.acquire()
                task = asyncio.create_task(send(i, intended))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.wait(pending)
            offered_s = (time.monotonic_ns() - t0) / 1e9
            done += n
            finished = await wait_for_count(probedir, done, args.load_drain)
            result = summarize_latency(phase_latencies(measured), len(measured), offered_s * len(measured) / n)
            result["lead_in_jobs"] = lead
            from_send = sorted(v / MS for v in phase_latencies(measured, sent_at))
            result["from_send_p50_ms"] = percentile(from_send, 50)  # producer lag left out
            result["from_send_p99_ms"] = percentile(from_send, 99)
            lag = sorted(v / MS for v in lag_ns)
            result.update({"rate": rate, "seconds": args.load_seconds, "offer_errors": errors,
                           "offer_error_kinds": dict(error_kinds.most_common(3)),
                           "producer_lag_p99_ms": percentile(lag, 99), "producer_blocked": blocked,
                           "all_started": finished})
            out[f"open_{rate}"] = result
            if not finished:  # saturated: a higher rate would only pile onto the backlog
                out[f"open_{rate}"]["note"] = f"not all started within {args.load_drain}s after the last offer"
                break
            await wait_drained(adapter, 10.0)
            await asyncio.sleep(0.5)
    finally:
        workers.stop()
    measured = set(offered_at)
    runs = check_runs([r for r in probe.records(probedir) if r[0] in measured], measured)
    out["duplicates"] = runs["duplicates"]
    return out


def _effectmq_origin() -> str | None:
    """Where `import effectmq` resolved in this venv (the checkout or a baseline folder)."""
    module = sys.modules.get("effectmq")
    return str(Path(module.__file__).resolve().parents[1]) if module and module.__file__ else None


def versions(adapter) -> dict:
    out = {}
    for dist in adapter.distributions:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


async def main() -> None:
    # run.py stops a scenario with SIGTERM: exit through the finally blocks that stop the workers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description="one library's workload (see run.py)")
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--options", default="{}", help="the variant's settings (JSON)")
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", default="bench")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--workload", choices=sorted(work.WORKLOADS), default="noop")
    parser.add_argument("--cpu-loops", type=int, default=0, help="busy-loop iterations of cpu5ms (run.py calibrates)")
    parser.add_argument("--producer", action="store_true", help="also measure offers one at a time")
    parser.add_argument("--producer-offers", type=int, default=2000)
    parser.add_argument("--memory", action="store_true", help="memory per waiting task (settles 2 x 3.5 s)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="throughput phase limit (s)")
    parser.add_argument("--stall", type=float, default=30.0, help="give up after this long without progress (s)")
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between starting the latency "
                        "phase's workers and the first offer")
    parser.add_argument("--boot-timeout", type=float, default=60.0, help="limit for the first warm-up job (s)")
    parser.add_argument("--idle-offers", type=int, default=200)
    parser.add_argument("--idle-gap", type=float, default=0.01)
    parser.add_argument("--idle-time", type=float, default=20.0)
    parser.add_argument("--rates", type=int, nargs="*", default=[500, 2000])
    parser.add_argument("--load-seconds", type=float, default=4.0)
    parser.add_argument("--lead-in", type=float, default=0.5, help="unmeasured seconds at each rate first")
    parser.add_argument("--load-drain", type=float, default=15.0)
    parser.add_argument("--producer-inflight", type=int, default=64,
                        help="offers one open-loop producer keeps in flight at most (its connection budget)")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    probedir = args.workdir / "probe"
    probedir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, BENCH_URL=args.url, BENCH_QUEUE=args.queue, BENCH_CONCURRENCY=str(args.concurrency),
               BENCH_OPTIONS=args.options, BENCH_PROBE_DIR=str(probedir), BENCH_WORKLOAD=args.workload,
               BENCH_CPU_LOOPS=str(args.cpu_loops))
    os.environ.update({k: env[k] for k in ("BENCH_URL", "BENCH_QUEUE", "BENCH_CONCURRENCY", "BENCH_OPTIONS",
                                           "BENCH_PROBE_DIR", "BENCH_WORKLOAD", "BENCH_CPU_LOOPS")})
    module = importlib.import_module(f"bench.peers.adapters.{args.adapter}")
    adapter = module.Adapter(Settings.from_env())
    result: dict = {"adapter": args.adapter, "versions": versions(adapter), "settings": adapter.options_summary(),
                    "python": sys.version.split()[0], "processes": args.processes, "concurrency": args.concurrency,
                    "effectmq_from": _effectmq_origin()}
    client = resp.Resp(args.url)
    try:
        if args.producer:
            try:
                result["producer"] = await producer(adapter, args, client)
            except Exception as exc:
                result["producer"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        try:
            result["throughput"] = await throughput(adapter, args, client, env, probedir, args.workdir)
        except Exception as exc:
            result["throughput"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        if args.latency:
            try:
                result["latency"] = await latency(adapter, args, client, env, probedir, args.workdir)
            except Exception as exc:
                result["latency"] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    finally:
        try:
            await adapter.close()
        except Exception:
            pass
        client.call("FLUSHALL")
        client.close()
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
