"""The control core: honest status, Events that match the action, pod costs."""

from datetime import datetime, timezone

from effectmq_operator import control, scaling
from effectmq_operator.status import Problem

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


class Stats:
    waiting, delayed, active, failed, completed, oldest_waiting_seconds = 12, 0, 2, 1, 40, 3.25


def deployment(replicas=2, generation=3, observed=3, updated=2, available=2, progressing=None):
    conditions = [progressing] if progressing else []
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated,
                       "availableReplicas": available, "readyReplicas": available, "conditions": conditions}}


def conds(plan):
    return {c["type"]: (c["status"], c["reason"]) for c in plan.status["conditions"]}


def test_ready_only_when_the_deployment_is_rolled_out():
    facts = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment()))
    plan = control.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("True", "Ready") and conds(plan)["WorkersDeployed"] == ("True", "Available")
    assert plan.status["backlog"]["waiting"] == 12 and plan.status["observedGeneration"] == 4

    rolling = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment(available=1)))
    plan = control.plan(rolling, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "RollingOut") and conds(plan)["Reconciling"][0] == "True"
    assert not [e for e in plan.events if e.type == "Warning"]  # a rollout in progress is not a warning

    stale = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment(observed=2)))
    assert conds(control.plan(stale, generation=4, previous={}, decision=None, replicas_before=None))["Ready"][0] \
        == "False"


def test_a_failed_rollout_is_stalled():
    failed = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
              "message": 'ReplicaSet "emails-worker-x" has timed out progressing.'}
    facts = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment(available=0,
                                                                                               progressing=failed)))
    plan = control.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "ProgressDeadlineExceeded")
    assert conds(plan)["Stalled"] == ("True", "ProgressDeadlineExceeded") and conds(plan)["Reconciling"][0] == "False"
    assert [e.reason for e in plan.events] == ["ProgressDeadlineExceeded"]
    again = control.plan(facts, generation=4, previous=plan.status, decision=None, replicas_before=None, now=NOW)
    assert again.status == plan.status and again.events == []  # level-based: the same facts change nothing


def test_a_failed_apply_wins_over_an_old_healthy_deployment():
    facts = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment()),
                               apply_problem=Problem("DeploymentFailed", "422 Unprocessable Entity: bad", True))
    plan = control.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "DeploymentFailed") and conds(plan)["Stalled"][0] == "True"


def test_a_queue_without_worker_is_ready_with_a_reason():
    plan = control.plan(control.QueueFacts(stats=Stats(), has_worker=False), generation=1, previous={},
                        decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("True", "Ready") and conds(plan)["WorkersDeployed"] == ("True", "NoWorkers")


def test_a_redis_that_refuses_writes_is_not_ready_but_still_observed():
    refusal = Problem("RedisRefusesWrites", "offers are refused: OOM command not allowed")
    facts = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment()),
                               write_problem=refusal)
    plan = control.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "RedisRefusesWrites")
    assert conds(plan)["AcceptingTasks"] == ("False", "RedisRefusesWrites")
    assert conds(plan)["RedisReachable"][0] == "True" and conds(plan)["WorkersDeployed"][0] == "True"
    assert (conds(plan)["Reconciling"][0], conds(plan)["Stalled"][0]) == ("True", "False")  # it clears by itself
    assert plan.status["backlog"]["waiting"] == 12  # Redis still answers reads
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "RedisRefusesWrites")]
    again = control.plan(facts, generation=4, previous=plan.status, decision=None, replicas_before=None, now=NOW)
    assert again.events == []  # one Warning per outage
    # A mistake only the user can fix says so first.
    broken = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment()),
                                write_problem=refusal,
                                apply_problem=Problem("DeploymentFailed", "422 Unprocessable Entity: bad", True))
    plan = control.plan(broken, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "DeploymentFailed") and conds(plan)["AcceptingTasks"][0] == "False"
    unknown = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment()),
                                 write_problem=Problem("NotChecked", "the write probe was refused: NOPERM"))
    plan = control.plan(unknown, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["AcceptingTasks"] == ("Unknown", "NotChecked") and conds(plan)["Ready"][0] == "True"
    healthy = control.plan(control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment())),
                           generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(healthy)["AcceptingTasks"] == ("True", "Accepting")


