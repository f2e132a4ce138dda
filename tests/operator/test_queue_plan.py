"""The control core: honest status, Events that match the action, pod costs."""

from datetime import datetime, timezone

from effectmq_operator import api, queue_plan, scaling
from effectmq_operator.status import Problem

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


class Stats:
    waiting, delayed, active, failed, completed, oldest_waiting_seconds = 12, 0, 2, 1, 40, 3.25
    rate_limit, rate_window_starts, starts_held_for = None, 0, 0.0
    parked, group_caps = 0, False


def deployment(replicas=2, generation=3, observed=3, updated=2, available=2, progressing=None):
    conditions = [progressing] if progressing else []
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated,
                       "availableReplicas": available, "readyReplicas": available, "conditions": conditions}}


def conds(plan):
    return {c["type"]: (c["status"], c["reason"]) for c in plan.status["conditions"]}


def test_ready_only_when_the_deployment_is_rolled_out():
    facts = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment()))
    plan = queue_plan.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("True", "Ready") and conds(plan)["WorkersDeployed"] == ("True", "Available")
    assert plan.status["backlog"]["waiting"] == 12 and plan.status["observedGeneration"] == 4

    rolling = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment(available=1)))
    plan = queue_plan.plan(rolling, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "RollingOut") and conds(plan)["Reconciling"][0] == "True"
    assert not [e for e in plan.events if e.type == "Warning"]  # a rollout in progress is not a warning

    stale = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment(observed=2)))
    assert conds(queue_plan.plan(stale, generation=4, previous={}, decision=None, replicas_before=None))["Ready"][0] \
        == "False"


def test_a_failed_rollout_is_stalled():
    failed = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
              "message": 'ReplicaSet "emails-worker-x" has timed out progressing.'}
    facts = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment(available=0,
                                                                                                     progressing=failed)))
    plan = queue_plan.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "ProgressDeadlineExceeded")
    assert conds(plan)["Stalled"] == ("True", "ProgressDeadlineExceeded") and conds(plan)["Reconciling"][0] == "False"
    assert [e.reason for e in plan.events] == ["ProgressDeadlineExceeded"]
    again = queue_plan.plan(facts, generation=4, previous=plan.status, decision=None, replicas_before=None, now=NOW)
    assert again.status == plan.status and again.events == []  # level-based: the same facts change nothing


def test_a_failed_apply_wins_over_an_old_healthy_deployment():
    facts = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment()),
                                  apply_problem=Problem("DeploymentFailed", "422 Unprocessable Entity: bad", True))
    plan = queue_plan.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "DeploymentFailed") and conds(plan)["Stalled"][0] == "True"


def test_a_queue_without_worker_is_ready_with_a_reason():
    plan = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), has_worker=False), generation=1, previous={},
                           decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("True", "Ready") and conds(plan)["WorkersDeployed"] == ("True", "NoWorkers")


def test_a_redis_that_refuses_writes_is_not_ready_but_still_observed():
    refusal = Problem("RedisRefusesWrites", "offers are refused: OOM command not allowed")
    facts = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment()),
                                  write_problem=refusal)
    plan = queue_plan.plan(facts, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "RedisRefusesWrites")
    assert conds(plan)["AcceptingTasks"] == ("False", "RedisRefusesWrites")
    assert conds(plan)["RedisReachable"][0] == "True" and conds(plan)["WorkersDeployed"][0] == "True"
    assert (conds(plan)["Reconciling"][0], conds(plan)["Stalled"][0]) == ("True", "False")  # it clears by itself
    assert plan.status["backlog"]["waiting"] == 12  # Redis still answers reads
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "RedisRefusesWrites")]
    again = queue_plan.plan(facts, generation=4, previous=plan.status, decision=None, replicas_before=None, now=NOW)
    assert again.events == []  # one Warning per outage
    # A mistake only the user can fix says so first.
    broken = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment()),
                                   write_problem=refusal,
                                apply_problem=Problem("DeploymentFailed", "422 Unprocessable Entity: bad", True))
    plan = queue_plan.plan(broken, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "DeploymentFailed") and conds(plan)["AcceptingTasks"][0] == "False"
    unknown = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment()),
                                    write_problem=Problem("NotChecked", "the write probe was refused: NOPERM"))
    plan = queue_plan.plan(unknown, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["AcceptingTasks"] == ("Unknown", "NotChecked") and conds(plan)["Ready"][0] == "True"
    healthy = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(),
                                                    deployment=queue_plan.DeploymentFacts.of(deployment())),
                              generation=4, previous={}, decision=None, replicas_before=None, now=NOW)
    assert conds(healthy)["AcceptingTasks"] == ("True", "Accepting")


