"""Operator fan-out: N Queues (and N Schedules) on one operator; the time of a full
poll pass and the API requests per second it causes.

    python bench/operator_fanout.py                              # 1,000 Queues + 1,000 Schedules, 60 s window
    python bench/operator_fanout.py --queues 50 --steady-seconds 20   # quick check
    python bench/operator_fanout.py --redis 4 --cron "0 3 * * *"      # 4 redis-servers, Schedules that rarely fire
    python bench/operator_fanout.py --api-latency 0.02                # every API call of the operator 20 ms slower

Targets: a full pass within the default poll interval (10 s) on this
machine, also with `--api-latency 0.02`, and under 1 API request per Queue per
minute in steady state. Reported too: the operator's connections to each
redis-server (its sockets matched to CLIENT LIST, sampled through every phase),
against the bound per distinct Redis however many Queues it holds.

`--api-latency S`: the operator (only: kubectl, the bench's own reads and
kube-controller-manager go straight) reaches the API server through a TCP proxy
that holds every chunk S/2 seconds in each direction (tests/fixtures/proxy.py
LatencyProxy, in a process of its own), so each request-reply takes S longer:
latency on the wire, TLS untouched, concurrent requests not serialized.

Runs everything on loopback and stops it afterwards: the test control plane
(etcd, kube-apiserver, kube-controller-manager from tooling/testbed/controlplane.py;
build it with `bash tooling/controlplane/build.sh`), `--redis` private
redis-servers and the operator as a real process (tests/support/operator.py).
Run it with the project's venv (the operator runs under the same interpreter).

1. The CRDs, one namespace, the Queues (each with a worker Deployment, scaling
   minReplicas 0 / maxReplicas `--max-replicas`, so no pods by default;
   pollIntervalSeconds `--poll-interval`; Redis round-robin over the servers) and
   the Schedules (cron `--cron`, Schedule i -> Queue i mod N) are created by
   server-side apply BEFORE the operator starts, so creation is not counted. The
   operator starts once kube-controller-manager's garbage collector watches the
   new CRDs (else it GETs every Queue that owns a Deployment, again and again).
2. First full pass: from the operator's start until every Queue has
   status.observedGeneration and a Ready condition and every Schedule has
   status.nextTickTime (listed every 2 s). Also from the operator's own gauge
   effectmq_operator_oldest_reconcile_age_seconds: it grows from the start of the
   leader's term until every Queue was reconciled once, then drops; its peak is
   the first pass as the leader sees it (cold: includes creating N Deployments).
3. Settling: until every Queue is Ready=True, i.e. kube-controller-manager has
   rolled out every worker Deployment (its client-side rate limit makes this take
   minutes for 1,000). Then `--warmup` seconds, then a steady window of
   `--steady-seconds` (keep it a whole number of cron periods: a per-minute
   Schedule writes its status once per tick, and its tick task makes the Queue's
   backlog change). In the window: the gauge
   sampled every second (in steady state it is poll interval + lag: the longest
   any Queue waited since its last reconcile), effectmq_operator_reconciles_total
   and effectmq_operator_api_requests_total (the reconcilers' API calls), and
   apiserver_request_total from the API server's /metrics at both ends, kept to
   the resources the operator touches (queues, schedules, deployments, pods,
   events, secrets, leases). WATCH requests are counted apart (the counter counts
   a watch when it ends). The same API server delta over a baseline window with
   the operator stopped (same objects, kube-controller-manager and the API
   server's own lease renewals still running) is subtracted.
   Operator CPU% and RSS from /proc over the window; schedule ticks
   materialized (effectmq_operator_schedule_ticks_total) against those due.

The pass target counts as met when the cold first pass (leader's view) fits in
the poll interval and, in the steady window, no Queue waited more than one extra
interval (max oldest-reconcile age <= 2 x interval), i.e. the operator keeps up.
Exit status is non-zero only on errors (a crash, a timeout), never on a missed target.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import re
import shutil
import signal
import ssl
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator")]

from tooling.testbed import Unavailable  # noqa: E402
from tooling.testbed.controlplane import KubeControlPlane, locate_bin_dir  # noqa: E402
from tests.fixtures.proxy import LatencyProxy  # noqa: E402
from tests.fixtures.redis import RedisServer  # noqa: E402
from tests.support.operator import OperatorProcess  # noqa: E402
from effectmq_operator.redis_pool import CONNECTIONS_PER_REDIS  # noqa: E402

NAMESPACE = "bench-fanout"
GROUP, VERSION = "effectmq.io", "v1alpha1"
WATCHED_RESOURCES = {"queues", "schedules", "deployments", "pods", "events", "secrets", "leases"}
WATCHED_GROUPS = {"effectmq.io", "apps", "", "coordination.k8s.io", "events.k8s.io"}
CLK_TCK = os.sysconf("SC_CLK_TCK")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------------------------------
# small helpers


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples as (name, labels, value); every `# TYPE` family also yields (family, {}, nan)
    so a labelled counter that never counted reads as 0 rather than as missing."""
    samples = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                samples.append((parts[2], {"__family__": "1"}, float("nan")))
            continue
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_text, _, value = rest.rpartition("}")
            labels = dict(LABEL.findall(labels_text))
        else:
            name, _, value = line.partition(" ")
            labels = {}
        try:
            samples.append((name.strip(), labels, float(value.split()[0])))
        except (ValueError, IndexError):
            continue
    return samples


