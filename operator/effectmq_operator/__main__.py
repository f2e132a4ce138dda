"""Run the operator: `python -m effectmq_operator [--namespace NS ...]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys

from effectmq.clitools import USAGE, HelpFormatter, Parser, missing_extra, say
from effectmq.worker.tracing import setup_sdk

PROG = "effectmq-operator"


def _whole(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(text)
        return value
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):  # nan and inf parse as floats
        raise ValueError(text)
    return value


def _option(parser: argparse.ArgumentParser, flag: str, env: str, default: object, parse, kind: str, help: str) -> None:
    """An option whose default comes from $env; a bad value, given either way, is a usage
    error (exit 2) that names both, instead of a traceback."""
    def checked(text: str):
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, not {text!r} (from {flag} or ${env})") from None
    # argparse runs `type` on a string default too: the environment's value is checked the same way
    parser.add_argument(flag, type=checked, default=os.environ.get(env) or str(default), help=f"{help} (${env})")


def build_parser() -> argparse.ArgumentParser:
    """The operator's options; their defaults come from the modules that use them, which
    need the operator extra (kopf, kubernetes)."""
    from .queue_controller import RECONCILES_AT_ONCE
    from .redis_pool import CONNECTIONS_PER_REDIS
    from .runtime.kube import API_THREADS
    from .runtime.leader import LEASE_SECONDS

    parser = Parser(prog=PROG, description="The EffectMQ Kubernetes operator: reconciles Queues and Schedules.",
                    formatter_class=HelpFormatter)
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="a Kubernetes namespace to watch (repeat it); default: $EFFECTMQ_WATCH_NAMESPACES "
                        "(comma-separated), else the whole cluster")
    parser.add_argument("--liveness",
                        default=os.environ.get("EFFECTMQ_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
                        help="liveness endpoint URL, served by kopf ($EFFECTMQ_OPERATOR_LIVENESS)")
    _option(parser, "--metrics-port", "EFFECTMQ_OPERATOR_METRICS_PORT", 9090, _whole(0, 65535), "a port number",
            "Prometheus metrics port (0: off)")
    _option(parser, "--lease-seconds", "EFFECTMQ_OPERATOR_LEASE_SECONDS", LEASE_SECONDS, _seconds,
            "a positive number of seconds", "leader election: how long a leader's Lease lasts")
    _option(parser, "--api-threads", "EFFECTMQ_OPERATOR_API_THREADS", API_THREADS, _whole(1), "a positive whole number",
            "Kubernetes API calls in flight at once")
    _option(parser, "--redis-connections", "EFFECTMQ_OPERATOR_REDIS_CONNECTIONS", CONNECTIONS_PER_REDIS, _whole(1),
            "a positive whole number", "connections, and polls at once, per distinct Redis")
    _option(parser, "--reconciles", "EFFECTMQ_OPERATOR_RECONCILES", RECONCILES_AT_ONCE, _whole(1),
            "a positive whole number", "Queue reconciles in flight at once")
    parser.add_argument("--verbose", action="store_true", help="log kopf's debug messages")
    return parser


def main() -> None:
    try:
        import kopf
        from prometheus_client import start_http_server

        from .handlers import OperatorOptions  # importing handlers registers them with kopf

        parser = build_parser()
    except ModuleNotFoundError as exc:
        hint = missing_extra(exc, PROG)
        if hint is None:
            raise
        say("error", str(hint), PROG)
        sys.exit(USAGE)
    args = parser.parse_args()
    kopf.configure(verbose=args.verbose, log_prefix=True)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    if exporting := setup_sdk(service="effectmq-operator"):  # the Schedules' ticks are trace roots
        logging.getLogger("effectmq.operator").info("exporting traces (OTEL_* variables): %s", exporting)
    namespaces = args.namespace or [n for n in os.environ.get("EFFECTMQ_WATCH_NAMESPACES", "").split(",") if n]
    asyncio.run(kopf.operator(
        clusterwide=not namespaces, namespaces=namespaces, standalone=True, liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(options=OperatorOptions(tuple(namespaces), api_threads=args.api_threads,
                                               redis_connections=args.redis_connections, reconciles=args.reconciles,
                                               lease_seconds=args.lease_seconds)),
    ))


if __name__ == "__main__":
    main()
