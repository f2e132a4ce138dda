"""The operator's Redis clients on real redis-servers: shared per distinct Redis, and
closed once nobody uses them (a rotated Secret leaves its old URL behind)."""

from __future__ import annotations

import asyncio

from effectmq_operator.connections import IDLE_CLIENT, Connections, RedisTarget


async def settles_at(server, expected: int, timeout: float = 2.0) -> bool:
    """Whether the server's count of other connections is (or becomes, within `timeout`:
    a connection closed on our side is dropped on the server's next loop) `expected`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (count := others(server)) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return count == expected


def others(server) -> int:
    """Connections the server holds, except the one asking."""
    client = server.client()
    try:
        own = client.client_id()
        return sum(1 for c in client.client_list() if int(c["id"]) != own)
    finally:
        client.close()


async def test_a_client_nobody_uses_is_closed(make_redis):
    old, new = make_redis(), make_redis()
    now = [1000.0]
    connections = Connections(kube=None, clock=lambda: now[0])
    try:
        old_target, new_target = RedisTarget(old.url), RedisTarget(new.url)
        assert connections.queue(old_target, "a").redis is connections.queue(old_target, "b").redis
        await connections.queue(old_target, "a").stats()
        assert await settles_at(old, 1), others(old)
        now[0] += IDLE_CLIENT / 2
        await connections.queue(new_target, "a").stats()
        assert await settles_at(old, 1), "still in use a while ago"
        now[0] += IDLE_CLIENT / 2 + 1
        await connections.queue(new_target, "a").stats()
        assert await settles_at(old, 0)  # the close runs on its own
        assert await settles_at(new, 1), others(new)
    finally:
        await connections.close()
