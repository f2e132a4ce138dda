"""Who can reach the dashboard and what a visitor can make it do, each
against a running dashboard over HTTP (the open redirect; no read
authentication and any Host header; the session cookie, sign-in
without a rate limit or a minimum token length, logout from another site, and the
`Server` header naming versions)."""

from __future__ import annotations

import asyncio
import re
from urllib.parse import urljoin, urlsplit

import aiohttp
import pytest

from effectmq import TaskQueue
from effectmq.errors import InvalidOption

from .conftest import TOKEN

pytestmark = pytest.mark.timeout(120)

READ_TOKEN = "read-token-0b7e9d41c2"
ACT = {"X-EffectMQ-Action": "1"}


def browser_like() -> aiohttp.ClientSession:
    """A client that keeps cookies as a browser does (aiohttp's jar refuses them for IP hosts by default)."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def seed(url: str) -> None:
    async with TaskQueue("emails", url=url) as q:
        await q.offer("send", {"to": "a@example.com"}, task_id="t1")


def session_cookie(response: aiohttp.ClientResponse) -> str | None:
    morsel = response.cookies.get("effectmq_session")
    return morsel.value if morsel is not None and morsel.value else None


async def sign_in(http: aiohttp.ClientSession, dash, token: str, **headers: str) -> aiohttp.ClientResponse:
    async with http.post(dash.url("/login"), data={"token": token, "next": "/"}, allow_redirects=False,
                         headers=headers) as r:
        await r.read()
        return r


# -- sign-in sends people back to this dashboard only ---------------------------------------

OFF_SITE = ["/\t/evil.example", "/\r\n/evil.example", "/\n/evil.example", "/\r/evil.example", "/\x00/evil.example",
            "/\x0b/evil.example", "/\x7f/evil.example", "\t//evil.example", "/\\evil.example", "//evil.example",
            "https://evil.example/", "/\u2028/evil.example"]


@pytest.mark.parametrize("target", OFF_SITE, ids=repr)
async def test_sign_in_never_redirects_off_site(redis_url, start_dashboard, target):
    dash = await start_dashboard(redis_url, actions=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(dash.url("/login"), data={"token": dash.token, "next": target},
                             allow_redirects=False) as r:
            assert r.status == 303, await r.text()
            location = r.headers["Location"]
        assert not re.search(r"[\x00-\x20\x7f\\]", location), location
        assert urlsplit(urljoin(dash.url("/login"), location)).netloc == urlsplit(dash.base).netloc, location
        assert location == "/"
        async with http.get(dash.url("/login"), params={"next": target}) as r:
            assert 'name="next" value="/"' in await r.text()


async def test_sign_in_keeps_a_local_next(redis_url, start_dashboard):
    dash = await start_dashboard(redis_url, actions=True)
    async with aiohttp.ClientSession() as http:
        async with http.post(dash.url("/login"), data={"token": dash.token, "next": "/queues/emails?state=failed"},
                             allow_redirects=False) as r:
            assert (r.status, r.headers["Location"]) == (303, "/queues/emails?state=failed")


# -- the Host header, read authentication ----------------------------------------------------

async def test_only_allowed_host_names_are_answered(redis_url, start_dashboard):
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 reads the
    dashboard with `Host: evil.example`. Only loopback names (and those allowed) are answered;
    the probes answer any Host (the kubelet sends the pod's IP)."""
    await seed(redis_url)
    dash = await start_dashboard(redis_url)
    port = urlsplit(dash.base).port
    async with aiohttp.ClientSession() as http:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", f"localhost.evil.example:{port}",
                     "10.0.0.7", ""):
            for path in ("/", "/api/queues", "/api/queues/emails/tasks/t1", "/login"):
                async with http.get(dash.url(path), headers={"Host": host}, allow_redirects=False) as r:
                    assert r.status == 421, (host, path, r.status)
                    assert "t1" not in await r.text()
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", f"LOCALHOST:{port}"):
            async with http.get(dash.url("/api/queues"), headers={"Host": host}) as r:
                assert r.status == 200, host
        for path in ("/healthz", "/readyz"):
            async with http.get(dash.url(path), headers={"Host": "10.1.2.3:8080"}) as r:
                assert r.status == 200, path
    named = await start_dashboard(redis_url, allowed_hosts=["dash.example.com"])
    async with aiohttp.ClientSession() as http:
        for host, status in (("dash.example.com", 200), ("dash.example.com:443", 200), ("DASH.example.com", 200),
                             ("evil.example", 421), ("x.dash.example.com", 421)):
            async with http.get(named.url("/api/queues"), headers={"Host": host}) as r:
                assert r.status == status, host