def metric_sum(samples, name: str, **match: str) -> float | None:
    """Sum of the samples of `name` whose labels match; 0 when only the family is known;
    None when the operator does not have the metric at all."""
    values = [v for n, labels, v in samples
              if n == name and "__family__" not in labels and all(labels.get(k) == x for k, x in match.items())]
    if values:
        return sum(values)
    family = name.removesuffix("_total")
    known = any("__family__" in labels and n in (name, family) for n, labels, _ in samples)
    return 0.0 if known else None


class Api:
    """Admin HTTPS GETs straight to the API server (cheaper than a kubectl per poll)."""

    def __init__(self, plane: KubeControlPlane):
        self.server = plane.server
        self.ctx = ssl.create_default_context(cafile=str(plane.ca_file))
        self.ctx.load_cert_chain(str(plane.admin_cert), str(plane.admin_key))

    def get(self, path: str, timeout: float = 30) -> bytes:
        with urllib.request.urlopen(self.server + path, context=self.ctx, timeout=timeout) as resp:
            return resp.read()

    def items(self, plural: str) -> list[dict]:
        return json.loads(self.get(f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{plural}"))["items"]

    def watchers(self, resource: str) -> float:
        """Watches open right now on a resource (apiserver_longrunning_requests)."""
        return sum(v for n, labels, v in parse_prometheus(self.get("/metrics").decode())
                   if n == "apiserver_longrunning_requests" and "__family__" not in labels
                   and labels.get("verb") == "WATCH" and labels.get("resource") == resource)

    def request_counts(self) -> dict[tuple[str, str, str, str], float]:
        """apiserver_request_total summed by (verb, group, resource, subresource)."""
        counts: dict[tuple[str, str, str, str], float] = defaultdict(float)
        for name, labels, value in parse_prometheus(self.get("/metrics").decode()):
            if name == "apiserver_request_total" and "__family__" not in labels:
                counts[(labels.get("verb", ""), labels.get("group", ""), labels.get("resource", ""),
                        labels.get("subresource", ""))] += value
        return counts


def counts_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}


def ours(key: tuple[str, str, str, str]) -> bool:
    _, group, resource, _ = key
    return resource in WATCHED_RESOURCES and group in WATCHED_GROUPS


def split_watch(delta: dict) -> tuple[float, float]:
    """(non-watch requests, watch requests) among the resources the operator touches."""
    calls = sum(v for k, v in delta.items() if ours(k) and k[0] != "WATCH")
    watches = sum(v for k, v in delta.items() if ours(k) and k[0] == "WATCH")
    return calls, watches


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def ready_condition(body: dict) -> dict | None:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)


class RedisConnections:
    """The operator's connections to each redis-server, peak per phase."""

    def __init__(self, servers: list[RedisServer]):
        self.servers = servers
        self.peaks: dict[str, int] = {}

    def sample(self, op: OperatorProcess, phase: str) -> None:
        try:
            counts = [len(op.redis_clients(server)) for server in self.servers]
        except OSError:  # the process or one of its sockets went away meanwhile
            return
        self.peaks[phase] = max(self.peaks.get(phase, 0), *counts)


