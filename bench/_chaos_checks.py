"""The checks of a chaos run (bench/chaos_cluster.py), as pure functions of its recorded history.

A history is a JSON-able dict:
  lock_seconds, tick_seconds, max_replicas, min_replicas (absent: 0),
  tick_prefix (the task-id prefix of the Schedule's ticks)
  offers: {task_id: {"kind": "work" | "oom"}}   offers Redis confirmed (created or already there)
  tasks: {task_id: {"state", "attempt", "last_token" (hashed as the handlers hash it), "result",
                    "indexes": [the state indexes holding the id]}}   read from Redis after the run
  unknown_in_indexes: [ids in a state index that are neither offered nor ticks]
  runs: [{"ev": "start" | "done" | "cancel", "task", "attempt", "token", "pod", "t"}]   the side store
  faults: [{"kind", "target": a pod name, "*" (every pod) or "operator", "start", "end"}]
  replicas: [[t, the worker Deployment's spec.replicas, its status.replicas]]
  ready_after: {"ready": bool, "waited": seconds, "conditions": [...]}
  leases: [[t, the operator Lease's holderIdentity ("<pod>-<pid>"), its renewTime]]   sampled each second
  leadership: [{"identity", "start", "end" (None: still leading when its log was read)}]
              each operator replica's terms, from its own log lines
  operator_events: [{"instance": reportingInstance (the pod), "first", "last" (RFC 3339), ...}]
(the last three only from runs with the control plane's faults; absent, their checks find nothing)
  operator_restarts: [{"pod", "container", "restarts": its restartCount, "died": lastState's
                       finishedAt (RFC 3339) or None, "since", "seen": the samples around it}]
                     each time an operator container's restartCount was seen going up
Each check returns a list of problems (strings); :func:`check` runs them all.

A failover run (bench/chaos_failover.py) adds rollback_kinds: the fault kinds that can lose
writes a primary confirmed (it died or was cut off before its replica had them). Within such
a fault's window an acquisition may be lost and its attempt number minted again (another
token), a run may be of an attempt past the surviving record, and a plain offer whose every
confirmation fell within [start - REPLICATION_LAG, end] may be gone: lost by design
(:func:`lost_by_replication`), unless the offer is marked "durable" (confirmed with WAIT).
Its offers carry "confirmed": [wall-clock instants of each confirmation].
"""

from __future__ import annotations

import calendar
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

# An attempt meets a fault when the fault's window overlaps [start - BEFORE, end + lease + AFTER]:
# BEFORE covers an acquire whose reply came late, lease + AFTER an acknowledgement
# retried within its lease when the fault began.
BEFORE = 2.0
AFTER = 2.0
# Ticks that fall while the operator cannot offer them are skipped (missedTicks: Skip);
# the scheduler is back this long after the fault that stopped it ended.
TICK_RECOVERY = 20.0
# Faults that stop the operator's scheduler (its pod, its Redis, the node under it).
SCHEDULER_STOPPERS = ("operator_delete", "redis_delete", "net_cut", "kubelet_restart", "containerd_restart",
                      "apiserver_stop", "leader_cut", "redis_primary_kill")
# Faults that may restart an operator container: the node's agents restarted under it. Not
# the API server stopped nor the leader cut from it (the liveness probe passes while Lease
# calls fail or time out), and operator_delete replaces the pod (a new one, no restart).
RESTART_CAUSES = ("kubelet_restart", "containerd_restart")
RESTART_SLACK = 30.0  # seconds around such a fault's window in which a restart counts as its doing
# Faults that touch no worker pod: they explain no handler's extra run.
CONTROL_PLANE_TARGETS = ("operator", "apiserver")
# Seconds of slack between an operator Event's time stamp (whole seconds) and the Lease samples.
EVENT_SLACK = 3.0
# How long before a primary's death its confirmed writes may still be missing on its replica
# (asynchronous replication; milliseconds on a quiet host, generous for a loaded one).
REPLICATION_LAG = 1.0

@dataclass
class Fault:
    """One fault a chaos run injected, as its history's "faults" records it (what the checks read)."""
    kind: str
    target: str  # a pod's name, "*" (anything), "operator" or "apiserver"
    start: float
    end: float | None = None
    note: str = ""


CHECKS = ("accepted tasks lost", "stale acknowledgements accepted", "tasks not in exactly one state",
          "attempts run twice", "extra runs not explained by a fault", "ticks missed beyond the policy",
          "ticks run twice as different tasks", "replicas above maxReplicas", "replicas below minReplicas",
          "queue not Ready after the faults",
          "two operator leaders at once", "operator Events not from the Lease's holder",
          "leader cuts not taken over", "operator restarts not explained by a fault")


