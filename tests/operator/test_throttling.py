"""The RateLimited condition: why a backlog waits, beside Ready (pure)."""

from datetime import datetime, timezone

from effectmq_operator import queue_plan, throttling
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


def test_the_plan_shows_the_condition_beside_a_ready_queue():
    plan = queue_plan.plan(queue_plan.QueueFacts(stats=Stats(), has_worker=False), generation=1, previous={},
                           decision=None, replicas_before=None, now=NOW)
    by_type = {c["type"]: c for c in plan.status["conditions"]}
    assert by_type["Ready"]["status"] == "True"  # a queue held back by its own limit works as asked
    assert (by_type["RateLimited"]["status"], by_type["RateLimited"]["reason"]) == ("True", "LimitReached")