def serve_latency_proxy(host: str, port: int, delay: float, control) -> None:
    """The latency proxy, in a process of its own (the bench's JSON parsing must not hold
    up its threads): sends its port, then serves until the bench closes `control`."""
    proxy = LatencyProxy(host, port, delay)
    control.send(proxy.port)
    try:
        control.recv()
    except EOFError:
        pass
    proxy.close()


class LatencyProxyProcess:
    def __init__(self, server: str, latency: float):
        address = urllib.parse.urlsplit(server)
        context = multiprocessing.get_context("spawn")
        self._control, child = context.Pipe()
        self.proc = context.Process(target=serve_latency_proxy, daemon=True,
                                    args=(address.hostname, address.port, latency / 2, child))
        self.proc.start()
        self.port = self._control.recv()

    def stop(self) -> None:
        self._control.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def operator_kubeconfig(plane: KubeControlPlane, proxy_port: int, work_dir: Path) -> Path:
    """The admin kubeconfig with the API server behind the latency proxy."""
    config = json.loads(plane.kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{proxy_port}"
    path = work_dir / "operator.kubeconfig"
    path.write_text(json.dumps(config))
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------------------------------
# setup


def start_plane(work_dir: Path, log_dir: Path) -> KubeControlPlane:
    try:
        bin_dir = locate_bin_dir()
    except Unavailable as exc:
        raise SystemExit(str(exc)) from None
    plane = KubeControlPlane(bin_dir=bin_dir, work_dir=work_dir, log_dir=log_dir)
    try:
        plane.start()
    except Exception as exc:
        report = plane.startup_report(exc)
        plane.stop()
        raise SystemExit(report) from exc
    return plane


def apply_crds(plane: KubeControlPlane) -> None:
    out = plane.kubectl("apply", "-f", str(ROOT / "crds"), "-o", "name").stdout
    names = [line.split("/", 1)[1] for line in out.split() if line.strip()]
    plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in names])


def wait_for_gc_watches(api: Api, timeout: float = 120.0) -> float:
    """Wait until kube-controller-manager's garbage collector watches Queues and Schedules.
    Until its discovery resync (every 30 s) has seen the CRDs, it cannot map the
    Deployments' owner references and GETs every owning Queue, again and again:
    traffic that would be blamed on the operator."""
    started = time.monotonic()
    while True:
        if api.watchers("queues") >= 1 and api.watchers("schedules") >= 1:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            log(f"warning: no watch on queues/schedules after {timeout:.0f}s (the garbage collector's); going on")
            return time.monotonic() - started
        time.sleep(1.0)


def queue_doc(i: int, redis_url: str, args) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Queue",
        "metadata": {"name": f"q-{i:05d}", "namespace": NAMESPACE},
        "spec": {
            "redis": {"url": redis_url},
            "worker": {"image": "registry.example/bench-worker:1", "handlers": "bench.tasks:app"},
            "scaling": {"minReplicas": 0, "maxReplicas": args.max_replicas, "pollIntervalSeconds": args.poll_interval},
        },
    }


def schedule_doc(i: int, args) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Schedule",
        "metadata": {"name": f"s-{i:05d}", "namespace": NAMESPACE},
        "spec": {"queueRef": {"name": f"q-{i % args.queues:05d}"}, "schedule": args.cron,
                 "task": {"name": "bench_tick", "payload": {"n": i}}},
    }


def apply_bulk(plane: KubeControlPlane, docs: list[dict], chunk: int, parallel: int) -> None:
    def one(part: list[dict]) -> None:
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": part})
        plane.kubectl("apply", "--server-side", "--field-manager=effectmq-bench", "-o", "name", "-f", "-",
                      input=body, timeout=600)

    parts = [docs[i:i + chunk] for i in range(0, len(docs), chunk)]
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        for future in [pool.submit(one, p) for p in parts]:
            future.result()


# ---------------------------------------------------------------------------------------
# phases


class OperatorDied(RuntimeError):
    pass


def check_alive(op: OperatorProcess) -> None:
    if op.proc.poll() is not None:
        raise OperatorDied(f"the operator exited with {op.proc.returncode}; log tail:\n{op.log()[-4000:]}")


def operator_samples(op: OperatorProcess):
    check_alive(op)
    return parse_prometheus(op.metrics())


