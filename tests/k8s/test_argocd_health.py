"""Argo CD's health of a Queue or Schedule agrees with kstatus's.

Each object is judged by both tools' own code: Argo CD's by tooling/argohealth
(argo-cd's argocd-cm parsing, util/lua on gopher-lua, gitops-engine's
GetResourceHealth), running gitops/argocd/health.lua and the argocd-cm.yaml made
from it; kstatus's by tooling/kstatus (cli-utils' status.Compute, what Flux reads).
The objects: every Queue and Schedule of tests/k8s/test_kstatus_helper.py, and the
statuses the operator writes (its own status.conditions) while ready, rolling out,
catching up with an edit, failing, stalled, paused and suspended.

How the two tools' words map (AGREEING):

    Argo CD       kstatus
    Healthy       Current
    Progressing   InProgress
    Degraded      Failed
    Suspended     Current       Argo CD only: a settled Queue with spec.paused, a
                                Schedule with spec.suspend (for kstatus a paused
                                Queue is as done as it gets)
    Progressing   Terminating   Argo CD says "Pending deletion" before any script

and one disagreement on purpose (NOT_YET_SEEN): a resource with no status at all
is Progressing for Argo CD (waiting for the operator), while kstatus calls it
Current (it cannot tell that a Ready condition will come; see the comment of
checkReadyCondition in cli-utils). Flux therefore reads a Queue applied a moment
ago as ready; the operator writes its first status within a poll.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import yaml
from effectmq_operator.status import Check, Problem, conditions

from tests.fixtures.argohealth import ArgoHealth, argohealth  # noqa: F401 (the fixture)
from tooling.testbed.controlplane import REPO_ROOT, KubeControlPlane
from tests.k8s.test_kstatus_helper import cond, custom_resource

SCRIPT = REPO_ROOT / "gitops" / "argocd" / "health.lua"
ARGOCD_CM = REPO_ROOT / "gitops" / "argocd" / "argocd-cm.yaml"
HEALTH_KEYS = {kind: f"resource.customizations.health.effectmq.io_{kind}" for kind in ("Queue", "Schedule")}

AGREEING = {
    ("Healthy", "Current"), ("Progressing", "InProgress"), ("Degraded", "Failed"),
    ("Suspended", "Current"), ("Progressing", "Terminating"),
}
NOT_YET_SEEN = ("Progressing", "Current")
# States whose message both tools take from the same condition (or say alike).
SAME_MESSAGE = {("Progressing", "InProgress"), ("Degraded", "Failed")}
ARGO_STATES = {"Healthy", "Progressing", "Degraded", "Suspended"}  # what the script may return


@dataclass(frozen=True)
class Case:
    id: str
    obj: dict
    argo: str  # the Argo CD health expected
    kstatus: str  # the kstatus status expected


def with_spec(obj: dict, **spec) -> dict:
    obj = copy.deepcopy(obj)
    obj["spec"].update(spec)
    return obj


# --------------------------------------------------------------------------
# the objects of tests/k8s/test_kstatus_helper.py (its helpers build them)


def kstatus_test_cases(kind: str) -> list[Case]:
    deleting = custom_resource(kind, [cond("Ready", "True")])
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return [
        Case("ready", custom_resource(kind, [cond("Ready", "True", "Reconciled")]), "Healthy", "Current"),
        Case("reconciling", custom_resource(kind, [cond("Reconciling", "True", "Scaling", "scaling workers")]),
             "Progressing", "InProgress"),
        Case("stalled", custom_resource(kind, [cond("Stalled", "True", "RedisUnreachable", "no redis")]),
             "Degraded", "Failed"),
        Case("old-observed-generation", custom_resource(kind, [cond("Ready", "True")], observed_generation=1),
             "Progressing", "InProgress"),
        Case("stalled-wins-over-ready",
             custom_resource(kind, [cond("Ready", "True"), cond("Stalled", "True", "RedisUnreachable")]),
             "Degraded", "Failed"),
        Case("ready-false", custom_resource(kind, [cond("Ready", "False", "RedisUnreachable", "no redis")]),
             "Progressing", "InProgress"),
        Case("ready-unknown", custom_resource(kind, [cond("Ready", "Unknown")]), "Progressing", "InProgress"),
        Case("no-conditions", custom_resource(kind, []), "Healthy", "Current"),
        Case("other-condition-false", custom_resource(kind, [cond("RedisReachable", "False", "ConnectionRefused")]),
             "Healthy", "Current"),
        Case("abnormal-conditions-false",
             custom_resource(kind, [cond("Reconciling", "False"), cond("Stalled", "False")]), "Healthy", "Current"),
        Case("deleting", deleting, "Progressing", "Terminating"),
        Case("no-observed-generation", custom_resource(kind, [cond("Ready", "True")], observed_generation=None),
             "Healthy", "Current"),
    ]


# --------------------------------------------------------------------------
# what the operator writes: its conditions() over the checks each kind makes

QUEUE_CHECKS_OK = [
    Check.of("RedisReachable", True, "Connected", "queue settings written to Redis"),
    Check.of("AcceptingTasks", True, "Accepting", "Redis takes new tasks"),
    Check.of("WorkersDeployed", True, "Available", "2 of 2 replicas available"),
]
SCHEDULE_CHECKS_OK = [
    Check.of("ScheduleValid", True, "Valid", "*/5 * * * * in UTC"),
    Check.of("QueueFound", True, "Found", "Queue shop/emails"),
    Check.of("RedisReachable", True, "Connected", "schedule stored in the Queue's Redis"),
    Check.of("TicksMaterialized", True, "Materializing", "the tick passes on its Redis succeed"),
]

QUEUE_PROBLEMS = {
    "rolling-out": Problem("RollingOut", "1 of 2 replicas of the current template available, 1 starting"),
    "deployment-missing": Problem("DeploymentMissing", "the worker Deployment does not exist yet"),
    "redis-unreachable": Problem("RedisUnreachable", "Error 111 connecting to redis:6379. Connection refused."),
    "redis-refuses-writes": Problem("RedisRefusesWrites", "offers are refused: OOM command not allowed"),
    "rollout-failed": Problem("ProgressDeadlineExceeded",
                              'the worker rollout failed: ReplicaSet "emails-7d9" has timed out progressing.',
                              permanent=True),
    "crash-looping": Problem("WorkersCrashLooping", "pod emails-7d9-x keeps exiting (exit code 1); restarted 3 times",
                             permanent=True),
    "secret-missing": Problem("SecretNotFound", "Secret shop/redis with key 'url' not found", permanent=True),
    "invalid-spec": Problem("InvalidSpec", "spec.scaling.minReplicas must not exceed maxReplicas", permanent=True),
}
SCHEDULE_PROBLEMS = {
    "redis-unreachable": Problem("RedisUnreachable", "Error 111 connecting to redis:6379. Connection refused."),
    "ticks-failing": Problem("TicksFailing", "ticks are not materialized: Redis timed out"),
    "schedule-missing": Problem("ScheduleMissing", "the schedule is missing from its Queue's Redis"),
    "invalid-schedule": Problem("InvalidSchedule", "cron field 'minute' out of range: 61", permanent=True),
    "queue-not-found": Problem("QueueNotFound", "Queue shop/emails not found", permanent=True),
    "queue-invalid": Problem("QueueInvalid", "Queue shop/emails: spec.redis needs url or urlFrom", permanent=True),
}
SPECS = {
    "Queue": {"redis": {"url": "redis://redis:6379/0"},
              "worker": {"image": "example/workers:1", "handlers": "shop.tasks:app"}},
    "Schedule": {"queueRef": {"name": "emails"}, "schedule": "*/5 * * * *", "task": {"name": "send_digest"}},
}
SUSPEND_FIELD = {"Queue": "paused", "Schedule": "suspend"}


def operator_object(kind: str, problem: Problem | None, *, generation: int = 3,
                    observed: int | None = 3) -> dict:
    """A Queue or Schedule at `generation` whose status the operator wrote for `observed`
    (None: no status yet)."""
    obj = {
        "apiVersion": "effectmq.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "emails", "namespace": "shop", "generation": generation},
        "spec": copy.deepcopy(SPECS[kind]),
    }
    if observed is not None:
        checks = QUEUE_CHECKS_OK if kind == "Queue" else SCHEDULE_CHECKS_OK
        if problem is not None:  # one check fails (which one matters to neither tool: both read
            # only Ready, Reconciling and Stalled)
            checks = checks[:-1] + [Check.of(checks[-1].type, False, problem.reason, problem.message)]
        obj["status"] = {"observedGeneration": observed, "conditions": conditions(checks, problem, observed)}
        if kind == "Queue":
            obj["status"].update({"replicas": 2, "readyReplicas": 2, "desiredReplicas": 2,
                                  "backlog": {"waiting": 4, "delayed": 0, "active": 2, "failed": 0, "completed": 9}})
    return obj


def stalling_queue(**spec) -> dict:
    """A ready Queue whose stalls cluster: the operator's Stalling condition beside Ready.
    It still works (its attempts are retried), so both tools call it healthy; Argo CD
    shows what to fix as the message."""
    from effectmq_operator import stalls

    obj = with_spec(operator_object("Queue", None), **spec)
    checks = QUEUE_CHECKS_OK + [stalls.check({"oom_killed": 4, "unknown": 1})]
    obj["status"]["conditions"] = conditions(checks, None, obj["status"]["observedGeneration"])
    return obj


def rate_limited_queue() -> dict:
    """A ready Queue whose rate limit holds tasks back: RateLimited beside Ready. It works
    as asked, so both tools call it healthy; Argo CD says why tasks wait."""
    from effectmq_operator import throttling

    obj = operator_object("Queue", None)
    checks = QUEUE_CHECKS_OK + [throttling.check(throttling.Throttle((100, 1.0), 100, 0.0, 5000))]
    obj["status"]["conditions"] = conditions(checks, None, obj["status"]["observedGeneration"])
    return obj


def group_capped_queue(rate_limited: bool = False) -> dict:
    """A ready Queue with tasks parked by their group's cap: GroupCapped beside Ready (and
    RateLimited, which Argo CD names first). It works as asked: healthy for both tools."""
    from effectmq import QueueStats
    from effectmq_operator import throttling

    obj = operator_object("Queue", None)
    stats = QueueStats("q", 20, 0, 5, 0, 0, 0, 1.0, False, 0, parked=300, group_caps=True)
    checks = QUEUE_CHECKS_OK + [throttling.group_check(stats)]
    if rate_limited:
        checks.append(throttling.check(throttling.Throttle((100, 1.0), 100, 0.0, 5000)))
    obj["status"]["conditions"] = conditions(checks, None, obj["status"]["observedGeneration"])
    return obj


def operator_cases(kind: str) -> list[Case]:
    problems = QUEUE_PROBLEMS if kind == "Queue" else SCHEDULE_PROBLEMS
    stop = {SUSPEND_FIELD[kind]: True}
    any_transient = next(name for name, p in problems.items() if not p.permanent)
    any_permanent = next(name for name, p in problems.items() if p.permanent)
    cases = [Case("ready", operator_object(kind, None), "Healthy", "Current")]
    for name, problem in problems.items():
        cases.append(Case(name, operator_object(kind, problem), *(
            ("Degraded", "Failed") if problem.permanent else ("Progressing", "InProgress"))))
    cases += [
        # catching up: the status is of the generation before the latest edit
        Case("catching-up", operator_object(kind, None, observed=2), "Progressing", "InProgress"),
        Case("catching-up-after-a-failure", operator_object(kind, problems[any_permanent], observed=2),
             "Progressing", "InProgress"),
        # paused / suspended: only a settled resource is Suspended
        Case(SUSPEND_FIELD[kind], with_spec(operator_object(kind, None), **stop), "Suspended", "Current"),
        Case(f"{SUSPEND_FIELD[kind]}-and-{any_transient}", with_spec(operator_object(kind, problems[any_transient]),
             **stop), "Progressing", "InProgress"),
        Case(f"{SUSPEND_FIELD[kind]}-and-{any_permanent}", with_spec(operator_object(kind, problems[any_permanent]),
             **stop), "Degraded", "Failed"),
        Case(f"{SUSPEND_FIELD[kind]}-not-yet-observed", with_spec(operator_object(kind, None, observed=2), **stop),
             "Progressing", "InProgress"),
        Case(f"{SUSPEND_FIELD[kind]}-false", with_spec(operator_object(kind, None), **{SUSPEND_FIELD[kind]: False}),
             "Healthy", "Current"),
    ]
    if kind == "Queue":
        cases += [Case("stalling", stalling_queue(), "Healthy", "Current"),
                  Case("paused-and-stalling", stalling_queue(paused=True), "Suspended", "Current"),
                  Case("rate-limited", rate_limited_queue(), "Healthy", "Current"),
                  Case("group-capped", group_capped_queue(), "Healthy", "Current"),
                  Case("group-capped-and-rate-limited", group_capped_queue(rate_limited=True), "Healthy", "Current")]
    return cases


def not_yet_seen_cases(kind: str) -> list[Case]:
    no_status = operator_object(kind, None, generation=1, observed=None)
    empty_status = copy.deepcopy(no_status)
    empty_status["status"] = {}
    return [Case("no-status-yet", no_status, *NOT_YET_SEEN),
            Case("empty-status", empty_status, *NOT_YET_SEEN),
            Case(f"{SUSPEND_FIELD[kind]}-no-status-yet", with_spec(no_status, **{SUSPEND_FIELD[kind]: True}),
                 *NOT_YET_SEEN)]


CASES = [Case(f"{kind}/{group}/{c.id}", c.obj, c.argo, c.kstatus)
         for kind in ("Queue", "Schedule")
         for group, cases in (("kstatus-test", kstatus_test_cases(kind)), ("operator", operator_cases(kind)),
                              ("not-yet-seen", not_yet_seen_cases(kind)))
         for c in cases]


@pytest.fixture(scope="module", params=["health.lua", "argocd-cm.yaml"])
def judged(request, argohealth) -> dict[str, ArgoHealth]:  # noqa: F811
    """Argo CD's health of every case, from the script file or from the argocd-cm snippet."""
    source = {"script": SCRIPT} if request.param == "health.lua" else {"argocd_cm": ARGOCD_CM}
    return dict(zip([c.id for c in CASES], argohealth([c.obj for c in CASES], **source)))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_argo_cd_and_kstatus_agree(case: Case, judged, kstatus):
    argo, flux = judged[case.id], kstatus(case.obj)
    assert argo.error == "", f"the script failed in Argo CD: {argo.error}"
    seen = (argo.status, flux.status)
    assert seen == (case.argo, case.kstatus), (
        f"Argo CD {argo.status} ({argo.message!r}), kstatus {flux.status} ({flux.message!r}); "
        f"expected {case.argo} / {case.kstatus}")
    # The mapping, stated once: every expectation above is in it (or the one exception).
    assert seen in AGREEING or (seen == NOT_YET_SEEN and "/not-yet-seen/" in case.id)
    if seen != NOT_YET_SEEN:  # Suspended: exactly when paused or suspended and otherwise settled
        suspending = (case.obj.get("spec") or {}).get(SUSPEND_FIELD[case.obj["kind"]]) is True
        assert (argo.status == "Suspended") == (suspending and flux.status == "Current")
    if seen in SAME_MESSAGE:
        assert argo.message == flux.message
    if "/kstatus-test/" not in case.id:  # (those conditions often have no message)
        assert argo.message, "Argo CD shows the health message beside the state: never leave it empty"
    if case.id == "Queue/operator/stalling":  # healthy, with the warning and its advice as the message
        assert argo.message.startswith("stalling: 5 stalls in 10 min: OOMKilled 4, Unknown 1; raise "
                                       "worker.resources.limits.memory"), argo.message
    if case.id in ("Queue/operator/rate-limited", "Queue/operator/group-capped-and-rate-limited"):
        assert argo.message == ("rate limited: 5000 waiting: the rate limit of 100 starts per 1s is reached (100 "
                                "started in the last 1s)"), argo.message  # healthy, saying why tasks wait
    if case.id == "Queue/operator/group-capped":
        assert argo.message == ("group capped: 300 of 320 waiting tasks wait for their group's cap, rate limit or "
                                "resume; more replicas would not start them"), argo.message


