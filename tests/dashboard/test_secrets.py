"""A password planted in the Redis URL and a queue marked
sensitive; neither the password nor the sensitive values appear in any answer of any
route the dashboard serves (every GET route is crawled, each action answered once,
and the pages while Redis is unreachable)."""

from __future__ import annotations

import html
import json
import re
from urllib.parse import quote, quote_plus

import aiohttp
import pytest

from effectmq import App, TaskError, TaskQueue
from effectmq.protocol.keys import INDEXES
from effectmq.scheduler import Scheduler, ScheduleSpec
from tests.support.inprocess import make_worker, running, settled

from .seed import fail_one

pytestmark = pytest.mark.timeout(120)

# A "/" (percent-encoded in the URL) and every character HTML or JSON escapes.
PASSWORD = "pl4nted-Pa55/word&\"<>\\'x"
SECRETS = ["PAYLOAD-SECRET-81f2", "RESULT-SECRET-3c9a", "PROGRESS-SECRET-77d0", "ERRDATA-SECRET-a41e",
           "MESSAGE-SECRET-5be0"]
TOKEN_SHOWN = re.compile(r"test-token")


def encodings(secret: str) -> set[str]:
    """The forms a secret could take in an answer: as is, HTML-, JSON- or URL-encoded, and combinations."""
    forms = {secret, html.escape(secret), html.escape(secret, quote=False), quote_plus(secret),
             json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1], repr(secret)[1:-1]}
    for safe in ("", "/", "'", "/'"):  # a query or path as a client encodes it, inside a link once more
        forms |= {quote(secret, safe=safe), quote(quote(secret, safe=safe), safe="")}
    forms |= {html.escape(f) for f in list(forms)} | {json.dumps(f)[1:-1] for f in list(forms)}
    return forms


def leaks(text: str) -> list[str]:
    found = [s for s in SECRETS if s in text]
    for form in encodings(PASSWORD):
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
        await fail_one(q, ErrorWithData(f"could not open {SECRETS[4]}", data={"secret": SECRETS[3]}))
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
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:  # keeps 127.0.0.1's cookie
        for path in gets:
            async with http.get(dash.url(path)) as r:
                answers[f"GET {path} {r.status}"] = await r.text() + str(r.headers)
        # signed in (the pages then show the buttons), and every action answered once
        async with http.post(dash.url("/login"), data={"token": dash.token, "next": "/"}) as r:
            assert r.status == 200 and r.url.path == "/"
        for path in (f"/queues/{q}?state=failed", f"/queues/{q}/tasks/broken", "/schedules"):
            async with http.get(dash.url(path)) as r:
                text = await r.text()
                assert 'data-action="/api/' in text  # signed in: the buttons are there
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
    assert "ErrorWithData" in answers[f"GET /queues/{q}/tasks/broken 200"]  # its tag is shown, not its message
    leaked = {where: leaks(text) for where, text in answers.items() if leaks(text)}
    assert leaked == {}
    assert len(answers) > 80


