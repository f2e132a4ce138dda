"""Credentials never leave their URL.

Anything that names a Redis URL (messages, reprs, logs, CLI output) shows
`redact_url(url)`; text built elsewhere (redis-py's exceptions) goes through
`scrub` with the secrets of the URL or client before it is shown.
"""

from __future__ import annotations

from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit

__all__ = ["CLUSTER_SCHEMES", "INVALID_URL", "MASK", "SECRET_OPTIONS", "redact_url", "scrub", "url_secrets"]

MASK = "***"
INVALID_URL = "<invalid Redis URL>"  # what an unreadable URL is shown as: never the value itself
SENTINEL_SCHEMES = frozenset({"redis+sentinel", "rediss+sentinel"})  # host list: h1:p1,h2:p2 (transport.sentinel)
CLUSTER_SCHEMES = frozenset({"redis+cluster", "rediss+cluster"})  # seed list: h1:p1,h2:p2 (transport.cluster)
SCHEMES = frozenset({"redis", "rediss", "unix"}) | SENTINEL_SCHEMES | CLUSTER_SCHEMES
# Connection options that hold secrets, whether in a URL query or a client's settings.
SECRET_OPTIONS = ("password", "ssl_password")
# ... and those only a URL's query holds (a Sentinel's own password).
URL_SECRET_OPTIONS = SECRET_OPTIONS + ("sentinel_password",)


def _redact(url: object) -> tuple[str, list[str]] | None:
    """The URL with its secrets masked and those secrets (raw), or None when it cannot
    be parsed safely (not a redis/rediss/unix/redis+sentinel/redis+cluster URL, or a password cut short by an
    unencoded / ? or #, whose rest would be shown as path, query or fragment)."""
    if not isinstance(url, str):
        return None
    try:
        parts = urlsplit(url)
        if parts.scheme in SENTINEL_SCHEMES | CLUSTER_SCHEMES:  # each host's port must be a number
            for address in parts.netloc.rpartition("@")[2].split(","):
                _ = urlsplit(f"//{address}").port
        else:
            _ = parts.port  # ValueError when the port is not a number
    except ValueError:
        return None
    if parts.scheme not in SCHEMES or parts.fragment:
        return None
    secrets: list[str] = []
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    if password:
        secrets.append(password)
        userinfo = f"{user}:{MASK}"
    items = []
    for item in parts.query.split("&") if parts.query else ():
        key, eq, value = item.partition("=")
        if eq and value and unquote(key).lower() in URL_SECRET_OPTIONS:
            secrets.append(value)
            item = f"{key}={MASK}"
        items.append(item)
    query = "&".join(items)
    if "@" in parts.path + query:
        return None
    netloc = f"{userinfo}@{hostinfo}" if at else hostinfo
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else ""), secrets


def redact_url(url: str) -> str:
    """`url` with its password (and password query values) replaced by ***, the rest
    kept (scheme, user, host, port, db); INVALID_URL for anything that is not such a URL."""
    redacted = _redact(url)
    return INVALID_URL if redacted is None else redacted[0]


def url_secrets(url: str) -> tuple[str, ...]:
    """The secret parts of `url`, raw and decoded, for `scrub`.

    A value that cannot be parsed as a Redis URL is secret as a whole."""
    redacted = _redact(url)
    if redacted is None:
        return (url,) if isinstance(url, str) and url else ()
    forms: list[str] = []
    for raw in redacted[1]:
        for form in (raw, unquote(raw), unquote_plus(raw)):
            if form not in forms:
                forms.append(form)
    return tuple(forms)


def scrub(text: str, *secrets: str) -> str:
    """`text` with every non-empty secret, as is or percent-encoded, replaced by ***."""
    forms = {form for secret in secrets if isinstance(secret, str) and secret
             for form in (secret, quote(secret, safe=""), quote_plus(secret, safe=""))}
    for form in sorted(forms, key=len, reverse=True):  # longest first: no tail of a secret is left
        text = text.replace(form, MASK)
    return text
