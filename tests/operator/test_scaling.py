"""Table-driven tests of the pure scaling decision."""

import dataclasses

import pytest

from effectmq_operator.scaling import Observation, ScalingSpec, ScalingState, decide, max_step_up, restore_state

SPEC = ScalingSpec(min_replicas=0, max_replicas=20, target_tasks_per_replica=100, activation_tasks=5,
                   scale_down_stabilization=60, cooldown=120, concurrency=10)


@pytest.mark.parametrize("name, spec, seen, expected, reason", [
    ("idle stays at zero", SPEC, Observation(0, 0, 0), 0, "hold at 0"),
    ("below activation stays at zero", SPEC, Observation(4, 0, 0), 0, "below the activation threshold of 5"),
    ("activation wakes from zero", SPEC, Observation(5, 0, 0), 1, "scale up to 1"),
    ("in-flight work wakes from zero whatever the threshold", SPEC, Observation(0, 3, 0), 1, "scale up to 1"),
    ("1000 tasks at 100 per replica is 10, step-limited from 2", SPEC, Observation(1000, 0, 2), 6,
     "step limited, target 10"),
    ("step limit from 8 reaches the target", SPEC, Observation(900, 100, 8), 10, "scale up to 10"),
    ("never above max", SPEC, Observation(10_000, 0, 20), 20, "hold at 20"),
    ("min replicas hold even when idle", ScalingSpec(min_replicas=2, max_replicas=5), Observation(0, 0, 2), 2,
     "hold at 2"),
    ("below min scales up to min", ScalingSpec(min_replicas=2, max_replicas=5), Observation(0, 0, 0), 2,
     "scale up to 2"),
    ("max below min is treated as min", ScalingSpec(min_replicas=3, max_replicas=1), Observation(0, 0, 0), 3,
     "scale up to 3"),
    ("ceil, not floor", SPEC, Observation(101, 0, 1), 2, "scale up to 2"),
])
def test_decisions_from_a_fresh_state(name, spec, seen, expected, reason):
    decision = decide(spec, seen, ScalingState(), now=1000.0)
    assert decision.replicas == expected, name
    assert reason in decision.reason, (name, decision.reason)


def test_scale_down_waits_for_the_stabilization_window():
    state = ScalingState()
    d = decide(SPEC, Observation(1000, 0, 10), state, now=0)
    assert d.replicas == 10
    d = decide(SPEC, Observation(100, 0, 10), d.state, now=30)  # inside the window: hold
    assert d.replicas == 10 and "stabilization window" in d.reason
    d = decide(SPEC, Observation(100, 0, 10), d.state, now=61)  # the 10 fell out of the window
    assert d.replicas == 1 and d.reason.startswith("scale down to 1")


def test_scale_down_never_below_pods_holding_leases():
    d = decide(SPEC, Observation(0, 35, 10), ScalingState(), now=0)
    assert d.replicas == 10  # a fresh window holds
    d = decide(SPEC, Observation(0, 35, 10), d.state, now=100)
    assert d.replicas == 4  # ceil(35 active / 10 per pod)
    d = decide(SPEC, Observation(0, 1, 4, busy_workers=3), d.state, now=200)
    assert d.replicas == 3  # three pods still announce work in flight


def test_scale_to_zero_only_after_the_cooldown():
    d = decide(SPEC, Observation(50, 0, 1), ScalingState(), now=0)
    assert d.replicas == 1
    d = decide(SPEC, Observation(0, 0, 1), d.state, now=90)  # window passed, cooldown not
    assert d.replicas == 1 and "cooldown" in d.reason
    d = decide(SPEC, Observation(0, 0, 1), d.state, now=121)
    assert d.replicas == 0 and d.reason.startswith("scale to zero")
    d = decide(SPEC, Observation(4, 0, 0), d.state, now=130)  # below activation: stays down
    assert d.replicas == 0


def test_restart_does_not_scale_down_immediately():
    state = restore_state(None, now=500, current=6)
    d = decide(SPEC, Observation(0, 0, 6), state, now=501)
    assert d.replicas == 6
    assert decide(SPEC, Observation(0, 0, 6), d.state, now=561).replicas == 1
    assert decide(SPEC, Observation(0, 0, 1), d.state, now=621).replicas == 0