def test_redis_down_keeps_the_last_backlog_and_retries():
    previous = {"backlog": {"waiting": 5}, "oldestWaitingSeconds": 1.0}
    facts = queue_plan.QueueFacts(redis_problem=Problem("RedisUnreachable", "Redis unreachable: timeout"),
                                  deployment=queue_plan.DeploymentFacts.of(deployment()))
    plan = queue_plan.plan(facts, generation=1, previous=previous, decision=None, replicas_before=None, now=NOW)
    assert conds(plan)["Ready"] == ("False", "RedisUnreachable") and conds(plan)["Reconciling"][0] == "True"
    assert plan.status["backlog"] == {"waiting": 5}
    assert conds(plan)["AcceptingTasks"] == ("Unknown", "NotChecked")  # not claimed either way
    assert [e.type for e in plan.events] == ["Warning"]
    assert queue_plan.plan(facts, generation=1, previous=plan.status, decision=None, replicas_before=None,
                           now=datetime(2026, 12, 2, tzinfo=timezone.utc)).status == plan.status  # no rewrite per poll


def test_the_scaling_event_is_the_final_decision():
    decision = scaling.Decision(3, "scale up to 3: ...")
    facts = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment(replicas=3)))
    plan = queue_plan.plan(facts, generation=1, previous={}, decision=decision, replicas_before=1, now=NOW)
    assert plan.status["lastScaleReason"] == decision.reason and plan.status["desiredReplicas"] == 3
    assert [(e.reason, e.message) for e in plan.events] == [("Scaled", decision.reason)]


def test_pod_costs_follow_attempts_in_flight():
    assert queue_plan.pod_costs({"a": (3, 0), "b": (0, 1)}, ["a", "b", "c"]) == {"a": "3", "b": "0", "c": "0"}


def test_backlog_figures_alone_are_written_at_most_once_a_minute():
    live = {"conditions": [1], "backlog": {"waiting": 5}, "oldestWaitingSeconds": 1.0, "replicas": 1}
    busier = {**live, "backlog": {"waiting": 9}, "oldestWaitingSeconds": 7.5}
    assert not queue_plan.needs_write(live, live, None)  # nothing changed: no write
    assert queue_plan.needs_write(live, busier, None)  # never written by this operator: write
    assert not queue_plan.needs_write(live, busier, 10.0)
    assert queue_plan.needs_write(live, busier, queue_plan.FIGURES_EVERY)
    assert queue_plan.needs_write(live, {**busier, "replicas": 2}, 1.0)  # anything else: at once
    assert queue_plan.needs_write(live, {**live, "conditions": [2]}, 1.0)