def test_every_state_argo_cd_users_expect_is_covered():
    """Healthy, Progressing (rolling out, catching up, no status yet), Degraded, Suspended:
    each is expected of some case of each kind, so none can silently go untested."""
    for kind in ("Queue", "Schedule"):
        expected = {c.argo for c in CASES if c.obj["kind"] == kind}
        assert expected == ARGO_STATES, kind
        ids = {c.id.split("/")[-1] for c in CASES if c.obj["kind"] == kind}
        assert {"ready", "rolling-out" if kind == "Queue" else "ticks-failing", "catching-up",
                SUSPEND_FIELD[kind], "no-status-yet"} <= ids


# --------------------------------------------------------------------------
# the files themselves


def test_argocd_cm_snippet_holds_the_script_under_both_keys():
    """gitops/argocd/argocd-cm.yaml is generated from health.lua (tooling/argohealth/argocd_cm.py)."""
    from tooling.argohealth import argocd_cm

    assert argocd_cm.main(["--check"]) == 0, "run `python tooling/argohealth/argocd_cm.py`"
    manifest = yaml.safe_load(ARGOCD_CM.read_text())
    assert (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"]) == ("v1", "ConfigMap", "argocd-cm")
    assert manifest["data"] == {key: SCRIPT.read_text() for key in HEALTH_KEYS.values()}


def test_a_mistyped_key_leaves_the_kind_without_health(argohealth, tmp_path):  # noqa: F811
    """Argo CD matches `<group>_<kind>` exactly: with a typo in the key Argo CD gives a Queue
    no health at all, and the helper says so instead of inventing one."""
    manifest = yaml.safe_load(ARGOCD_CM.read_text())
    manifest["data"] = {key.replace("_Queue", "_Queues"): value for key, value in manifest["data"].items()}
    mistyped = tmp_path / "argocd-cm.yaml"
    mistyped.write_text(yaml.safe_dump(manifest))
    assert argohealth(operator_object("Schedule", None), argocd_cm=mistyped).status == "Healthy"
    with pytest.raises(RuntimeError, match="no health script is configured for effectmq.io/Queue"):
        argohealth(operator_object("Queue", None), argocd_cm=mistyped)


def test_a_script_error_is_what_argo_cd_shows_not_a_crash(argohealth, tmp_path):  # noqa: F811
    """The helper reports a failing script as Argo CD does (Unknown, the error as message),
    so a typo in the script fails the agreement test with the Lua error. Argo CD opens no
    string library for argocd-cm scripts: string.format is such a typo."""
    script = tmp_path / "health.lua"
    script.write_text('return {status = "Healthy", message = string.format("%d", 1)}\n')
    health = argohealth(operator_object("Queue", None), script=script)
    assert health.status == "Unknown"
    assert "attempt to index a non-table object(nil) with key 'format'" in health.error
    assert health.message in health.error


def test_a_script_that_returns_nothing_has_no_health(argohealth, tmp_path):  # noqa: F811
    """What the Schedule entry of the Argo CD settings was before (a comment only): Argo CD gets no health state."""
    script = tmp_path / "health.lua"
    script.write_text("-- the same script as for Queue\n")
    assert argohealth(operator_object("Schedule", None), script=script) == ArgoHealth("", "", "")


# --------------------------------------------------------------------------
# on a real API server: the documented install step, and objects as the API returns them


@pytest.mark.kube
def test_the_documented_patch_merges_both_keys_into_an_existing_argocd_cm(
        kube_control_plane: KubeControlPlane, kube_namespace, argohealth, tmp_path):  # noqa: F811
    """docs/gitops.md: `kubectl patch configmap argocd-cm -n argocd --patch-file
    gitops/argocd/argocd-cm.yaml` keeps the keys already there and adds both scripts."""
    plane, ns = kube_control_plane, kube_namespace
    existing = {"url": "https://argocd.example.com",
                "resource.customizations.health.cert-manager.io_Certificate": "return {status = \"Healthy\"}\n"}
    plane.kubectl("create", "-n", ns, "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "argocd-cm", "labels": {
            "app.kubernetes.io/name": "argocd-cm", "app.kubernetes.io/part-of": "argocd"}},
        "data": existing}))
    plane.kubectl("patch", "configmap", "argocd-cm", "-n", ns, "--patch-file", str(ARGOCD_CM))
    live = plane.kubectl_json("get", "configmap", "argocd-cm", "-n", ns)
    assert live["data"] == {**existing, **{key: SCRIPT.read_text() for key in HEALTH_KEYS.values()}}
    assert live["metadata"]["labels"]["app.kubernetes.io/name"] == "argocd-cm"
    patched = tmp_path / "argocd-cm.json"
    patched.write_text(json.dumps(live))
    queue, schedule = (operator_object(kind, None) for kind in ("Queue", "Schedule"))
    assert [h.status for h in argohealth([queue, schedule], argocd_cm=patched)] == ["Healthy", "Healthy"]


