"""A Queue's Stalling condition and Warning when stalls cluster, beside a Ready that stays True."""

from __future__ import annotations

from datetime import datetime, timezone

from effectmq.client.models import STALL_CAUSES

from effectmq_operator import queue_plan, stalls
from tests.operator.test_queue_plan import Stats, deployment

NOW = datetime(2026, 12, 5, 21, 0, tzinfo=timezone.utc)


def plan(recent, previous=None, **facts):
    facts = queue_plan.QueueFacts(stats=Stats(), deployment=queue_plan.DeploymentFacts.of(deployment()),
                                  stalls=recent, **facts)
    return queue_plan.plan(facts, generation=3, previous=previous or {}, decision=None, replicas_before=None,
                           now=NOW)


def condition(result, type_):
    return next((c for c in result.status["conditions"] if c["type"] == type_), None)


def test_every_cause_has_a_reason_and_advice():
    assert set(stalls.REASONS) == set(stalls.ADVICE) == set(STALL_CAUSES)
    assert all(reason[0].isupper() and reason.isalnum() for reason in stalls.REASONS.values())  # CamelCase


def test_stalls_cluster_from_the_threshold_on_with_the_dominant_cause_and_its_advice():
    below = stalls.check({"oom_killed": stalls.CLUSTER - 1})
    assert (below.status, below.reason) == ("False", "FewStalls")
    assert below.message == f"{stalls.CLUSTER - 1} stalls in 10 min: OOMKilled (a warning from {stalls.CLUSTER})"
    assert stalls.check({}) == stalls.check({"evicted": 0})
    assert (stalls.check({}).status, stalls.check({}).reason, stalls.check({}).message) == \
        ("False", "NoStalls", "no stalls in 10 min")

    five = stalls.check({"oom_killed": 5})
    assert (five.type, five.status, five.reason) == ("Stalling", "True", "OOMKilled")
    assert five.message == "5 stalls in 10 min: OOMKilled; raise worker.resources.limits.memory " \
                           "(or lower worker.concurrency)"
    mixed = stalls.check({"unknown": 1, "evicted": 3, "oom_killed": 1})
    assert mixed.reason == "Evicted"
    assert mixed.message.startswith("5 stalls in 10 min: Evicted 3, OOMKilled 1, Unknown 1; set worker.resources")


def test_a_tie_goes_to_the_cause_listed_first():
    assert stalls.dominant({"unknown": 2, "deleted": 2}) == "deleted"
    assert stalls.dominant({"unknown": 2, "oom_killed": 2, "evicted": 2}) == "oom_killed"


def test_stalling_is_a_condition_beside_ready_never_a_problem():
    result = plan({"oom_killed": 4})
    assert condition(result, "Ready")["status"] == "True"
    assert condition(result, "Stalled")["status"] == "False" and condition(result, "Reconciling")["status"] == "False"
    stalling = condition(result, "Stalling")
    assert (stalling["status"], stalling["reason"], stalling["observedGeneration"]) == ("True", "OOMKilled", 3)
    assert [(e.type, e.reason, e.message) for e in result.events] == [("Warning", "Stalling", stalling["message"])]


def test_the_warning_is_posted_when_stalls_start_to_cluster_or_their_cause_changes():
    first = plan({"oom_killed": 3})
    assert [e.reason for e in first.events] == ["Stalling"]
    more = plan({"oom_killed": 6}, previous=first.status)
    assert more.events == []  # the condition's message keeps the count
    assert condition(more, "Stalling")["message"].startswith("6 stalls")
    assert condition(more, "Stalling")["lastTransitionTime"] == condition(first, "Stalling")["lastTransitionTime"]
    other = plan({"oom_killed": 2, "node_lost": 5}, previous=more.status)
    assert [(e.type, e.reason) for e in other.events] == [("Warning", "Stalling")]
    assert "NodeLost 5" in other.events[0].message
    calm = plan({"node_lost": 1}, previous=other.status)
    assert calm.events == [] and condition(calm, "Stalling")["status"] == "False"
    again = plan({"node_lost": 3}, previous=calm.status)
    assert [e.reason for e in again.events] == ["Stalling"]


def test_stalls_not_read_are_unknown_once_the_condition_exists_and_absent_before():
    assert condition(plan(None), "Stalling") is None  # a driver that reads none (effectmq local) shows none
    shown = plan({"evicted": 4})
    unread = plan(None, previous=shown.status)
    stalling = condition(unread, "Stalling")
    assert (stalling["status"], stalling["reason"]) == ("Unknown", queue_plan.NOT_CHECKED)
    assert unread.events == []
