"""The Lua scripts of the storage protocol, one per atomic operation, and their runner.

Each script in ``lua/`` is prefixed with ``lua/lib.lua`` and called by SHA
(EVALSHA); when Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH) the
runner loads it and sends the call again.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources
from typing import Any, Sequence

import redis
import redis.exceptions as redis_errors

from .connection import TRANSPORT_ERRORS

try:  # hiredis packs commands in C; redis-py's own packer is the fallback
    from hiredis import pack_command as _pack
except ImportError:  # pragma: no cover - hiredis is a declared dependency
    _pack = None

OPERATIONS = (
    "offer", "acquire", "renew", "complete", "fail", "release", "progress",
    "cancel", "retry", "maintain", "stats", "configure", "workers",
)
# Safe to send again after a lost connection: each is idempotent for the same
# arguments (explicit or pre-generated task ids, lease tokens). acquire is not:
# a repeat could lease a second task nobody runs, so the worker retries it instead.
RETRY_SAFE = frozenset(OPERATIONS) - {"acquire"}
# redis-py 5.3 deprecated naming the command when taking a pooled connection.
_CONNECTION_ARGS = () if tuple(map(int, redis.__version__.split(".")[:2])) >= (5, 3) else ("EVALSHA",)


@cache
def source(operation: str) -> str:
    lua = resources.files(__package__) / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{operation}.lua").read_text()


@cache
def sha(operation: str) -> str:
    return hashlib.sha1(source(operation).encode()).hexdigest()


class ScriptRunner:
    """Calls scripts over a redis-py asyncio pool with as little overhead as possible.

    The hot path packs EVALSHA once (keys pre-encoded) and talks to a pooled
    connection directly; a connection interrupted mid-call is discarded, never
    reused with an unread reply.
    """

    def __init__(self, client, keys: Sequence[str]):
        self.client = client
        self.pool = client.connection_pool
        self.keys = [k.encode() for k in keys]
        self.nkeys = len(self.keys)

    def _packed(self, operation: str, argv: Sequence[Any]):
        command = ("EVALSHA", sha(operation), self.nkeys, *self.keys, *argv)
        if _pack is not None:
            return _pack(command)
        return self.pool.connection_class(**self.pool.connection_kwargs).pack_command(*command)

    async def _send(self, packed) -> Any:
        conn = await self.pool.get_connection(*_CONNECTION_ARGS)
        try:
            await conn.send_packed_command(packed, check_health=False)
            return await conn.read_response()
        except BaseException as exc:
            if not isinstance(exc, redis_errors.ResponseError):
                await conn.disconnect()  # the reply may still be in flight
            raise
        finally:
            await self.pool.release(conn)

    async def __call__(self, operation: str, argv: Sequence[Any]) -> Any:
        packed = self._packed(operation, argv)
        loaded = resent = False
        while True:
            try:
                return await self._send(packed)
            except redis_errors.NoScriptError:
                if loaded:
                    raise
                await self.client.script_load(source(operation))
                loaded = True
            except TRANSPORT_ERRORS:
                if resent or operation not in RETRY_SAFE:
                    raise
                resent = True  # once, on a fresh connection
