"""The kstatus helper (tooling/kstatus, fixture tests/fixtures/kstatus.py) runs the
real sigs.k8s.io/cli-utils kstatus library: pure objects, no API server.

The expected values are what kstatus v0.37.2 returns, not what we would like it
to return: these tests pin the library's rules that our Queue and Schedule
status has to live with.
"""

from __future__ import annotations

import copy
import json
import subprocess

import pytest

from tests.fixtures.kstatus import KStatus, locate_binary


def deployment(**status_overrides) -> dict:
    """A Deployment whose status matches its spec, as the controller leaves it."""
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "workers", "namespace": "default", "generation": 3},
        "spec": {"replicas": 2, "progressDeadlineSeconds": 600},
        "status": {
            "observedGeneration": 3,
            "replicas": 2,
            "updatedReplicas": 2,
            "availableReplicas": 2,
            "readyReplicas": 2,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
            ],
        },
    }
    obj["status"].update(status_overrides)
    return obj


def custom_resource(kind: str, conditions: list, observed_generation=2) -> dict:
    obj = {
        "apiVersion": "effectmq.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": "q", "namespace": "default", "generation": 2},
        "spec": {},
        "status": {"conditions": conditions},
    }
    if observed_generation is not None:
        obj["status"]["observedGeneration"] = observed_generation
    return obj


def cond(type_: str, status: str, reason: str = "", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message}


# --------------------------------------------------------------------------
# Deployment: the library's built-in rules for apps/Deployment


def test_deployment_matching_its_spec_is_current(kstatus):
    result = kstatus(deployment())
    assert isinstance(result, KStatus)
    assert result == KStatus(
        status="Current", message="Deployment is available. Replicas: 2", conditions=[]
    )


def test_deployment_with_lagging_observed_generation_is_in_progress(kstatus):
    result = kstatus(deployment(observedGeneration=2))
    assert result.status == "InProgress"
    assert result.message == "Deployment generation is 3, but latest observed generation is 2"
    assert result.conditions == [
        {
            "type": "Reconciling",
            "status": "True",
            "reason": "LatestGenerationNotObserved",
            "message": result.message,
        }
    ]


def test_deployment_past_its_progress_deadline_is_failed(kstatus):
    obj = deployment()
    obj["status"]["conditions"][1] = cond(
        "Progressing", "False", "ProgressDeadlineExceeded", 'ReplicaSet "workers-1" has timed out progressing.'
    )
    result = kstatus(obj)
    assert result.status == "Failed"
    assert result.message == "Progress deadline exceeded"
    assert [(c["type"], c["status"], c["reason"]) for c in result.conditions] == [
        ("Stalled", "True", "ProgressDeadlineExceeded")
    ]


def test_deployment_counts_replicas(kstatus):
    # Numbers must reach the library as integers: it ignores float64 counts.
    result = kstatus(deployment(readyReplicas=1, availableReplicas=1))
    assert (result.status, result.message) == ("InProgress", "Available: 1/2")


def test_deployment_available_alone_is_not_enough_with_a_progress_deadline(kstatus):
    # With spec.progressDeadlineSeconds set (the API server defaults it to 600),
    # kstatus also wants Progressing=True reason NewReplicaSetAvailable.
    obj = deployment()
    obj["status"]["conditions"] = obj["status"]["conditions"][:1]  # only Available=True
    result = kstatus(obj)
    assert (result.status, result.message) == ("InProgress", "ReplicaSet not Available")
    del obj["spec"]["progressDeadlineSeconds"]
    assert kstatus(obj).status == "Current"


# --------------------------------------------------------------------------
# Queue and Schedule: custom resources get only the generic rules


@pytest.fixture(params=["Queue", "Schedule"])
def kind(request) -> str:
    return request.param


def test_custom_resource_ready_is_current(kstatus, kind):
    result = kstatus(custom_resource(kind, [cond("Ready", "True", "Reconciled")]))
    assert result == KStatus(status="Current", message="Resource is Ready", conditions=[])