def first_pass(api: Api, op: OperatorProcess, t0: float, n_queues: int, n_schedules: int, timeout: float,
               conns: RedisConnections) -> dict:
    """Poll until every Queue has observedGeneration + Ready and every Schedule nextTickTime."""
    out: dict = {"leader_pass_s": None, "first_sample_s": None}
    gauge_prev = None
    next_list = 0.0
    deadline = time.monotonic() + timeout
    last_report = ""
    while True:
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"first full pass not done within {timeout:.0f}s ({last_report}); "
                               f"operator log tail:\n{op.log()[-3000:]}")
        gauge = metric_sum(operator_samples(op), "effectmq_operator_oldest_reconcile_age_seconds")
        conns.sample(op, "first pass")
        if out["first_sample_s"] is None:
            out["first_sample_s"] = time.monotonic() - t0
        if gauge is not None and out["leader_pass_s"] is None:
            if gauge_prev is not None and gauge < gauge_prev:
                out["leader_pass_s"] = gauge_prev  # the peak before the first drop (+- one sample)
            gauge_prev = gauge
        if now >= next_list:
            next_list = now + 2.0
            queues, schedules = api.items("queues"), api.items("schedules")
            q_done = sum(1 for q in queues if (q.get("status") or {}).get("observedGeneration") is not None
                         and ready_condition(q) is not None)
            q_true = sum(1 for q in queues if (ready_condition(q) or {}).get("status") == "True")
            s_done = sum(1 for s in schedules if (s.get("status") or {}).get("nextTickTime"))
            elapsed = time.monotonic() - t0
            last_report = (f"{q_done}/{n_queues} Queues with Ready, {q_true} Ready=True, "
                           f"{s_done}/{n_schedules} Schedules")
            log(f"  +{elapsed:5.1f}s: {last_report}")
            if "queues_done_s" not in out and q_done >= n_queues:
                out["queues_done_s"] = elapsed
            if "schedules_done_s" not in out and s_done >= n_schedules:
                out["schedules_done_s"] = elapsed
            if "queues_done_s" in out and "schedules_done_s" in out:
                out["all_done_s"] = elapsed
                out["ready_reasons"] = dict(Counter((ready_condition(q) or {}).get("reason") for q in queues))
                return out
        time.sleep(0.2)


def warm_pass(op: OperatorProcess, conns: RedisConnections, timeout: float = 300.0) -> float:
    """A new leader's first pass when every Deployment exists already: the peak of the
    oldest-reconcile age before it first drops (every Queue reconciled once)."""
    deadline = time.monotonic() + timeout
    peak = None
    while time.monotonic() < deadline:
        gauge = metric_sum(operator_samples(op), "effectmq_operator_oldest_reconcile_age_seconds")
        conns.sample(op, "warm pass")
        if gauge is not None and gauge > 0:
            if peak is not None and gauge < peak:
                return peak
            peak = gauge
        time.sleep(0.1)
    raise TimeoutError(f"no full pass within {timeout:.0f}s; operator log tail:\n{op.log()[-3000:]}")


def stop_timed(op: OperatorProcess) -> tuple[float, int]:
    """SIGTERM to exit, in seconds, and the exit code."""
    started = time.monotonic()
    op.proc.send_signal(signal.SIGTERM)
    code = op.proc.wait(60)
    return time.monotonic() - started, code


def settle(api: Api, op: OperatorProcess, t0: float, n_queues: int, timeout: float) -> float | None:
    """Wait until every Queue is Ready=True: kube-controller-manager has rolled out (to
    zero replicas) every worker Deployment. Its deployment controller is client-side
    rate-limited, so with many Deployments this takes minutes; until then statuses
    change and the window would not be steady. Returns seconds since the operator's
    start, None on timeout."""
    deadline = time.monotonic() + timeout
    next_log = 0.0
    while time.monotonic() < deadline:
        check_alive(op)
        queues = api.items("queues")
        reasons = Counter((ready_condition(q) or {}).get("reason") for q in queues)
        ready = sum(1 for q in queues if (ready_condition(q) or {}).get("status") == "True")
        if ready >= n_queues:
            return time.monotonic() - t0
        if time.monotonic() >= next_log:
            log(f"  +{time.monotonic() - t0:5.1f}s: {ready}/{n_queues} Queues Ready=True {dict(reasons)}")
            next_log = time.monotonic() + 20.0
        time.sleep(5.0)
    log(f"warning: not every Queue Ready=True after {timeout:.0f}s; measuring anyway")
    return None


