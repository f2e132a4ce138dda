"""Redis server time: the one clock leases, delays and schedules are measured by."""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster


async def server_time_ms(client: Any, key: str) -> int:
    """Redis time (ms) of the server that holds `key`: on a cluster, the master of its
    slot (redis-py sends a keyless TIME to any node, and refuses it in a pipeline)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        seconds, micros = await client.execute_command("TIME", target_nodes=client.get_node_from_key(key))
    else:
        seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000