async def test_request_input_is_never_scrubbed(make_redis, start_dashboard):
    """Was: the dashboard scrubbed every answer of the Redis password
    and the token, so `?search=aaa+<guess>` came back as "aaa ***" exactly when the
    guess was right: many guesses per request, no rate limit. Text from the request
    is shown as sent: a right guess and a wrong one of the same length answer alike."""
    server = make_redis(password=PASSWORD)
    async with TaskQueue("vault", url=server.url) as q:
        await q.offer("open", {}, task_id="t1")
    dash = await start_dashboard(server.url, actions=True)
    right = {"password": PASSWORD, "token": dash.token}
    async with aiohttp.ClientSession() as http:
        async def answer(path: str, **params: str) -> tuple[int, str]:
            async with http.get(dash.url(path), params=params) as r:
                return r.status, await r.text()

        for what, secret in right.items():
            # A wrong guess that every encoding treats alike: only its letters and digits differ.
            wrong = "".join("7" if c.isdigit() else ("Q" if c.isupper() else "q") if c.isalnum() else c
                            for c in secret)
            for path, params in (("/api/queues/vault/tasks", {"search": "aaa {}"}),
                                 ("/queues/vault", {"search": "aaa {}"}),
                                 ("/api/queues/vault/tasks/{}", {}), ("/queues/vault/tasks/{}", {}),
                                 ("/login", {"next": "/queues/vault?q={}"})):
                def fill(value: str):
                    return (path.format(quote(value, safe="")), {k: v.format(value) for k, v in params.items()})

                status_right, text_right = await answer(fill(secret)[0], **fill(secret)[1])
                status_wrong, text_wrong = await answer(fill(wrong)[0], **fill(wrong)[1])
                assert status_right == status_wrong, (what, path)
                assert "aaa ***" not in text_right, (what, path)
                # The same answer but for the guess itself (and numbers: ages change between two answers).
                numbers = re.compile(r"\d+(\.\d+)?")
                text_right, text_wrong = numbers.sub("0", text_right), numbers.sub("0", text_wrong)
                assert len(text_right) == len(text_wrong), (what, path)
                differ = {(a, b) for a, b in zip(text_right, text_wrong) if a != b}
                assert all(a.isalnum() and b.isalnum() for a, b in differ), (what, path, differ)


CARD = "4111-1111-1111-1111"


class CardDeclined(TaskError):
    """A typed error whose author put the value in its message."""


async def test_a_sensitive_queue_hides_messages_built_from_payload_values(redis_url, start_dashboard):
    """Was: the schema check quoted the value (`'4111-...' is not of type
    'integer'`) and the dashboard showed it on a queue marked sensitive. Run by a real
    worker: a schema violation, a Python exception and a typed error, each quoting the card."""
    app = App("cards", url=redis_url)

    @app.task(schema={"type": "object", "properties": {"card": {"type": "integer"}}})
    def charge(payload):
        raise AssertionError("never runs: the schema refuses the payload")

    @app.task
    def parse(payload):
        return int(payload["card"])  # ValueError: invalid literal for int() with base 10: '4111-...'

    @app.task(errors=[CardDeclined])
    def declined(payload):
        raise CardDeclined(f"card {payload['card']} declined")

    async with TaskQueue("cards", url=redis_url) as q:
        await q.configure(sensitive=True, max_retries=0)
        for name in ("charge", "parse", "declined"):
            await q.offer(name, {"card": CARD}, task_id=name)  # past App.offer's own schema check
        async with running(make_worker(q, app)):
            infos = {name: await settled(q, name) for name in ("charge", "parse", "declined")}
    assert {name: info.state for name, info in infos.items()} == dict.fromkeys(infos, "failed")
    assert all(CARD in info.error.message for info in infos.values())  # stored as the runtime made them

    async with TaskQueue("plain", url=redis_url) as plain:
        await plain.offer("parse", {"card": CARD}, task_id="parse")
        await fail_one(plain, ValueError(f"invalid literal for int() with base 10: {CARD!r}"))

    dash = await start_dashboard(redis_url)
    answers = {}
    async with aiohttp.ClientSession() as http:
        paths = ["/queues/cards?state=failed", "/api/queues/cards?state=failed", "/api/queues/cards/tasks?state=failed"]
        for name in infos:
            paths += [f"/queues/cards/tasks/{name}", f"/api/queues/cards/tasks/{name}", f"/queues/cards?search={name}"]
        for path in paths:
            async with http.get(dash.url(path)) as r:
                assert r.status == 200, path
                answers[path] = await r.text()
        async with http.get(dash.url("/api/queues/plain/tasks/parse")) as r:
            assert CARD in await r.text()  # a queue not marked sensitive shows its messages
    assert {path: CARD in text for path, text in answers.items()} == dict.fromkeys(answers, False)
    assert "CardDeclined" in answers["/queues/cards/tasks/declined"]  # the tag still says what failed