def expected_ticks(cron: str, n_schedules: int, start: float, end: float) -> int | None:
    """Ticks due in (start, end - 2 s] (wall clock), every Schedule on one cron in UTC."""
    try:
        from effectmq.scheduler import timeline
        return timeline(cron, "UTC").count(int(start), int(end - 2)) * n_schedules
    except Exception:  # a cron the library does not read: no expectation
        return None


def steady_window(api: Api, op: OperatorProcess, plane: KubeControlPlane, seconds: float,
                  conns: RedisConnections) -> dict:
    pid = op.proc.pid
    others = {p.name: p.popen.pid for p in plane.procs}
    before_api = api.request_counts()
    before_op = operator_samples(op)
    cpu0 = cpu_seconds(pid)
    cpu_others0 = {name: cpu_seconds(p) for name, p in others.items()}
    t_start, wall_start = time.monotonic(), time.time()
    gauges, rss = [], []
    while True:
        s = operator_samples(op)
        g = metric_sum(s, "effectmq_operator_oldest_reconcile_age_seconds")
        if g is not None:
            gauges.append(g)
        rss.append(rss_mib(pid))
        conns.sample(op, "steady")
        remaining = t_start + seconds - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(1.0, remaining))
    after_op = operator_samples(op)
    cpu1 = cpu_seconds(pid)
    cpu_others1 = {name: cpu_seconds(p) for name, p in others.items()}
    after_api = api.request_counts()
    elapsed = time.monotonic() - t_start

    def delta(name: str, **match) -> float | None:
        a, b = metric_sum(after_op, name, **match), metric_sum(before_op, name, **match)
        return None if a is None else a - (b or 0.0)

    return {
        "elapsed": elapsed, "wall": (wall_start, time.time()),
        "gauge_max": max(gauges) if gauges else None,
        "gauge_mean": sum(gauges) / len(gauges) if gauges else None,
        "reconciles": delta("effectmq_operator_reconciles_total"),
        "reconciles_retry": delta("effectmq_operator_reconciles_total", outcome="retry"),
        "op_api_requests": delta("effectmq_operator_api_requests_total"),
        "poll_errors": delta("effectmq_operator_poll_errors_total"),
        "ticks": delta("effectmq_operator_schedule_ticks_total"),
        "api_delta": counts_delta(before_api, after_api),
        "cpu_pct": (cpu1 - cpu0) / elapsed * 100,
        "cpu_others_pct": {n: (cpu_others1[n] - cpu_others0[n]) / elapsed * 100 for n in others},
        "rss_max": max(rss), "rss_end": rss[-1],
    }


def baseline_window(api: Api, seconds: float) -> tuple[dict, float]:
    before = api.request_counts()
    t = time.monotonic()
    time.sleep(seconds)
    after = api.request_counts()
    return counts_delta(before, after), time.monotonic() - t


# ---------------------------------------------------------------------------------------
# report


