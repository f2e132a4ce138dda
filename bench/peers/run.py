"""EffectMQ and its Python peers side by side, on one private Redis, in one run.

    python bench/peers/run.py                      # everything: 10,000 jobs, latency, ceiling
    python bench/peers/run.py --jobs 2000          # a quick check
    python bench/peers/run.py --only effectmq taskiq --latency effectmq --repeat 3

Builds (or reuses) one virtualenv per library (venvs.py), starts one redis-server
on a free loopback port, runs each variant's workload in its own venv
(scenario.py: 2 worker processes x 10 in flight, N prefilled no-op jobs, every
job verified), then redis-benchmark EVALSHA of a trivial script on the same
server as the ceiling. Prints a table and writes JSON (bench/results/peers-*.json).
Only stdlib here: the libraries live in their venvs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.peers import resp, venvs  # noqa: E402


@dataclass
class Variant:
    name: str
    adapter: str  # adapters/<adapter>.py and adapters/<adapter>.txt
    options: dict = field(default_factory=dict)
    about: str = ""
    default: bool = True  # False: runs only when named in --only


VARIANTS = [
    Variant("effectmq", "effectmq", {}, "this checkout, leases + heartbeats + fencing on"),
    Variant("taskiq", "taskiq", {}, "taskiq-redis streams, xread_count 100 (default)"),
    Variant("taskiq-x10", "taskiq", {"xread_count": 10}, "claims at most the in-flight budget per read"),
    Variant("saq", "saq", {}, ""),
    Variant("bullmq", "bullmq", {}, "Python port"),
    Variant("celery", "celery", {}, "threads pool, acks_late, prefetch multiplier 4 (default)"),
    Variant("celery-p1", "celery", {"prefetch_multiplier": 1}, "reserves only the in-flight budget"),
    Variant("arq-50ms", "arq", {"poll_delay": 0.05}, "poll_delay 50 ms"),
    Variant("arq", "arq", {}, "poll_delay 0.5 s (default)"),
    Variant("rq", "rq", {}, "worker-pool of 10 per process, rq.Worker forks per job (default)"),
    Variant("rq-simple", "rq", {"worker_class": "rq.SimpleWorker"}, "worker-pool of 10, SimpleWorker (no fork)"),
    # EffectMQ settings experiments, never counted as peers: run with --only effectmq-noevents ...
    Variant("effectmq-noevents", "effectmq", {"events_maxlen": 0}, "events stream off (events_maxlen=0)",
            default=False),
]


def say(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- the machine --------------------------------------------------------------

def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = round(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024, 1)

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip()

    return {
        "nproc": os.cpu_count(), "cpu_model": cpu, "memory_gib": mem, "kernel": platform.release(),
        "python": platform.python_version(), "loadavg_at_start": loadavg(),
        "checkout": {"commit": git("rev-parse", "HEAD"),
                     "effectmq_dirty": bool(git("status", "--porcelain", "--", "effectmq"))},
    }


# -- the private redis-server ---------------------------------------------------

@contextlib.contextmanager
def redis_server(binary: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="effectmq-peers-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(250):
            with contextlib.suppress(OSError, resp.RedisError):
                with resp.Resp(url, timeout=1) as c:
                    c.call("PING")
                    break
            if proc.poll() is not None:
                raise SystemExit(f"redis-server exited with {proc.returncode}")
            time.sleep(0.02)
        else:
            raise SystemExit("redis-server did not answer PING within 5 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def redis_facts(url: str) -> dict:
    with resp.Resp(url) as c:
        info = c.info("server")
        config = c.call("CONFIG", "GET", "io-threads")
    version = info.get("redis_version", "?")
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    return {"version": version, "io_threads": config[1] if config else None,
            "persistence": "none (--save '' --appendonly no)",
            "ok_for_bullmq": major_minor >= (6, 2)}


# -- the ceiling ------------------------------------------------------------------

def ceiling(url: str, clients: int, requests: int) -> dict:
    """redis-benchmark EVALSHA of `return 1` on the same server: what one Redis does at most."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {"error": "redis-benchmark not found (Debian package redis-tools)"}
    port = url.rsplit(":", 1)[1].split("/")[0]
    out: dict = {"script": "return 1", "clients": clients, "requests": requests}
    with resp.Resp(url) as c:
        c.call("FLUSHALL")
        sha = c.call("SCRIPT", "LOAD", "return 1")
        for pipeline in (1, 16):
            before = resp.snapshot(c)
            r = subprocess.run([binary, "-h", "127.0.0.1", "-p", port, "-c", str(clients), "-n", str(requests),
                                "-P", str(pipeline), "-q", "--csv", "EVALSHA", sha, "0"],
                               capture_output=True, text=True, timeout=300)
            d = resp.delta(before, resp.snapshot(c))
            rows = [line.split('","') for line in r.stdout.splitlines() if line.startswith('"EVALSHA')]
            if not rows:
                out[f"pipeline_{pipeline}"] = {"error": (r.stdout + r.stderr)[-500:]}
                continue
            calls = d["calls"].get("evalsha", 0) or requests
            out[f"pipeline_{pipeline}"] = {
                "evalsha_per_s": float(rows[0][1]), "p50_ms": float(rows[0][4]), "p99_ms": float(rows[0][6]),
                "redis_cpu_us_per_call": d["cpu"] * 1e6 / calls,
            }
    return out


