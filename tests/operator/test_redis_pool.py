"""The operator's Redis clients on real redis-servers: shared per distinct Redis, and
closed once nobody uses them (a rotated Secret leaves its old URL behind); and what
they tell a Queue's author about a Redis that does not answer."""

from __future__ import annotations

import asyncio
import logging

import pytest

from effectmq.transport.redaction import redact_url
from effectmq_operator.redis_pool import IDLE_CLIENT, Connections, RedisTarget
from effectmq_operator.spec import RedisSpec
from tests.operator.endpoints import endpoints


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


async def problem_at(connections: Connections, url: str, deadline: float = 10.0):
    """The Problem a Queue's poll of `url` ends with, its URL replaced by <URL>."""
    target = await connections.target("ns", RedisSpec(url=url))
    with pytest.raises(Exception) as caught:
        await connections.poll(target, lambda: connections.queue(target, "ns/q").stats(), deadline)
    problem = connections.problem(caught.value, target)
    return problem.reason, problem.message.replace(redact_url(target.url), "<URL>")


async def test_what_does_not_answer_as_redis_gets_one_message_whatever_it_is(caplog):
    """A Queue's author writes spec.redis.url, the operator connects from its
    own place in the network, and the status said what came back: "Connection refused"
    for a closed port, "Protocol error, got 'H'" for an HTTP server, a timeout for a
    firewall, "Name or service not known" for a name: a port scanner. Now one message
    for all of them; the cause goes to the operator's log (debug), for the platform team."""
    caplog.set_level(logging.DEBUG, logger="effectmq.operator.connections")
    connections = Connections(kube=None, socket_timeout=1.0)
    try:
        with endpoints() as at:
            seen = {kind: await problem_at(connections, endpoint.url()) for kind, endpoint in at.items()}
            seen["TLS to the HTTP server"] = await problem_at(connections, at["garbage"].url("rediss"))
            seen["TLS to the closed port"] = await problem_at(connections, at["closed"].url("rediss"))
            seen["a Sentinel that is an HTTP server"] = await problem_at(
                connections, f"redis+sentinel://127.0.0.1:{at['garbage'].port}/mymaster")
            seen["a cluster seed that is an HTTP server"] = await problem_at(
                connections, f"redis+cluster://127.0.0.1:{at['garbage'].port}")
            seen["a socket path"] = await problem_at(connections, "unix:///nonexistent/redis.sock")
            seen["a name"] = await problem_at(connections, "redis://no-such-host.invalid:6379/0")
            # silent, and the poll's own deadline (shorter than the socket's timeout) ends it
            seen["silent past the poll's deadline"] = await problem_at(connections, at["silent"].url(), deadline=0.3)
    finally:
        await connections.close()
    assert set(seen.values()) == {seen["closed"]}, seen
    reason, message = seen["closed"]
    assert reason == "RedisUnreachable"
    assert message.startswith("Redis at <URL> did not answer as a Redis server: check spec.redis"), message
    # the details are in the operator's log, for the platform team
    logged = caplog.text
    assert "Connect call failed" in logged or "Connection refused" in logged, logged
    assert "Protocol error" in logged and "Timeout" in logged, logged


async def test_a_redis_that_answers_is_still_told_apart(make_redis):
    """What only a Redis can answer (a wrong or missing password, an ACL) needs no
    secret kept: the author learns their Redis is there and what it said."""
    server = make_redis(password="answ3red-pw")
    connections = Connections(kube=None, socket_timeout=1.0)
    try:
        wrong = await problem_at(connections, server.url.replace("answ3red-pw", "wrong"))
        missing = await problem_at(connections, f"redis://127.0.0.1:{server.port}/0")
    finally:
        await connections.close()
    for _reason, message in (wrong, missing):
        assert "did not answer as a Redis server" not in message, message
        assert "answ3red-pw" not in message
    assert "invalid username-password pair" in wrong[1] or "WRONGPASS" in wrong[1], wrong
    assert "Authentication required" in missing[1] or "NOAUTH" in missing[1], missing
