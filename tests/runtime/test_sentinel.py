"""Redis Sentinel: a queue and a worker reach Redis through redis+sentinel:// and
keep working when the primary is SIGKILLed and a Sentinel promotes the replica.

Everything here is real: redis-server processes for the primary, its replica and
three Sentinels (tests/fixtures/sentinel.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import pytest
import redis.exceptions as redis_errors
from redis.asyncio.sentinel import SentinelConnectionPool

import effectmq
from effectmq.transport.connection import TlsOptions, connect
from effectmq.transport.sentinel import BlockingSentinelConnectionPool, SentinelRedis, is_sentinel_url
from tests.fixtures.redis import server_version

QUEUE = "failover"


async def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def replicas_acknowledging(queue: effectmq.TaskQueue) -> int:
    """WAIT 1 on the producer's only connection, the one that carried its last offer
    (WAIT counts the replicas that have this connection's writes so far)."""
    pool = queue.redis.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_command("WAIT", 1, 1000, check_health=False)
        return int(await conn.read_response())
    except (redis_errors.ConnectionError, redis_errors.TimeoutError):
        await conn.disconnect()
        return 0
    finally:
        await pool.release(conn)


@pytest.mark.slow
async def test_failover_keeps_every_replicated_offer_and_the_worker(make_sentinel, caplog):
    """SIGKILL the primary mid-run: after the promotion every offer we may count on
    completes exactly once (one record, state completed), and the worker carries on.

    What replication lets us promise. Replication is asynchronous: the old primary
    confirms an offer before its replica has it, so an offer it confirmed in the last
    moment before the kill can be missing on the promoted replica, and no client
    setting changes that. What the producer can learn is whether a replica has it:
    after each offer it issues WAIT 1 on the same connection (max_connections=1).
    So the test asserts, for exactly these offers:

    - replicated: confirmed by the old primary and acknowledged by WAIT >= 1;
    - after-kill: an offer attempt that started after the kill and was confirmed:
      only the new primary can have confirmed it (the old one is dead, the replica
      refuses writes until promoted); retries of an offer that raised
      RedisUnavailable reuse its id (offers are idempotent), so an offer the old
      primary may have applied lands exactly once on the new one;

    each has exactly one record on the new primary, in state completed. Offers the
    old primary confirmed without a WAIT acknowledgement ("unreplicated") may be
    lost: each is either absent or completed, never stuck or failed. A task whose
    completion was lost with the old primary runs again (at-least-once): counted,
    not forbidden. The worker must keep running throughout (no exception escaping
    its loops) and execute after-kill tasks, which only the new primary holds.
    """
    deployment = make_sentinel()
    url = deployment.url()
    assert is_sentinel_url(url)
    caplog.set_level(logging.WARNING, logger="effectmq")
    options = dict(url=url, lock_timeout=2.0, max_stalled_count=50, socket_timeout=3.0)
    producer = effectmq.TaskQueue(QUEUE, max_connections=1, **options)
    consumer = effectmq.TaskQueue(QUEUE, **options)
    assert isinstance(producer.redis.connection_pool, BlockingSentinelConnectionPool)
    assert producer.redis.connection_pool.max_connections == 1

    executions: collections.Counter[str] = collections.Counter()

    async def work(payload, ctx):
        executions[ctx.task_id] += 1
        return payload

    replicated: set[str] = set()
    after_kill: set[str] = set()
    unreplicated: set[str] = set()
    retried_offers = 0
    killed = False
    stop_producing = asyncio.Event()

    async def produce() -> None:
        nonlocal retried_offers
        number = 0
        while not stop_producing.is_set():
            task_id = f"t{number:05d}"
            number += 1
            while True:
                started_after_kill = killed
                try:
                    await producer.offer("work", {"n": number}, task_id=task_id)
                    break
                except effectmq.RedisUnavailable:
                    retried_offers += 1
                    await asyncio.sleep(0.05)
            if started_after_kill:
                after_kill.add(task_id)
            elif await replicas_acknowledging(producer) >= 1:
                replicated.add(task_id)
            else:
                unreplicated.add(task_id)
            await asyncio.sleep(0.005)

    worker = effectmq.Worker(consumer, {"work": work}, install_signal_handlers=False, maintenance_interval=0.1,
                             idle_poll=0.5)
    worker_task = asyncio.create_task(worker.run())
    producer_task = asyncio.create_task(produce())
    timings = {}
    try:
        async def warmed_up():
            return len(replicated) >= 100 and sum(executions.values()) >= 50
        await wait_until(warmed_up, 20, "offers and completions through the first primary")

        killed = True  # set before the kill, with no await between: later attempts start after it
        t_kill = time.monotonic()
        deployment.primary.stop("kill")
        timings["promotion"] = await asyncio.to_thread(deployment.wait_for_master, deployment.replica.port, 30)

        async def served_after_kill():
            assert not worker_task.done(), "the worker stopped during the failover"
            done = [t for t in after_kill if executions[t]]
            return len(after_kill) >= 100 and len(done) >= 50
        await wait_until(served_after_kill, 30, "offers and executions through the promoted replica")
        timings["kill_to_after_kill_work"] = time.monotonic() - t_kill

        stop_producing.set()
        await asyncio.wait_for(producer_task, 30)

        async def drained():
            assert not worker_task.done(), "the worker stopped"
            stats = await consumer.stats()
            return stats.waiting + stats.delayed + stats.active == 0
        await wait_until(drained, 30, "the queue to drain on the new primary", interval=0.2)
        timings["kill_to_drained"] = time.monotonic() - t_kill
        assert not worker_task.done(), "the worker stopped"
    finally:
        stop_producing.set()
        worker.stop()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(producer_task, 30)
        worker_error = None
        try:
            await asyncio.wait_for(worker_task, 30)
        except Exception as exc:  # reported below, with the Redis logs
            worker_error = exc
    try:
        assert worker_error is None, f"worker.run() raised {worker_error!r}"
        must = replicated | after_kill
        infos = {task_id: await consumer.get(task_id) for task_id in sorted(must | unreplicated)}
        missing = sorted(t for t in must if infos[t] is None)
        not_completed = {t: infos[t].state for t in must if infos[t] is not None and infos[t].state != "completed"}
        assert not missing, f"{len(missing)} offers we could count on were lost: {missing[:10]}"
        assert not not_completed, f"not completed: {dict(list(not_completed.items())[:10])}"
        assert all(executions[t] >= 1 for t in must)
        lost = sorted(t for t in unreplicated if infos[t] is None)
        assert all(infos[t].state == "completed" for t in unreplicated if infos[t] is not None)
        stats = await consumer.stats()
        present = sum(1 for info in infos.values() if info is not None)
        assert (stats.completed, stats.failed, stats.canceled) == (present, 0, 0), stats  # one record, one state
        assert stats.waiting + stats.delayed + stats.active == 0, stats
        # Expected while there is no primary: warnings, and an acknowledgement given up when the
        # lease ran out (the task is recovered and runs again). Anything else is a defect.
        problems = [r for r in caplog.records if r.exc_info or (
            r.levelno >= logging.ERROR and "not confirmed before the lease ran out" not in r.getMessage())]
        assert not problems, "worker logged errors:\n" + "\n".join(
            f"{r.levelname} {r.name}: {r.getMessage()}\n"
            + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "") for r in problems)
        gave_up = sum(1 for r in caplog.records if "not confirmed before the lease ran out" in r.getMessage())
        duplicates = sum(1 for t in must | unreplicated if executions[t] > 1)
        print(f"\nsentinel failover: {len(replicated)} replicated, {len(after_kill)} after-kill, "
              f"{len(unreplicated)} unreplicated ({len(lost)} lost), {retried_offers} offer retries, "
              f"{duplicates} tasks run more than once, {gave_up} acknowledgements given up; timings {timings}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{deployment.logs()}") from None
    finally:
        await producer.close()
        await consumer.close()


