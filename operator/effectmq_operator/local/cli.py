"""`effectmq local`: run Queue and Schedule manifests on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from effectmq.clitools import FAILED, CommandError, deprecated, log_level_option, needs_extras, port
from effectmq.transport.connection import URL_KINDS

from .manifests import ManifestError, load


def register(sub) -> None:
    p = sub.add_parser("local", help="run Queue and Schedule manifests locally (Redis, workers, schedules); "
                       "needs effectmq[operator]",
                       description="Run Queue and Schedule manifests on this machine: a local redis-server (or "
                       "--url), the schedules, and workers scaled on backlog as the operator would. Needs the "
                       "operator extra: pip install 'effectmq[operator]'.")
    p.add_argument("paths", nargs="*", default=["examples/k8s"],
                   help="manifest files or directories (default: the example application)")
    p.add_argument("--data-dir", default=".effectmq/local", help="Redis data and worker logs (kept across runs)")
    p.add_argument("--redis-port", type=port, default=6390, help="port of the local redis-server")
    p.add_argument("--url", help=f"use this Redis, {URL_KINDS}, instead of starting one; default: a redis-server "
                   "on --redis-port with its data in --data-dir")
    deprecated(p, "--redis-url", replacement="--url", dest="url")
    p.add_argument("--pythonpath", action="append", default=None,
                   help="where the handler packages are, repeat it (default: examples)")
    p.add_argument("--burst", type=int, default=0, help="offer this many tasks at start, to watch workers scale")
    p.add_argument("--burst-task", default="send_email", help="task name of the burst")
    p.add_argument("--burst-payload", type=json_object, metavar="JSON",
                   help="payload of every task of the burst, a JSON object; default: a new address for each "
                   "(send_email's)")
    p.add_argument("--dashboard-port", type=port,
                   help="also serve the web dashboard (the dashboard extra) on 127.0.0.1 at this port; default: none")
    p.add_argument("--no-view", action="store_true", help="status lines instead of the live view")
    p.add_argument("--stop-after", type=float, help=argparse.SUPPRESS)  # the tests' stop
    log_level_option(p, default="WARNING")
    p.set_defaults(run=run)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


async def run(args) -> int:
    with needs_extras("effectmq local"):  # manifests are checked with CEL (cel-python)
        from .runner import LocalError, LocalRunner

        try:
            resources = load(args.paths)
        except ManifestError as exc:
            raise CommandError(f"invalid manifest: {exc}") from None
    runner = LocalRunner(resources, data_dir=Path(args.data_dir), redis_port=args.redis_port,
                         redis_url=args.url, pythonpath=args.pythonpath or ["examples"],
                         live_view=not args.no_view, burst=args.burst, burst_task=args.burst_task,
                         burst_payload=args.burst_payload,
                         stop_after=args.stop_after, dashboard_port=args.dashboard_port)
    try:
        await runner.run()
    except LocalError as exc:
        raise CommandError(str(exc), FAILED) from None
    return 0
