"""Run the operator: `python -m effectmq_operator [--namespace NS ...]`."""

from __future__ import annotations

import argparse
import asyncio
import os

import kopf
from prometheus_client import start_http_server

from . import handlers  # noqa: F401  (registers the handlers)
from .connections import CONNECTIONS_PER_REDIS
from .controller import RECONCILES_AT_ONCE
from .kube import API_THREADS


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {text!r}")
    return value


def _env(name: str, default: int) -> str:
    return os.environ.get(name) or str(default)  # argparse checks a string default with `type`


def main() -> None:
    parser = argparse.ArgumentParser(prog="effectmq-operator", description="The EffectMQ Kubernetes operator")
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only these namespaces (default: the whole cluster)")
    parser.add_argument("--liveness", default=os.environ.get("EFFECTMQ_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
                        help="liveness endpoint URL (kopf)")
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("EFFECTMQ_OPERATOR_METRICS_PORT", "9090")),
                        help="Prometheus metrics port (0: off)")
    parser.add_argument("--api-threads", type=_positive, default=_env("EFFECTMQ_OPERATOR_API_THREADS", API_THREADS),
                        help=f"Kubernetes API calls in flight at once (default {API_THREADS})")
    parser.add_argument("--redis-connections", type=_positive,
                        default=_env("EFFECTMQ_OPERATOR_REDIS_CONNECTIONS", CONNECTIONS_PER_REDIS),
                        help=f"connections, and polls at once, per distinct Redis (default {CONNECTIONS_PER_REDIS})")
    parser.add_argument("--reconciles", type=_positive, default=_env("EFFECTMQ_OPERATOR_RECONCILES", RECONCILES_AT_ONCE),
                        help=f"Queue reconciles in flight at once (default {RECONCILES_AT_ONCE})")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    kopf.configure(verbose=args.verbose, log_prefix=True)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    namespaces = args.namespace or [n for n in os.environ.get("EFFECTMQ_WATCH_NAMESPACES", "").split(",") if n]
    asyncio.run(kopf.operator(
        clusterwide=not namespaces, namespaces=namespaces, standalone=True, liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(namespaces=namespaces, api_threads=args.api_threads, redis_connections=args.redis_connections,
                       reconciles=args.reconciles),
    ))


if __name__ == "__main__":
    main()