@pytest.mark.parametrize("current, limit", [(0, 4), (1, 5), (4, 8), (10, 20)])
def test_step_limit(current, limit):
    assert max_step_up(current) == limit


def test_recommendation_history_is_bounded_by_the_window():
    state = ScalingState()
    for t in range(0, 1000, 10):
        state = decide(SPEC, Observation(100, 0, 1), state, now=t).state
    assert len(state.recommendations) <= SPEC.scale_down_stabilization / 10 + 1


def test_paused_scales_to_min_at_once_and_keeps_busy_workers():
    paused = ScalingSpec(min_replicas=1, max_replicas=20, target_tasks_per_replica=50, concurrency=10, paused=True,
                         scale_down_stabilization=300)
    d = decide(paused, Observation(615, 0, 13), ScalingState(), now=0)
    assert d.replicas == 1 and d.reason.startswith("scale down to 1: queue paused")
    d = decide(paused, Observation(615, 25, 13, busy_workers=4), ScalingState(), now=0)
    assert d.replicas == 4 and "4 kept for work in flight" in d.reason


def test_max_active_caps_replicas_and_the_reason_says_so():
    capped = ScalingSpec(min_replicas=0, max_replicas=20, target_tasks_per_replica=10, concurrency=4, replica_cap=2)
    d = decide(capped, Observation(1000, 0, 1), ScalingState(), now=0)
    assert d.replicas == 2 and d.reason.startswith("scale up to 2") and "capped at 2 by maxActive" in d.reason
    d = decide(capped, Observation(1000, 0, 6), ScalingState(), now=0)  # lowered maxActive: down at once
    assert d.replicas == 2 and d.reason.startswith("scale down to 2")


@pytest.mark.parametrize("seen", [Observation(1000, 0, 2), Observation(0, 0, 5), Observation(3, 30, 0),
                                  Observation(50, 0, 20), Observation(0, 0, 0)])
def test_the_reason_names_the_replicas_of_the_decision(seen):
    for spec in (SPEC, ScalingSpec(max_replicas=3, replica_cap=2, concurrency=5), ScalingSpec(paused=True)):
        d = decide(spec, seen, ScalingState(), now=1000.0)
        head = d.reason.split(":")[0]
        if d.replicas > seen.current_replicas:
            assert head == f"scale up to {d.replicas}"
        elif d.replicas < seen.current_replicas:
            assert head in (f"scale down to {d.replicas}", "scale to zero")
        else:
            assert head == f"hold at {d.replicas}"


# A reason names the bound that decided, never contradicts the decision.

def test_max_replicas_zero_scales_to_zero_and_says_so_without_a_cooldown_that_did_not_apply():
    """Was: "scale to zero: no tasks for 60s; idle for less than the 60s cooldown", with
    tasks waiting and the cooldown not waited for."""
    spec = ScalingSpec(min_replicas=0, max_replicas=0, cooldown=60)
    d = decide(spec, Observation(10, 0, 1), ScalingState(last_demand_at=999.0), now=1000.0)
    assert d.replicas == 0
    assert d.reason.startswith("scale to zero: capped at 0 by maxReplicas"), d.reason
    assert "cooldown" not in d.reason and "no tasks" not in d.reason, d.reason


def test_min_replicas_that_decided_is_named():
    """Was: "scale up to 4: 0 tasks (0 waiting + 0 active) / 50 per replica"."""
    spec = ScalingSpec(min_replicas=4, max_replicas=10)
    d = decide(spec, Observation(0, 0, 0), ScalingState(), now=1000.0)
    assert d.replicas == 4 and d.reason.startswith("scale up to 4: minReplicas is 4"), d.reason
    d = decide(spec, Observation(0, 0, 4), d.state, now=1001.0)
    assert d.replicas == 4 and d.reason.startswith("hold at 4: minReplicas is 4"), d.reason
    # when the backlog needs more than the floor, the backlog decides
    d = decide(spec, Observation(500, 0, 4), d.state, now=1002.0)
    assert d.replicas == 8 and "minReplicas" not in d.reason and "500 tasks" in d.reason, d.reason


