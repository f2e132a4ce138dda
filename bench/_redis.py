"""A private redis-server for benchmarks (or an existing one given by URL)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time

import redis


def start_redis(prefix: list[str] = (), *, wait: float = 4.0,
                binary: str | None = None) -> tuple[subprocess.Popen, int, str]:
    """A redis-server (`binary`, else the one on PATH; run under `prefix`, e.g. valgrind) on
    a free loopback port, without persistence, answering PING; returns the process, its
    port and its folder."""
    binary = binary or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install the Debian package redis-server or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="effectmq-bench-")
    proc = subprocess.Popen([*prefix, binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL if prefix else None)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + wait
    while True:
        try:
            client.ping()
            return proc, port, workdir
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise SystemExit(f"redis-server on port {port} did not answer within {wait}s") from None
            time.sleep(0.02)


@contextlib.contextmanager
def private_redis(url: str | None = None):
    if url:
        yield url
        return
    proc, port, _ = start_redis()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait()


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command since start (commands inside scripts included)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}


def calls_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


@contextlib.asynccontextmanager
async def private_client():
    """An asyncio client (decoded replies) of a private redis-server, stopped on exit."""
    import redis.asyncio as aioredis

    proc, port, _ = start_redis()
    client = aioredis.Redis(port=port, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()
        proc.terminate()
        proc.wait()
