"""The Schedule side's pure decisions: a Schedule's status and Events from what one
reconcile observed, garbage collection's verdict, and which changes the mirror writes."""

from __future__ import annotations

import pytest
from effectmq.scheduler.errors import InvalidSchedule

from effectmq_operator.schedule_plan import (
    MIRROR_EVERY, RESTORED, Missing, OtherRedis, ScheduleFacts, Stored, Unreachable, definition, due_mirror, plan,
    progress_differs, queue_ref, schedule_key, unwanted,
)
from effectmq_operator.status import Problem

SPEC = {"queueRef": {"name": "emails"}, "schedule": "0 2 * * *", "timeZone": "Europe/Berlin", "task": {"name": "x"}}
VALID = definition("shop", "nightly", SPEC)
INVALID = definition("shop", "nightly", {**SPEC, "schedule": "61 * * * *"})
PROGRESS = {"lastTickTime": "2026-12-05T02:00:00Z", "lastTaskID": "t-1", "nextTickTime": "2026-12-06T02:00:00Z",
            "missedTicks": {"skipped": 0, "coalesced": 0, "backfilled": 0}, "lastError": None}
DOWN = Problem("RedisUnreachable", "connection refused")
SECRET = Problem("SecretNotFound", "Secret shop/redis not found", permanent=True)
TICKS = Problem("TicksFailing", "ticks are not materialized: took longer than 10 s")


def facts(**changes) -> ScheduleFacts:
    base = dict(definition=VALID, queue="shop/emails", queue_found=True, outcome=Stored(PROGRESS))
    return ScheduleFacts(**{**base, **changes})


def shown(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_the_definition_or_why_there_is_none():
    assert not isinstance(VALID, InvalidSchedule) and VALID.id == "shop/nightly" and VALID.timezone == "Europe/Berlin"
    assert isinstance(INVALID, InvalidSchedule) and "61" in str(INVALID)
    assert schedule_key("shop/nightly") == ("shop", "nightly") and schedule_key("by-hand") == ("by-hand", "")
    assert queue_ref({"spec": SPEC}) == "emails" and queue_ref({}) == ""


@pytest.mark.parametrize("observed, ready, checks, retry", [
    # stored, ticks materialized: Ready
    (facts(), ("True", "Ready"),
     {"ScheduleValid": ("True", "Valid"), "QueueFound": ("True", "Found"), "RedisReachable": ("True", "Connected"),
      "TicksMaterialized": ("True", "Materializing")}, False),
    # an invalid cron: nothing stored (the first problem found is Ready's reason)
    (facts(definition=INVALID, outcome=None), ("False", "InvalidSchedule"),
     {"ScheduleValid": ("False", "InvalidSchedule"), "QueueFound": ("True", "Found")}, False),
    (facts(definition=INVALID, queue_found=False, outcome=None), ("False", "InvalidSchedule"),
     {"ScheduleValid": ("False", "InvalidSchedule"), "QueueFound": ("False", "QueueNotFound")}, False),
    # no Queue
    (facts(queue_found=False, outcome=None), ("False", "QueueNotFound"),
     {"ScheduleValid": ("True", "Valid"), "QueueFound": ("False", "QueueNotFound")}, False),
    # the Queue's Redis cannot be told (a missing Secret)
    (facts(queue_problem=SECRET, outcome=None), ("False", "SecretNotFound"),
     {"QueueFound": ("True", "Found"), "RedisReachable": ("False", "SecretNotFound")}, False),
    # stored, but the tick passes there fail
    (facts(ticks_problem=TICKS), ("False", "TicksFailing"),
     {"RedisReachable": ("True", "Connected"), "TicksMaterialized": ("False", "TicksFailing")}, False),
    # gone from Redis and not stored again: retried
    (facts(outcome=Missing(DOWN)), ("False", "ScheduleMissing"), {"RedisReachable": ("False", "RedisUnreachable")},
     True),
    # the Redis does not answer: retried
    (facts(outcome=Unreachable(DOWN)), ("False", "RedisUnreachable"), {"RedisReachable": ("False", "RedisUnreachable")},
     True),
    # an invalid cron whose old record could not be removed: both said, the cron first
    (facts(definition=INVALID, outcome=Unreachable(DOWN)), ("False", "InvalidSchedule"),
     {"ScheduleValid": ("False", "InvalidSchedule"), "RedisReachable": ("False", "RedisUnreachable")}, True),
])
def test_plan(observed, ready, checks, retry):
    result = plan(observed, generation=3, previous={})
    conditions = shown(result.status)
    assert conditions["Ready"] == ready
    assert {k: conditions.get(k) for k in checks} == checks
    assert result.retry is retry and result.write
    assert result.status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in result.status["conditions"])
    warnings = [e.reason for e in result.events if e.type == "Warning"]
    assert warnings == ([] if ready[0] == "True" else [ready[1]])


