"""Issue 16, must show 3: a password planted in the Redis URL and a queue marked
sensitive; neither the password nor the sensitive values appear in any answer of any
route the dashboard serves (every GET route is crawled, each action answered once,
and the pages while Redis is unreachable)."""

from __future__ import annotations

import re
from urllib.parse import quote

import aiohttp
import pytest

from effectmq import TaskError, TaskQueue
from effectmq.keys import INDEXES
from effectmq.scheduler import Scheduler, ScheduleSpec

from .seed import fail_one

pytestmark = pytest.mark.timeout(120)

PASSWORD = "pl4nted-Pa55/word"  # a "/" too: it must be percent-encoded in the URL
SECRETS = ["PAYLOAD-SECRET-81f2", "RESULT-SECRET-3c9a", "PROGRESS-SECRET-77d0", "ERRDATA-SECRET-a41e"]
TOKEN_SHOWN = re.compile(r"test-token")


def leaks(text: str) -> list[str]:
    found = [s for s in SECRETS if s in text]
    for form in (PASSWORD, quote(PASSWORD, safe=""), quote(PASSWORD)):
        if form in text:
            found.append(f"password as {form!r}")
    if TOKEN_SHOWN.search(text):
        found.append("the action token")
    return found


class ErrorWithData(TaskError):
    """A typed error whose data (hidden on a sensitive queue) holds a secret."""


async def seed_sensitive(url: str) -> dict:
    async with TaskQueue("vault", url=url) as q:
        await q.configure(sensitive=True)
        await q.want_events()  # so the lifecycle events (progress values too) are written
        await q.offer("open", {"code": SECRETS[0]}, task_id="done")
        lease = await q.acquire()
        await lease.progress({"note": SECRETS[2]})
        await lease.complete({"value": SECRETS[1]})
        await q.offer("open", {"code": SECRETS[0]}, task_id="broken")
        await fail_one(q, ErrorWithData("could not open", data={"secret": SECRETS[3]}))
        await q.offer("open", {"code": SECRETS[0]}, task_id="running/1")
        running = await q.acquire(lock_timeout=600)
        await running.progress(SECRETS[2])
        await q.offer("open", {"code": SECRETS[0]}, task_id="later", delay=3600)
        await q.offer("open", {"code": SECRETS[0]}, task_id="waiting?&<x>")
        await q.offer("open", {"code": SECRETS[0]}, task_id="cancel-me")
        await q.cancel("cancel-me")
    async with Scheduler(url, namespace="default") as scheduler:
        await scheduler.put(ScheduleSpec(id="vault/nightly", queue="vault", cron="0 2 * * *", task="open",
                                         payload={"code": SECRETS[0]}))
    return {"tasks": ["done", "broken", "running/1", "later", "waiting?&<x>", "cancel-me"]}


def routes_of(app) -> set[str]:
    return {r.canonical for r in app.router.resources() if any(route.method == "GET" for route in r)}


async def test_no_password_and_no_sensitive_value_in_any_answer(make_redis, start_dashboard):
    server = make_redis(password=PASSWORD)
    assert quote(PASSWORD, safe="") in server.url
    seeded = await seed_sensitive(server.url)
    dash = await start_dashboard(server.url, actions=True)
    q = quote("vault", safe="")
    gets = ["/", "/queues", "/api/queues", "/schedules", "/api/schedules", "/login", "/login?next=/queues/vault",
            "/healthz", "/readyz", "/static/app.js", "/static/style.css",
            "/queues/nope", "/api/queues/nope", "/queues/vault?state=bogus", "/no/such/route"]
    for state in INDEXES:
        gets += [f"/queues/{q}?state={state}", f"/api/queues/{q}?state={state}",
                 f"/api/queues/{q}/tasks?state={state}", f"/queues/{q}?state={state}&offset=1&limit=1"]
    for task_id in seeded["tasks"] + ["missing"]:
        t = quote(task_id, safe="")
        gets += [f"/queues/{q}/tasks/{t}", f"/api/queues/{q}/tasks/{t}", f"/queues/{q}?search={t}",
                 f"/api/queues/{q}/tasks?search={t}"]
    covered = {re.sub(r"\?.*", "", path) for path in gets}
    templates = {re.sub(r"\{[^}]+\}", "X", route) for route in routes_of(dash.app)}
    crawled = {re.sub(r"/queues/[^/]+", "/queues/X", re.sub(r"/tasks/[^/]+$", "/tasks/X", p)) for p in covered}
    assert templates - {"/static"} <= crawled | {"/static"}, f"routes not crawled: {templates - crawled}"

    answers: dict[str, str] = {}
    async with aiohttp.ClientSession() as http:
        for path in gets:
            async with http.get(dash.url(path)) as r:
                answers[f"GET {path} {r.status}"] = await r.text() + str(r.headers)
        # signed in (the pages then show the buttons), and every action answered once
        async with http.post(dash.url("/login"), data={"token": dash.token, "next": "/"}) as r:
            assert r.status == 200 and r.url.path == "/"
        for path in (f"/queues/{q}?state=failed", f"/queues/{q}/tasks/broken", "/schedules"):
            async with http.get(dash.url(path)) as r:
                text = await r.text()
                assert "data-action" in text
                answers[f"GET {path} signed in"] = text
        auth = {"Authorization": f"Bearer {dash.token}"}
        for action in ("tasks/running%2F1/retry", "tasks/broken/retry", "tasks/later/cancel", "tasks/missing/cancel",
                       "retry-all", "pause", "resume"):
            async with http.post(dash.url(f"/api/queues/{q}/{action}"), headers=auth) as r:
                answers[f"POST {action} {r.status}"] = await r.text()
        for action in ("suspend", "resume"):
            async with http.post(dash.url(f"/api/schedules/vault%2Fnightly/{action}"), headers=auth) as r:
                assert r.status == 200
                answers[f"POST schedule {action}"] = await r.text()
        async with http.post(dash.url("/login"), data={"token": "wrong", "next": "/"}) as r:
            answers["POST /login wrong"] = await r.text()

        # Redis gone: the pages say so, without its password
        server.stop()
        for path in ("/", "/api/queues", f"/queues/{q}", f"/api/queues/{q}/tasks/done", "/readyz", "/schedules"):
            async with http.get(dash.url(path)) as r:
                text = await r.text()
                assert r.status == 503, path
                assert "Redis unreachable" in text
                answers[f"GET {path} redis down"] = text

    assert "redis://:***@127.0.0.1" in answers["GET / 200"]  # the URL is shown, masked
    assert "hidden: the queue is marked sensitive" in answers[f"GET /api/queues/{q}/tasks/done 200"]
    assert "could not open" in answers[f"GET /queues/{q}/tasks/broken 200"]  # the error itself is shown
    leaked = {where: leaks(text) for where, text in answers.items() if leaks(text)}
    assert leaked == {}
    assert len(answers) > 80