@pytest.mark.kube
def test_queue_and_schedule_from_the_api_server_agree(kube_control_plane: KubeControlPlane, effectmq_crds,
                                                      kube_namespace, argohealth, kstatus):  # noqa: F811
    """Objects as the API server returns them (integers, defaults, pruned status): applied
    (no status yet), reported Ready by the operator's conditions, then paused or suspended
    (the operator has not seen that edit yet), then seen again."""
    plane, ns = kube_control_plane, kube_namespace

    def judge(kind: str) -> tuple[str, str]:
        obj = plane.kubectl_json("get", "-n", ns, kind.lower(), "emails")
        argo = argohealth(obj, argocd_cm=ARGOCD_CM)
        assert argo.error == ""
        return argo.status, kstatus(obj).status

    def report(kind: str) -> None:
        obj = plane.kubectl_json("get", "-n", ns, kind.lower(), "emails")
        generation = obj["metadata"]["generation"]
        checks = QUEUE_CHECKS_OK if kind == "Queue" else SCHEDULE_CHECKS_OK
        status = {"observedGeneration": generation, "conditions": conditions(checks, None, generation)}
        plane.kubectl("patch", "-n", ns, kind.lower(), "emails", "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": status}))

    for kind in ("Queue", "Schedule"):
        obj = operator_object(kind, None, observed=None)
        del obj["metadata"]["namespace"], obj["metadata"]["generation"]
        plane.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))
        assert judge(kind) == NOT_YET_SEEN
        report(kind)
        assert judge(kind) == ("Healthy", "Current")
        plane.kubectl("patch", "-n", ns, kind.lower(), "emails", "--type=merge",
                      "-p", json.dumps({"spec": {SUSPEND_FIELD[kind]: True}}))
        assert judge(kind) == ("Progressing", "InProgress")
        report(kind)
        assert judge(kind) == ("Suspended", "Current")