@pytest.mark.parametrize("problem, stalled", [
    (Problem("InvalidSchedule", "bad", permanent=True), "True"),  # needs an edit
    (DOWN, "False"),  # retrying by itself
])
def test_a_permanent_problem_stalls_and_a_transient_one_is_reconciling(problem, stalled):
    result = plan(facts(outcome=Unreachable(problem)), generation=1, previous={})
    conditions = shown(result.status)
    assert conditions["Stalled"][0] == stalled
    assert conditions["Reconciling"][0] == ("False" if stalled == "True" else "True")


def test_the_progress_is_shown_once_stored_and_only_then():
    assert {k: plan(facts(), generation=1, previous={}).status[k] for k in PROGRESS} == PROGRESS
    for outcome in (None, Missing(DOWN), Unreachable(DOWN)):
        assert not set(PROGRESS) & set(plan(facts(outcome=outcome), generation=1, previous={}).status)


def test_a_restored_schedule_is_ready_and_says_it_was_stored_again():
    result = plan(facts(outcome=Stored(PROGRESS, restored=True)), generation=1, previous={})
    assert shown(result.status)["Ready"] == ("True", "Ready") and result.events == [RESTORED]


def test_the_status_shown_is_not_written_again_nor_its_problem_posted_again():
    for observed in (facts(), facts(queue_found=False, outcome=None), facts(outcome=Unreachable(DOWN))):
        first = plan(observed, generation=2, previous={})
        again = plan(observed, generation=2, previous=first.status)
        assert again.status == first.status and not again.write and again.events == []


def test_a_new_generation_is_written():
    first = plan(facts(), generation=2, previous={})
    assert plan(facts(), generation=3, previous=first.status).write


A, B = "redis://a:6379/0", "redis://b:6379/0"


@pytest.mark.parametrize("schedule, queue_exists, queue_redis, expected", [
    (None, True, A, "no live Schedule resource"),
    ({"spec": SPEC}, False, None, "its Queue shop/emails does not exist"),
    ({"spec": SPEC}, True, None, None),  # its Queue's Redis not resolved yet: kept, not removed on a guess
    ({"spec": SPEC}, True, A, None),  # stored where its Queue is
    ({"spec": SPEC}, True, B, OtherRedis(B)),  # stored through another URL: kept if it reaches the same store
])
def test_unwanted(schedule, queue_exists, queue_redis, expected):
    assert unwanted(schedule, "shop/emails", queue_exists, queue_redis, A) == expected


NOW = 1000.0


@pytest.mark.parametrize("changed, held, mirrored_at, due, later", [
    (["a", "b"], [], {"a": None, "b": None}, ["a", "b"], set()),  # never mirrored: at once
    (["a"], [], {"a": NOW - 1}, [], {"a"}),  # written a second ago: held back
    (["a"], [], {"a": NOW - MIRROR_EVERY}, ["a"], set()),  # the hold is over
    ([], ["a"], {"a": NOW - MIRROR_EVERY - 1}, ["a"], set()),  # held before, due now
    (["a", "a"], ["a"], {"a": None}, ["a"], set()),  # once each
    (["x", "a"], ["y"], {"a": None}, ["a"], set()),  # not this Redis' schedules (or gone): neither
])
def test_due_mirror(changed, held, mirrored_at, due, later):
    assert due_mirror(changed, held, mirrored_at, NOW) == (due, later)


def test_progress_differs_only_in_what_the_scheduler_shows():
    assert not progress_differs(PROGRESS, {**PROGRESS, "conditions": [], "observedGeneration": 4})
    assert progress_differs(PROGRESS, {**PROGRESS, "lastTaskID": "t-0"})
    assert progress_differs(PROGRESS, {})