def fmt(value, spec: str = ".1f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def report(args, created: dict, first: dict, steady: dict, baseline: tuple[dict, float] | None,
           post: dict, op_log: str, log_dir: Path, conns: RedisConnections) -> None:
    n, interval, window = args.queues, args.poll_interval, steady["elapsed"]
    per_min = 60.0 / window
    op_calls = steady["op_api_requests"]
    calls, watches = split_watch(steady["api_delta"])
    base_calls = base_watches = None
    if baseline is not None:
        b_delta, b_elapsed = baseline
        b_calls, b_watches = split_watch(b_delta)
        base_calls, base_watches = b_calls * window / b_elapsed, b_watches * window / b_elapsed
    net_calls = calls - base_calls if base_calls is not None else None
    net_watches = watches - base_watches if base_watches is not None else None

    print()
    print(f"operator fan-out: {n} Queues, {args.schedules} Schedules (cron {args.cron!r}), "
          f"{args.redis} redis-server(s), pollIntervalSeconds {interval}, maxReplicas {args.max_replicas}, "
          f"{os.cpu_count()} cores, "
          f"API latency {args.api_latency * 1000:.0f} ms per request (operator only)")
    print(f"created before the operator started: {created['queues']} Queues + {created['schedules']} Schedules "
          f"in {created['seconds']:.1f} s (server-side apply, chunks of {args.apply_chunk})")
    print()
    print("first full pass (cold: every Queue due at once, every Deployment created)")
    leader = first.get("leader_pass_s")
    print(f"  leader's view (peak of oldest-reconcile age):          {fmt(leader, '.1f', ' s')}"
          + ("" if leader is not None else f"   (over before the bench's first sample, "
             f"+{first['first_sample_s']:.1f} s after the operator's start)"))
    print(f"  operator start -> all Queues have status + Ready cond: {fmt(first.get('queues_done_s'), '.1f', ' s')}")
    print(f"  operator start -> all Schedules have nextTickTime:     {fmt(first.get('schedules_done_s'), '.1f', ' s')}")
    print(f"  Ready reasons at that point: {first.get('ready_reasons')}")
    print(f"  operator start -> all Queues Ready=True (worker Deployments rolled out by kube-controller-manager): "
          f"{fmt(first.get('settled_s'), '.1f', ' s')}")
    print("warm full pass (a new leader after a restart: Deployments exist, every Queue due at once)")
    print(f"  leader's view (peak of oldest-reconcile age):          {fmt(first.get('warm_pass_s'), '.1f', ' s')}")
    warm_top = sorted(((k, v) for k, v in first.get("warm_requests", {}).items() if ours(k) and k[0] != "WATCH"),
                      key=lambda kv: -kv[1])[:6]
    print("  API server requests from its start to the end of that pass: "
          + (", ".join(f"{verb} {resource}{'/' + sub if sub else ''} {v:.0f}"
                       for (verb, _, resource, sub), v in warm_top)
             or "none"))
    print(f"  SIGTERM -> exit, with {n} Queues: {fmt(first.get('stop_s'), '.1f', ' s')} "
          f"(the new leader: {fmt(first.get('warm_stop_s'), '.1f', ' s')})")
    print()
    print(f"steady window: {window:.1f} s, after every Queue was Ready=True and {args.warmup:.0f} s warm-up")
    rec = steady["reconciles"]
    print(f"  oldest-reconcile age: max {fmt(steady['gauge_max'], '.2f', ' s')}, "
          f"mean {fmt(steady['gauge_mean'], '.2f', ' s')}  (poll interval {interval} s)")
    print(f"  reconciles: {fmt(rec and rec / window, '.1f', '/s')} (needed to keep up: {n / interval:.1f}/s), "
          f"retries {fmt(steady['reconciles_retry'], '.0f')}, poll errors {fmt(steady['poll_errors'], '.0f')}")
    due = expected_ticks(args.cron, args.schedules, *steady["wall"])
    print(f"  schedule ticks materialized: {fmt(steady['ticks'], '.0f')} (due in the window: {fmt(due, 'd')})")
    print(f"  operator API calls (effectmq_operator_api_requests_total): {fmt(op_calls, '.0f')} = "
          f"{fmt(op_calls and op_calls / window, '.2f', '/s')} = "
          f"{fmt(op_calls and op_calls / n * per_min, '.3f')} per Queue per minute")
    print(f"  API server, resources {'/'.join(sorted(WATCHED_RESOURCES))}: "
          f"{calls:.0f} requests + {watches:.0f} watches ended;"
          f" baseline (operator stopped, scaled to the window) "
          f"{fmt(base_calls, '.0f')} + {fmt(base_watches, '.0f')}")
    print(f"  API server, net of baseline: {fmt(net_calls, '.0f')} requests = "
          f"{fmt(net_calls and net_calls / window, '.2f', '/s')}"
          f" = {fmt(net_calls and net_calls / n * per_min, '.3f')} per Queue per minute; "
          f"watches {fmt(net_watches, '.0f')}")
    top = sorted(((k, v) for k, v in steady["api_delta"].items() if ours(k)), key=lambda kv: -kv[1])[:12]
    if top:
        print("  API server requests in the window by verb and resource (before baseline):")
        for (verb, group, resource, sub), v in top:
            b = 0.0
            if baseline is not None:
                b = baseline[0].get((verb, group, resource, sub), 0.0) * window / baseline[1]
            print(f"    {verb:7} {(group or 'core') + '/' + resource + ('/' + sub if sub else ''):40} {v:7.0f}"
                  f"   baseline {b:6.0f}")
    others = ", ".join(f"{k} {v:.0f}%" for k, v in steady["cpu_others_pct"].items())
    print(f"  operator process: CPU {steady['cpu_pct']:.0f}% of one core, RSS max {steady['rss_max']:.0f} MiB "
          f"(end {steady['rss_end']:.0f} MiB); control plane: {others}")
    print(f"  after the window: {post.get('queues_ready_true')}/{n} Queues Ready=True, "
          f"{post.get('schedules_ticked')}/{args.schedules} Schedules with lastTickTime, "
          f"{post.get('queues_waiting')} Queues with waiting tasks (status.backlog.waiting > 0)")
    print()
    warm = first.get("warm_pass_s")
    pass_ok = None if warm is None or steady["gauge_max"] is None else (
        warm <= interval and steady["gauge_max"] <= 2 * interval)
    cold_ok = None if leader is None else leader <= interval
    op_ok = None if op_calls is None else op_calls / n * per_min < 1.0
    api_ok = None if net_calls is None else net_calls / n * per_min < 1.0
    print("targets")
    print(f"  full pass within the poll interval ({interval} s): {verdict(pass_ok)}  "
          f"(all due at once: {fmt(warm, '.1f', ' s')}; steady max age {fmt(steady['gauge_max'], '.1f', ' s')}"
          f" <= {2 * interval} s)")
    print(f"  the very first pass, creating every Deployment, too:  {verdict(cold_ok)}  ({fmt(leader, '.1f', ' s')})")
    print(f"  < 1 API request per Queue per minute (operator counter): {verdict(op_ok)}  "
          f"({fmt(op_calls and op_calls / n * per_min, '.3f')})")
    print(f"  < 1 API request per Queue per minute (API server, net):  {verdict(api_ok)}  "
          f"({fmt(net_calls and net_calls / n * per_min, '.3f')})")
    warnings = [line for line in op_log.splitlines() if re.search(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback", line)]
    per_redis = -(-n // args.redis)
    peaks = ", ".join(f"{phase} {count}" for phase, count in conns.peaks.items())
    print(f"  connections per distinct Redis (operator, peak): {peaks}  ({per_redis} Queues on each; "
          f"bound {CONNECTIONS_PER_REDIS} whatever the number): "
          f"{verdict(bool(conns.peaks) and max(conns.peaks.values()) <= CONNECTIONS_PER_REDIS)}")
    print()
    print(f"operator log: {len(warnings)} warning/error lines; logs in {log_dir}")
    for line in warnings[:15]:
        print(f"  {line[:300]}")
    if len(warnings) > 15:
        print(f"  ... {len(warnings) - 15} more")


# ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--schedules", type=int, help="default: as many as Queues")
    parser.add_argument("--redis", type=int, default=1, help="distinct redis-servers (Queues round-robin)")
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument("--poll-interval", type=int, default=10, help="spec.scaling.pollIntervalSeconds")
    parser.add_argument("--warmup", type=float, help="seconds between the first pass and the window "
                        "(default: max(20, 2 x poll interval))")
    parser.add_argument("--baseline-seconds", type=float, help="API server baseline with the operator stopped "
                        "(default: as long as the window; 0: none)")
    parser.add_argument("--cron", default="* * * * *", help="every Schedule's spec.schedule")
    parser.add_argument("--max-replicas", type=int, default=0,
                        help="spec.scaling.maxReplicas (0: ticks never scale a Deployment up to pods no kubelet runs)")
    parser.add_argument("--first-pass-timeout", type=float, default=900.0)
    parser.add_argument("--settle-timeout", type=float, default=900.0,
                        help="seconds to wait after the first pass for every Queue to be Ready=True")
    parser.add_argument("--apply-chunk", type=int, default=250, help="objects per `kubectl apply --server-side`")
    parser.add_argument("--apply-parallel", type=int, default=2)
    parser.add_argument("--api-latency", type=float, default=0.0,
                        help="seconds added to each of the operator's API requests, on the wire (default 0)")
    args = parser.parse_args()
    if args.schedules is None:
        args.schedules = args.queues
    if args.warmup is None:
        args.warmup = max(20.0, 2.0 * args.poll_interval)
    if args.baseline_seconds is None:
        args.baseline_seconds = args.steady_seconds
    if args.queues < 1 or args.redis < 1:
        parser.error("--queues and --redis must be at least 1")
    if not 0 <= args.api_latency <= 5:
        parser.error("--api-latency is in seconds, from 0 to 5")

    log_dir = Path(tempfile.mkdtemp(prefix="emq-fanout-logs-"))
    work_dir = Path(tempfile.mkdtemp(prefix="emq-fanout-"))
    plane = op = proxy = None
    servers: list[RedisServer] = []
    try:
        log(f"starting the control plane (logs in {log_dir})")
        (work_dir / "plane").mkdir()
        plane = start_plane(work_dir / "plane", log_dir)
        api = Api(plane)
        apply_crds(plane)
        plane.kubectl("create", "namespace", NAMESPACE)
        for i in range(args.redis):
            d = work_dir / f"redis-{i}"
            d.mkdir()
            servers.append(RedisServer(d).start())
        urls = [s.url for s in servers]
        conns = RedisConnections(servers)
        kubeconfig = None
        if args.api_latency:
            proxy = LatencyProxyProcess(plane.server, args.api_latency)
            kubeconfig = operator_kubeconfig(plane, proxy.port, work_dir)

        log(f"creating {args.queues} Queues and {args.schedules} Schedules")
        t = time.monotonic()
        apply_bulk(plane, [queue_doc(i, urls[i % len(urls)], args) for i in range(args.queues)],
                   args.apply_chunk, args.apply_parallel)
        apply_bulk(plane, [schedule_doc(i, args) for i in range(args.schedules)], args.apply_chunk, args.apply_parallel)
        created = {"queues": len(api.items("queues")), "schedules": len(api.items("schedules")),
                   "seconds": time.monotonic() - t}
        if created["queues"] != args.queues or created["schedules"] != args.schedules:
            raise RuntimeError(f"created {created}, wanted {args.queues} Queues and {args.schedules} Schedules")

        waited = wait_for_gc_watches(api)
        log(f"the garbage collector watches Queues and Schedules ({waited:.0f} s); starting the operator")
        t0 = time.monotonic()
        op = OperatorProcess(plane, NAMESPACE, log_dir, kubeconfig=kubeconfig)
        log(f"operator pid {op.proc.pid} alive after {time.monotonic() - t0:.1f} s; waiting for the first full pass")
        first = first_pass(api, op, t0, args.queues, args.schedules, args.first_pass_timeout, conns)

        log(f"first pass done after {first['all_done_s']:.1f} s; waiting for every Queue to be Ready=True")
        first["settled_s"] = settle(api, op, t0, args.queues, args.settle_timeout)
        log(f"warm-up {args.warmup:.0f} s")
        warm_end = time.monotonic() + args.warmup
        while time.monotonic() < warm_end:
            check_alive(op)
            time.sleep(1.0)
        log(f"steady window: {args.steady_seconds:.0f} s")
        steady = steady_window(api, op, plane, args.steady_seconds, conns)
        queues, schedules = api.items("queues"), api.items("schedules")
        post = {"queues_ready_true": sum(1 for q in queues if (ready_condition(q) or {}).get("status") == "True"),
                "schedules_ticked": sum(1 for s in schedules if (s.get("status") or {}).get("lastTickTime")),
                "queues_waiting": sum(1 for q in queues
                                      if ((q.get("status") or {}).get("backlog") or {}).get("waiting"))}
        check_alive(op)
        first["stop_s"], op_rc = stop_timed(op)
        op_log = op.log_path.read_text(errors="replace")
        log(f"operator stopped in {first['stop_s']:.1f} s (exit {op_rc}); a new one takes over")
        before_warm = api.request_counts()
        op = OperatorProcess(plane, NAMESPACE, log_dir, name="operator-warm", kubeconfig=kubeconfig)
        first["warm_pass_s"] = warm_pass(op, conns)
        first["warm_requests"] = counts_delta(before_warm, api.request_counts())
        first["warm_stop_s"], _ = stop_timed(op)
        op = None
        baseline = None
        if args.baseline_seconds > 0:
            log(f"operator stopped (exit {op_rc}); API server baseline: {args.baseline_seconds:.0f} s")
            time.sleep(5.0)  # its watches end and are counted before the baseline starts
            baseline = baseline_window(api, args.baseline_seconds)
        report(args, created, first, steady, baseline, post, op_log, log_dir, conns)
        return 0
    except OperatorDied as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    finally:
        if op is not None:
            try:
                op.stop()
            except Exception as exc:
                print(f"stopping the operator failed: {exc}", file=sys.stderr)
        if proxy is not None:
            proxy.stop()
        if plane is not None:
            plane.stop()
        for server in servers:
            server.stop()
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
