"""The dashboard's HTTP side: routes, pages (Jinja, autoescaped) and the JSON API.

Every page has a JSON twin under /api with the same path (``/queues/{q}`` and
``/api/queues/{q}``); the page's script polls that twin for live updates and posts
actions to it. Handlers parse the request, call `DashboardService`, and render.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import quote

import jinja2
from aiohttp import web

from ..errors import EffectMQError, InvalidOption, RedisUnavailable
from ..protocol.keys import INDEXES
from ..scheduler import InvalidSchedule
from . import auth, views
from .service import DashboardConfig, DashboardService, UnknownQueue

log = logging.getLogger("effectmq.dashboard")

HERE = Path(__file__).parent
REDIS_UNREACHABLE = "Redis unreachable"
POLL_MS = 2000  # how often a page asks its JSON twin for news
SERVER_NAME = "effectmq-dashboard"  # the Server header: no versions
PROBES = ("/healthz", "/readyz")  # answered to any Host and without a token (the kubelet's probes)
OPEN_PATHS = (*PROBES, "/login", "/logout")  # no token needed (besides /static/)
SERVICE = web.AppKey("service", DashboardService)
CONFIG = web.AppKey("config", DashboardConfig)
TEMPLATES = web.AppKey("templates", jinja2.Environment)
FAILURES = web.AppKey("failures", auth.FailureLimit)
REVOKED = web.AppKey("revoked", auth.Revoked)
ROLE = "effectmq_role"  # request key: auth.READ, auth.ACT or None
BY_BEARER = "effectmq_by_bearer"  # request key: the role came from an Authorization header
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# No inline script or style, nothing from elsewhere, never framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # no-referrer would make form posts carry "Origin: null"
}


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["u"] = lambda value: quote(str(value), safe="", errors="backslashreplace")  # one path segment
    env.filters["pretty"] = lambda value: json.dumps(value, indent=2, ensure_ascii=False, default=str)
    env.filters["age"] = views.human_age
    env.filters["pct"] = lambda value: "-" if value is None else f"{value * 100:.1f}%"
    env.filters["when"] = lambda value: (value or "-").replace("T", " ")[:19]
    return env


def _wants_json(request: web.Request) -> bool:
    return request.path.startswith("/api/")


def _json(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=lambda v: json.dumps(v, default=str))


def _tokens(config: DashboardConfig) -> dict[str, str | None]:
    return {auth.ACT: config.token if config.actions else None, auth.READ: config.read_token}


def _page(request: web.Request, template: str, status: int = 200, **context: Any) -> web.Response:
    config = request.app[CONFIG]
    role = request.get(ROLE)
    signed_in = role is not None and not request.get(BY_BEARER)
    body = request.app[TEMPLATES].get_template(template).render(
        redis_url=request.app[SERVICE].shown_url,
        actions=config.actions and bool(config.token),
        sign_in=any(_tokens(config).values()),
        signed_in=signed_in, can_act=config.actions and signed_in and role == auth.ACT,
        action_header=auth.ACTION_HEADER, poll_ms=POLL_MS, path=request.path_qs, states=INDEXES,
        **context)
    return web.Response(text=body, status=status, content_type="text/html")


def _problem(request: web.Request, status: int, title: str, detail: str) -> web.Response:
    if _wants_json(request):
        return _json({"error": title, "detail": detail}, status)
    return _page(request, "error.html", status, title=title, detail=detail)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Known failures as a page or JSON answer people can read, never a traceback."""
    try:
        return await handler(request)
    except RedisUnavailable as exc:
        return _problem(request, 503, REDIS_UNREACHABLE, str(exc))
    except UnknownQueue as exc:
        return _problem(request, 404, "Unknown queue", str(exc))
    except (views.BadRequest, InvalidOption, InvalidSchedule) as exc:
        return _problem(request, 400, "Bad request", str(exc))
    except EffectMQError as exc:
        log.warning("dashboard request %s failed: %s", request.path, exc)
        return _problem(request, 500, "Error", str(exc))
    except web.HTTPException:
        raise
    except Exception:
        log.exception("dashboard request %s failed", request.path)
        return _problem(request, 500, "Internal error", "see the dashboard's log")