PAGES = ["/", "/queues", "/queues/emails", "/queues/emails/tasks/t1", "/schedules"]
APIS = ["/api/queues", "/api/queues/emails", "/api/queues/emails/tasks", "/api/queues/emails/tasks/t1",
        "/api/schedules"]


async def test_a_read_token_guards_every_page(redis_url, start_dashboard):
    await seed(redis_url)
    dash = await start_dashboard(redis_url, read_token=READ_TOKEN)
    async with aiohttp.ClientSession() as http:
        for path in PAGES:
            async with http.get(dash.url(path), allow_redirects=False) as r:
                assert r.status == 303, path
                assert r.headers["Location"].startswith("/login?next=")
                assert "t1" not in await r.text()
        for path in APIS:
            async with http.get(dash.url(path)) as r:
                assert r.status == 401, path
                assert "t1" not in await r.text()
            for wrong in ("wrong", TOKEN, READ_TOKEN[:-1]) if path in (APIS[0], APIS[-1]) else ():  # < 10 guesses
                async with http.get(dash.url(path), headers={"Authorization": f"Bearer {wrong}"}) as r:
                    assert r.status == 401, path
            async with http.get(dash.url(path), headers={"Authorization": f"Bearer {READ_TOKEN}"}) as r:
                assert r.status == 200, path
        for path in ("/healthz", "/readyz", "/login", "/static/app.js"):
            async with http.get(dash.url(path)) as r:
                assert r.status == 200, path
        async with http.get(dash.url("/login")) as r:
            assert 'name="token"' in await r.text()  # a read-only dashboard with a read token has a sign-in form
    async with browser_like() as http:
        assert (await sign_in(http, dash, READ_TOKEN)).status == 303
        for path in PAGES + APIS:
            async with http.get(dash.url(path)) as r:
                assert r.status == 200, path
        async with http.post(dash.url("/api/queues/emails/pause"), headers=ACT) as r:
            assert r.status == 403  # reading is not acting: the dashboard is read-only


async def test_a_read_session_cannot_act_and_the_action_token_also_reads(redis_url, start_dashboard):
    await seed(redis_url)
    dash = await start_dashboard(redis_url, actions=True, read_token=READ_TOKEN)
    async with browser_like() as http:
        assert (await sign_in(http, dash, READ_TOKEN)).status == 303
        async with http.get(dash.url("/api/queues")) as r:
            assert r.status == 200
        async with http.post(dash.url("/api/queues/emails/pause"), headers=ACT) as r:
            assert r.status == 403, await r.text()
        async with http.post(dash.url("/api/queues/emails/pause"),
                             headers={"Authorization": f"Bearer {READ_TOKEN}"}) as r:
            assert r.status == 403  # the read token reads only
    async with browser_like() as http:
        assert (await sign_in(http, dash, TOKEN)).status == 303
        async with http.get(dash.url("/api/queues")) as r:
            assert r.status == 200
        async with http.post(dash.url("/api/queues/emails/pause"), headers=ACT) as r:
            assert r.status == 200, await r.text()
    async with TaskQueue("emails", url=redis_url) as q:
        assert (await q.stats()).paused is True


# -- Low: the session cookie --------------------------------------------------------------------

