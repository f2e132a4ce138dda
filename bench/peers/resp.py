"""A minimal synchronous Redis client (stdlib only) for the harness's own calls.

The harness runs inside every library's virtualenv, each with its own redis-py
version (or none), so its INFO/FLUSHALL/SCRIPT calls go through this instead.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse


class RedisError(Exception):
    pass


class Resp:
    def __init__(self, url: str, timeout: float = 30.0):
        parsed = urlparse(url)
        self.sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")
        db = (parsed.path or "/0").strip("/") or "0"
        if db != "0":
            self.call("SELECT", db)

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def __enter__(self) -> "Resp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def call(self, *args):
        parts = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        self.sock.sendall(b"".join(parts))
        return self._read()

    def _read(self):
        line = self.file.readline()
        if not line:
            raise RedisError("connection closed")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.file.read(n + 2)[:-2]
            return data.decode(errors="replace")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise RedisError(f"unexpected reply {line!r}")

    def info(self, section: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.call("INFO", section).splitlines():
            if line and not line.startswith("#") and ":" in line:
                key, _, value = line.partition(":")
                out[key] = value
        return out


def command_stats(client: Resp) -> tuple[dict[str, int], dict[str, int]]:
    """Calls and microseconds per command since the server started (commands run by
    scripts included, each in its own entry and again in its script's time)."""
    calls, usec = {}, {}
    for key, value in client.info("commandstats").items():
        fields = dict(item.split("=", 1) for item in value.split(","))
        name = key.removeprefix("cmdstat_")
        calls[name], usec[name] = int(fields["calls"]), int(fields["usec"])
    return calls, usec


def cpu_seconds(client: Resp) -> float:
    """Redis server CPU (user + system, all threads) since it started."""
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def used_memory(client: Resp) -> dict[str, int]:
    """INFO memory used_memory, and `data`: used_memory without the clients' memory and
    the script cache (a producer's 100 pooled connections can hold KBs of query buffer
    each: divided over the prefilled tasks they would pass for memory per task). The
    clients' share is CLIENT LIST tot-mem, computed when asked (INFO's
    mem_clients_normal is refreshed by a cron and lags)."""
    clients = sum(int(field.split("=", 1)[1]) for line in client.call("CLIENT", "LIST").splitlines()
                  for field in line.split() if field.startswith("tot-mem="))
    info = client.info("memory")
    used = int(info["used_memory"])
    return {"used_memory": used, "data": used - clients - int(info.get("used_memory_scripts", 0) or 0),
            "clients": clients}


def snapshot(client: Resp) -> dict:
    calls, usec = command_stats(client)
    return {"calls": calls, "usec": usec, "cpu": cpu_seconds(client)}


def delta(before: dict, after: dict) -> dict:
    """Commands and CPU between two snapshots; INFO itself (the harness's) is left out."""
    calls = {k: after["calls"].get(k, 0) - before["calls"].get(k, 0) for k in after["calls"]}
    calls = {k: v for k, v in calls.items() if v and k != "info"}
    usec = {k: after["usec"].get(k, 0) - before["usec"].get(k, 0) for k in calls}
    return {"calls": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
            "usec": dict(sorted(usec.items(), key=lambda kv: -kv[1])), "cpu": after["cpu"] - before["cpu"]}
