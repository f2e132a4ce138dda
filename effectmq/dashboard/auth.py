"""Who may read and who may press the buttons: the decisions are pure; `web` applies
them to requests.

Design (CSRF-safe without a server-side session store):
- Read-only unless the dashboard runs with actions enabled and a token. Reading is
  open unless a read token is set; then every page and API answer needs a session or
  a Bearer token (the read token or the action token).
- People sign in once with a token (a POST form); the answer sets a session cookie
  (HttpOnly: page scripts cannot read it; SameSite=Strict: no other site's page sends
  it; Secure when the dashboard is told it is behind TLS). The cookie holds the
  session's role (read or act), its expiry and a random id, signed with an HMAC keyed
  by that role's token: never the token itself. The server checks the expiry (the
  browser's Max-Age is only a hint), logout revokes the session's id, and a new token
  revokes every session made with the old one.
- Every action is a POST that must also carry the header ACTION_HEADER, which the
  page's own script adds. A cross-site form cannot set headers, and a cross-site
  fetch with a custom header needs a CORS preflight the dashboard never grants, so a
  cookie alone never acts. An Origin header, when sent, must name this dashboard.
- Scripts and curl may instead send `Authorization: Bearer <token>` (no cookie,
  so nothing a browser adds by itself).
- Tokens are compared in constant time, are at least MIN_TOKEN_LENGTH characters, and
  a client that presents wrong ones is refused for a while (FailureLimit). Behind a
  proxy the dashboard is told to trust, the client is the address it forwards
  (`client_address`), so one client's guesses lock out that client only.
- Only requests naming an allowed host are answered (`host_allowed`): a DNS-rebinding
  page (evil.example resolving to the dashboard's address) sends its own name.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Collection, Mapping
from urllib.parse import urlsplit

from ..errors import InvalidOption

SESSION_COOKIE = "effectmq_session"
ACTION_HEADER = "X-EffectMQ-Action"
SESSION_MAX_AGE = 12 * 3600  # seconds a session lasts, checked by the server
MIN_TOKEN_LENGTH = 16  # `openssl rand -hex 24` gives 48
READ, ACT = "read", "act"  # a session's or a Bearer token's role
# Failed token checks (sign-in form and Bearer headers) a client may make per window
# before every check of its is refused (429) until the oldest leaves the window.
MAX_FAILURES = 10
FAILURE_WINDOW = 60.0
FAILURE_CLIENTS = 10_000  # clients remembered; the longest-quiet is forgotten first
LOCALHOST = "localhost"
ANY_HOST = "*"  # in the allow-list: every Host header is answered


def check_token(token: str | None, what: str) -> None:
    """A token shorter than MIN_TOKEN_LENGTH can be guessed: refused (InvalidOption)."""
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise InvalidOption(f"the {what} must be at least {MIN_TOKEN_LENGTH} characters (it has {len(token)}); "
                            "make one with: openssl rand -hex 24")


def token_matches(given: str | None, token: str | None) -> bool:
    return bool(given) and bool(token) and hmac.compare_digest(str(given).encode(), str(token).encode())


# -- sessions ---------------------------------------------------------------------------

def _signature(token: str, body: str) -> str:
    return hmac.new(token.encode(), b"effectmq-dashboard-session\0" + body.encode(), hashlib.sha256).hexdigest()


def new_session(token: str, role: str, *, now: float, max_age: float, session_id: str) -> str:
    """A cookie value: `<role>.<expiry in ms>.<id>.<HMAC keyed by the role's token>`."""
    body = f"{role}.{int((now + max_age) * 1000)}.{session_id}"
    return f"{body}.{_signature(token, body)}"


@dataclass(frozen=True)
class Session:
    role: str
    expires: float  # epoch seconds
    session_id: str


def read_session(value: str | None, tokens: Mapping[str, str | None], *, now: float,
                 max_age: float) -> Session | None:
    """The session a cookie value holds, when its signature is right for its role's
    token and it has not expired (nor lasts longer than this dashboard grants)."""
    if not value or len(value) > 256:
        return None
    parts = value.split(".")
    if len(parts) != 4:
        return None
    role, expires, session_id, signature = parts
    token = tokens.get(role)
    if not token or not (expires.isascii() and expires.isdigit()) or len(expires) > 16:
        return None
    if not hmac.compare_digest(signature.encode(), _signature(token, f"{role}.{expires}.{session_id}").encode()):
        return None
    at = int(expires) / 1000
    if not now < at <= now + max_age + 1:
        return None
    return Session(role, at, session_id)


class Revoked:
    """Ids of sessions signed out before they expired, kept until they would have."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def add(self, session: Session, now: float) -> None:
        self._until = {k: at for k, at in self._until.items() if at > now}
        self._until[session.session_id] = session.expires

    def __contains__(self, session: Session) -> bool:
        return session.session_id in self._until


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer ...` header ("" when it has none), None without one."""
    authorization = headers.get("Authorization")
    if authorization is None:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def role_of_token(given: str, tokens: Mapping[str, str | None]) -> str | None:
    """ACT for the action token, READ for the read token, None for anything else
    (both compared, in constant time, whatever matches)."""
    matches = [role for role in (ACT, READ) if token_matches(given, tokens.get(role))]
    return matches[0] if matches else None


# -- decisions ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    allowed: bool
    status: int = 200  # when refused: 403 (read-only, foreign origin, read role) or 401 (not signed in)
    reason: str = ""


READ_ONLY = Decision(False, 403, "this dashboard is read-only (start it with --actions and a token)")


def may_read(*, read_token: str | None, role: str | None) -> Decision:
    """Whether a page or API answer may be shown: always without a read token; with
    one, to a session or Bearer token of either role."""
    if not read_token or role in (READ, ACT):
        return Decision(True)
    return Decision(False, 401, "sign in with the dashboard's read token first")


def same_origin(origin: str | None, host: str | None) -> bool:
    """An Origin header (when the browser sends one) must name the host the request went to."""
    if not origin:
        return True
    if origin == "null" or not host:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()


def cross_site(headers: Mapping[str, str], host: str | None) -> bool:
    """A request a page of another site made: a foreign Origin, or the browser's own
    Sec-Fetch-Site saying so (sent even where Origin is not)."""
    return not same_origin(headers.get("Origin"), host) or headers.get("Sec-Fetch-Site") == "cross-site"


def may_act(*, actions: bool, role: str | None, by_bearer: bool, headers: Mapping[str, str],
            host: str | None) -> Decision:
    """Whether one POST to an action route may run. `role`: that of the Bearer token
    (by_bearer; a wrong one is refused before) or of the session cookie, or None."""
    if not actions:
        return READ_ONLY
    if by_bearer:
        if role == ACT:
            return Decision(True)
        return Decision(False, 403, "the read token only reads: actions need the action token")
    if role is None:
        return Decision(False, 401, "sign in with the dashboard token first")
    if role != ACT:
        return Decision(False, 403, "signed in to read only: sign in with the action token to act")
    if headers.get(ACTION_HEADER) != "1":
        return Decision(False, 403, f"actions need the {ACTION_HEADER} header the dashboard page sends")
    if cross_site(headers, host):
        return Decision(False, 403, "request from another origin refused")
    return Decision(True)


def local_path(target: str | None) -> str:
    """Where to go after signing in: only a path of this dashboard (no open redirect).
    Control characters, line breaks and other unprintable ones are refused as a whole:
    URL parsers drop some of them (`/<TAB>/evil.example` becomes `//evil.example`)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    if not all(c.isprintable() for c in target):
        return "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "/"
    return target


