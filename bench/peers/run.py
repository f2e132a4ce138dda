"""EffectMQ and its Python peers side by side, on one private Redis, in one run.

    python bench/peers/run.py                      # everything: 4 workloads, producer, latency, ceiling
    python bench/peers/run.py --quick              # 2,000 jobs, no latency, no redis-benchmark
    python bench/peers/run.py --jobs 2000 --only effectmq taskiq --workloads redis-rtt
    python bench/peers/run.py --baseline 52294ff --only effectmq taskiq saq

Builds (or reuses) one virtualenv per library (venvs.py), starts one redis-server
on a free loopback port, and for each workload (work.py: noop, redis-rtt,
sleep10ms, cpu5ms) runs every variant in its own venv (scenario.py: N jobs
prefilled through the library's bulk way, 2 worker processes x 10 in flight, every
job verified), then redis-benchmark EVALSHA of a trivial script on the same
server as the ceiling. Prints tables and writes JSON (bench/results/peers-*.json).
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
import signal
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

from bench.peers import resp, venvs, work  # noqa: E402


@dataclass
class Variant:
    name: str
    adapter: str  # adapters/<adapter>.py and adapters/<adapter>.txt
    options: dict = field(default_factory=dict)
    about: str = ""
    default: bool = True  # False: runs only when named in --only
    venv: str = ""  # key of the venv it runs in (default: the adapter's); baselines have their own
    commit: str | None = None  # a baseline's EffectMQ commit
    source: Path | None = None  # a baseline's extracted EffectMQ folder

    @property
    def venv_id(self) -> str:
        return self.venv or self.adapter

    @property
    def is_effectmq(self) -> bool:
        return self.adapter == "effectmq"


VARIANTS = [
    Variant("effectmq", "effectmq", {}, "this checkout, leases + heartbeats + fencing on, prefetch auto"),
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
    Variant("effectmq-p0", "effectmq", {"prefetch": 0}, "prefetch 0: holds no lease ahead (auto is the default)",
            default=False),
    Variant("effectmq-uvloop", "effectmq", {"loop": "uvloop"}, "--loop uvloop (asyncio's loop is the default)",
            default=False),
    Variant("effectmq-traced", "effectmq", {"traced": True},
            "OpenTelemetry SDK installed, every span sampled, exported to a no-op exporter", default=False),
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


def effectmq_state() -> str:
    """HEAD plus a hash of the uncommitted changes under effectmq/: the code an editable
    EffectMQ variant runs. Taken before every run, so a tree edited mid-run shows."""
    head = subprocess.run(["git", "rev-parse", "--short=9", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    diff = subprocess.run(["git", "diff", "HEAD", "--", "effectmq"], cwd=ROOT, capture_output=True).stdout
    untracked = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", "effectmq"], cwd=ROOT,
                               capture_output=True).stdout
    if not diff and not untracked:
        return head
    import hashlib
    return f"{head}+{hashlib.sha256(diff + untracked).hexdigest()[:8]}"


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

def bench_only_path(work_dir: Path) -> Path:
    """A folder holding only `bench` (a symlink to this checkout's): the cwd and PYTHONPATH
    of every scenario and worker, so `import effectmq` resolves to the venv's install
    (this checkout or a baseline) and never to a checkout on sys.path."""
    path = work_dir / "pythonpath"
    path.mkdir(exist_ok=True)
    (path / "bench").symlink_to(ROOT / "bench", target_is_directory=True)
    return path


def run_variant(v: Variant, python: str, url: str, args, workdir: Path, *, workload: str, latency: bool,
                producer: bool, cpu_loops: int, pythonpath: Path) -> dict:
    out_file = workdir / "result.json"
    jobs = scaled_jobs(args.jobs, workload)
    cmd = [python, "-m", "bench.peers.scenario", "--adapter", v.adapter, "--options", json.dumps(v.options),
           "--url", url, "--queue", "bench", "--jobs", str(jobs), "--processes", str(args.processes),
           "--concurrency", str(args.concurrency), "--workdir", str(workdir), "--out", str(out_file),
           "--workload", workload, "--cpu-loops", str(cpu_loops),
           "--rates", *map(str, args.rates), "--load-seconds", str(args.load_seconds),
           "--idle-offers", str(args.idle_offers), "--producer-offers", str(args.producer_offers)]
    if latency:
        cmd.append("--latency")
    if producer:
        cmd += ["--producer", "--memory"]
    env = dict(os.environ, PYTHONPATH=str(pythonpath), BENCH_BULK=str(args.bulk))
    state = effectmq_state() if v.is_effectmq and not v.commit else None
    load_before = loadavg()
    started = time.monotonic()
    log = workdir / "scenario.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=pythonpath, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=args.variant_timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
            stop_scenario(proc)
        except BaseException:  # interrupted: the scenario stops its workers before we go
            stop_scenario(proc)
            raise
    if code != 0 or not out_file.exists():
        return {"variant": v.name, "workload": workload, "checkout": state,
                "error": f"scenario exited with {code}: {log.read_text(errors='replace')[-2000:]}",
                "loadavg_before": load_before}
    result = json.loads(out_file.read_text())
    result.update({"variant": v.name, "workload": workload, "options": v.options, "about": v.about,
                   "commit": v.commit, "checkout": state, "loadavg_before": load_before,
                   "wall_s": round(time.monotonic() - started, 1)})
    return result


def stop_scenario(proc: subprocess.Popen) -> None:
    """SIGTERM lets the scenario stop its worker processes (own sessions) and exit."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def scaled_jobs(jobs: int, workload: str) -> int:
    return max(200, round(jobs * work.WORKLOADS[workload].jobs_factor))


# -- summaries ------------------------------------------------------------------------

THROUGHPUT_KEYS = ("jobs_per_s", "jobs_per_s_from_first", "jobs_per_s_with_boot", "redis_commands_per_job",
                   "redis_commands_per_job_excl_handler", "redis_cpu_us_per_job", "redis_cpu_us_per_job_excl_handler",
                   "queue_ceiling_jobs_per_s", "queue_ceiling_excl_handler_jobs_per_s", "worker_cpu_ms_per_job",
                   "total_cpu_ms_per_job", "evalsha_per_job", "prefill_commands_per_job",
                   "memory_bytes_per_waiting_task", "handler_commands_per_job")


def dig(d: dict | None, *path):
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def median_at(runs: list[dict], *path):
    values = [x for r in runs if (x := dig(r, *path)) is not None]
    return statistics.median(values) if values else None


def run_ok(r: dict) -> bool:
    return "error" not in r and isinstance(r.get("throughput"), dict) and "error" not in r["throughput"]


def summarize(name: str, workload: str, runs: list[dict]) -> dict:
    """One row: medians over the repeats (all runs stay in the JSON)."""
    ok = [r for r in runs if run_ok(r)]
    last = runs[-1]
    row: dict = {"variant": name, "workload": workload, "runs": len(runs), "ok_runs": len(ok),
                 "versions": last.get("versions"), "commit": last.get("commit"),
                 "effectmq_from": last.get("effectmq_from"), "settings": last.get("settings"),
                 "about": last.get("about"), "jobs": dig(last, "throughput", "jobs")}
    for key in THROUGHPUT_KEYS:
        row[key] = median_at(ok, "throughput", key)
    row["handler_alone_redis_cpu_us"] = median_at(ok, "throughput", "handler_alone", "redis_cpu_us_per_round_trip")
    row["bulk"] = {"way": dig(last, "throughput", "bulk", "way"), "batch": dig(last, "throughput", "bulk", "batch"),
                   **{k: median_at(ok, "throughput", "bulk", k)
                      for k in ("tasks_per_s", "redis_commands_per_task", "redis_cpu_us_per_task")}}
    row["duplicates"] = sum(dig(r, "throughput", "duplicates") or 0 for r in ok)
    row["missing"] = sum(dig(r, "throughput", "missing") or 0 for r in ok)
    row["verified"] = bool(ok) and row["missing"] == 0
    errors = [r.get("error") or dig(r, "throughput", "error") for r in runs]
    row["errors"] = [e for e in errors if e]
    row["latency"] = next((r["latency"] for r in reversed(runs) if isinstance(r.get("latency"), dict)), None)
    producers = [r["producer"] for r in runs if isinstance(r.get("producer"), dict) and "error" not in r["producer"]]
    row["producer"] = {k: median_at([{"p": p} for p in producers], "p", k)
                       for k in ("tasks_per_s", "redis_commands_per_task", "redis_cpu_us_per_task")} \
        if producers else next((r["producer"] for r in runs if isinstance(r.get("producer"), dict)), None)
    return row


def compare(rows: list[dict], processes: int, concurrency: int) -> None:
    """vs_best_peer within each workload (EffectMQ variants are never peers), and the sleep ceiling."""
    for workload in {r["workload"] for r in rows}:
        same = [r for r in rows if r["workload"] == workload]
        peers = [r["jobs_per_s"] for r in same if r["jobs_per_s"] and not r["variant"].startswith("effectmq")]
        best = max(peers) if peers else None
        ideal = processes * concurrency / work.WORKLOADS[workload].handler_seconds \
            if workload == "sleep10ms" else None
        for r in same:
            r["best_peer_jobs_per_s"] = best
            r["vs_best_peer"] = r["jobs_per_s"] / best if best and r["jobs_per_s"] else None
            r["ideal_jobs_per_s"] = ideal
            r["share_of_ideal"] = r["jobs_per_s"] / ideal if ideal and r["jobs_per_s"] else None


def against_baselines(rows: list[dict]) -> list[dict]:
    """Each EffectMQ variant of this checkout over each effectmq@REV of the same workload: <1 is less work."""
    out = []
    for new in (r for r in rows if r["variant"].startswith("effectmq") and not r.get("commit")):
        for old in (r for r in rows if r["workload"] == new["workload"] and r.get("commit")):
            def ratio(key: str):
                return new[key] / old[key] if new.get(key) is not None and old.get(key) else None
            out.append({"workload": new["workload"], "variant": new["variant"], "baseline": old["variant"],
                        "redis_cpu_per_job": ratio("redis_cpu_us_per_job"),
                        "redis_cpu_per_job_excl_handler": ratio("redis_cpu_us_per_job_excl_handler"),
                        "redis_commands_per_job": ratio("redis_commands_per_job"),
                        "jobs_per_s": ratio("jobs_per_s"),
                        "memory_per_waiting_task": ratio("memory_bytes_per_waiting_task")})
    return out


def baseline_lines(ratios: list[dict], workload: str) -> list[str]:
    lines = []
    for r in (r for r in ratios if r["workload"] == workload):
        parts = [f"Redis CPU/job x{fmt(r['redis_cpu_per_job'], '.2f')}"]
        if r["redis_cpu_per_job_excl_handler"] is not None:
            parts.append(f"excl handler x{r['redis_cpu_per_job_excl_handler']:.2f}")
        parts += [f"cmds/job x{fmt(r['redis_commands_per_job'], '.2f')}", f"jobs/s x{fmt(r['jobs_per_s'], '.2f')}"]
        if r["memory_per_waiting_task"] is not None:
            parts.append(f"memory/waiting task x{r['memory_per_waiting_task']:.2f}")
        lines.append(f"{r['variant']} against {r['baseline']}: " + ", ".join(parts))
    return lines


# -- tables -------------------------------------------------------------------------------

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


def verified_cell(row: dict) -> str:
    cell = "error" if not row["ok_runs"] else ("ok" if row["verified"] else f"miss {row['missing']}")
    return cell + (f" +{row['duplicates']}dup" if row["duplicates"] else "")


def version_of(row: dict) -> str:
    if row.get("commit"):
        return row["commit"][:7]
    return row.get("checkout") or next(iter((row.get("versions") or {}).values()), None) or "?"


def throughput_table(rows: list[dict], workload: str) -> str:
    """One workload: rate, Redis work per job and the ceiling of one queue it implies."""
    excl = bool(work.HANDLER_COMMANDS.get(workload))
    cols = [("variant", 18, "<"), ("version", 9, "<"), ("jobs/s", 7, ">"), ("vs best", 7, ">")]
    if workload == "sleep10ms":
        cols.append(("of ideal", 8, ">"))
    cols += [("cmds/job", 8, ">")] + ([("excl h", 6, ">")] if excl else [])
    cols += [("Redis us/job", 12, ">")] + ([("excl h", 6, ">")] if excl else [])
    cols += [("ceiling/core", 12, ">")] + ([("excl h", 7, ">")] if excl else [])
    cols += [("worker us/job", 13, ">"), ("verified", 9, ">")]
    lines = [" ".join(format(name, f"{align}{width}") for name, width, align in cols)]
    lines.append("-" * len(lines[0]))
    for r in (r for r in rows if r["workload"] == workload):
        cells = [r["variant"], version_of(r), fmt(r["jobs_per_s"], ",.0f"),
                 fmt(r.get("vs_best_peer"), ".2f") + ("x" if r.get("vs_best_peer") else "")]
        if workload == "sleep10ms":
            cells.append(fmt(r.get("share_of_ideal") and r["share_of_ideal"] * 100, ".0f") + "%")
        cells.append(fmt(r["redis_commands_per_job"], ".1f"))
        if excl:
            cells.append(fmt(r["redis_commands_per_job_excl_handler"], ".1f"))
        cells.append(fmt(r["redis_cpu_us_per_job"], ".0f"))
        if excl:
            cells.append(fmt(r["redis_cpu_us_per_job_excl_handler"], ".0f"))
        cells.append(fmt(r["queue_ceiling_jobs_per_s"], ",.0f"))
        if excl:
            cells.append(fmt(r["queue_ceiling_excl_handler_jobs_per_s"], ",.0f"))
        cells += [fmt(r["worker_cpu_ms_per_job"] and r["worker_cpu_ms_per_job"] * 1000, ".0f"), verified_cell(r)]
        lines.append(" ".join(format(c, f"{align}{width}") for c, (_, width, align) in zip(cells, cols)))
    return "\n".join(lines)


def producer_table(rows: list[dict]) -> str:
    """Per variant: offers one at a time, the bulk way, and memory per waiting task."""
    by_variant: dict[str, list[dict]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    head = (f"{'variant':<18} {'1-by-1/s':>8} {'us/task':>7} {'cmds':>5} {'bulk/s':>8} {'us/task':>7} "
            f"{'cmds':>5} {'B/waiting':>9}  bulk way")
    lines = [head, "-" * len(head)]
    for name, rs in by_variant.items():
        single = next((r["producer"] for r in rs if isinstance(r.get("producer"), dict)), None) or {}
        ok = [r for r in rs if r["ok_runs"]]

        def med(get):
            values = [x for r in ok if (x := get(r)) is not None]
            return statistics.median(values) if values else None

        way = next((r["bulk"]["way"] for r in rs if r["bulk"].get("way")), "-")
        batch = next((r["bulk"]["batch"] for r in rs if r["bulk"].get("batch")), None)
        lines.append(
            f"{name:<18} {fmt(single.get('tasks_per_s'), ',.0f'):>8} "
            f"{fmt(single.get('redis_cpu_us_per_task'), '.0f'):>7} "
            f"{fmt(single.get('redis_commands_per_task'), '.1f'):>5} "
            f"{fmt(med(lambda r: r['bulk']['tasks_per_s']), ',.0f'):>8} "
            f"{fmt(med(lambda r: r['bulk']['redis_cpu_us_per_task']), '.0f'):>7} "
            f"{fmt(med(lambda r: r['bulk']['redis_commands_per_task']), '.1f'):>5} "
            f"{fmt(med(lambda r: r['memory_bytes_per_waiting_task']), ',.0f'):>9}  {way}"
            + (f" ({batch} per call)" if batch else ""))
    return "\n".join(lines)


def latency_table(rows: list[dict], rates: list[int]) -> str:
    head = f"{'variant':<18} {'idle p50/p99':>12}" + "".join(f" {f'{r}/s p50/p99':>14}" for r in rates)
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("latency"):
            lines.append(f"{r['variant']:<18} {latency_cell(r['latency'], 'idle'):>12}"
                         + "".join(f" {latency_cell(r['latency'], f'open_{x}'):>14}" for x in rates))
    return "\n".join(lines) if len(lines) > 2 else ""


# -- main -------------------------------------------------------------------------------------

def select_variants(args, parser) -> list[Variant]:
    selected = [v for v in VARIANTS
                if (v.name in (args.only or []) or (v.default and (not args.only or v.adapter in args.only)))
                and v.name not in args.skip and v.adapter not in args.skip]
    after_effectmq = next((k + 1 for k, v in enumerate(selected) if v.name == "effectmq"), 0)
    for n, rev in enumerate(args.baseline or []):  # right after effectmq, in the order given
        commit, source = venvs.baseline_source(rev, log=say)
        name = f"effectmq@{rev if len(rev) < 13 else commit[:9]}"
        selected.insert(after_effectmq + n,
                        Variant(name, "effectmq", {}, f"EffectMQ at {commit} (git archive), defaults as effectmq",
                                venv=name, commit=commit, source=source))
    if not selected:
        parser.error("no variant selected")
    return selected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--jobs", type=int, default=10_000,
                        help="prefilled jobs per throughput run (cpu5ms runs a fifth of them)")
    parser.add_argument("--workloads", type=lambda s: [w.strip() for w in s.split(",") if w.strip()],
                        default=list(work.WORKLOADS), help=f"comma-separated, from {','.join(work.WORKLOADS)}")
    parser.add_argument("--processes", type=int, default=2, help="worker processes per library")
    parser.add_argument("--concurrency", type=int, default=10, help="jobs in flight per worker process")
    parser.add_argument("--only", nargs="+", help="variant or adapter names to run (default: all)")
    parser.add_argument("--skip", nargs="+", default=[], help="variant or adapter names to leave out")
    parser.add_argument("--baseline", nargs="+", metavar="REV",
                        help="also run EffectMQ at these commits (git archive into a cache folder, own venv)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all variants (medians reported)")
    parser.add_argument("--latency", choices=["all", "effectmq", "none"], default="all",
                        help="which variants get the latency phases (run with the first workload)")
    parser.add_argument("--no-producer", action="store_true", help="skip the one-at-a-time offer phase")
    parser.add_argument("--producer-offers", type=int, default=2000, help="offers one at a time per variant")
    parser.add_argument("--bulk", type=int, default=100, help="jobs per bulk offer call (the prefill)")
    parser.add_argument("--cpu-loops", type=int, default=0,
                        help="busy-loop iterations of cpu5ms (default: calibrated to 5 ms at start; give the "
                             "JSON's workload.cpu5ms_loops to repeat a run's exact handler)")
    parser.add_argument("--quick", action="store_true", help="--jobs 2000 (unless given), no latency, no ceiling")
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
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup below runs: scenario, redis-server
    if args.quick:
        if not any(a == "--jobs" or a.startswith("--jobs=") for a in sys.argv[1:]):
            args.jobs = 2000
        args.latency, args.no_ceiling = "none", True
    unknown = [w for w in args.workloads if w not in work.WORKLOADS]
    if unknown or not args.workloads:
        parser.error(f"unknown workload(s) {unknown}; choose from {','.join(work.WORKLOADS)}")

    selected = select_variants(args, parser)
    if not shutil.which(args.redis_server) and not Path(args.redis_server).exists():
        raise SystemExit("redis-server not found: apt-get install redis-server")

    cpu_loops = args.cpu_loops or (work.calibrate_loops(0.005) if "cpu5ms" in args.workloads else 0)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_path = args.out or ROOT / "bench" / "results" / f"peers-{stamp}.json"
    report: dict = {"command": " ".join(["python", "bench/peers/run.py", *sys.argv[1:]]), "started": stamp,
                    "machine": machine(),
                    "workload": {"jobs": args.jobs, "processes": args.processes, "concurrency": args.concurrency,
                                 "workloads": {w: {"about": work.WORKLOADS[w].about,
                                                   "jobs": scaled_jobs(args.jobs, w)} for w in args.workloads},
                                 "handler_commands": work.HANDLER_COMMANDS, "cpu5ms_loops": cpu_loops,
                                 "bulk": args.bulk, "producer_offers": args.producer_offers, "rates": args.rates,
                                 "load_seconds": args.load_seconds, "idle_offers": args.idle_offers},
                    "baselines": {v.name: {"commit": v.commit, "source": str(v.source)} for v in selected if v.commit}}

    pythons: dict[str, str] = {}
    for v in selected:
        if v.venv_id in pythons:
            continue
        try:
            root = v.source or ROOT
            pythons[v.venv_id] = venvs.python_of(venvs.ensure_venv(v.adapter, args.python, log=say, root=root))
        except (SystemExit, subprocess.CalledProcessError) as exc:
            say(f"{v.venv_id}: venv build failed, skipped: {exc}")
    work_dir = Path(tempfile.mkdtemp(prefix="effectmq-peers-"))
    pythonpath = bench_only_path(work_dir)
    runs: dict[tuple[str, str], list[dict]] = {(w, v.name): [] for w in args.workloads for v in selected}
    with redis_server(args.redis_server) as url:
        report["redis"] = redis_facts(url)
        say(f"redis-server {report['redis']['version']} at {url}; load average {loadavg()}; "
            f"cpu5ms = {cpu_loops:,} loop iterations")
        for round_ in range(args.repeat):
            for w_index, workload in enumerate(args.workloads):
                for v in selected:
                    if v.venv_id not in pythons:
                        runs[(workload, v.name)].append({"variant": v.name, "workload": workload,
                                                         "error": "venv build failed"})
                        continue
                    # latency and the producer phase once per variant: first workload, last round
                    once = w_index == 0 and round_ == args.repeat - 1
                    latency = once and (args.latency == "all" or (args.latency == "effectmq" and v.is_effectmq))
                    producer = once and not args.no_producer
                    jobs = scaled_jobs(args.jobs, workload)
                    say(f"[{round_ + 1}/{args.repeat}] {workload} {v.name}: {jobs} jobs"
                        f"{' + producer' if producer else ''}{' + latency' if latency else ''} (load {loadavg()[0]})")
                    workdir = work_dir / f"{workload}-{v.name}-{round_}"
                    workdir.mkdir()
                    result = run_variant(v, pythons[v.venv_id], url, args, workdir, workload=workload,
                                         latency=latency, producer=producer, cpu_loops=cpu_loops,
                                         pythonpath=pythonpath)
                    runs[(workload, v.name)].append(result)
                    if not run_ok(result):
                        say(f"   error: {(result.get('error') or result['throughput']['error'])[:500]}")
                    else:
                        t = result["throughput"]
                        say(f"   {t['jobs_per_s']:,.0f} jobs/s, {t['redis_commands_per_job']:.1f} cmds/job, "
                            f"{t['redis_cpu_us_per_job']:.0f} us Redis CPU/job, missing {t['missing']}, "
                            f"duplicates {t['duplicates']}")
        if not args.no_ceiling:
            say("ceiling: redis-benchmark EVALSHA ...")
            report["ceiling"] = ceiling(url, args.processes * args.concurrency, args.ceiling_requests)
    report["machine"]["loadavg_at_end"] = loadavg()

    rows = [summarize(name, workload, rs) for (workload, name), rs in runs.items()]
    states = sorted({r["checkout"] for rs in runs.values() for r in rs if r.get("checkout")})
    for row in rows:  # EffectMQ of this checkout: its commit, + when effectmq/ had uncommitted changes
        state = next((r.get("checkout") for r in runs[(row["workload"], row["variant"])] if r.get("checkout")), None)
        if state:
            row["checkout"] = state.split("+")[0][:7] + ("+" if "+" in state else "")
    report["effectmq_checkout_states"] = states
    compare(rows, args.processes, args.concurrency)
    ratios = against_baselines(rows)
    report["summary"] = rows
    report["against_baselines"] = ratios
    report["runs"] = {f"{w}/{name}": rs for (w, name), rs in runs.items()}
    report["logs"] = str(work_dir)

    print(f"\n{args.processes} worker processes x {args.concurrency} in flight per library; Redis "
          f"{report['redis']['version']} (private, loopback); {report['machine']['nproc']} x "
          f"{report['machine']['cpu_model']}; load average {report['machine']['loadavg_at_start']} at start, "
          f"{report['machine']['loadavg_at_end']} at end")
    for workload in args.workloads:
        jobs = scaled_jobs(args.jobs, workload)
        extra = ""
        if workload == "sleep10ms":
            extra = f"; ideal ceiling {args.processes * args.concurrency} in flight / 10 ms = " \
                    f"{args.processes * args.concurrency / 0.01:,.0f} jobs/s"
        print(f"\n== {workload}: {work.WORKLOADS[workload].about}, {jobs:,} jobs{extra}")
        print(throughput_table(rows, workload))
        for line in baseline_lines(ratios, workload):
            print(line)
    print("\njobs/s: with all worker processes running, to the last handler start. vs best: ratio to the best "
          "peer in the same workload. cmds/job, Redis us/job: INFO commandstats / cpu (used_cpu_user + "
          "used_cpu_sys) deltas from worker start until all acked, commands inside Lua included. ceiling/core: "
          "1e6 / Redis us/job, the jobs/s one queue (one Redis core) can carry. excl h: without the handler's "
          f"own round trip ({work.HANDLER_COMMANDS.get('redis-rtt')} commands counted, its Redis CPU measured "
          "alone after the run). worker us/job: CPU of the worker process trees from the first handler on.")
    if any(r.get("producer") or r["bulk"].get("tasks_per_s") for r in rows):
        print(f"\n== producer path and memory: 1-by-1 = {args.producer_offers:,} offers one at a time "
              f"(no workers); bulk = the prefill through the library's bulk way, {args.bulk} per call; "
              "us/task = Redis CPU per offered task; B/waiting = used_memory delta / prefilled tasks")
        print(producer_table(rows))
    lat = latency_table([r for r in rows if r["workload"] == args.workloads[0]], args.rates)
    if lat:
        print(f"\n== latency ({args.workloads[0]} handler): offer -> handler start in ms (open loop from the "
              "scheduled offer time); * = not every job started within 15 s or offers failed; ^ = the "
              "library's offer path could not keep the rate (see JSON)")
        print(lat)
    c = report.get("ceiling") or {}
    if "pipeline_1" in c and "evalsha_per_s" in c["pipeline_1"]:
        p1, p16 = c["pipeline_1"], c.get("pipeline_16", {})
        print(f"\nceiling: redis-benchmark EVALSHA 'return 1', {c['clients']} clients: {p1['evalsha_per_s']:,.0f}/s "
              f"({p1['redis_cpu_us_per_call']:.1f} us Redis CPU each); pipelined x16: "
              f"{fmt(p16.get('evalsha_per_s'), ',.0f')}/s")
    elif c:
        print(f"\nceiling: {c.get('error') or c}")
    if len(states) > 1:
        print(f"warning: effectmq/ changed during the run ({', '.join(states)}): rows of this checkout "
              "are not all the same code (runs[*].checkout in the JSON)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1))
    print(f"JSON: {out_path}")
    failed = [f"{r['workload']}/{r['variant']}" for r in rows if not r["ok_runs"] or r["missing"]]
    if failed:
        print(f"not verified: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