def test_a_queue_that_drained_or_got_work_shows_it_within_seconds():
    """Found by hand: 600 tasks done, the Queue still said 153 waiting and 208 active
    for half a minute (figures alone wait a minute). Empty <-> not empty is written as
    soon as FIGURES_SOON has passed since the last write; busy figures still wait."""
    def status(waiting, active, completed=0):
        return {"conditions": [1], "replicas": 3, "oldestWaitingSeconds": 2.0 if waiting else 0,
                "backlog": {"waiting": waiting, "delayed": 0, "active": active, "failed": 0, "completed": completed}}
    busy, drained = status(153, 208), status(0, 0, completed=1200)
    assert queue_plan.needs_write(busy, drained, queue_plan.FIGURES_SOON)
    assert queue_plan.needs_write(drained, busy, queue_plan.FIGURES_SOON)  # work arrived
    assert not queue_plan.needs_write(busy, drained, queue_plan.FIGURES_SOON - 1)  # a queue flapping: bounded
    assert not queue_plan.needs_write(busy, status(100, 208), queue_plan.FIGURES_SOON)  # busy either way
    assert not queue_plan.needs_write(drained, status(0, 0, completed=1300), queue_plan.FIGURES_SOON)  # idle either way
    assert queue_plan.FIGURES_SOON < queue_plan.FIGURES_EVERY


def test_needs_apply_sees_drift_also_across_a_restart():
    from effectmq_operator import builders
    from effectmq_operator.spec import QueueSpec

    spec = QueueSpec.parse({"redis": {"url": "redis://r:6379/0"}, "worker": {"image": "w:1", "handlers": "a:b"}})
    desired = builders.worker_deployment("shop", "emails", spec, 2)
    ours = {"manager": api.FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {}}}
    status = {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
              "fieldsV1": {"f:status": {}}}
    live = {"metadata": {**desired["metadata"], "generation": 4, "managedFields": [ours, status]},
            "spec": dict(desired["spec"])}
    assert queue_plan.needs_apply(None, desired, None)
    assert not queue_plan.needs_apply(live, desired, 4)
    assert queue_plan.needs_apply(live, desired, 3)  # a generation we did not make
    assert not queue_plan.needs_apply(live, desired, None)  # a new term: nobody else touched the spec
    edited = {**live, "metadata": {**live["metadata"], "managedFields": [ours, status, {
        "manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {"f:template": {}}}}]}}
    assert queue_plan.foreign_spec_edits(edited) == ["kubectl-edit"]
    assert queue_plan.needs_apply(edited, desired, None)
    assert queue_plan.needs_apply({**live, "spec": {**live["spec"], "replicas": 5}}, desired, 4)


# -- worker health judged from the pods themselves --------------------------------

T0 = NOW.timestamp()


def iso(seconds_after_now: float) -> str:
    return datetime.fromtimestamp(T0 + seconds_after_now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def rollout(replicas=1, current=1, updated=1, available=0, new_rs="q-worker-new", generation=3, observed=3,
            deadline=600, scale_up=False):
    """A Deployment rolling out a new template, or (scale_up) scaled up after a completed
    rollout: the controller then keeps NewReplicaSetAvailable and never times out."""
    reason, message = ("NewReplicaSetAvailable", f'ReplicaSet "{new_rs}" has successfully progressed.') if scale_up \
        else ("ReplicaSetUpdated", f'ReplicaSet "{new_rs}" is progressing.')
    d = deployment(replicas=replicas, generation=generation, observed=observed, updated=updated, available=available,
                   progressing={"type": "Progressing", "status": "True", "reason": reason, "message": message})
    d["status"]["replicas"] = current
    d["spec"]["progressDeadlineSeconds"] = deadline
    return queue_plan.DeploymentFacts.of(d)


def pod(name, rs="q-worker-new", *, created=-120.0, ready=False, unready_since=None, restarts=0, waiting=None,
        running_since=None, last_exit=None, deleting=False):
    container = {"name": "worker", "restartCount": restarts, "ready": ready, "state": {}}
    if waiting:
        container["state"]["waiting"] = {"reason": waiting[0], "message": waiting[1]}
    if running_since is not None:
        container["state"]["running"] = {"startedAt": iso(running_since)}
    if last_exit:
        container["lastState"] = {"terminated": {"exitCode": last_exit[0], "reason": last_exit[1],
                                                 "message": last_exit[2]}}
    ready_since = unready_since if unready_since is not None else created
    body = {"metadata": {"name": name, "creationTimestamp": iso(created),
                         "ownerReferences": [{"kind": "ReplicaSet", "name": rs}]},
            "status": {"phase": "Running" if (running_since is not None or waiting) else "Pending",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "lastTransitionTime": iso(ready_since)}],
                       "containerStatuses": [container]}}
    if deleting:
        body["metadata"]["deletionTimestamp"] = iso(0)
    return queue_plan.PodFacts.of(body)


TRACEBACK = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'shop.taskz'\n"


def health(d, pods, **facts):
    f = queue_plan.QueueFacts(stats=Stats(), deployment=d, pods=tuple(pods), **facts)
    return queue_plan.plan(f, generation=4, previous={}, decision=None, replicas_before=None, now=NOW)


def test_a_crash_loop_after_a_scale_from_zero_is_not_ready_then_stalled():
    """Was: RollingOut for ever (a scale-up is not a rollout: no ProgressDeadlineExceeded)."""
    d = rollout(scale_up=True)
    crashing = pod("q-worker-new-a", restarts=1, waiting=("CrashLoopBackOff", "back-off 10s restarting failed"),
                   last_exit=(1, "Error", TRACEBACK), created=-20)
    plan = health(d, [crashing])
    assert conds(plan)["Ready"] == ("False", "WorkersCrashLooping")
    assert (conds(plan)["Reconciling"][0], conds(plan)["Stalled"][0]) == ("True", "False")  # not yet: 1 restart
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert "q-worker-new-a" in ready["message"] and "exit code 1" in ready["message"]
    assert "No module named 'shop.taskz'" in ready["message"] and "Traceback" not in ready["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "WorkersCrashLooping")]

    looping = pod("q-worker-new-a", restarts=3, waiting=("CrashLoopBackOff", "back-off 40s restarting failed"),
                  last_exit=(1, "Error", TRACEBACK), created=-75)
    stalled = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), deployment=d, pods=(looping,)), generation=4,
                              previous=plan.status, decision=None, replicas_before=None, now=NOW)
    assert conds(stalled)["Ready"] == ("False", "WorkersCrashLooping")
    assert (conds(stalled)["Reconciling"][0], conds(stalled)["Stalled"][0]) == ("False", "True")
    assert [(e.type, e.reason) for e in stalled.events] == [("Warning", "WorkersCrashLooping")]
    again = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), deployment=d, pods=(
        pod("q-worker-new-a", restarts=4, waiting=("CrashLoopBackOff", "back-off 1m20s"),
            last_exit=(1, "Error", TRACEBACK), created=-160),)), generation=4, previous=stalled.status,
        decision=None, replicas_before=None, now=NOW)
    assert again.events == [] and again.status["conditions"] == stalled.status["conditions"]  # one restart more: quiet