# -- where requests come from --------------------------------------------------------------

def host_name(host: str | None) -> str | None:
    """The name of a Host header: lower case, without its port (or IPv6 brackets) and
    a final dot; None when there is none or it cannot be read."""
    if not host:
        return None
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, colon, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
        if colon and not port.isdigit():
            return None
    name = name.rstrip(".")
    return name or None


def is_loopback(name: str | None) -> bool:
    """localhost, or an address of 127.0.0.0/8 or ::1."""
    if not name:
        return False
    if name == LOCALHOST:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host: str | None, allowed: Collection[str]) -> bool:
    """Whether a request with this Host header is answered: loopback names always,
    others only when allowed (ANY_HOST: every one)."""
    if ANY_HOST in allowed:
        return True
    name = host_name(host)
    if name is None:
        return False
    return is_loopback(name) or name in {host_name(a) for a in allowed}


class FailureLimit:
    """Failed token checks per client: after MAX_FAILURES within FAILURE_WINDOW seconds,
    every check of that client is refused until the oldest failure leaves the window."""

    def __init__(self, max_failures: int = MAX_FAILURES, window: float = FAILURE_WINDOW,
                 clients: int = FAILURE_CLIENTS):
        self.max_failures = max_failures
        self.window = window
        self.clients = clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, client: str, now: float | None = None) -> float:
        """Seconds until `client` may try again; 0 when it may now."""
        now = time.monotonic() if now is None else now
        failures = self._failures.get(client)
        if not failures:
            return 0.0
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if len(failures) < self.max_failures:
            return 0.0
        return failures[0] + self.window - now

    def failed(self, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        failures = self._failures.pop(client, None) or deque()
        failures.append(now)
        while len(failures) > self.max_failures:
            failures.popleft()
        self._failures[client] = failures  # the most recent last
        while len(self._failures) > self.clients:
            self._failures.popitem(last=False)


MAX_FORWARDED_HOPS = 20  # X-Forwarded-For entries read, from the right: no chain is longer


def trusted_networks(specs: Collection[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The proxies trusted to say whom they forward for, from addresses or CIDRs;
    raises ValueError naming a bad one."""
    networks = []
    for spec in specs:
        try:
            networks.append(ipaddress.ip_network(spec.strip(), strict=False))
        except ValueError:
            raise ValueError(f"trusted proxy {spec!r} is not an IP address or network (CIDR)") from None
    return tuple(networks)


def _trusted(address: str, networks: Collection[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def client_address(remote: str | None, forwarded_for: Collection[str],
                   trusted: Collection[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
    """Who sent a request: its peer, unless the peer is a trusted proxy; then the nearest
    address in X-Forwarded-For (`forwarded_for`: the header's values, in order) that is not
    a trusted proxy, read from the right, where each proxy appends the address it saw.
    Entries left of that one were written by the client and are never believed."""
    client = remote or ""
    if not trusted or not _trusted(client, trusted):
        return client
    hops = [hop.strip() for value in forwarded_for for hop in value.split(",")]
    for hop in reversed(hops[-MAX_FORWARDED_HOPS:]):
        if not hop:
            break
        client = hop[:64]  # a key of the failure limit: bounded, whatever was written
        if not _trusted(hop, trusted):
            break
    return client
