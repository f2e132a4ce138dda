"""The RateLimited and GroupCapped conditions: why a backlog waits, beside Ready (pure)."""

import dataclasses
from datetime import datetime, timezone

from effectmq import QueueStats
from effectmq_operator import queue_plan, throttling
from effectmq_operator.spec import QueueSpec
from effectmq_operator.scaling import ScalingState
from effectmq_operator.throttling import Throttle

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


def test_a_queue_without_a_limit_has_no_condition():
    assert throttling.check(Throttle(None, 0, 0.0, 500)) is None


def test_the_limit_reached_with_tasks_waiting_is_true_and_says_so():
    c = throttling.check(Throttle((100, 1.0), 100, 0.0, 5000))
    assert (c.type, c.status, c.reason) == ("RateLimited", "True", "LimitReached")
    assert c.message == "5000 waiting: the rate limit of 100 starts per 1s is reached (100 started in the last 1s)"


def test_below_the_limit_or_nothing_waiting_is_false():
    for throttle in (Throttle((5, 60.0), 4, 0.0, 10), Throttle((5, 60.0), 5, 0.0, 0)):
        c = throttling.check(throttle)
        assert (c.status, c.reason, c.message) == ("False", "BelowLimit",
                                                   "starts are below the rate limit of 5 starts per 60s")


def test_starts_held_by_a_handler_say_so_with_or_without_a_limit():
    for limit in (None, (100, 1.0)):
        c = throttling.check(Throttle(limit, 0, 30.0, 7))
        assert (c.status, c.reason) == ("True", "StartsHeld")
        assert "held the queue's starts for 30.0s more" in c.message


def test_an_unread_limit_is_unknown_only_where_the_condition_was_shown():
    assert throttling.check(None, []) is None
    c = throttling.check(None, [{"type": "RateLimited", "status": "True"}])
    assert (c.status, c.reason) == ("Unknown", "NotChecked")


class Stats:
    waiting, delayed, active, failed, completed, oldest_waiting_seconds = 4000, 0, 3, 0, 10, 2.0
    rate_limit, rate_window_starts, starts_held_for = (10, 1.0), 10, 0.0
    parked, group_caps = 0, False


def test_the_plan_shows_the_condition_beside_a_ready_queue():
    plan = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), has_worker=False), generation=1, previous={},
                           decision=None, replicas_before=None, now=NOW)
    by_type = {c["type"]: c for c in plan.status["conditions"]}
    assert by_type["Ready"]["status"] == "True"  # a queue held back by its own limit works as asked
    assert (by_type["RateLimited"]["status"], by_type["RateLimited"]["reason"]) == ("True", "LimitReached")


# -- GroupCapped: tasks parked by their group's cap or pause ----------------------------------

IDLE = QueueStats("q", waiting=20, delayed=0, active=5, completed=0, failed=0, canceled=0, oldest_waiting_seconds=1.0,
                  paused=False, max_active=0)


def test_a_queue_that_never_capped_a_group_has_no_condition():
    assert throttling.group_check(IDLE) is None


def test_parked_tasks_make_it_true_and_say_how_many_of_the_waiting():
    c = throttling.group_check(dataclasses.replace(IDLE, parked=300, group_caps=True))
    assert (c.type, c.status, c.reason) == ("GroupCapped", "True", "TasksParked")
    assert c.message == ("300 of 320 waiting tasks wait for their group's cap, rate limit or resume; more replicas "
                         "would not start them")


def test_caps_that_hold_nothing_back_are_false():
    c = throttling.group_check(dataclasses.replace(IDLE, group_caps=True))
    assert (c.status, c.reason) == ("False", "NoneParked")


def test_unread_parked_tasks_are_unknown_only_where_the_condition_was_shown():
    assert throttling.group_check(None, []) is None
    c = throttling.group_check(None, [{"type": "GroupCapped", "status": "True"}])
    assert (c.status, c.reason) == ("Unknown", "NotChecked")


def test_the_plan_shows_group_capped_beside_a_ready_queue_and_the_parked_count():
    stats = dataclasses.replace(IDLE, parked=300, group_caps=True)
    plan = queue_plan.plan(queue_plan.QueueFacts(stats=stats, has_worker=False), generation=1, previous={},
                           decision=None, replicas_before=None, now=NOW)
    by_type = {c["type"]: c for c in plan.status["conditions"]}
    assert by_type["Ready"]["status"] == "True"  # held back as asked: the queue works
    assert (by_type["GroupCapped"]["status"], by_type["GroupCapped"]["reason"]) == ("True", "TasksParked")
    assert "RateLimited" not in by_type
    assert plan.status["backlog"]["parked"] == 300 and plan.status["backlog"]["waiting"] == 20


def test_parked_tasks_are_no_demand_for_replicas():
    spec = QueueSpec.parse({"redis": {"url": "redis://r"}, "worker": {"image": "w", "handlers": "a:b"},
                            "scaling": {"targetTasksPerReplica": 10, "maxReplicas": 50}})
    parked = dataclasses.replace(IDLE, parked=10_000, group_caps=True)
    decision = queue_plan.scale(spec, parked, {}, current=3, state=ScalingState(), now=0.0)
    assert decision.replicas == 3 and "25 tasks (20 waiting + 5 active)" in decision.reason
    only_parked = dataclasses.replace(parked, waiting=0, active=0)
    state = ScalingState()
    for now in (0.0, 400.0):  # the stabilization window and the cooldown pass without demand
        decision = queue_plan.scale(spec, only_parked, {}, current=1, state=state, now=now)
        state = decision.state
    assert decision.replicas == 0  # they start as their group's attempts end or it resumes: not by more pods
