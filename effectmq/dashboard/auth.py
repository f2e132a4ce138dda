"""Who may press the buttons: the decision is pure; `web` applies it to requests.

Design (CSRF-safe without server state):
- Read-only unless the dashboard runs with actions enabled and a token.
- People sign in once with the token (a POST form); the answer sets a session cookie
  (HttpOnly: page scripts cannot read it; SameSite=Strict: no other site's page sends
  it). The cookie holds an HMAC of the token, never the token itself.
- Every action is a POST that must also carry the header ACTION_HEADER, which the
  page's own script adds. A cross-site form cannot set headers, and a cross-site
  fetch with a custom header needs a CORS preflight the dashboard never grants, so a
  cookie alone never acts. An Origin header, when sent, must name this dashboard.
- Scripts and curl may instead send `Authorization: Bearer <token>` (no cookie,
  so nothing a browser adds by itself).
Tokens are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

SESSION_COOKIE = "effectmq_session"
ACTION_HEADER = "X-EffectMQ-Action"
SESSION_MAX_AGE = 12 * 3600


def session_value(token: str) -> str:
    """The cookie's value for `token`: an HMAC, so the cookie never reveals the token."""
    return hmac.new(token.encode(), b"effectmq-dashboard-session", hashlib.sha256).hexdigest()


def token_matches(given: str | None, token: str) -> bool:
    return bool(given) and hmac.compare_digest(str(given).encode(), token.encode())


@dataclass(frozen=True)
class Decision:
    allowed: bool
    status: int = 200  # when refused: 403 (read-only, foreign origin) or 401 (not signed in)
    reason: str = ""


READ_ONLY = Decision(False, 403, "this dashboard is read-only (start it with --actions and a token)")


def signed_in(cookies: Mapping[str, str], token: str | None) -> bool:
    return bool(token) and hmac.compare_digest(cookies.get(SESSION_COOKIE, ""), session_value(token or ""))


def same_origin(origin: str | None, host: str | None) -> bool:
    """An Origin header (when the browser sends one) must name the host the request went to."""
    if not origin:
        return True
    if origin == "null" or not host:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()


def may_act(*, actions: bool, token: str | None, headers: Mapping[str, str], cookies: Mapping[str, str],
            host: str | None) -> Decision:
    """Whether one POST to an action route may run."""
    if not actions or not token:
        return READ_ONLY
    authorization = headers.get("Authorization", "")
    if authorization.startswith("Bearer "):
        if token_matches(authorization[len("Bearer "):].strip(), token):
            return Decision(True)
        return Decision(False, 401, "wrong token")
    if not signed_in(cookies, token):
        return Decision(False, 401, "sign in with the dashboard token first")
    if headers.get(ACTION_HEADER) != "1":
        return Decision(False, 403, f"actions need the {ACTION_HEADER} header the dashboard page sends")
    if not same_origin(headers.get("Origin"), host):
        return Decision(False, 403, "request from another origin refused")
    return Decision(True)
