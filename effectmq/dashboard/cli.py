"""`effectmq dashboard`: serve the web dashboard (see effectmq.dashboard).

    effectmq dashboard --url URL [--queue NAME ...] [--host 127.0.0.1] [--port 8080]
                       [--actions] [--token-file PATH]

Read-only unless --actions is given together with a token (--token-file, or
EFFECTMQ_DASHBOARD_TOKEN). Binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from ..clitools import URL_HELP, env

log = logging.getLogger("effectmq.dashboard")


class StartupError(Exception):
    """A configuration the dashboard refuses to start with (exit status 2)."""


def read_token(token_file: str | None) -> str | None:
    """The token from the file (surrounding whitespace dropped) or EFFECTMQ_DASHBOARD_TOKEN."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise StartupError(f"cannot read the token file {token_file!r}: {exc.strerror}") from None
        if not token:
            raise StartupError(f"the token file {token_file!r} is empty")
        return token
    return os.environ.get("EFFECTMQ_DASHBOARD_TOKEN") or None


def config_from_args(args):
    from .service import DashboardConfig

    token = read_token(args.token_file)
    if args.actions and not token:
        raise StartupError("--actions needs a token: --token-file PATH or EFFECTMQ_DASHBOARD_TOKEN "
                           "(without --actions the dashboard is read-only)")
    queues = args.queue or [n.strip() for n in (env("EFFECTMQ_DASHBOARD_QUEUES") or "").split(",") if n.strip()]
    return DashboardConfig(url=args.url, queues=queues, prefix=args.prefix,
                           actions=bool(args.actions), token=token if args.actions else None,
                           scheduler_namespace=args.scheduler_namespace)


async def cmd_dashboard(args) -> int:
    try:
        config = config_from_args(args)
        from aiohttp import web

        from .web import create_app
    except StartupError as exc:
        print(f"effectmq dashboard: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(f"effectmq dashboard: {exc.name} is missing: pip install 'effectmq[dashboard]'", file=sys.stderr)
        return 2
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
        mode = "actions enabled" if config.actions else "read-only"
        log.info("dashboard on http://%s:%d (%s, Redis %s)", args.host, args.port, mode, app_url(app))
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
    p.add_argument("--url", default=env("EFFECTMQ_REDIS_URL"), help=URL_HELP)
    p.add_argument("--queue", "-q", action="append", metavar="NAME",
                   help="a queue to show (repeat it); default: every queue found in Redis "
                   "[EFFECTMQ_DASHBOARD_QUEUES, comma-separated]")
    p.add_argument("--host", default=env("EFFECTMQ_DASHBOARD_HOST", "127.0.0.1"),
                   help="address to bind [EFFECTMQ_DASHBOARD_HOST, default 127.0.0.1]")
    p.add_argument("--port", type=int, default=env("EFFECTMQ_DASHBOARD_PORT", 8080, int),
                   help="[EFFECTMQ_DASHBOARD_PORT, default 8080]")
    p.add_argument("--actions", action="store_true",
                   default=(env("EFFECTMQ_DASHBOARD_ACTIONS") or "").lower() == "true",
                   help="enable retry/cancel/pause/suspend (needs a token) [EFFECTMQ_DASHBOARD_ACTIONS=true]")
    p.add_argument("--token-file", default=env("EFFECTMQ_DASHBOARD_TOKEN_FILE"),
                   help="file holding the action token [EFFECTMQ_DASHBOARD_TOKEN_FILE]; "
                   "or the token itself in EFFECTMQ_DASHBOARD_TOKEN")
    p.add_argument("--prefix", default=env("EFFECTMQ_PREFIX", "emq"), help="key prefix [EFFECTMQ_PREFIX]")
    p.add_argument("--scheduler-namespace", default=env("EFFECTMQ_SCHEDULER_NAMESPACE", "default"),
                   help="whose schedules to show [EFFECTMQ_SCHEDULER_NAMESPACE]")
    p.add_argument("--log-level", default=env("EFFECTMQ_LOG_LEVEL", "INFO"), help="[EFFECTMQ_LOG_LEVEL]")
    p.set_defaults(run=cmd_dashboard)