@web.middleware
async def safety(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Security headers on every answer. Nothing is rewritten: secrets are redacted where
    the server builds text from them (the Redis URL shown, Redis's errors), and text from
    the request is shown as sent (a scrubber would tell a right guess from a wrong one)."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = exc
    response.headers.update(SECURITY_HEADERS)
    if not request.path.startswith("/static/"):
        response.headers["Cache-Control"] = "no-store"
    if isinstance(response, web.HTTPException):
        raise response
    return response


@web.middleware
async def hosts(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Only requests naming an allowed host (loopback, --allowed-host) are answered: a
    DNS-rebinding page sends its own name. The probes answer any."""
    if request.path not in PROBES and not auth.host_allowed(request.headers.get("Host"),
                                                            request.app[CONFIG].allowed_hosts):
        return web.Response(status=421, text="this dashboard does not answer to that host name "
                                             "(allow it with --allowed-host)\n")
    return await handler(request)


def _retry_later(request: web.Request, wait: float) -> web.Response:
    seconds = max(1, math.ceil(wait))
    text = f"too many wrong tokens from this address: try again in {seconds} s"
    if _wants_json(request):
        response = _json({"ok": False, "error": "Too many requests", "detail": text, "message": text}, 429)
    else:
        response = _page(request, "login.html", 429, next="/", failed=False, limited=text)
    response.headers["Retry-After"] = str(seconds)
    return response


def _unauthorized(request: web.Request, reason: str) -> web.Response:
    response = _json({"ok": False, "error": "Unauthorized", "detail": reason, "message": reason}, 401)
    response.headers["WWW-Authenticate"] = 'Bearer realm="effectmq-dashboard"'
    return response


def _client(request: web.Request) -> str:
    """Whom the sign-in limit counts this request against (behind a trusted proxy: the
    address it forwards for)."""
    return auth.client_address(request.remote, request.headers.getall("X-Forwarded-For", []),
                               request.app[CONFIG].trusted_networks)


@web.middleware
async def who(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Whose request this is (ROLE: by an Authorization header, else by the session
    cookie), and, with a read token, that pages are shown only to a role."""
    config = request.app[CONFIG]
    tokens = _tokens(config)
    role, by_bearer = None, False
    given = auth.bearer(request.headers) if any(tokens.values()) and request.path not in PROBES else None
    if given is not None:
        failures = request.app[FAILURES]
        client = _client(request)
        wait = failures.retry_after(client)
        if wait > 0:
            return _retry_later(request, wait)
        role, by_bearer = auth.role_of_token(given, tokens), True
        if role is None:
            failures.failed(client)
            return _unauthorized(request, "wrong token")
    else:
        session = auth.read_session(request.cookies.get(auth.SESSION_COOKIE), tokens, now=time.time(),
                                    max_age=config.session_max_age)
        if session is not None and session not in request.app[REVOKED]:
            role = session.role
    request[ROLE], request[BY_BEARER] = role, by_bearer
    open_path = request.path in OPEN_PATHS or request.path.startswith("/static/")
    if request.method in ("GET", "HEAD") and not open_path:
        decision = auth.may_read(read_token=config.read_token, role=role)
        if not decision.allowed:
            if _wants_json(request):
                return _unauthorized(request, decision.reason)
            raise web.HTTPSeeOther(f"/login?next={quote(request.path_qs, safe='')}")
    return await handler(request)


# -- pages and their JSON twins --------------------------------------------------------

async def overview(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    queues, notes = await asyncio.gather(service.overview(), service.redis_notes())
    if _wants_json(request):
        return _json({"queues": queues, "redis": {"notes": notes}})
    return _page(request, "overview.html", queues=queues, redis_notes=notes, api="/api/queues")


async def queue_page(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    name = request.match_info["queue"]
    state, offset, limit, search, group = views.parse_listing(request.query)
    groups_offset, groups_limit = views.parse_groups_page(request.query)
    listing, groups, notes = await asyncio.gather(service.tasks(name, state, offset, limit, search, group),
                                                  service.groups(name, groups_offset, groups_limit, group),
                                                  service.redis_notes())
    page = listing.pop("_page")
    listing["groups"] = groups
    listing["schedules"] = await service.schedules(queue=name)
    listing["redis"] = {"notes": notes}
    if _wants_json(request):
        return _json(listing)
    api = f"/api/queues/{quote(name, safe='')}?{request.query_string}"
    return _page(request, "queue.html", pager=page, api=api, redis_notes=notes, **listing)


async def tasks_api(request: web.Request) -> web.Response:
    name = request.match_info["queue"]
    listing = await request.app[SERVICE].tasks(name, *views.parse_listing(request.query))
    listing.pop("_page")
    return _json(listing)


async def task_page(request: web.Request) -> web.Response:
    name, task_id = request.match_info["queue"], request.match_info["task_id"]
    detail = await request.app[SERVICE].task(name, task_id)
    if detail is None:
        return _problem(request, 404, "Unknown task", f"no task {task_id!r} in queue {name!r} "
                                                      "(never offered, or its record expired)")
    if _wants_json(request):
        return _json(detail)
    api = f"/api/queues/{quote(name, safe='')}/tasks/{quote(task_id, safe='')}"
    return _page(request, "task.html", api=api, **detail)


async def schedules_page(request: web.Request) -> web.Response:
    schedules = await request.app[SERVICE].schedules()
    if _wants_json(request):
        return _json({"schedules": schedules})
    return _page(request, "schedules.html", schedules=schedules, api="/api/schedules")


# -- actions: POST to the API, each one engine operation -----------------------------

def action(run: Callable[[DashboardService, web.Request], Awaitable[views.ActionResult]]) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        config = request.app[CONFIG]
        decision = auth.may_act(actions=config.actions and bool(config.token), role=request.get(ROLE),
                                by_bearer=request.get(BY_BEARER, False), headers=request.headers,
                                host=request.host)
        if not decision.allowed:
            return _json({"ok": False, "error": decision.reason, "message": decision.reason}, decision.status)
        result = await run(request.app[SERVICE], request)
        return _json(result.to_json(), result.status)
    return handle


def _q(request: web.Request) -> str:
    return request.match_info["queue"]


def _t(request: web.Request) -> str:
    return request.match_info["task_id"]


def _ns(request: web.Request) -> str | None:
    """The scheduler namespace an action names (?namespace=), if any: it only narrows the
    namespaces the dashboard shows, so an unknown one finds nothing."""
    return request.query.get("namespace") or None


# -- signing in ------------------------------------------------------------------------

async def login_form(request: web.Request) -> web.Response:
    return _page(request, "login.html", next=auth.local_path(request.query.get("next")), failed=False, limited="")


async def login(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    form = await request.post()
    target = auth.local_path(str(form.get("next") or "/"))
    tokens = _tokens(config)
    if not any(tokens.values()):
        return _page(request, "login.html", 403, next=target, failed=True, limited="")
    if auth.cross_site(request.headers, request.host):
        return _page(request, "login.html", 403, next=target, failed=True, limited="")
    failures, client = request.app[FAILURES], _client(request)
    wait = failures.retry_after(client)
    if wait > 0:
        return _retry_later(request, wait)
    role = auth.role_of_token(str(form.get("token") or ""), tokens)
    token = tokens.get(role) if role else None
    if role is None or token is None:
        failures.failed(client)
        return _page(request, "login.html", 401, next=target, failed=True, limited="")
    value = auth.new_session(token, role, now=time.time(), max_age=config.session_max_age,
                             session_id=secrets.token_urlsafe(18))
    response = web.HTTPSeeOther(target)
    response.set_cookie(auth.SESSION_COOKIE, value, httponly=True, samesite="Strict", path="/",
                        max_age=max(1, int(config.session_max_age)), secure=config.behind_tls or request.secure)
    raise response


async def logout(request: web.Request) -> web.Response:
    """Ends the session on the server too (its id is revoked until it would have expired).
    Only from this dashboard's own pages: another site cannot sign people out."""
    if auth.cross_site(request.headers, request.host):
        return _json({"ok": False, "error": "request from another origin refused"}, 403)
    config = request.app[CONFIG]
    now = time.time()
    session = auth.read_session(request.cookies.get(auth.SESSION_COOKIE), _tokens(config), now=now,
                                max_age=config.session_max_age)
    if session is not None:
        request.app[REVOKED].add(session, now)
    response = web.HTTPSeeOther("/")
    response.del_cookie(auth.SESSION_COOKIE, path="/")
    raise response


# -- probes ------------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def readyz(request: web.Request) -> web.Response:
    try:
        await request.app[SERVICE].ping()
    except RedisUnavailable:
        return web.Response(text=REDIS_UNREACHABLE, status=503)
    return web.Response(text="ok")


def create_app(config: DashboardConfig) -> web.Application:
    """The aiohttp application; Redis is connected when it starts."""
    app = web.Application(middlewares=[safety, hosts, who, errors])
    app[CONFIG] = config
    app[TEMPLATES] = _templates()
    app[SERVICE] = DashboardService(config)
    app[FAILURES] = auth.FailureLimit()
    app[REVOKED] = auth.Revoked()

    async def server_header(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["Server"] = SERVER_NAME

    app.on_response_prepare.append(server_header)

    async def start(app: web.Application) -> None:
        await app[SERVICE].start()

    async def stop(app: web.Application) -> None:
        await app[SERVICE].close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    r = app.router
    r.add_get("/", overview)
    for prefix in ("", "/api"):  # each page and its JSON twin
        r.add_get(prefix + "/queues", overview)
        r.add_get(prefix + "/queues/{queue}", queue_page)
        r.add_get(prefix + "/queues/{queue}/tasks/{task_id}", task_page)
        r.add_get(prefix + "/schedules", schedules_page)
    r.add_get("/api/queues/{queue}/tasks", tasks_api)
    r.add_post("/api/queues/{queue}/tasks/{task_id}/retry", action(lambda s, rq: s.retry(_q(rq), _t(rq))))
    r.add_post("/api/queues/{queue}/tasks/{task_id}/cancel", action(lambda s, rq: s.cancel(_q(rq), _t(rq))))
    r.add_post("/api/queues/{queue}/retry-all", action(lambda s, rq: s.retry_all(_q(rq))))
    r.add_post("/api/queues/{queue}/pause", action(lambda s, rq: s.set_paused(_q(rq), True)))
    r.add_post("/api/queues/{queue}/resume", action(lambda s, rq: s.set_paused(_q(rq), False)))
    r.add_post("/api/schedules/{schedule_id}/suspend",
               action(lambda s, rq: s.set_suspended(rq.match_info["schedule_id"], True, _ns(rq))))
    r.add_post("/api/schedules/{schedule_id}/resume",
               action(lambda s, rq: s.set_suspended(rq.match_info["schedule_id"], False, _ns(rq))))
    r.add_get("/login", login_form)
    r.add_post("/login", login)
    r.add_post("/logout", logout)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_static("/static", HERE / "static")
    return app
