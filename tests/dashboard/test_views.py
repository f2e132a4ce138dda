"""The dashboard's pure decisions: what is shown, who may act, how outcomes read."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from effectmq.dashboard import auth, views
from effectmq.dashboard.discovery import queue_name_of
from effectmq.errors import ErrorInfo
from effectmq.models import AttemptRecord, QueueStats, TaskInfo, ThroughputPoint

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def task(**fields) -> TaskInfo:
    base = dict(task_id="t1", name="job", state="failed", payload={"p": 1}, attempt=2, handler_failure_count=2,
                stalled_attempt_count=0, priority=0, result={"r": 1}, progress={"g": 1},
                error=ErrorInfo("Boom", "it broke", data={"d": 1}))
    return TaskInfo(**{**base, **fields})


@pytest.mark.parametrize("previous, status, words", [
    (None, 404, "no task"), ("failed", 200, "now waiting"), ("canceled", 200, "now waiting"),
    ("active", 409, "is running"), ("waiting", 409, "is waiting"), ("completed", 409, "is completed"),
    ("delayed", 409, "is delayed"),
])
def test_retry_result(previous, status, words):
    result = views.retry_result("t1", previous)
    assert (result.status, words in result.message) == (status, True)


@pytest.mark.parametrize("previous, status", [
    (None, 404), ("waiting", 200), ("delayed", 200), ("active", 200), ("completed", 409), ("failed", 409),
    ("canceled", 409),
])
def test_cancel_result(previous, status):
    assert views.cancel_result("t1", previous).status == status


def test_sensitive_task_shows_no_values_but_its_error():
    shown = views.task_detail(task(attempts=[AttemptRecord(1, "failed", ErrorInfo("Boom", "first", {"d": 2}), T0)]),
                              sensitive=True)
    for name in ("payload", "result", "progress"):
        assert shown[name] == views.HIDDEN
    assert shown["error"] == {"tag": "Boom", "message": "it broke", "kind": "handler", "data": views.HIDDEN}
    assert shown["attempts"][0]["error"]["data"] == views.HIDDEN
    assert "{'d'" not in repr(shown) and "'p': 1" not in repr(shown)
    plain = views.task_detail(task(), sensitive=False)
    assert plain["payload"] == {"p": 1} and plain["error"]["data"] == {"d": 1}


def test_attempt_rows_add_the_current_attempt_once():
    failed_twice = task(attempts=[AttemptRecord(1, "failed", ErrorInfo("A"), T0),
                                  AttemptRecord(2, "failed", ErrorInfo("B"), T0)])
    rows = views.task_detail(failed_twice, sensitive=False)["attempt_rows"]
    assert [(r["attempt"], r["current"]) for r in rows] == [(1, False), (2, True)]
    running = task(state="active", attempt=3, error=None, attempts=failed_twice.attempts)
    rows = views.task_detail(running, sensitive=False)["attempt_rows"]
    assert [(r["attempt"], r["outcome"], r["current"]) for r in rows] == [
        (1, "failed", False), (2, "failed", False), (3, "active", True)]
    assert views.task_detail(task(state="waiting", attempt=0, error=None), sensitive=False)["attempt_rows"] == []


def test_events_keep_known_fields_only():
    shown = views.task_events([{"event": "progress", "id": "t1", "at": "1796140800000", "progress": "{\"x\": 1}",
                                "event_id": "1-0"}])
    assert shown == [{"event": "progress", "id": "t1", "at": "2026-12-01T16:00:00+00:00"}]
    failed = views.task_events([{"event": "failed", "id": "t1", "at": "0", "kind": "handler", "retry_at": "-1"},
                                {"event": "failed", "id": "t1", "at": "0", "kind": "handler", "retry_at": "60000"}])
    assert [e.get("retry_at") for e in failed] == [None, "1970-01-01T00:01:00+00:00"]


def test_queue_summary_and_failure_rate():
    stats = QueueStats("q", 3, 1, 2, 10, 5, 0, 75.0, True, 4)
    points = [ThroughputPoint(T0, 6, 2), ThroughputPoint(T0, 2, 0)]
    s = views.queue_summary(stats, {"sensitive": True}, {"w1": (2, 10), "w2": (0, 5)}, points)
    assert s["counts"] == {"waiting": 3, "delayed": 1, "active": 2, "completed": 10, "failed": 5, "canceled": 0}
    assert (s["failure_rate"], s["worker_count"], s["in_flight"], s["concurrency"]) == (0.2, 2, 2, 15)
    assert (s["oldest_waiting"], s["paused"], s["max_active"], s["sensitive"]) == ("1m 15s", True, 4, True)
    assert views.failure_rate([ThroughputPoint(T0, 0, 0)]) is None
    nothing_waits = views.queue_summary(QueueStats("q", 0, 0, 0, 0, 0, 0, 0.0, False, 0), {}, {}, [])
    assert (nothing_waits["oldest_waiting"], nothing_waits["max_active"]) == ("-", None)


@pytest.mark.parametrize("seconds, shown", [(0, "0s"), (59.9, "59s"), (61, "1m 1s"), (7260, "2h 1m"),
                                            (90000, "1d 1h")])
def test_human_age(seconds, shown):
    assert views.human_age(seconds) == shown


def test_paging():
    page = views.Page(50, 50, 120)
    assert (page.previous, page.next, page.first_shown, page.last_shown) == (0, 100, 51, 100)
    assert (views.Page(100, 50, 120).next, views.Page(0, 50, 0).first_shown) == (None, 0)
    assert views.parse_listing({}) == ("waiting", 0, views.DEFAULT_PAGE, "")
    assert views.parse_listing({"state": "failed", "offset": "10", "limit": "5", "search": " x "}) == (
        "failed", 10, 5, "x")
    for bad in ({"state": "nope"}, {"offset": "-1"}, {"limit": "0"}, {"limit": "100000"}, {"offset": "x"}):
        with pytest.raises(views.BadRequest):
            views.parse_listing(bad)


TOKEN = "s3cret-token"
SESSION = {auth.SESSION_COOKIE: auth.session_value(TOKEN)}
PAGE = {auth.ACTION_HEADER: "1", "Origin": "http://dash:8080"}


@pytest.mark.parametrize("actions, token, headers, cookies, status", [
    (False, TOKEN, PAGE, SESSION, 403),  # read-only, whatever is sent
    (False, None, {"Authorization": f"Bearer {TOKEN}"}, {}, 403),
    (True, None, PAGE, SESSION, 403),  # actions without a token never act
    (True, TOKEN, PAGE, SESSION, 200),  # the page: cookie + header, same origin
    (True, TOKEN, {auth.ACTION_HEADER: "1"}, SESSION, 200),  # no Origin sent
    (True, TOKEN, {"Origin": "http://dash:8080"}, SESSION, 403),  # a cookie alone (a cross-site form) does not act
    (True, TOKEN, {**PAGE, "Origin": "http://evil.example"}, SESSION, 403),
    (True, TOKEN, {**PAGE, "Origin": "null"}, SESSION, 403),
    (True, TOKEN, PAGE, {}, 401),  # not signed in
    (True, TOKEN, PAGE, {auth.SESSION_COOKIE: "forged"}, 401),
    (True, TOKEN, PAGE, {auth.SESSION_COOKIE: TOKEN}, 401),  # the cookie is an HMAC, not the token
    (True, TOKEN, {"Authorization": f"Bearer {TOKEN}"}, {}, 200),  # scripts and curl
    (True, TOKEN, {"Authorization": "Bearer wrong"}, SESSION, 401),
])
def test_who_may_act(actions, token, headers, cookies, status):
    decision = auth.may_act(actions=actions, token=token, headers=headers, cookies=cookies, host="dash:8080")
    assert (200 if decision.allowed else decision.status) == status


def test_session_value_reveals_nothing_of_the_token():
    assert TOKEN not in auth.session_value(TOKEN)
    assert auth.session_value(TOKEN) != auth.session_value(TOKEN + "x")


@pytest.mark.parametrize("key, name", [
    ("{emq:emails}:seq", "emails"), ("{emq:reports/daily}:meta", "reports/daily"),
    ("{emq:q}:t:odd}:seq", "q"),  # a task id may hold anything after the tag
    ("{emq-sched:default}:meta", None), ("{other:q}:seq", None), ("{emq:bad name}:seq", None), ("plain", None),
])
def test_queue_name_of(key, name):
    assert queue_name_of(key, "emq") == name


@pytest.mark.parametrize("target, safe", [
    ("/queues/x", "/queues/x"), (None, "/"), ("https://evil.example/", "/"), ("//evil.example", "/"),
    ("/\\evil.example", "/"), ("queues", "/"),
])
def test_sign_in_returns_only_to_local_paths(target, safe):
    from effectmq.dashboard.web import _local_path

    assert _local_path(target) == safe


def test_what_redis_info_says_about_taking_new_tasks():
    from effectmq.checks import redis_write_notes
    mib = 2**20
    healthy = {"role": "master", "maxmemory": 100 * mib, "used_memory": 50 * mib, "maxmemory_policy": "noeviction",
               "rdb_last_bgsave_status": "ok", "aof_enabled": 1, "aof_last_write_status": "ok"}
    assert redis_write_notes(healthy) == []
    assert redis_write_notes({**healthy, "maxmemory": 0, "used_memory": 10**12}) == []  # no limit
    (nearly,) = redis_write_notes({**healthy, "used_memory": 95 * mib})
    assert nearly.startswith("Redis is nearly full (95.0 MiB used of maxmemory 100.0 MiB)")
    # Memory Redis does not count for eviction (replication buffers) does not make it full.
    assert redis_write_notes({**healthy, "used_memory": 120 * mib, "mem_not_counted_for_evict": 40 * mib}) == []
    (aof,) = redis_write_notes({**healthy, "aof_last_write_status": "err"})
    assert "could not write its AOF" in aof and "MISCONF" in aof
    (unknown,) = redis_write_notes({**healthy, "rdb_last_bgsave_status": "err"})  # CONFIG not answered
    assert unknown.startswith("Redis's last RDB save failed: unless stop-writes-on-bgsave-error is off")