def test_custom_resource_reconciling_is_in_progress(kstatus, kind):
    result = kstatus(custom_resource(kind, [cond("Reconciling", "True", "Scaling", "scaling workers")]))
    assert result.status == "InProgress"
    assert result.message == "scaling workers"
    assert result.conditions == [cond("Reconciling", "True", "Scaling", "scaling workers")]


def test_custom_resource_stalled_is_failed(kstatus, kind):
    result = kstatus(custom_resource(kind, [cond("Stalled", "True", "RedisUnreachable", "no redis")]))
    assert result.status == "Failed"
    assert result.message == "no redis"
    assert result.conditions == [cond("Stalled", "True", "RedisUnreachable", "no redis")]


def test_custom_resource_with_old_observed_generation_is_in_progress(kstatus, kind):
    result = kstatus(custom_resource(kind, [cond("Ready", "True")], observed_generation=1))
    assert result.status == "InProgress"
    assert result.message == f"{kind} generation is 2, but latest observed generation is 1"
    assert [c["reason"] for c in result.conditions] == ["LatestGenerationNotObserved"]


def test_custom_resource_stalled_wins_over_ready(kstatus, kind):
    conditions = [cond("Ready", "True"), cond("Stalled", "True", "RedisUnreachable")]
    assert kstatus(custom_resource(kind, conditions)).status == "Failed"


def test_custom_resource_ready_false_is_in_progress_never_failed(kstatus, kind):
    # Ready=False (or Unknown) only ever means InProgress; Failed needs Stalled=True.
    result = kstatus(custom_resource(kind, [cond("Ready", "False", "RedisUnreachable", "no redis")]))
    assert result.status == "InProgress"
    assert [(c["type"], c["reason"]) for c in result.conditions] == [("Reconciling", "RedisUnreachable")]
    assert kstatus(custom_resource(kind, [cond("Ready", "Unknown")])).status == "InProgress"


@pytest.mark.parametrize(
    "conditions",
    [
        [],
        [cond("RedisReachable", "False", "ConnectionRefused")],
        [cond("Reconciling", "False"), cond("Stalled", "False")],
    ],
    ids=["no-conditions", "other-condition-false", "abnormal-conditions-false"],
)
def test_custom_resource_without_ready_reconciling_or_stalled_is_current(kstatus, kind, conditions):
    # Only Reconciling, Stalled and Ready are read: anything else, and no status
    # at all, counts as Current.
    result = kstatus(custom_resource(kind, conditions))
    assert (result.status, result.message) == ("Current", "Resource is current")


def test_deletion_timestamp_is_terminating(kstatus, kind):
    obj = custom_resource(kind, [cond("Ready", "True")])
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert kstatus(obj).status == "Terminating"


def test_custom_resource_without_observed_generation_skips_the_generation_check(kstatus, kind):
    obj = custom_resource(kind, [cond("Ready", "True")], observed_generation=None)
    assert kstatus(obj).status == "Current"


# --------------------------------------------------------------------------
# the helper itself


def test_helper_reports_library_errors_on_stderr_with_exit_code_1(kstatus):
    binary = locate_binary()
    obj = custom_resource("Queue", [], observed_generation="2")  # not an integer
    with pytest.raises(RuntimeError, match="expected int64"):
        kstatus(obj)
    proc = subprocess.run([str(binary)], input="not json", capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "not one JSON object" in proc.stderr


def test_helper_prints_one_json_line(kstatus):
    binary = locate_binary()
    proc = subprocess.run(
        [str(binary)], input=json.dumps(deployment()), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    assert set(json.loads(lines[0])) == {"status", "message", "conditions"}


def test_compute_does_not_modify_its_argument(kstatus):
    obj = deployment()
    before = copy.deepcopy(obj)
    kstatus(obj)
    assert obj == before