def _rolled_back(rollbacks: list[dict], lo: float, hi: float) -> bool:
    return any(f["start"] - REPLICATION_LAG <= hi and f["end"] >= lo for f in rollbacks)


def rollback_faults(history: dict) -> list[dict]:
    kinds = history.get("rollback_kinds") or ()
    return [f for f in history["faults"] if f["kind"] in kinds]


def runs_by_attempt(runs: list[dict], rollbacks: list[dict] | None = None
                    ) -> tuple[dict[tuple[str, int], dict], list[str]]:
    """(task, attempt) -> {"token", "pod", "start", "end", "how"}; and attempts started twice.
    An attempt started again under another token across a rollback fault (its acquisition
    was lost with the primary) keeps the earlier run under "earlier"."""
    out: dict[tuple[str, int], dict] = {}
    twice = []
    for e in sorted(runs, key=lambda e: e["t"]):
        key = (e["task"], e["attempt"])
        run = out.get(key)
        if e["ev"] == "start":
            if run is not None:
                if e["token"] != run["token"] and _rolled_back(rollbacks or [], run["start"] - BEFORE, e["t"]):
                    out[key] = {"token": e["token"], "pod": e["pod"], "start": e["t"], "end": None, "how": None,
                                "earlier": [*run.pop("earlier", []), run]}
                    continue
                twice.append(f"{key[0]} attempt {key[1]}: started in {run['pod']} and again in {e['pod']}")
                continue
            out[key] = {"token": e["token"], "pod": e["pod"], "start": e["t"], "end": None, "how": None}
        elif run is not None:
            same = next((r for r in [run, *run.get("earlier", [])] if r["end"] is None and r["token"] == e["token"]),
                        None)
            if same is not None:
                same["end"], same["how"] = e["t"], e["ev"]
    return out, twice


def lost_by_replication(history: dict) -> list[str]:
    """Plain offers gone from Redis, each of whose confirmations fell in a rollback fault's window."""
    rollbacks = rollback_faults(history)
    lost = []
    for tid, offer in history["offers"].items():
        confirmed = offer.get("confirmed") or []
        if (tid not in history["tasks"] and confirmed and not offer.get("durable")
                and all(_rolled_back(rollbacks, t, t) for t in confirmed)):
            lost.append(f"{tid}: confirmed at {', '.join(f'{t:.2f}' for t in confirmed)}")
    return lost


def _hits(fault: dict, pod: str | None) -> bool:
    if fault["target"] in CONTROL_PLANE_TARGETS:
        return False  # the operator's own pod never ran a handler
    return fault["target"] == "*" or pod is None or fault["target"] == pod


def explain(history: dict, runs: dict[tuple[str, int], dict], task: str, attempt: int) -> str | None:
    """The fault in the window of a superseded attempt, or None."""
    lease = history["lock_seconds"]
    run = runs.get((task, attempt))
    later = [r["start"] for (t, a), r in runs.items() if t == task and a > attempt]
    next_start = min(later) if later else float("inf")
    if run is None:  # leased but never reached its handler (its acquire reply was lost)
        earlier = [r["start"] for (t, a), r in runs.items() if t == task and a < attempt]
        lo, hi, pod = (max(earlier) if earlier else 0.0) - BEFORE, next_start + AFTER, None
    else:
        end = run["end"] if run["end"] is not None else next_start
        lo, hi, pod = run["start"] - BEFORE, end + lease + AFTER, run["pod"]
    for fault in history["faults"]:
        if _hits(fault, pod) and fault["start"] <= hi and fault["end"] >= lo:
            return f"{fault['kind']}({fault['target']})@{fault['start']:.1f}"
    return None


