"""`effectmq dashboard`: serve the web dashboard (see effectmq.dashboard).

    effectmq dashboard --url URL [--queue NAME ...] [--host 127.0.0.1] [--port 8080]
                       [--actions] [--token-file PATH] [--read-token-file PATH]
                       [--allowed-host NAME ...] [--behind-tls] [--trusted-proxy CIDR ...] [--unauthenticated-reads]

Read-only unless --actions is given together with a token (--token-file, or
EFFECTMQ_DASHBOARD_TOKEN). Reading is open unless a read token is given
(--read-token-file, or EFFECTMQ_DASHBOARD_READ_TOKEN): then every page needs it (or
the action token). Binds 127.0.0.1 unless --host says otherwise; an address other
hosts reach needs a read token, or --unauthenticated-reads to say that anyone who
reaches it may read every queue. Tokens are at least 16 characters. Only requests
naming a loopback host or one given with --allowed-host are answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

from ..clitools import URL_HELP, CommandError, env, env_flag, log_level_option, needs_extras, port
from ..transport.connection import url_from_env
from ..errors import InvalidOption

log = logging.getLogger("effectmq.dashboard")

WILDCARD_BINDS = ("", "0.0.0.0", "::", "*")


class StartupError(CommandError):
    """A configuration the dashboard refuses to start with (exit status 2)."""


def read_token(token_file: str | None, variable: str = "EFFECTMQ_DASHBOARD_TOKEN") -> str | None:
    """The token from the file (surrounding whitespace dropped) or the environment variable."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise StartupError(f"cannot read the token file {token_file!r}: {exc.strerror}") from None
        if not token:
            raise StartupError(f"the token file {token_file!r} is empty")
        return token
    return os.environ.get(variable) or None


def _names(values: list[str] | None, variable: str) -> list[str]:
    return values or [n.strip() for n in (env(variable) or "").split(",") if n.strip()]


def config_from_args(args):
    from . import auth
    from .service import DashboardConfig

    token = read_token(args.token_file)
    read = read_token(args.read_token_file, "EFFECTMQ_DASHBOARD_READ_TOKEN")
    if args.actions and not token:
        raise StartupError("--actions needs a token: --token-file PATH or EFFECTMQ_DASHBOARD_TOKEN "
                           "(without --actions the dashboard is read-only)")
    if not auth.is_loopback(args.host) and not read and not args.unauthenticated_reads:
        raise StartupError(f"--host {args.host or '(every address)'} can be reached from other hosts, and without a "
                           "read token anyone who reaches it reads every queue: give one with --read-token-file "
                           "PATH (or EFFECTMQ_DASHBOARD_READ_TOKEN), or say that is meant with "
                           "--unauthenticated-reads (behind an authenticating proxy, or a NetworkPolicy)")
    allowed = _names(args.allowed_host, "EFFECTMQ_DASHBOARD_ALLOWED_HOSTS")
    if args.host not in WILDCARD_BINDS and not auth.is_loopback(args.host):
        allowed.append(args.host)  # the address it is reached at
    try:
        return DashboardConfig(url=args.url or url_from_env(), queues=_names(args.queue, "EFFECTMQ_DASHBOARD_QUEUES"),
                               prefix=args.prefix, actions=bool(args.actions), token=token if args.actions else None,
                               scheduler_namespace=args.scheduler_namespace, read_token=read, allowed_hosts=allowed,
                               behind_tls=bool(args.behind_tls), want_events=True if args.want_events else None,
                               trusted_proxies=tuple(_names(args.trusted_proxy, "EFFECTMQ_DASHBOARD_TRUSTED_PROXIES")))
    except InvalidOption as exc:
        raise StartupError(str(exc)) from None