def test_max_replicas_that_capped_is_named():
    d = decide(SPEC, Observation(5_000, 0, 12), ScalingState(), now=1000.0)
    assert d.replicas == 20 and d.reason.startswith("scale up to 20: capped at 20 by maxReplicas"), d.reason
    assert "5000 tasks" in d.reason


def test_paused_names_the_min_replicas_it_keeps():
    paused = ScalingSpec(min_replicas=2, max_replicas=20, paused=True)
    d = decide(paused, Observation(615, 0, 13), ScalingState(), now=0)
    assert d.replicas == 2 and d.reason == "scale down to 2: queue paused; minReplicas is 2", d.reason


def test_to_zero_after_the_cooldown_says_no_tasks_only_when_there_were_none():
    d = decide(SPEC, Observation(0, 0, 1), ScalingState(((0.0, 1),), last_demand_at=0.0), now=500.0)
    assert d.replicas == 0 and d.reason == "scale to zero: no tasks for 120s", d.reason


# A backlog held back by the queue's rate limit: more pods would only wait for the limit.
# What the limit can use is the attempts it lets run at once: those in flight (Little's law,
# starts per second times seconds per attempt), plus one pod to spare.
@pytest.mark.parametrize("name, seen, expected, says", [
    ("fast tasks under a limit need one pod, not 20", Observation(100_000, 2, 1, rate_limited=True), 2,
     "the rate limit holds 100000 waiting back: its 2 attempts in flight fill 1 replica, plus one"),
    ("from zero the first pod comes as usual", Observation(100_000, 0, 0, rate_limited=True), 1, "scale up to 1"),
    ("slow tasks under a limit: the pods their attempts fill, plus one",
     Observation(100_000, 95, 10, rate_limited=True),
     11, "fill 10 replicas, plus one"),
    ("the limit above what the backlog needs changes nothing", Observation(50, 0, 1, rate_limited=True), 1,
     "50 tasks (50 waiting + 0 active)"),
    ("without the limit the backlog decides (step limited from 1)", Observation(100_000, 2, 1), 5,
     "step limited, target 20"),
])
def test_a_rate_limited_backlog_scales_only_to_what_the_limit_can_use(name, seen, expected, says):
    decision = decide(SPEC, seen, ScalingState(), now=1000.0)
    assert decision.replicas == expected, (name, decision.reason)
    assert says in decision.reason, (name, decision.reason)


def test_a_queue_with_a_rate_limit_starts_with_one_replica_and_grows_while_the_limit_is_not_reached():
    limited = dataclasses.replace(SPEC, has_rate_limit=True)
    d = decide(limited, Observation(100_000, 0, 0), ScalingState(), now=0)
    assert d.replicas == 1 and "one replica until attempts show what it allows" in d.reason
    d = decide(limited, Observation(100_000, 0, 1), d.state, now=2)  # the pod not started yet
    assert d.replicas == 1
    # A pod that just started has started few tasks in the window: that is no sign the
    # limit leaves room for more, so up one replica a decision, not the usual doubling.
    d = decide(limited, Observation(100_000, 1, 1), d.state, now=4)
    assert d.replicas == 2 and "step limited" in d.reason
    d = decide(limited, Observation(100_000, 20, 2), d.state, now=6)  # slow tasks, the limit not reached
    assert d.replicas == 3
    d = decide(limited, Observation(100_000, 48, 5, rate_limited=True), d.state, now=8)
    assert d.replicas == 6 and "fill 5 replicas, plus one" in d.reason


def test_a_rate_limited_queue_scales_down_to_what_the_limit_uses():
    d = decide(SPEC, Observation(100_000, 40, 10), ScalingState(), now=0)
    assert d.replicas == 20  # the limit not reached yet
    d = decide(SPEC, Observation(99_000, 40, 20, rate_limited=True), d.state, now=30)
    assert d.replicas == 20 and "stabilization window" in d.reason
    d = decide(SPEC, Observation(98_000, 40, 20, rate_limited=True), d.state, now=100)
    assert d.replicas == 5 and "rate limit" in d.reason  # 40 in flight fill 4 pods, plus one