def test_a_crash_loop_between_two_restarts_is_still_a_crash_loop():
    d = rollout()
    between = pod("q-worker-new-a", restarts=2, running_since=-1, last_exit=(1, "Error", TRACEBACK), created=-40)
    assert conds(health(d, [between]))["Ready"] == ("False", "WorkersCrashLooping")


def test_an_old_pod_is_never_available_for_a_new_template():
    """Was: "1 of 1 replicas updated, 1 available" (the old pod) until the 600 s deadline."""
    d = rollout(replicas=1, current=2, updated=1, available=1)
    old = pod("q-worker-old-a", rs="q-worker-old", ready=True, running_since=-3600, created=-3600)
    new = pod("q-worker-new-a", restarts=3, waiting=("CrashLoopBackOff", "back-off 40s"),
              last_exit=(1, "Error", TRACEBACK), created=-90)
    plan = health(d, [old, new])
    assert conds(plan)["Ready"] == ("False", "WorkersCrashLooping") and conds(plan)["Stalled"][0] == "True"
    message = next(c for c in plan.status["conditions"] if c["type"] == "WorkersDeployed")["message"]
    assert "q-worker-new-a" in message and "1 pod of the previous template still serves" in message
    starting = health(d, [old, pod("q-worker-new-a", created=-5)])
    message = next(c for c in starting.status["conditions"] if c["type"] == "Ready")["message"]
    assert conds(starting)["Ready"] == ("False", "RollingOut")
    assert message.startswith("0 of 1 replicas of the current template available"), message
    # without the pods, the Deployment's counts are read as a bound: the old pod is not counted
    unknown = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), deployment=d), generation=4, previous={},
                              decision=None, replicas_before=None, now=NOW)
    message = next(c for c in unknown.status["conditions"] if c["type"] == "Ready")["message"]
    assert "at least 0 of them available" in message, message
    # nor are the counts of a Deployment whose controller has not seen the new template yet
    unseen = rollout(replicas=1, current=1, updated=1, available=1, observed=2)
    plan = health(unseen, [old])
    message = next(c for c in plan.status["conditions"] if c["type"] == "Ready")["message"]
    assert conds(plan)["Ready"] == ("False", "RollingOut") and "available" not in message, message