class StaleSentinels:
    """What the Sentinels answer across a failover they have finished: the old primary
    until `switch()`, the promoted one afterwards."""

    def __init__(self, old: int, new: int):
        self.old, self.new, self.switched = old, new, False
        self.asked = 0

    def switch(self) -> None:
        self.switched = True

    async def discover_master(self, service_name: str):
        self.asked += 1
        return "127.0.0.1", self.new if self.switched else self.old

    async def aclose(self) -> None:
        return None


async def test_a_demoted_primary_answering_readonly_is_left_for_the_promoted_one(make_redis):
    """The script runner's own connection handling (EVALSHA over pooled connections)
    under redis-py's SentinelConnectionPool: when the primary it is connected to is
    demoted (its connection stays open and answers READONLY), the call is sent again
    on a fresh connection, which asks the Sentinels and goes to the promoted primary."""
    old, new = make_redis(), make_redis()
    for server in (old, new):
        server.client().config_set("repl-diskless-sync-delay", 0)  # Redis 7 waits 5 s by default
    new.client().replicaof("127.0.0.1", old.port)
    sentinels = StaleSentinels(old.port, new.port)
    pool = SentinelConnectionPool("mymaster", sentinels, decode_responses=True, socket_timeout=5)
    client = SentinelRedis.from_pool(pool)
    q = effectmq.TaskQueue("demoted", redis=client)
    try:
        await q.offer("work", {"n": 1}, task_id="before")
        assert (await q.get("before")).state == "waiting"
        pooled = list(pool._available_connections)
        assert pooled and all(c.is_connected and c.port == old.port for c in pooled)

        deadline = time.monotonic() + 10
        while not new.client().exists(q.keys.task("before")):
            assert time.monotonic() < deadline, "the replica never got the first offer"
            await asyncio.sleep(0.02)
        new.client().replicaof("no", "one")  # promote, then demote the old primary under it
        old.client().replicaof("127.0.0.1", new.port)
        sentinels.switch()
        assert pooled[0].is_connected  # still connected to the demoted primary

        offered = await q.offer("work", {"n": 2}, task_id="after")  # READONLY -> ConnectionError -> resent
        assert offered.created
        # it did answer READONLY (6.2 counts a script's READONLY as the ERR that wraps it)
        errorstat = "errorstat_READONLY" if server_version() >= (7, 0) else "errorstat_ERR"
        assert errorstat in old.client().info("errorstats")
        assert pool.master_address == ("127.0.0.1", new.port)
        assert new.client().exists(q.keys.task("after")) == 1
        lease = await q.acquire()
        assert lease is not None and lease.task_id == "before"
        await lease.complete("ok")
        assert (await q.get("before")).state == "completed"
        assert (await q.stats()).waiting == 1
        assert all(c.port == new.port for c in pool._available_connections if c.is_connected)
    finally:
        await q.close()
        await client.aclose()