# -- the variants ---------------------------------------------------------------------

def run_variant(v: Variant, python: str, url: str, args, workdir: Path, latency: bool) -> dict:
    out_file = workdir / "result.json"
    cmd = [python, "-m", "bench.peers.scenario", "--adapter", v.adapter, "--options", json.dumps(v.options),
           "--url", url, "--queue", "bench", "--jobs", str(args.jobs), "--processes", str(args.processes),
           "--concurrency", str(args.concurrency), "--workdir", str(workdir), "--out", str(out_file),
           "--rates", *map(str, args.rates), "--load-seconds", str(args.load_seconds),
           "--idle-offers", str(args.idle_offers)]
    if latency:
        cmd.append("--latency")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    load_before = loadavg()
    started = time.monotonic()
    log = workdir / "scenario.log"
    with open(log, "wb") as f:
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.variant_timeout)
            code = r.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out_file.exists():
        return {"variant": v.name, "error": f"scenario exited with {code}: {log.read_text(errors='replace')[-2000:]}",
                "loadavg_before": load_before}
    result = json.loads(out_file.read_text())
    result.update({"variant": v.name, "options": v.options, "about": v.about, "loadavg_before": load_before,
                   "wall_s": round(time.monotonic() - started, 1)})
    return result


def tp(result: dict, key: str):
    return (result.get("throughput") or {}).get(key)


def median_of(runs: list[dict], key: str):
    values = [tp(r, key) for r in runs if tp(r, key) is not None]
    return statistics.median(values) if values else None


def summarize(name: str, runs: list[dict]) -> dict:
    """One row: medians over the repeats (all runs stay in the JSON)."""
    ok = [r for r in runs if "error" not in r and "error" not in (r.get("throughput") or {})]
    last = runs[-1]
    row: dict = {"variant": name, "runs": len(runs), "ok_runs": len(ok),
                 "versions": last.get("versions"), "settings": last.get("settings"), "about": last.get("about")}
    for key in ("jobs_per_s", "jobs_per_s_from_first", "jobs_per_s_with_boot", "redis_commands_per_job",
                "redis_cpu_ms_per_job", "worker_cpu_ms_per_job", "total_cpu_ms_per_job", "evalsha_per_job",
                "prefill_commands_per_job"):
        row[key] = median_of(ok, key)
    row["duplicates"] = sum(tp(r, "duplicates") or 0 for r in ok)
    row["missing"] = sum(tp(r, "missing") or 0 for r in ok)
    row["verified"] = bool(ok) and row["missing"] == 0
    errors = [r.get("error") or (r.get("throughput") or {}).get("error") for r in runs]
    row["errors"] = [e for e in errors if e]
    lat = next((r["latency"] for r in reversed(runs) if isinstance(r.get("latency"), dict)), None)
    row["latency"] = lat
    return row


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def latency_cell(lat: dict | None, key: str) -> str:
    if not lat:
        return "-"
    if "error" in lat and key not in lat:
        return "error"
    phase = lat.get(key)
    if not phase or phase.get("p50_ms") is None:
        return "-"
    cell = f"{phase['p50_ms']:.1f}/{phase['p99_ms']:.0f}" if phase["p99_ms"] >= 10 else \
        f"{phase['p50_ms']:.1f}/{phase['p99_ms']:.1f}"
    if phase.get("all_started") is False or phase.get("offer_errors"):
        cell += "*"
    elif phase.get("rate") and (phase.get("offer_rate_achieved") or 0) < 0.95 * phase["rate"]:
        cell += "^"
    return cell


