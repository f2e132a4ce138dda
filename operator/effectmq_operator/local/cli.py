"""`effectmq local`: run Queue and Schedule manifests on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .manifests import ManifestError, load


def register(sub) -> None:
    p = sub.add_parser("local", help="run Queue and Schedule manifests locally (Redis, workers, schedules)")
    p.add_argument("paths", nargs="*", default=["examples/k8s"],
                   help="manifest files or directories (default: the example application)")
    p.add_argument("--data-dir", default=".effectmq/local", help="Redis data and worker logs (kept across runs)")
    p.add_argument("--redis-port", type=int, default=6390, help="port of the local redis-server")
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--pythonpath", action="append", default=None,
                   help="where the handler packages are (default: examples)")
    p.add_argument("--burst", type=int, default=0, help="offer this many tasks at start, to watch workers scale")
    p.add_argument("--burst-task", default="send_email", help="task name of the burst")
    p.add_argument("--no-view", action="store_true", help="status lines instead of the live view")
    p.add_argument("--stop-after", type=float, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(run=run)


async def run(args) -> int:
    from .runner import LocalError, LocalRunner

    try:
        resources = load(args.paths)
    except ManifestError as exc:
        print(f"effectmq local: invalid manifest: {exc}", file=sys.stderr)
        return 2
    runner = LocalRunner(resources, data_dir=Path(args.data_dir), redis_port=args.redis_port,
                         redis_url=args.redis_url, pythonpath=args.pythonpath or ["examples"],
                         live_view=not args.no_view, burst=args.burst, burst_task=args.burst_task,
                         stop_after=args.stop_after)
    try:
        await runner.run()
    except LocalError as exc:
        print(f"effectmq local: {exc}", file=sys.stderr)
        return 1
    return 0