def test_redis_down_keeps_the_last_backlog_and_retries():
    previous = {"backlog": {"waiting": 5}, "oldestWaitingSeconds": 1.0}
    facts = control.QueueFacts(redis_problem=Problem("RedisUnreachable", "Redis unreachable: timeout"),
                               deployment=control.DeploymentFacts.of(deployment()))
    plan = control.plan(facts, generation=1, previous=previous, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "RedisUnreachable") and conds(plan)["Reconciling"][0] == "True"
    assert plan.status["backlog"] == {"waiting": 5}
    assert conds(plan)["AcceptingTasks"] == ("Unknown", "NotChecked")  # not claimed either way
    assert [e.type for e in plan.events] == ["Warning"]
    assert control.plan(facts, generation=1, previous=plan.status, decision=None, replicas_before=None,
                        now=datetime(2026, 12, 2, tzinfo=timezone.utc)).status == plan.status  # no rewrite per poll


def test_the_scaling_event_is_the_final_decision():
    decision = scaling.Decision(3, "scale up to 3: ...")
    facts = control.QueueFacts(stats=Stats(), deployment=control.DeploymentFacts.of(deployment(replicas=3)))
    plan = control.plan(facts, generation=1, previous={}, decision=decision, replicas_before=1, now=NOW)
    assert plan.status["lastScaleReason"] == decision.reason and plan.status["desiredReplicas"] == 3
    assert [(e.reason, e.message) for e in plan.events] == [("Scaled", decision.reason)]


def test_pod_costs_follow_attempts_in_flight():
    assert control.pod_costs({"a": (3, 0), "b": (0, 1)}, ["a", "b", "c"]) == {"a": "3", "b": "0", "c": "0"}


def test_backlog_figures_alone_are_written_at_most_once_a_minute():
    live = {"conditions": [1], "backlog": {"waiting": 5}, "oldestWaitingSeconds": 1.0, "replicas": 1}
    busier = {**live, "backlog": {"waiting": 9}, "oldestWaitingSeconds": 7.5}
    assert not control.needs_write(live, live, None)  # nothing changed: no write
    assert control.needs_write(live, busier, None)  # never written by this operator: write
    assert not control.needs_write(live, busier, 10.0)
    assert control.needs_write(live, busier, control.FIGURES_EVERY)
    assert control.needs_write(live, {**busier, "replicas": 2}, 1.0)  # anything else: at once
    assert control.needs_write(live, {**live, "conditions": [2]}, 1.0)


def test_a_queue_that_drained_or_got_work_shows_it_within_seconds():
    """Found by hand: 600 tasks done, the Queue still said 153 waiting and 208 active
    for half a minute (figures alone wait a minute). Empty <-> not empty is written as
    soon as FIGURES_SOON has passed since the last write; busy figures still wait."""
    def status(waiting, active, completed=0):
        return {"conditions": [1], "replicas": 3, "oldestWaitingSeconds": 2.0 if waiting else 0,
                "backlog": {"waiting": waiting, "delayed": 0, "active": active, "failed": 0, "completed": completed}}
    busy, drained = status(153, 208), status(0, 0, completed=1200)
    assert control.needs_write(busy, drained, control.FIGURES_SOON)
    assert control.needs_write(drained, busy, control.FIGURES_SOON)  # work arrived
    assert not control.needs_write(busy, drained, control.FIGURES_SOON - 1)  # a queue flapping: bounded
    assert not control.needs_write(busy, status(100, 208), control.FIGURES_SOON)  # busy either way
    assert not control.needs_write(drained, status(0, 0, completed=1300), control.FIGURES_SOON)  # idle either way
    assert control.FIGURES_SOON < control.FIGURES_EVERY


def test_needs_apply_sees_drift_also_across_a_restart():
    from effectmq_operator import builders
    from effectmq_operator.spec import QueueSpec

    spec = QueueSpec.parse({"redis": {"url": "redis://r:6379/0"}, "worker": {"image": "w:1", "handlers": "a:b"}})
    desired = builders.worker_deployment("shop", "emails", spec, 2)
    ours = {"manager": builders.FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {}}}
    status = {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
              "fieldsV1": {"f:status": {}}}
    live = {"metadata": {**desired["metadata"], "generation": 4, "managedFields": [ours, status]},
            "spec": dict(desired["spec"])}
    assert control.needs_apply(None, desired, None)
    assert not control.needs_apply(live, desired, 4)
    assert control.needs_apply(live, desired, 3)  # a generation we did not make
    assert not control.needs_apply(live, desired, None)  # a new term: nobody else touched the spec
    edited = {**live, "metadata": {**live["metadata"], "managedFields": [ours, status, {
        "manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {"f:template": {}}}}]}}
    assert control.foreign_spec_edits(edited) == ["kubectl-edit"]
    assert control.needs_apply(edited, desired, None)
    assert control.needs_apply({**live, "spec": {**live["spec"], "replicas": 5}}, desired, 4)
