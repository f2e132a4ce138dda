"""The dashboard's pure decisions: what is shown, who may act, how outcomes read."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest

from effectmq.dashboard import auth, views
from effectmq.client.discovery import queue_name_of
from effectmq.errors import STALLED, ErrorInfo
from effectmq.client.models import AttemptRecord, GroupStats, QueueStats, TaskInfo, ThroughputPoint, parse_task
from effectmq.protocol.protocol import RawFields

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


def test_sensitive_task_shows_no_values_and_no_messages_but_its_error_tags():
    shown = views.task_detail(task(attempts=[AttemptRecord(1, "failed", ErrorInfo("Boom", "first", {"d": 2}), T0),
                                             AttemptRecord(2, "stalled", ErrorInfo(STALLED, "lease expired"), T0)]),
                              sensitive=True)
    for name in ("payload", "result", "progress"):
        assert shown[name] == views.HIDDEN
    assert shown["error"] == {"tag": "Boom", "message": views.HIDDEN_MESSAGE, "kind": "handler", "data": views.HIDDEN}
    assert shown["attempts"][0]["error"]["data"] == views.HIDDEN
    assert shown["attempts"][0]["error"]["message"] == views.HIDDEN_MESSAGE
    assert shown["attempts"][1]["error"]["message"] == "lease expired"  # the engine's own words quote nothing
    assert "{'d'" not in repr(shown) and "'p': 1" not in repr(shown) and "it broke" not in repr(shown)
    assert views.task_row(task(), sensitive=True)["error"] == {"tag": "Boom", "message": views.HIDDEN_MESSAGE}
    assert views.task_row(task())["error"] == {"tag": "Boom", "message": "it broke"}
    assert (views.task_row(task())["group"], views.task_row(task(group="acme"))["group"]) == (None, "acme")
    plain = views.task_detail(task(), sensitive=False)
    assert plain["payload"] == {"p": 1} and plain["error"]["data"] == {"d": 1}
    assert plain["error"]["message"] == "it broke"


def test_a_record_nested_too_deeply_is_reported_not_raised():
    deep = "[" * 100_000 + "]" * 100_000
    fields = RawFields({"name": "job", "state": "waiting", "payload": deep, "result": "[1]", "attempt": "0",
                        "error": '{"tag": "X", "message": "m", "data": ' + deep + "}", "progress": deep,
                        "options": deep, "attempts": deep})
    info = parse_task("t1", fields)
    assert info.result == [1] and info.error is None and info.attempts == []  # the rest kept as text
    for name in ("payload", "error", "progress", "options", "attempts"):
        assert f"stored {name} is nested too deep to decode" in info.corrupt
    nested: list = []
    for _ in range(150):
        nested = [nested]
    assert views.depth_exceeds(nested, 100) and not views.depth_exceeds(nested, 151)
    assert views.depth_exceeds({"a": [{"b": 1}]}, 2) and not views.depth_exceeds({"a": [{"b": 1}]}, 3)
    shown = views.task_detail(task(payload=nested, state="waiting", error=None), sensitive=False)
    assert shown["payload"] == "not shown: nested deeper than 100 levels"


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


def test_a_stalls_cause_is_shown_on_sensitive_queues_too_and_poison_is_named():
    oom = {"kind": "oom_killed", "pod": "emails-worker-7d9f-x2", "node": "n1", "exit_code": 137}
    stalled = task(state="waiting", attempt=2, error=None, pod_kills=2, attempts=[
        AttemptRecord(1, "stalled", ErrorInfo(STALLED, "lease expired"), T0, oom),
        AttemptRecord(2, "stalled", ErrorInfo(STALLED, "lease expired"), T0, {"kind": "unknown",
                                                                              "heartbeat_age_ms": 41_200})])
    for sensitive in (False, True):
        shown = views.task_detail(stalled, sensitive=sensitive)
        assert [r["cause_text"] for r in shown["attempt_rows"]] == [
            "pod emails-worker-7d9f-x2 OOMKilled (exit 137) on node n1", "cause unknown (last heartbeat 41 s before)"]
        assert shown["poison"] is True and shown["pod_kills"] == 2
    assert views.task_detail(task(pod_kills=1), sensitive=False)["poison"] is False
    failed = task(attempts=[AttemptRecord(1, "failed", ErrorInfo("A"), T0)])
    assert "cause_text" not in views.task_detail(failed, sensitive=False)["attempt_rows"][0]


def test_the_poison_list_is_a_listing_of_its_own():
    assert views.parse_listing({"state": "poison"}) == ("poison", 0, views.DEFAULT_PAGE, "", None)
    with pytest.raises(views.BadRequest, match="known: waiting, .*, canceled, poison, parked"):
        views.parse_listing({"state": "poisoned"})


def test_the_parked_list_is_a_listing_of_its_own_narrowed_by_a_group():
    assert views.parse_listing({"state": "parked", "group": "<b>acme</b>", "limit": "7"}) == (
        "parked", 0, 7, "", "<b>acme</b>")
    assert views.parse_listing({"state": "parked", "group": ""})[4] is None
    for bad, says in (("a\tb", "control characters"), ("x" * 129, "at most MAX_GROUP_BYTES"),
                      ("\udcff", "UTF-8")):
        with pytest.raises(views.BadRequest, match=says):
            views.parse_listing({"state": "parked", "group": bad})


def test_the_groups_section_pages_and_shows_every_groupstats_field():
    assert views.parse_groups_page({}) == (0, views.DEFAULT_GROUPS_PAGE)
    assert views.parse_groups_page({"groups_offset": "40", "groups_limit": "20", "offset": "x"}) == (40, 20)
    for bad in ({"groups_offset": "-1"}, {"groups_offset": "x"}, {"groups_limit": "0"}, {"groups_offset": "1e3"},
                {"groups_limit": str(views.MAX_GROUPS_PAGE + 1)}, {"groups_offset": str(2**63)}):
        with pytest.raises(views.BadRequest, match="groups_offset must be|groups_offset and groups_limit"):
            views.parse_groups_page(bad)
    capped = GroupStats("<script>x</script>", 3, 1, 4, 1, True, (5, 2.5))
    free = GroupStats("b", 9)
    section = views.groups_section([free, capped], views.Page(0, 2, 5), GroupStats("idle", 0, 0, 2, 0, True))
    assert section["columns"] == ["waiting", "active", "parked", "max_active", "paused", "rate_limit"]
    assert section["columns"] == [f.name for f in dataclasses.fields(GroupStats)][1:]  # a new field: a new column
    assert [r["group"] for r in section["rows"]] == ["b", "<script>x</script>"]
    assert section["rows"][1]["shown"] == {"waiting": "3", "active": "1", "parked": "4", "max_active": "1",
                                           "paused": "yes", "rate_limit": "5 per 2.5s"}
    assert section["rows"][0]["shown"] == {"waiting": "9", "active": "0", "parked": "0", "max_active": "none",
                                           "paused": "", "rate_limit": "none"}
    assert section["rows"][1]["max_active"] == 1 and section["rows"][1]["paused"] is True  # JSON keeps the values
    assert section["group"]["group"] == "idle" and section["group"]["shown"]["parked"] == "2"
    assert section["page"] == {"offset": 0, "limit": 2, "total": 5, "previous": None, "next": 2}
    assert views.groups_section([], views.Page(0, 20, 0), None)["group"] is None


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
    assert nothing_waits["rate_limit"] == "none"
    limited = QueueStats("q", 0, 0, 0, 0, 0, 0, 0.0, False, 0, rate_limit=(100, 1.0), rate_window_starts=37)
    assert views.queue_summary(limited, {}, {}, [])["rate_limit"] == "100 per 1 s · 37 in the window"
    held = QueueStats("q", 0, 0, 0, 0, 0, 0, 0.0, False, 0, rate_limit=(5, 60.0), starts_held_for=11.2)
    assert views.queue_summary(held, {}, {}, [])["rate_limit"] == "5 per 60 s · 0 in the window · held 12s"
    capped = QueueStats("q", 0, 0, 0, 0, 0, 0, 0.0, False, 0, parked=7, group_caps=True)
    grouped = views.queue_summary(capped, {}, {}, [])
    assert (grouped["parked"], grouped["group_caps"], nothing_waits["parked"], nothing_waits["group_caps"]) == (
        7, True, 0, False)


@pytest.mark.parametrize("seconds, shown", [(0, "0s"), (59.9, "59s"), (61, "1m 1s"), (7260, "2h 1m"),
                                            (90000, "1d 1h")])
def test_human_age(seconds, shown):
    assert views.human_age(seconds) == shown


def test_paging():
    page = views.Page(50, 50, 120)
    assert (page.previous, page.next, page.first_shown, page.last_shown) == (0, 100, 51, 100)
    assert (views.Page(100, 50, 120).next, views.Page(0, 50, 0).first_shown) == (None, 0)
    assert views.parse_listing({}) == ("waiting", 0, views.DEFAULT_PAGE, "", None)
    assert views.parse_listing({"state": "failed", "offset": "10", "limit": "5", "search": " x "}) == (
        "failed", 10, 5, "x", None)
    assert views.parse_listing({"offset": str(views.MAX_OFFSET)})[1] == views.MAX_OFFSET
    for bad in ({"state": "nope"}, {"offset": "-1"}, {"limit": "0"}, {"limit": "100000"}, {"offset": "x"},
                {"offset": str(views.MAX_OFFSET + 1)}, {"offset": str(2**63)}, {"offset": "9" * 5000}):
        with pytest.raises(views.BadRequest):
            views.parse_listing(bad)


TOKEN = "s3cret-token-0123456"
READ_TOKEN = "read-token-6543210"
TOKENS = {auth.ACT: TOKEN, auth.READ: READ_TOKEN}
PAGE = {auth.ACTION_HEADER: "1", "Origin": "http://dash:8080"}
ACT, READ = auth.ACT, auth.READ


@pytest.mark.parametrize("actions, role, by_bearer, headers, status", [
    (False, ACT, False, PAGE, 403),  # read-only, whatever is sent
    (False, ACT, True, {}, 403),
    (True, ACT, False, PAGE, 200),  # the page: an action session + header, same origin
    (True, ACT, False, {auth.ACTION_HEADER: "1"}, 200),  # no Origin sent
    (True, ACT, False, {"Origin": "http://dash:8080"}, 403),  # a cookie alone (a cross-site form) does not act
    (True, ACT, False, {**PAGE, "Origin": "http://evil.example"}, 403),
    (True, ACT, False, {**PAGE, "Origin": "null"}, 403),
    (True, ACT, False, {auth.ACTION_HEADER: "1", "Sec-Fetch-Site": "cross-site"}, 403),
    (True, None, False, PAGE, 401),  # not signed in
    (True, READ, False, PAGE, 403),  # signed in to read only
    (True, ACT, True, {}, 200),  # scripts and curl with the action token
    (True, READ, True, {}, 403),  # ... with the read token
])
def test_who_may_act(actions, role, by_bearer, headers, status):
    decision = auth.may_act(actions=actions, role=role, by_bearer=by_bearer, headers=headers, host="dash:8080")
    assert (200 if decision.allowed else decision.status) == status


def test_who_may_read():
    assert auth.may_read(read_token=None, role=None).allowed
    assert not auth.may_read(read_token=READ_TOKEN, role=None).allowed
    assert auth.may_read(read_token=READ_TOKEN, role=READ).allowed
    assert auth.may_read(read_token=READ_TOKEN, role=ACT).allowed


def test_bearer_tokens_and_their_roles():
    assert auth.bearer({}) is None and auth.bearer({"Authorization": "Basic x"}) == ""
    assert auth.bearer({"Authorization": f"Bearer {TOKEN} "}) == TOKEN
    assert auth.role_of_token(TOKEN, TOKENS) == ACT and auth.role_of_token(READ_TOKEN, TOKENS) == READ
    assert auth.role_of_token("wrong", TOKENS) is None and auth.role_of_token("", TOKENS) is None
    assert auth.role_of_token(TOKEN, {ACT: None, READ: READ_TOKEN}) is None


def test_sessions_are_signed_expire_and_reveal_no_token():
    value = auth.new_session(TOKEN, ACT, now=1000.0, max_age=60, session_id="abc")
    assert TOKEN not in value
    assert auth.read_session(value, TOKENS, now=1000.0, max_age=60) == auth.Session(ACT, 1060.0, "abc")
    assert auth.read_session(value, TOKENS, now=1059.9, max_age=60) is not None
    assert auth.read_session(value, TOKENS, now=1060.0, max_age=60) is None  # expired on the server
    assert auth.read_session(value, TOKENS, now=900.0, max_age=60) is None  # lasts longer than granted
    assert auth.read_session(value, {ACT: TOKEN + "x"}, now=1000.0, max_age=60) is None  # another token
    assert auth.read_session(value.replace("act.", "read.", 1), TOKENS, now=1000.0, max_age=60) is None
    forged = value.replace(".abc.", ".abd.")
    assert auth.read_session(forged, TOKENS, now=1000.0, max_age=60) is None
    for junk in ("", "forged", TOKEN, "act.x.y.z", "act.99999999999999999999.a.b"):
        assert auth.read_session(junk, TOKENS, now=1000.0, max_age=60) is None
    revoked = auth.Revoked()
    session = auth.read_session(value, TOKENS, now=1000.0, max_age=60)
    revoked.add(session, 1000.0)
    assert session in revoked and auth.Session(ACT, 1060.0, "other") not in revoked


def test_short_tokens_are_refused():
    from effectmq.errors import InvalidOption

    auth.check_token(None, "token")
    auth.check_token("x" * auth.MIN_TOKEN_LENGTH, "token")
    with pytest.raises(InvalidOption, match="at least 16 characters"):
        auth.check_token("x" * (auth.MIN_TOKEN_LENGTH - 1), "token")


@pytest.mark.parametrize("host, allowed, answered", [
    ("127.0.0.1:8080", [], True), ("localhost", [], True), ("LOCALHOST.:80", [], True), ("[::1]:8080", [], True),
    ("127.3.4.5", [], True), ("::1", [], True),
    ("evil.example", [], False), ("10.0.0.7:8080", [], False), ("", [], False), (None, [], False),
    ("localhost.evil.example", [], False), ("127.0.0.1.nip.io", [], False), ("[::1", [], False),
    ("localhost:http", [], False),
    ("dash.example.com:443", ["dash.example.com"], True), ("Dash.Example.com", ["dash.example.com."], True),
    ("x.dash.example.com", ["dash.example.com"], False), ("anything", ["*"], True),
])
def test_which_hosts_are_answered(host, allowed, answered):
    assert auth.host_allowed(host, allowed) is answered


@pytest.mark.parametrize("bind, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.1", False),
                                            ("dash.internal", False)])
def test_loopback_binds(bind, loopback):
    assert auth.is_loopback(bind) is loopback


def test_wrong_tokens_are_limited_per_client():
    limit = auth.FailureLimit(max_failures=3, window=60)
    for t in range(3):
        assert limit.retry_after("a", now=100.0 + t) == 0
        limit.failed("a", now=100.0 + t)
    assert limit.retry_after("a", now=103.0) == pytest.approx(57.0)
    assert limit.retry_after("b", now=103.0) == 0  # another client
    assert limit.retry_after("a", now=160.5) == 0  # the oldest left the window
    small = auth.FailureLimit(max_failures=1, window=60, clients=2)
    for client in ("a", "b", "c"):
        small.failed(client, now=0)
    assert small.retry_after("a", now=1) == 0 and small.retry_after("c", now=1) > 0  # the oldest forgotten


@pytest.mark.parametrize("key, name", [
    ("{emq:emails}:seq", "emails"), ("{emq:reports/daily}:meta", "reports/daily"),
    ("{emq:q}:t:odd}:seq", "q"),  # a task id may hold anything after the tag
    ("{emq-sched:default}:meta", None), ("{other:q}:seq", None), ("{emq:bad name}:seq", None), ("plain", None),
])
def test_queue_name_of(key, name):
    assert queue_name_of(key, "emq") == name


@pytest.mark.parametrize("target, safe", [
    ("/queues/x", "/queues/x"), (None, "/"), ("https://evil.example/", "/"), ("//evil.example", "/"),
    ("/\\evil.example", "/"), ("queues", "/"), ("/queues/x?state=failed&q=a b", "/queues/x?state=failed&q=a b"),
    ("/\t/evil.example", "/"), ("/\r\n/evil.example", "/"), ("/\x00/x", "/"), ("/\x7f/x", "/"), ("/\x85/x", "/"),
    ("/\u2028/evil.example", "/"), ("/%09/x", "/%09/x"),
])
def test_sign_in_returns_only_to_local_paths(target, safe):
    assert auth.local_path(target) == safe


def test_what_redis_info_says_about_taking_new_tasks():
    from effectmq.client.checks import redis_write_notes
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