def test_a_failing_pod_of_an_earlier_template_is_not_the_current_ones_problem():
    d = rollout(replicas=1, current=2, updated=1, available=0)
    old = pod("q-worker-old-a", rs="q-worker-old", restarts=9, waiting=("CrashLoopBackOff", "back-off 5m0s"),
              last_exit=(1, "Error", TRACEBACK), created=-3600)
    plan = health(d, [old, pod("q-worker-new-a", created=-3)])
    assert conds(plan)["Ready"] == ("False", "RollingOut") and conds(plan)["Stalled"][0] == "False"


def test_image_pull_failures_stall_after_a_bound_or_at_once_when_nothing_can_heal():
    d = rollout(scale_up=True)
    young = pod("q-worker-new-a", waiting=("ImagePullBackOff", 'Back-off pulling image "nope:1"'), created=-20)
    plan = health(d, [young])
    assert conds(plan)["Ready"] == ("False", "ImagePullFailed") and conds(plan)["Stalled"][0] == "False"
    assert 'Back-off pulling image "nope:1"' in next(c for c in plan.status["conditions"]
                                                     if c["type"] == "Ready")["message"]
    old = pod("q-worker-new-a", waiting=("ErrImagePull", "manifest unknown"),
              created=-(queue_plan.START_FAILURE_LIMIT + 1))
    assert conds(health(d, [old]))["Stalled"] == ("True", "ImagePullFailed")
    invalid = pod("q-worker-new-a", waiting=("InvalidImageName", "couldn't parse image name"), created=-1)
    assert conds(health(d, [invalid]))["Stalled"] == ("True", "ImagePullFailed")
    # a short progress deadline of a scale-up comes first (a rollout's is the Deployment controller's)
    assert conds(health(rollout(deadline=10, scale_up=True), [young]))["Stalled"] == ("True", "ImagePullFailed")
    assert conds(health(rollout(deadline=10), [young]))["Stalled"][0] == "False"


def test_pods_pending_past_the_progress_deadline_of_a_scale_up_are_stalled():
    d = rollout(deadline=60, scale_up=True)
    assert conds(health(d, [pod("q-worker-new-a", created=-30)]))["Ready"] == ("False", "RollingOut")
    late = health(d, [pod("q-worker-new-a", created=-61)])
    assert conds(late)["Stalled"] == ("True", "ProgressDeadlineExceeded")
    # in a rollout the Deployment controller times out itself (Progressing=False), and that is read
    rolling = health(rollout(deadline=60), [pod("q-worker-new-a", created=-61)])
    assert conds(rolling)["Ready"] == ("False", "RollingOut")