async def cmd_dashboard(args) -> int:
    config = config_from_args(args)
    with needs_extras("effectmq dashboard"):
        from aiohttp import web

        from .web import create_app
    app = create_app(config)
    from aiohttp import web_response

    from .web import SERVER_NAME

    # The app names no version (web.SERVER_NAME); this process also answers what aiohttp's
    # parser refuses itself (malformed requests), with the default Server header.
    if hasattr(web_response, "SERVER_SOFTWARE"):
        web_response.SERVER_SOFTWARE = SERVER_NAME
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
        mode = "actions enabled" if config.actions else "read-only"
        reads = "reads need a token" if config.read_token else "reads open"
        log.info("dashboard on http://%s:%d (%s, %s, Redis %s)", args.host, args.port, mode, reads, app_url(app))
        if not config.read_token and args.unauthenticated_reads:
            log.warning("dashboard listens on %s without a read token (--unauthenticated-reads): anyone who "
                        "reaches port %d reads every queue it shows", args.host or "every address", args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def app_url(app) -> str:
    from .web import SERVICE

    return app[SERVICE].shown_url


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="serve the web dashboard", description=__doc__.splitlines()[0])
    p.add_argument("--url", help=URL_HELP)
    p.add_argument("--queue", "-q", action="append", metavar="NAME",
                   help="a queue to show (repeat it); default: every queue found in Redis "
                   "[EFFECTMQ_DASHBOARD_QUEUES, comma-separated]")
    p.add_argument("--host", default=env("EFFECTMQ_DASHBOARD_HOST", "127.0.0.1"),
                   help="address to bind [EFFECTMQ_DASHBOARD_HOST]")
    p.add_argument("--port", type=port, default=env("EFFECTMQ_DASHBOARD_PORT", 8080, port),
                   help="port to listen on [EFFECTMQ_DASHBOARD_PORT]")
    p.add_argument("--actions", action="store_true",
                   default=env_flag("EFFECTMQ_DASHBOARD_ACTIONS"),
                   help="enable retry/cancel/pause/suspend (needs a token) [EFFECTMQ_DASHBOARD_ACTIONS=true]")
    p.add_argument("--token-file", default=env("EFFECTMQ_DASHBOARD_TOKEN_FILE"),
                   help="file holding the action token [EFFECTMQ_DASHBOARD_TOKEN_FILE]; "
                   "or the token itself in EFFECTMQ_DASHBOARD_TOKEN")
    p.add_argument("--read-token-file", default=env("EFFECTMQ_DASHBOARD_READ_TOKEN_FILE"),
                   help="file holding the read token: every page then needs it, or the action token "
                   "[EFFECTMQ_DASHBOARD_READ_TOKEN_FILE]; or the token itself in EFFECTMQ_DASHBOARD_READ_TOKEN")
    p.add_argument("--unauthenticated-reads", action="store_true",
                   default=env_flag("EFFECTMQ_DASHBOARD_UNAUTHENTICATED_READS"),
                   help="bind an address other hosts reach without a read token: anyone who reaches it reads "
                   "every queue [EFFECTMQ_DASHBOARD_UNAUTHENTICATED_READS=true]")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a host name the dashboard answers to besides loopback ones (repeat it; * for any); "
                   "requests naming others get 421 [EFFECTMQ_DASHBOARD_ALLOWED_HOSTS, comma-separated]")
    p.add_argument("--behind-tls", action="store_true",
                   default=env_flag("EFFECTMQ_DASHBOARD_BEHIND_TLS"),
                   help="served through TLS (an ingress): the session cookie is Secure "
                   "[EFFECTMQ_DASHBOARD_BEHIND_TLS=true]")
    p.add_argument("--trusted-proxy", action="append", metavar="CIDR",
                   help="a proxy (address or network) whose X-Forwarded-For names the client, so the sign-in "
                   "limit counts each client apart behind an ingress (repeat it) "
                   "[EFFECTMQ_DASHBOARD_TRUSTED_PROXIES, comma-separated]")
    p.add_argument("--want-events", action="store_true",
                   default=env_flag("EFFECTMQ_DASHBOARD_WANT_EVENTS"),
                   help="keep lifecycle events written for every queue shown (a write per queue every 20 s), "
                   "as --actions does; a read-only dashboard otherwise writes nothing "
                   "[EFFECTMQ_DASHBOARD_WANT_EVENTS=true]")
    p.add_argument("--prefix", default=env("EFFECTMQ_PREFIX", "emq"), help="key prefix in Redis [EFFECTMQ_PREFIX]")
    p.add_argument("--scheduler-namespace", default=env("EFFECTMQ_SCHEDULER_NAMESPACE"),
                   help="the scheduler namespace whose schedules to show; default: every namespace that holds a "
                   "schedule (docs/cli.md, Scheduler namespaces) [EFFECTMQ_SCHEDULER_NAMESPACE]")
    log_level_option(p)
    p.set_defaults(run=cmd_dashboard)