def _tick_instant(task_id: str) -> int | None:
    try:
        return calendar.timegm(time.strptime(task_id.rsplit("/", 1)[1], "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, IndexError):
        return None


def _iso(stamp: str | None) -> float | None:
    try:
        return calendar.timegm(time.strptime(stamp or "", "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


def overlapping_leaders(history: dict) -> list[str]:
    """Terms of two replicas that overlap, from each replica's log. A term its log leaves open
    ends where the same pod's next term starts, when the pod was deleted (operator_delete names
    it), or else it lasts to the end."""
    terms = sorted(history.get("leadership") or [], key=lambda t: t["start"])
    deleted = {f["note"].split()[0]: f["start"] for f in history["faults"]
               if f["kind"] == "operator_delete" and f.get("note")}

    def pod(identity: str) -> str:
        return identity.rsplit("-", 1)[0]

    def end(term: dict) -> float:
        if term["end"] is not None:
            return term["end"]
        later = [t["start"] for t in terms
                 if pod(t["identity"]) == pod(term["identity"]) and t["start"] > term["start"]]
        if later:
            return min(later)
        return deleted.get(pod(term["identity"]), float("inf"))

    found = []
    for i, a in enumerate(terms):
        for b in terms[i + 1:]:
            if b["identity"] != a["identity"] and b["start"] < end(a):
                found.append(f"{b['identity']} leading from {b['start']:.1f} while {a['identity']} led "
                             f"{a['start']:.1f}-{end(a):.1f}")
    return found


def events_off_leader(history: dict) -> list[str]:
    """Operator Events written by a pod that did not hold the Lease around that time (both
    stamps of each Event: its creation and its last count bump); Events with no Lease sample
    near them (the API server was down, or before the sampling began) are not judged."""
    samples = history.get("leases") or []
    found = []
    for event in history.get("operator_events") or []:
        for stamp in {event.get("first"), event.get("last")}:
            t = _iso(stamp)
            if t is None or not event.get("instance"):
                continue
            near = [holder for at, holder, *_ in samples if t - EVENT_SLACK <= at <= t + 1 + EVENT_SLACK]
            if near and not any((holder or "").startswith(event["instance"] + "-") for holder in near):
                found.append(f"{event['reason']} on {event.get('object')} by {event['instance']} at {stamp}; "
                             f"the Lease was {sorted(set(map(str, near)))}")
    return found


def cuts_not_taken_over(history: dict) -> list[str]:
    """A leader_cut whose Lease never changed holder while its leader was cut."""
    samples = history.get("leases") or []
    found = []
    for fault in history["faults"]:
        if fault["kind"] != "leader_cut":
            continue
        before = [h for at, h, *_ in samples if at <= fault["start"]]
        during = {h for at, h, *_ in samples if fault["start"] <= at <= fault["end"]}
        if not before or not during - {before[-1], None}:
            found.append(f"cut at {fault['start']:.1f}-{fault['end']:.1f} ({fault.get('note')}): "
                         f"the Lease stayed with {before[-1] if before else 'unknown'}")
    return found


def unexplained_restarts(history: dict) -> list[str]:
    """Operator container restarts outside every node fault's window (with RESTART_SLACK):
    the instant its last run ended, else the interval between the samples around it."""
    causes = [f for f in history["faults"] if f["kind"] in RESTART_CAUSES]
    found = []
    for restart in history.get("operator_restarts") or []:
        died = _iso(restart.get("died"))
        lo, hi = (died, died) if died is not None else (restart["since"], restart["seen"])
        if not any(f["start"] - RESTART_SLACK <= hi and f["end"] + RESTART_SLACK >= lo for f in causes):
            during = sorted({f["kind"] for f in history["faults"] if f["start"] <= hi and f["end"] >= lo})
            found.append(f"{restart['pod']}/{restart['container']} restart {restart['restarts']} "
                         f"({restart.get('reason')}, exit {restart.get('exit_code')}) ended "
                         f"{restart.get('died') or f'between {lo:.1f} and {hi:.1f}'}; faults then: {during or 'none'}")
    return found


def check(history: dict) -> dict[str, list[str]]:
    problems: dict[str, list[str]] = {name: [] for name in CHECKS}
    rollbacks = rollback_faults(history)
    runs, twice = runs_by_attempt(history["runs"], rollbacks)
    by_design = {line.split(":")[0] for line in lost_by_replication(history)}
    problems["attempts run twice"] += twice
    tasks: dict[str, dict] = history["tasks"]
    prefix = history["tick_prefix"]
    ticks = sorted(t for t in tasks if t.startswith(prefix))

    for tid in history["offers"]:
        info = tasks.get(tid)
        if tid in by_design:
            continue
        if info is None or info["state"] != "completed":
            problems["accepted tasks lost"].append(
                f"{tid}: " + ("no record" if info is None else f"{info['state']} at attempt {info['attempt']}"))
    for tid in history.get("unknown_in_indexes", []):
        problems["tasks not in exactly one state"].append(f"{tid}: in a state index, never offered")

    for tid in [*history["offers"], *ticks]:
        info = tasks.get(tid)
        if info is None:
            continue
        if info["indexes"] != [info["state"]]:
            problems["tasks not in exactly one state"].append(
                f"{tid}: record says {info['state']}, indexes {info['indexes']}")
        stray = sorted(a for (t, a), r in runs.items() if t == tid and a > info["attempt"]
                       and not _rolled_back(rollbacks, r["start"] - BEFORE, r["start"] + AFTER))
        if stray:
            problems["attempts run twice"].append(
                f"{tid}: runs of attempts {stray} past the record's {info['attempt']}")
        if info["state"] != "completed":
            continue
        result = info["result"] if isinstance(info["result"], dict) else {}
        done = runs.get((tid, info["attempt"]))
        if done is not None and done["token"] != result.get("token"):  # the record kept a run rolled back over
            done = next((r for r in done.get("earlier", []) if r["token"] == result.get("token")), done)
        if (result.get("attempt") != info["attempt"] or result.get("token") != info["last_token"]
                or done is None or done["how"] != "done" or done["token"] != result.get("token")
                or done["pod"] != result.get("pod")):
            problems["stale acknowledgements accepted"].append(
                f"{tid}: record attempt {info['attempt']} token {info['last_token']}, result {result}, "
                f"that attempt's run {done}")
        for attempt in range(1, info["attempt"]):
            if explain(history, runs, tid, attempt) is None:
                run = runs.get((tid, attempt))
                problems["extra runs not explained by a fault"].append(
                    f"{tid} attempt {attempt} of {info['attempt']}: " + (
                        "leased, never ran" if run is None else
                        f"in {run['pod']} from {run['start']:.1f} to {run['end']} ({run['how']})"))

    by_instant: dict[int, list[str]] = defaultdict(list)
    for tid in ticks:
        instant = _tick_instant(tid)
        result = (tasks[tid].get("result") or {}) if isinstance(tasks[tid].get("result"), dict) else {}
        said = _tick_instant("/" + result["tick"]) if result.get("tick") else instant
        if instant is None or said != instant:
            problems["ticks run twice as different tasks"].append(f"{tid}: carries tick {result.get('tick')}")
        by_instant[said if said is not None else -1].append(tid)
    for instant, ids in by_instant.items():
        if len(ids) > 1:
            problems["ticks run twice as different tasks"].append(f"tick {instant}: tasks {ids}")
    instants = sorted(i for i in by_instant if i >= 0)
    stoppers = [f for f in history["faults"] if f["kind"] in SCHEDULER_STOPPERS]
    if instants:
        step = history["tick_seconds"]
        for instant in range(instants[0], instants[-1] + 1, step):
            if instant in by_instant:
                continue
            if not any(f["start"] - step <= instant <= f["end"] + TICK_RECOVERY for f in stoppers):
                problems["ticks missed beyond the policy"].append(
                    f"{prefix}{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(instant))}: no task, no fault")

    for at, spec, observed in history["replicas"]:
        if max(spec or 0, observed or 0) > history["max_replicas"]:
            problems["replicas above maxReplicas"].append(f"at {at:.1f}: spec {spec}, observed {observed}")
        if spec is not None and spec < history.get("min_replicas", 0):  # e.g. a Queue scaled to zero with work
            problems["replicas below minReplicas"].append(f"at {at:.1f}: spec {spec}")
    problems["two operator leaders at once"] += overlapping_leaders(history)
    problems["operator Events not from the Lease's holder"] += events_off_leader(history)
    problems["leader cuts not taken over"] += cuts_not_taken_over(history)
    problems["operator restarts not explained by a fault"] += unexplained_restarts(history)
    ready = history.get("ready_after") or {}
    if not ready.get("ready"):
        problems["queue not Ready after the faults"].append(f"after {ready.get('waited')}s: {ready.get('conditions')}")
    return problems


def summary(history: dict, problems: dict[str, list[str]]) -> dict[str, Any]:
    runs, _ = runs_by_attempt(history["runs"], rollback_faults(history))
    faults: dict[str, int] = defaultdict(int)
    for f in history["faults"]:
        faults[f["kind"]] += 1
    extra = sum(max(0, info["attempt"] - 1) for info in history["tasks"].values())
    explained_by: dict[str, int] = defaultdict(int)  # superseded attempts, by the kind of fault that explains them
    for tid, info in history["tasks"].items():
        for attempt in range(1, info["attempt"]):
            why = explain(history, runs, tid, attempt)
            explained_by[why.split("(")[0] if why else "nothing"] += 1
    return {
        "offers": len(history["offers"]),
        "ticks": sum(1 for t in history["tasks"] if t.startswith(history["tick_prefix"])),
        "handler runs": len(runs),
        "superseded attempts": extra,
        "superseded attempts explained by": dict(sorted(explained_by.items())),
        "faults": dict(sorted(faults.items())),
        "peak replicas": max((max(s or 0, o or 0) for _, s, o in history["replicas"]), default=0),
        **({"masters": " -> ".join(str(pod or ip) for _, ip, pod in history["masters"])}
           if history.get("masters") else {}),
        **({"operator restarts": len(history["operator_restarts"])} if "operator_restarts" in history else {}),
        **({"offers lost by asynchronous replication (by design)": len(lost_by_replication(history))}
           if history.get("rollback_kinds") is not None else {}),
        "checks": {name: len(found) for name, found in problems.items()},
        "passed": not any(problems.values()),
    }