def table(rows: list[dict], rates: list[int]) -> str:
    head = (f"{'variant':<17} {'version':<9} {'jobs/s':>7} {'vs best':>7} {'cmds/job':>8} {'Redis us/job':>12} "
            f"{'worker us/job':>13} {'verified':>9} {'idle p50/p99':>12}")
    head += "".join(f" {f'{r}/s p50/p99':>14}" for r in rates)
    lines = [head, "-" * len(head)]
    for row in rows:
        version = next(iter((row.get("versions") or {}).values()), None) or "?"
        verified = "error" if not row["ok_runs"] else ("ok" if row["verified"] else f"miss {row['missing']}")
        if row["duplicates"]:
            verified += f" +{row['duplicates']}dup"
        line = (f"{row['variant']:<17} {version:<9} {fmt(row['jobs_per_s'], ',.0f'):>7} "
                f"{fmt(row.get('vs_best_peer'), '.2f'):>6}x {fmt(row['redis_commands_per_job'], '.1f'):>8} "
                f"{fmt(row['redis_cpu_ms_per_job'] and row['redis_cpu_ms_per_job'] * 1000, '.0f'):>12} "
                f"{fmt(row['worker_cpu_ms_per_job'] and row['worker_cpu_ms_per_job'] * 1000, '.0f'):>13} "
                f"{verified:>9} {latency_cell(row['latency'], 'idle'):>12}")
        line += "".join(f" {latency_cell(row['latency'], f'open_{r}'):>14}" for r in rates)
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--jobs", type=int, default=10_000, help="prefilled no-op jobs per throughput run")
    parser.add_argument("--processes", type=int, default=2, help="worker processes per library")
    parser.add_argument("--concurrency", type=int, default=10, help="jobs in flight per worker process")
    parser.add_argument("--only", nargs="+", help="variant or adapter names to run (default: all)")
    parser.add_argument("--skip", nargs="+", default=[], help="variant or adapter names to leave out")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all variants (medians reported)")
    parser.add_argument("--latency", choices=["all", "effectmq", "none"], default="all",
                        help="which variants get the latency phases")
    parser.add_argument("--rates", type=int, nargs="*", default=[500, 2000], help="open-loop offer rates (jobs/s)")
    parser.add_argument("--load-seconds", type=float, default=4.0, help="length of each open-loop phase")
    parser.add_argument("--idle-offers", type=int, default=200, help="sequential offers on the idle queue")
    parser.add_argument("--no-ceiling", action="store_true", help="skip redis-benchmark")
    parser.add_argument("--ceiling-requests", type=int, default=200_000)
    parser.add_argument("--variant-timeout", type=float, default=1200.0, help="limit for one variant (s)")
    parser.add_argument("--python", default=sys.executable, help="the Python that builds the venvs")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/peers-<UTC time>.json)")
    args = parser.parse_args()

    selected = [v for v in VARIANTS
                if (v.name in (args.only or []) or (v.default and (not args.only or v.adapter in args.only)))
                and v.name not in args.skip and v.adapter not in args.skip]
    if not selected:
        parser.error("no variant selected")
    if not shutil.which(args.redis_server) and not Path(args.redis_server).exists():
        raise SystemExit("redis-server not found: apt-get install redis-server")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_path = args.out or ROOT / "bench" / "results" / f"peers-{stamp}.json"
    report: dict = {"command": " ".join(["python", "bench/peers/run.py", *sys.argv[1:]]), "started": stamp,
                    "machine": machine(),
                    "workload": {"jobs": args.jobs, "processes": args.processes, "concurrency": args.concurrency,
                                 "handler": "no-op (records its start)", "rates": args.rates,
                                 "load_seconds": args.load_seconds, "idle_offers": args.idle_offers}}

    pythons: dict[str, str] = {}
    for adapter in sorted({v.adapter for v in selected}):
        try:
            pythons[adapter] = venvs.python_of(venvs.ensure_venv(adapter, args.python, log=say))
        except (SystemExit, subprocess.CalledProcessError) as exc:
            say(f"{adapter}: venv build failed, skipped: {exc}")
    work = Path(tempfile.mkdtemp(prefix="effectmq-peers-"))
    runs: dict[str, list[dict]] = {v.name: [] for v in selected}
    with redis_server(args.redis_server) as url:
        report["redis"] = redis_facts(url)
        say(f"redis-server {report['redis']['version']} at {url}; load average {loadavg()}")
        for round_ in range(args.repeat):
            for v in selected:
                if v.adapter not in pythons:
                    runs[v.name].append({"variant": v.name, "error": "venv build failed"})
                    continue
                latency = args.latency == "all" or (args.latency == "effectmq" and v.adapter == "effectmq")
                latency = latency and round_ == args.repeat - 1  # latency once, in the last round
                say(f"[{round_ + 1}/{args.repeat}] {v.name}: {args.jobs} jobs{' + latency' if latency else ''} "
                    f"(load {loadavg()[0]})")
                workdir = work / f"{v.name}-{round_}"
                workdir.mkdir()
                result = run_variant(v, pythons[v.adapter], url, args, workdir, latency)
                runs[v.name].append(result)
                if "error" in result or "error" in (result.get("throughput") or {}):
                    say(f"   error: {(result.get('error') or result['throughput']['error'])[:500]}")
                else:
                    t = result["throughput"]
                    say(f"   {t['jobs_per_s']:,.0f} jobs/s, {t['redis_commands_per_job']:.1f} cmds/job, "
                        f"missing {t['missing']}, duplicates {t['duplicates']}")
        if not args.no_ceiling:
            say("ceiling: redis-benchmark EVALSHA ...")
            report["ceiling"] = ceiling(url, args.processes * args.concurrency, args.ceiling_requests)
    report["machine"]["loadavg_at_end"] = loadavg()

    rows = [summarize(name, rs) for name, rs in runs.items()]
    peers = [r["jobs_per_s"] for r in rows if r["jobs_per_s"] and not r["variant"].startswith("effectmq")]
    best = max(peers) if peers else None
    for row in rows:
        row["vs_best_peer"] = row["jobs_per_s"] / best if best and row["jobs_per_s"] else None
    report["best_peer_jobs_per_s"] = best
    report["summary"] = rows
    report["runs"] = runs
    report["logs"] = str(work)

    print(f"\n{args.jobs} prefilled no-op jobs, {args.processes} worker processes x {args.concurrency} in flight; "
          f"Redis {report['redis']['version']} (private, loopback); {report['machine']['nproc']} x "
          f"{report['machine']['cpu_model']}; load average {report['machine']['loadavg_at_start']} at start, "
          f"{report['machine']['loadavg_at_end']} at end")
    print(table(rows, args.rates))
    print("jobs/s: with all worker processes running, to the last handler start. vs best: ratio to the best peer. "
          "cmds/job, Redis us/job: Redis INFO commandstats / cpu deltas from worker start until all acked; "
          "worker us/job: CPU of the worker process trees from the first handler until all acked. "
          "latency: offer -> handler start in ms (open loop from the scheduled offer time); * = not every job "
          "started within 15 s or offers failed; ^ = the library's offer path could not keep the rate (see JSON).")
    c = report.get("ceiling") or {}
    if "pipeline_1" in c and "evalsha_per_s" in c["pipeline_1"]:
        p1, p16 = c["pipeline_1"], c.get("pipeline_16", {})
        print(f"ceiling: redis-benchmark EVALSHA 'return 1', {c['clients']} clients: {p1['evalsha_per_s']:,.0f}/s "
              f"({p1['redis_cpu_us_per_call']:.1f} us Redis CPU each); pipelined x16: "
              f"{fmt(p16.get('evalsha_per_s'), ',.0f')}/s")
    elif c:
        print(f"ceiling: {c.get('error') or c}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1))
    print(f"JSON: {out_path}")
    failed = [r["variant"] for r in rows if not r["ok_runs"] or r["missing"]]
    if failed:
        print(f"not verified: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