async def test_the_session_expires_on_the_server_and_logout_revokes_it(redis_url, start_dashboard):
    """Was: the cookie was a static HMAC of the token, valid forever and after logout."""
    await seed(redis_url)
    dash = await start_dashboard(redis_url, actions=True)
    async with aiohttp.ClientSession() as http:
        first = session_cookie(await sign_in(http, dash, TOKEN))
        second = session_cookie(await sign_in(http, dash, TOKEN))
    assert first and second and first != second  # each sign-in its own session
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:  # curl: cookies by hand
        async def acts(cookie: str) -> int:
            async with http.post(dash.url("/api/queues/emails/resume"), headers=ACT,
                                 cookies={"effectmq_session": cookie}) as r:
                return r.status

        assert await acts(first) == 200 and await acts(second) == 200
        async with http.post(dash.url("/logout"), cookies={"effectmq_session": first}, allow_redirects=False) as r:
            assert r.status == 303
        assert await acts(first) == 401  # revoked on the server, whatever the client keeps
        assert await acts(second) == 200  # another session lives on

    short = await start_dashboard(redis_url, actions=True, session_max_age=1.0)
    async with aiohttp.ClientSession() as http:
        response = await sign_in(http, short, TOKEN)
        assert "Max-Age=1" in response.headers["Set-Cookie"]
        cookie = session_cookie(response)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async def acts_short() -> int:
            async with http.post(short.url("/api/queues/emails/resume"), headers=ACT,
                                 cookies={"effectmq_session": cookie}) as r:
                return r.status

        assert await acts_short() == 200
        await asyncio.sleep(1.3)
        assert await acts_short() == 401  # expired on the server, though the client sent it again


async def test_the_cookie_is_secure_when_told_it_is_behind_tls(redis_url, start_dashboard):
    plain = await start_dashboard(redis_url, actions=True)
    behind = await start_dashboard(redis_url, actions=True, behind_tls=True)
    async with aiohttp.ClientSession() as http:
        plain_cookie = (await sign_in(http, plain, TOKEN)).headers["Set-Cookie"]
        secure_cookie = (await sign_in(http, behind, TOKEN)).headers["Set-Cookie"]
    assert "Secure" not in plain_cookie and "HttpOnly" in plain_cookie and "SameSite=Strict" in plain_cookie
    assert "Secure" in secure_cookie and "HttpOnly" in secure_cookie


# -- Low: sign-in rate limit and token length ---------------------------------------------------