def test_the_sentinel_url_reaches_connect_with_options():
    """connect() hands redis+sentinel:// to effectmq.transport.sentinel; max_connections bounds the pool."""
    q = effectmq.TaskQueue("q", url="redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/svc/3?sentinel_password=sp",
                           max_connections=4, socket_timeout=2.5)
    pool = q.redis.connection_pool
    assert isinstance(q.redis, SentinelRedis) and isinstance(pool, BlockingSentinelConnectionPool)
    assert (pool.service_name, pool.max_connections, pool.timeout) == ("svc", 4, 2.5)
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["decode_responses"] is True
    manager = pool.sentinel_manager
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in manager.sentinels] == [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert manager.sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    assert q.url == "redis+sentinel://:***@127.0.0.1:1,127.0.0.1:2/svc/3?sentinel_password=***"
    asyncio.run(q.close())


@pytest.mark.parametrize("bad", [
    "redis+sentinel://127.0.0.1:26379",  # no service name
    "redis+sentinel://127.0.0.1:26379/svc/notadb",
    "redis+sentinel://127.0.0.1:26379/svc/0/extra",
    "redis+sentinel://127.0.0.1:26379/svc?no_such_option=1",
    "redis+sentinel://,127.0.0.1/svc",
])
def test_a_malformed_sentinel_url_is_an_invalid_option(bad):
    with pytest.raises(effectmq.InvalidOption, match="Redis URL"):
        effectmq.TaskQueue("q", url=bad)


@pytest.mark.parametrize("url, tls", [
    ("rediss+sentinel://h:1/svc", TlsOptions(ca_file="/ca.pem")),
    ("redis+sentinel://h:1/svc", TlsOptions(enabled=True, ca_file="/ca.pem")),  # EFFECTMQ_REDIS_TLS=true
])
def test_tls_applies_to_the_sentinels_and_the_primary(url, tls):
    client, owned, shown = connect(url=url, tls=tls)
    try:
        assert owned and shown == "rediss+sentinel://h:1/svc"
        pool = client.connection_pool
        assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
        assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
        sentinel_pool = pool.sentinel_manager.sentinels[0].connection_pool
        assert sentinel_pool.connection_class.__name__ == "SSLConnection"
        assert sentinel_pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    finally:
        asyncio.run(client.aclose())