def test_redis_reasons_win_over_worker_readiness():
    """Was: a 3 s Redis outage read RollingOut. A running worker is ready exactly while its
    last Redis call worked; the operator's own failure to reach Redis says it first."""
    d = rollout(replicas=2, current=2, updated=2, available=0, scale_up=True)
    unready = [pod(f"q-worker-new-{i}", running_since=-600, created=-600, unready_since=-8) for i in "ab"]
    plan = health(d, unready)
    assert conds(plan)["Ready"] == ("False", "WorkersCannotReachRedis")
    assert (conds(plan)["Reconciling"][0], conds(plan)["Stalled"][0]) == ("True", "False")
    outage = health(d, unready, redis_problem=Problem("RedisUnreachable", "connection refused"))
    assert conds(outage)["Ready"] == ("False", "RedisUnreachable")
    assert conds(outage)["WorkersDeployed"] == ("False", "WorkersCannotReachRedis")
    # long unready while the operator reaches Redis: a network path only a change can fix
    stuck = [pod("q-worker-new-a", running_since=-3600, created=-3600, unready_since=-700)]
    assert conds(health(d, stuck))["Stalled"] == ("True", "WorkersCannotReachRedis")
    assert conds(health(d, stuck, redis_problem=Problem("RedisUnreachable", "down")))["Stalled"][0] == "False"
    # just started: not judged yet
    assert conds(health(d, [pod("q-worker-new-a", running_since=-5, created=-8)]))["Ready"] == ("False", "RollingOut")


def test_terminating_pods_and_their_restarts_do_not_count():
    d = rollout(replicas=1, current=2, updated=1, available=1)
    gone = pod("q-worker-new-z", restarts=5, waiting=("CrashLoopBackOff", "x"), last_exit=(1, "Error", ""),
               deleting=True, created=-900)
    ok = pod("q-worker-new-a", ready=True, running_since=-60, created=-60)
    plan = health(d, [gone, ok])
    assert conds(plan)["Ready"][1] == "RollingOut"


def test_the_last_poll_time_is_shown_and_written_alone_only_rarely():
    plan = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment())),
                           generation=1, previous={}, decision=None, replicas_before=None, now=NOW)
    assert plan.status["lastPollTime"] == "2026-12-01T00:00:00Z"
    later = {**plan.status, "lastPollTime": "2026-12-01T00:00:10Z"}
    assert not queue_plan.needs_write(plan.status, later, 10.0)
    assert queue_plan.needs_write(plan.status, later, queue_plan.POLL_TIME_EVERY)
    assert queue_plan.needs_write(plan.status, {**later, "replicas": 7}, 1.0)  # carried along with anything else
    down = queue_plan.plan(queue_plan.QueueFacts(redis_problem=Problem("RedisUnreachable", "x")), generation=1,
                           previous=plan.status, decision=None, replicas_before=None, now=NOW)
    assert down.status["lastPollTime"] == plan.status["lastPollTime"]  # the last poll that read the backlog


# -- a refusal for the object's content is permanent -------------------------------

def api_exception(status: int, message: str):
    import json

    from kubernetes.client.rest import ApiException

    exc = ApiException(status=status, reason={500: "Internal Server Error", 422: "Unprocessable Entity",
                                              409: "Conflict", 403: "Forbidden"}.get(status, "x"))
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "message": message, "code": status})
    return exc


def test_an_apply_refused_for_its_content_is_permanent_a_server_fault_is_not():
    from effectmq_operator.runtime.kube import permanent_refusal, refused_for_content

    typed = api_exception(500, 'failed to create typed patch object (shop/emails-worker; apps/v1, Kind=Deployment): '
                               '.spec.template.spec.containers[name="worker"].env[name="NUM"].value: expected string, '
                               'got &value.valueUnstructured{Value:5}')
    assert refused_for_content(typed) and permanent_refusal(typed)
    assert permanent_refusal(api_exception(422, 'Deployment.apps "x" is invalid: spec.template...'))
    assert permanent_refusal(api_exception(403, 'exceeded quota: no-deployments'))
    for transient in (api_exception(500, "etcdserver: request timed out"), api_exception(409, "conflict"),
                      api_exception(500, "Internal error occurred: resource quota evaluation timed out")):
        assert not permanent_refusal(transient), transient.body