async def test_sign_in_is_rate_limited(redis_url, start_dashboard):
    await seed(redis_url)
    dash = await start_dashboard(redis_url, actions=True)
    async with aiohttp.ClientSession() as http:
        statuses = [(await sign_in(http, dash, f"guess-{i:04d}-xxxxxxxx")).status for i in range(10)]
        assert statuses == [401] * 10
        refused = await sign_in(http, dash, "guess-9999-xxxxxxxx")
        assert refused.status == 429 and int(refused.headers["Retry-After"]) > 0
        assert (await sign_in(http, dash, TOKEN)).status == 429  # while limited, the right one too
        async with http.post(dash.url("/api/queues/emails/pause"), headers={"Authorization": "Bearer guess"}) as r:
            assert r.status == 429  # a Bearer guess is a sign-in too
        async with http.post(dash.url("/api/queues/emails/pause"), headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 429
    async with TaskQueue("emails", url=redis_url) as q:
        assert (await q.stats()).paused is False


async def test_bearer_guesses_are_rate_limited(redis_url, start_dashboard):
    dash = await start_dashboard(redis_url, read_token=READ_TOKEN)
    async with aiohttp.ClientSession() as http:
        statuses = []
        for i in range(11):
            async with http.get(dash.url("/api/queues"), headers={"Authorization": f"Bearer guess-{i}"}) as r:
                statuses.append(r.status)
        assert statuses == [401] * 10 + [429]


async def test_behind_a_trusted_proxy_each_client_has_its_own_sign_in_budget(redis_url, start_dashboard):
    """Behind an ingress every request comes from the proxy's address: with the proxy
    trusted, the client is the address it forwards (X-Forwarded-For, read from the right),
    so one client's guesses do not lock every user out, and a client cannot escape its own
    limit by writing the header itself."""
    dash = await start_dashboard(redis_url, actions=True, trusted_proxies=("127.0.0.0/8",))
    async with aiohttp.ClientSession() as http:
        async def sign_in_as(client: str, token: str, spoofed: str | None = None) -> int:
            forwarded = f"{spoofed}, {client}" if spoofed else client
            return (await sign_in(http, dash, token, **{"X-Forwarded-For": forwarded})).status

        assert [await sign_in_as("203.0.113.7", f"guess-{i:04d}-xxxxxxxx") for i in range(10)] == [401] * 10
        assert await sign_in_as("203.0.113.7", TOKEN) == 429
        assert await sign_in_as("203.0.113.7", TOKEN, spoofed="198.51.100.1") == 429  # its own header changes nothing
        assert await sign_in_as("198.51.100.9", TOKEN) == 303  # another user signs in


async def test_forwarded_addresses_are_ignored_unless_the_proxy_is_trusted(redis_url, start_dashboard):
    dash = await start_dashboard(redis_url, actions=True, trusted_proxies=("10.0.0.0/8",))
    async with aiohttp.ClientSession() as http:
        guesses = [await sign_in(http, dash, f"guess-{i:04d}-xxxxxxxx", **{"X-Forwarded-For": f"203.0.113.{i}"})
                   for i in range(10)]
        assert [r.status for r in guesses] == [401] * 10
        refused = await sign_in(http, dash, TOKEN, **{"X-Forwarded-For": "198.51.100.9"})
        assert refused.status == 429  # 127.0.0.1 is not a trusted proxy: the header is the client's own


@pytest.mark.parametrize("field", ["token", "read_token"])
def test_a_short_token_is_refused(redis_url, field):
    from effectmq.dashboard import DashboardConfig, create_app

    for short in ("x", "0123456789abcde"):  # the finding: a one-character token was accepted
        options = {"actions": True, "token": short} if field == "token" else {"read_token": short}
        with pytest.raises(InvalidOption, match="at least 16 characters"):
            create_app(DashboardConfig(url=redis_url, **options))
    ok = {"actions": True, "token": "0123456789abcdef"} if field == "token" else {"read_token": "0123456789abcdef"}
    create_app(DashboardConfig(url=redis_url, **ok))


# -- Low: logout from another site, the Server header -------------------------------------------

async def test_logout_refuses_cross_site_requests(redis_url, start_dashboard):
    await seed(redis_url)
    dash = await start_dashboard(redis_url, actions=True)
    async with aiohttp.ClientSession() as http:
        cookie = session_cookie(await sign_in(http, dash, TOKEN))
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        jar = {"effectmq_session": cookie}
        for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
            async with http.post(dash.url("/logout"), cookies=jar, headers=headers, allow_redirects=False) as r:
                assert r.status == 403, headers
                assert "Set-Cookie" not in r.headers, headers
        async with http.post(dash.url("/api/queues/emails/resume"), headers=ACT, cookies=jar) as r:
            assert r.status == 200  # still signed in
        async with http.post(dash.url("/logout"), cookies=jar, headers={"Origin": dash.base},
                             allow_redirects=False) as r:
            assert r.status == 303 and "effectmq_session" in r.headers["Set-Cookie"]


async def test_the_server_header_names_no_version(redis_url, start_dashboard):
    dash = await start_dashboard(redis_url, actions=True)
    async with aiohttp.ClientSession() as http:
        answers = []
        for method, path in (("GET", "/"), ("GET", "/static/app.js"), ("GET", "/no/such/page"), ("GET", "/healthz"),
                             ("POST", "/login"), ("GET", "/api/queues/nope"), ("DELETE", "/")):
            async with http.request(method, dash.url(path)) as r:
                answers.append((path, r.status, r.headers.get("Server", "")))
    for path, status, server in answers:
        assert not re.search(r"\d|aiohttp|python", server, re.I), (path, status, server)
