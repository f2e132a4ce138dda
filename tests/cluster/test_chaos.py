"""Seeded chaos on the one-node cluster (bench/chaos_cluster.py), short: the chart, a Queue
scaling worker pods, a Schedule ticking every 5 s and a producer, for 80 s of overlapping
faults of every kind the harness has, then its checks (bench/_chaos_checks.py) must all pass.

And the harness can fail: its checks find each planted violation in a recorded history
(an accepted task lost, a stale acknowledgement accepted, a task in two states, an extra
run no fault explains, a tick missed or run twice, replicas above the cap, a Queue not
Ready), so a clean run means something.

The same run on Redis Sentinel in pods (a primary, a replica, three Sentinels), its primary
force-deleted so the Sentinels promote the replica and the recreated pod rejoins as a
replica, under durable offers: the same checks must pass.

Before the run, on its cluster and chart, stall causes on real pods (TestStallCauses): a
worker container the kernel OOM-kills, a worker pod force-deleted and one evicted through
the Eviction API, each under attempts that then stall; the attempts' history, `effectmq
task`, the stall counters and the Queue's Stalling condition and Event must name the cause
and the pod."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

import effectmq
from bench import _chaos_checks as checks
from bench import chaos_cluster as chaos
from tests.support.operator import wait_for

SEED = int(os.environ.get("EFFECTMQ_CHAOS_SEED", "4242"))
T0 = 1_800_000_000.0  # a tick instant (divisible by 5)


def tick_id(offset: int) -> str:
    return "chaos/ticker/" + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0 + offset))


def recorded() -> dict:
    """A clean history: w1 ran once; w2's first attempt died with a force-deleted pod and ran
    again elsewhere; three ticks, 5 s apart."""
    def run(task, attempt, token, pod, start, end):
        return [{"ev": "start", "task": task, "attempt": attempt, "token": token, "pod": pod, "t": start},
                *([{"ev": "done", "task": task, "attempt": attempt, "token": token, "pod": pod, "t": end}]
                  if end else [])]

    def done(attempt, token, pod, **extra):
        return {"state": "completed", "attempt": attempt, "last_token": token, "indexes": ["completed"],
                "result": {"attempt": attempt, "token": token, "pod": pod, **extra}}

    ticks = {tick_id(i * 5): done(1, f"k{i}", "p1", tick=tick_id(i * 5).rsplit("/", 1)[1]) for i in range(3)}
    return {
        "seed": 1, "seconds": 60, "lock_seconds": 6, "tick_seconds": 5, "max_replicas": 4, "min_replicas": 1,
        "tick_prefix": "chaos/ticker/",
        "offers": {"w1": {"kind": "work"}, "w2": {"kind": "work"}},
        "tasks": {"w1": done(1, "a", "p1"), "w2": done(2, "c", "p3"), **ticks},
        "unknown_in_indexes": [],
        "runs": [*run("w1", 1, "a", "p1", T0 + 1, T0 + 2), *run("w2", 1, "b", "p2", T0 + 3, None),
                 *run("w2", 2, "c", "p3", T0 + 12, T0 + 13),
                 *(e for i in range(3) for e in run(tick_id(i * 5), 1, f"k{i}", "p1", T0 + i * 5, T0 + i * 5 + 1))],
        "faults": [{"kind": "pod_force", "target": "p2", "start": T0 + 4, "end": T0 + 10}],
        "replicas": [[T0, 1, 1], [T0 + 5, 4, 3]],
        "ready_after": {"ready": True, "waited": 1.0, "conditions": []},
    }


def operator_restart(died: float) -> dict:
    return {"pod": "effectmq-5d8c7-aaaaa", "container": "operator", "restarts": 1, "since": died - 2,
            "seen": died + 1, "died": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(died)), "reason": "Error",
            "exit_code": 1}


def planted(change) -> dict[str, list[str]]:
    history = copy.deepcopy(recorded())
    change(history)
    return checks.check(history)


def failing(problems: dict[str, list[str]]) -> set[str]:
    return {name for name, found in problems.items() if found}


def test_the_checks_pass_a_clean_history():
    assert failing(checks.check(recorded())) == set()


def set_in(path, value):
    def change(h):
        *keys, last = path
        target = h
        for key in keys:
            target = target[key]
        target[last] = value
    return change


@pytest.mark.parametrize("change, caught", [
    (lambda h: h["tasks"].pop("w1"), "accepted tasks lost"),
    (set_in(("tasks", "w1", "state"), "active"), "accepted tasks lost"),
    # Redis accepted attempt 1's completion while attempt 2 held the lease
    (lambda h: h["tasks"]["w2"].update(result={"attempt": 1, "token": "b", "pod": "p2"}),
     "stale acknowledgements accepted"),
    # a recorder that dropped the accepted run's end (the planted worker defect of bench/_chaos_handlers.py)
    (lambda h: h["runs"].remove(next(e for e in h["runs"] if e["task"] == "w1" and e["ev"] == "done")),
     "stale acknowledgements accepted"),
    (set_in(("tasks", "w1", "indexes"), ["completed", "waiting"]), "tasks not in exactly one state"),
    (set_in(("unknown_in_indexes",), ["ghost"]), "tasks not in exactly one state"),
    (lambda h: h["runs"].append({**h["runs"][0], "pod": "p9", "t": T0 + 1.5}), "attempts run twice"),
    (set_in(("faults",), []), "extra runs not explained by a fault"),
    # a fault on another pod does not explain w2's lost first attempt
    (set_in(("faults", 0, "target"), "p1"), "extra runs not explained by a fault"),
    (lambda h: h["tasks"].pop(tick_id(5)), "ticks missed beyond the policy"),
    (lambda h: h["tasks"][tick_id(10)]["result"].update(tick=tick_id(5).rsplit("/", 1)[1]),
     "ticks run twice as different tasks"),
    (lambda h: h["replicas"].append([T0 + 9, 5, 4]), "replicas above maxReplicas"),
    (lambda h: h["replicas"].append([T0 + 9, 0, 1]), "replicas below minReplicas"),  # scaled to zero with work
    (set_in(("ready_after", "ready"), False), "queue not Ready after the faults"),
    # the operator's container restarted with no node fault near: the liveness probe failed it
    (set_in(("operator_restarts",), [operator_restart(T0 + 40)]), "operator restarts not explained by a fault"),
    # an API server outage explains no restart: the probe passes while Lease calls fail
    (lambda h: h.update(operator_restarts=[operator_restart(T0 + 40)], faults=[
        *h["faults"], {"kind": "apiserver_stop", "target": "apiserver", "start": T0 + 20, "end": T0 + 50}]),
     "operator restarts not explained by a fault"),
    # when the restart ended is unknown, the samples around it bound it
    (set_in(("operator_restarts",), [{**operator_restart(T0 + 40), "died": None, "since": T0 + 38, "seen": T0 + 40}]),
     "operator restarts not explained by a fault"),
])
def test_the_checks_catch_a_planted_violation(change, caught):
    assert caught in failing(planted(change))


def test_a_missed_tick_inside_an_operator_outage_is_the_skip_policy():
    def outage(h):
        h["tasks"].pop(tick_id(5))
        h["faults"].append({"kind": "operator_delete", "target": "operator", "start": T0 + 3, "end": T0 + 4})
    assert failing(planted(outage)) == set()


def test_a_restart_under_a_node_fault_is_explained():
    def restarted(h):
        h["operator_restarts"] = [operator_restart(T0 + 40)]
        h["faults"].append({"kind": "containerd_restart", "target": "*", "start": T0 + 30, "end": T0 + 35})
    assert failing(planted(restarted)) == set()


def killed_primary(h: dict) -> None:
    """w2's attempt 2 was leased on a primary that died before its replica had the lease: the
    promoted replica leased attempt 2 again, under another token (its run is the one kept)."""
    h["runs"] += [{"ev": "start", "task": "w2", "attempt": 2, "token": "lost", "pod": "p2", "t": T0 + 11}]
    h["runs"].sort(key=lambda e: e["t"])
    h["faults"].append({"kind": "redis_primary_kill", "target": "*", "start": T0 + 11.5, "end": T0 + 25})


def test_an_acquisition_a_killed_primary_took_with_it_is_minted_again_in_its_window():
    def sentinel_run(h):
        killed_primary(h)
        h["rollback_kinds"] = list(chaos.ROLLBACK_KINDS)
    assert failing(planted(sentinel_run)) == set()
    assert "attempts run twice" in failing(planted(killed_primary))  # no rollback kinds: no excuse


# ---- stall causes on real pods (the chart and worker image of the chaos run, installed once)

STALLS = "stalls"  # the tests' Queue, next to the run's (it is deleted before the run starts)
STALLS_QUEUE = f"{chaos.NS}/{STALLS}"  # its name in Redis
STALL_LOCK_SECONDS = 5  # a killed worker's leases run out this long after its last renewal
STALL_GRACE_SECONDS = 2  # terminationGracePeriodSeconds: an evicted pod is killed this soon
WORKER_PODS = f"effectmq.io/queue={STALLS}"


@pytest.fixture(scope="module")
def chaos_install(kube_cluster, tmp_path_factory):
    """The chart with its bundled Redis and the chaos worker image (run_chaos finds them and
    removes them after its run); the Redis URL as the host reaches it. The host (the API
    server's) reaches the pods through the node, as a control plane does, for the pod proxy."""
    chaos.install(kube_cluster, tmp_path_factory.mktemp("chaos-install"))
    url, ip = chaos.redis_on_host(kube_cluster)
    pods = kube_cluster.network.pod_cidr
    subprocess.run(["ip", "route", "replace", pods, "via", kube_cluster.network.node_ip], check=True)
    yield url
    subprocess.run(["ip", "route", "del", pods], capture_output=True)
    chaos.forget_redis_route(ip)


def stalls_manifest() -> dict:
    return {"apiVersion": "effectmq.io/v1alpha1", "kind": "Queue",
            "metadata": {"name": STALLS, "namespace": chaos.NS},
            "spec": {"redis": {"urlFrom": {"secretKeyRef": {"name": f"{chaos.RELEASE}-redis", "key": "url"}}},
                     "lockTimeoutSeconds": STALL_LOCK_SECONDS, "lockRefreshSeconds": 1, "maxStalledCount": 3,
                     "worker": {"image": chaos.WORKER_IMAGE, "imagePullPolicy": "Never",
                                "handlers": f"{chaos.HANDLERS_MODULE}:app", "concurrency": 4, "prefetch": 0,
                                "terminationGracePeriodSeconds": STALL_GRACE_SECONDS,
                                "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                                              "limits": {"memory": "200Mi"}}},
                     "scaling": {"minReplicas": 1, "maxReplicas": 1, "pollIntervalSeconds": 2}}}


class Stalls:
    """The stall-cause tests' Queue: one worker pod (so the pod under an attempt is known),
    short leases, a short termination grace."""

    def __init__(self, cluster, url: str) -> None:
        self.cluster, self.url = cluster, url
        self.queue = effectmq.SyncTaskQueue(STALLS_QUEUE, url=url, socket_timeout=5)

    def get(self, *args: str) -> dict:
        return self.cluster.kubectl_json("get", *args, "-n", chaos.NS, timeout=30)

    def pods(self) -> list[dict]:
        return self.get("pods", "-l", WORKER_PODS)["items"]

    def serving_pod(self) -> dict:
        """The worker pod, once it is the only one and Ready (a replaced pod gone)."""
        def one_ready() -> dict | None:
            pods = self.pods()
            ready = [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
            return ready[0] if len(pods) == 1 and ready else None
        return wait_for(one_ready, timeout=120, interval=0.5, what="one Ready worker pod of Queue stalls")

    def active(self, *task_ids: str, timeout: float = 30) -> None:
        wait_for(lambda: all(self.queue.get(t).state == "active" for t in task_ids), timeout=timeout, interval=0.2,
                 what=f"{task_ids} active")

    def completed(self, *task_ids: str, timeout: float = 120) -> list:
        def done() -> list | None:
            infos = [self.queue.get(t) for t in task_ids]
            return infos if all(i.state == "completed" for i in infos) else None
        return wait_for(done, timeout=timeout, interval=0.5, what=f"{task_ids} completed")

    def cli_task(self, task_id: str) -> str:
        """`effectmq task ID` as a user runs it (the URL from the environment: it holds the password)."""
        shown = subprocess.run([sys.executable, "-m", "effectmq", "task", task_id, "--queue", STALLS_QUEUE],
                               env={**os.environ, "EFFECTMQ_REDIS_URL": self.url}, capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0, shown.stderr
        return shown.stdout

    def stall_counters(self) -> dict[str, dict[str, float]]:
        """effectmq_stalls_total of Queue stalls by cause, on the metrics port of each worker pod
        and of the operator (whichever swept the lease counts the stall), through the API
        server's pod proxy: {pod: {cause: count}}."""
        selector = self.get("deployment", chaos.RELEASE)["spec"]["selector"]["matchLabels"]
        operator = self.get("pods", "-l", ",".join(f"{k}={v}" for k, v in selector.items()))["items"]
        targets = [(p["metadata"]["name"], 9100) for p in self.pods() if p["status"].get("podIP")]
        targets += [(p["metadata"]["name"], 9090) for p in operator if p["status"].get("podIP")]
        counted: dict[str, dict[str, float]] = {}
        for pod, port in targets:
            path = f"/api/v1/namespaces/{chaos.NS}/pods/{pod}:{port}/proxy/metrics"
            text = self.cluster.kubectl("get", "--raw", path, timeout=30).stdout
            counted[pod] = {s.labels["cause"]: s.value for family in text_string_to_metric_families(text)
                            for s in family.samples
                            if s.name == "effectmq_stalls_total" and s.labels.get("queue") == STALLS_QUEUE}
        return counted

    def counted(self, stalls: Counter) -> dict[str, dict[str, float]]:
        """The counters, once their sum over the processes has each cause's `stalls` (a
        sweeper counts a stall just after it recovered it); exactly that many."""
        def summed(counted: dict) -> Counter:
            return sum(map(Counter, counted.values()), Counter())

        def enough() -> dict | None:
            counted = self.stall_counters()
            return counted if all(summed(counted)[cause] >= n for cause, n in stalls.items()) else None
        try:
            counted = wait_for(enough, timeout=30, what=f"stalls counted: {dict(stalls)}")
        except AssertionError:
            raise AssertionError(f"effectmq_stalls_total of {STALLS_QUEUE} by pod, not {dict(stalls)}: "
                                 f"{self.stall_counters()}") from None
        assert {cause: summed(counted)[cause] for cause in stalls} == stalls, counted
        return counted

    def close(self) -> None:
        self.queue.close()


@pytest.fixture(scope="class")
def stalls(kube_cluster, chaos_install):
    c = kube_cluster
    c.kubectl("apply", "-f", "-", input=json.dumps(stalls_manifest()))
    queue = Stalls(c, chaos_install)
    try:
        c.kubectl("wait", "-n", chaos.NS, "--for=condition=Ready", f"queue/{STALLS}", "--timeout=180s", timeout=190)
        queue.serving_pod()
        yield queue
    finally:
        queue.close()
        # gone with its worker pods: the run after these tests has the node's 2 cores to itself
        c.kubectl("delete", "queue", STALLS, "-n", chaos.NS, "--timeout=60s", timeout=70)
        wait_for(lambda: not queue.pods(), timeout=60, interval=0.5, what="the worker pods of Queue stalls gone")


def stalls_of(info) -> list[dict]:
    return [a.cause for a in info.attempts if a.outcome == "stalled"]


def pod_identity(pod: dict) -> tuple[str, str, str]:
    return pod["metadata"]["name"], pod["metadata"]["uid"], pod["spec"]["nodeName"]


@pytest.mark.cluster
@pytest.mark.timeout(900)  # the first test waits for the cluster's start
class TestStallCauses:
    def test_an_oom_killed_worker_is_the_cause_of_its_stalls_and_they_cluster(self, stalls: Stalls):
        pod, uid, node = pod_identity(stalls.serving_pod())
        ids = [f"oom-{i}" for i in range(3)]
        for task_id in ids:  # each allocates past the limit after 3 s: all three are in the container by then
            stalls.queue.offer("doomed", {"oom": True, "after": 3}, task_id=task_id)
        stalls.active(*ids, timeout=3)
        infos = stalls.completed(*ids)

        (container,) = stalls.get("pod", pod)["status"]["containerStatuses"]
        killed = container["lastState"]["terminated"]
        assert (killed["reason"], killed["exitCode"], container["restartCount"]) == ("OOMKilled", 137, 1), container
        assert stalls.get("pod", pod)["metadata"]["uid"] == uid
        for info in infos:
            assert (info.attempt, info.result["attempt"], info.result["pod"]) == (2, 2, pod), info
            (cause,) = stalls_of(info)
            assert {k: cause.get(k) for k in ("kind", "pod", "node", "exit_code")} == {
                "kind": "oom_killed", "pod": pod, "node": node, "exit_code": 137}, info.attempts
            shown = stalls.cli_task(info.task_id)
            assert f"attempt 1: stalled: pod {pod} OOMKilled (exit 137) on node {node}" in shown
        print(f"\n`effectmq task {ids[-1]}`:\n{shown}")

        # counted by the process whose maintenance recovered them: the operator's or a worker's
        counted = stalls.counted(Counter(oom_killed=3))
        assert sum(map(Counter, counted.values()), Counter()) == Counter(oom_killed=3), counted  # no other cause
        print(f"\neffectmq_stalls_total of {STALLS_QUEUE} by pod: {counted}")

        def stalling() -> dict | None:
            conditions = stalls.get("queue", STALLS).get("status", {}).get("conditions", [])
            return next((c for c in conditions if c["type"] == "Stalling" and c["status"] == "True"), None)
        condition = wait_for(stalling, timeout=30, what="the Queue's Stalling condition")
        assert condition["reason"] == "OOMKilled", condition
        assert condition["message"].startswith("3 stalls in 10 min: OOMKilled; raise worker.resources.limits.memory"), \
            condition
        events = wait_for(lambda: stalls.get("events", "--field-selector", f"involvedObject.kind=Queue,"
                                             f"involvedObject.name={STALLS},reason=Stalling")["items"],
                          timeout=30, what="the Queue's Stalling Event")
        assert [(e["type"], e["message"]) for e in events] == [("Warning", condition["message"])], events

    def test_a_force_deleted_pod_is_the_cause_of_its_attempts_stall(self, stalls: Stalls):
        pod, _, node = pod_identity(stalls.serving_pod())
        stalls.queue.offer("doomed", {"hold": 300}, task_id="deleted")
        stalls.active("deleted")
        stalls.cluster.kubectl("delete", "pod", pod, "-n", chaos.NS, "--force", "--grace-period=0", "--wait=false")
        (info,) = stalls.completed("deleted")
        assert info.attempt == 2 and info.result["pod"] != pod, info  # run again in the pod that replaced it
        (cause,) = stalls_of(info)
        assert {k: cause.get(k) for k in ("kind", "pod", "node")} == {"kind": "deleted", "pod": pod, "node": node}, \
            info.attempts
        shown = stalls.cli_task("deleted")
        assert f"attempt 1: stalled: pod {pod} deleted on node {node}" in shown
        print(f"\n`effectmq task deleted`, its stall: {shown.splitlines()[-1].strip()}")
        stalls.counted(Counter(deleted=1))

    def test_an_evicted_pod_is_the_cause_of_its_attempts_stall(self, stalls: Stalls):
        pod, _, node = pod_identity(stalls.serving_pod())
        stalls.queue.offer("doomed", {"hold": 300}, task_id="evicted")
        stalls.active("evicted")
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": chaos.NS}}
        stalls.cluster.kubectl("create", "--raw", f"/api/v1/namespaces/{chaos.NS}/pods/{pod}/eviction", "-f", "-",
                               input=json.dumps(eviction))
        (info,) = stalls.completed("evicted")
        assert info.attempt == 2 and info.result["pod"] != pod, info
        (cause,) = stalls_of(info)
        # killed when its grace ran out (the handler ignored the drain): the kill's exit, the Eviction API's word
        assert {k: cause.get(k) for k in ("kind", "pod", "node", "exit_code")} == {
            "kind": "evicted", "pod": pod, "node": node, "exit_code": 137}, info.attempts
        shown = stalls.cli_task("evicted")
        assert f"attempt 1: stalled: pod {pod} Evicted (exit 137) on node {node}" in shown
        print(f"\n`effectmq task evicted`, its stall: {shown.splitlines()[-1].strip()}")
        stalls.counted(Counter(evicted=1))


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_seeded_chaos_run_loses_nothing_and_accepts_no_stale_ack(kube_cluster, tmp_path):
    result = chaos.run_chaos(kube_cluster, SEED, 80, tmp_path)
    summary, problems = result["summary"], result["problems"]
    print(f"\nchaos seed {SEED} (EFFECTMQ_CHAOS_SEED replays it): {summary}")
    assert set(summary["faults"]) >= {"pod_delete", "pod_force", "oom", "operator_delete", "redis_delete",
                                      "net_cut", "kubelet_restart", "containerd_restart"}, summary
    assert summary["offers"] > 50 and summary["ticks"] >= 5, summary
    assert failing(problems) == set(), {k: v[:5] for k, v in problems.items() if v}


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_seeded_chaos_run_on_redis_sentinel_in_pods_loses_nothing(kube_cluster, tmp_path):
    result = chaos.run_chaos(kube_cluster, SEED, 120, tmp_path, redis="sentinel")
    summary, problems = result["summary"], result["problems"]
    history = json.loads((tmp_path / "history.json").read_text())
    print(f"\nchaos on Redis Sentinel, seed {SEED}: {summary}; skipped: {history['skipped']}")
    assert summary["faults"].get("redis_primary_kill", 0) >= 1, (summary, history["skipped"])
    masters = [ip for _, ip, _ in history["masters"]]
    assert len(masters) >= 2 and all(a != b for a, b in zip(masters, masters[1:])), history["masters"]
    assert summary["offers"] > 50 and summary["ticks"] >= 5, summary
    assert failing(problems) == set(), {k: v[:5] for k, v in problems.items() if v}
