"""Durable offers (TaskQueue(replicas_to_confirm=N)) and a primary that refuses writes
without replicas (min-replicas-to-write), against real primaries with real replicas:
a standalone primary and its replica (make_redis), a Sentinel deployment and a Redis
Cluster. A replica is made unable to acknowledge by SIGSTOP (the primary still counts it
connected, so WAIT waits its timeout), or stopped outright.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import redis

import effectmq
from effectmq.client.queue import MAX_REPLICAS_TO_CONFIRM
from effectmq.protocol.keys import QueueKeys

QUEUE = "durable"


def wait_calls(client: redis.Redis) -> int:
    """How many WAIT commands this Redis ran so far (INFO commandstats)."""
    return int(client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def wait_in_sync(primary: redis.Redis, replica: redis.Redis, timeout: float = 15) -> None:
    """Until the replica is connected and has every write the primary has made."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = replica.info("replication")
        if info.get("master_link_status") == "up" and \
                info.get("slave_repl_offset") == primary.info("replication")["master_repl_offset"]:
            return
        time.sleep(0.05)
    raise AssertionError("the replica did not catch up")


@contextmanager
def paused(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def primary_and_replica(make_redis):
    primary = make_redis()
    replica = make_redis(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    wait_in_sync(primary.client(), replica.client())
    return primary, replica


async def test_a_durable_offer_returns_once_the_replica_holds_it(primary_and_replica):
    primary, replica = primary_and_replica
    keys = QueueKeys("emq", QUEUE)
    async with effectmq.TaskQueue(QUEUE, url=primary.url, replicas_to_confirm=1) as q:
        offered = await q.offer("work", {"n": 1}, task_id="one")
        assert offered == effectmq.Offered("one", True)
        # WAIT answered 1: the replica had the task before offer() returned
        assert replica.client().hget(keys.task("one"), "state") == "waiting"
        before = wait_calls(primary.client())  # (the first offer loaded the scripts: a round trip more)
        batch = await q.offer_many([("work", {"n": i}) for i in range(1200)])  # 3 chunks, one round trip
        assert all(o.created for o in batch)
        assert all(replica.client().exists(keys.task(o.task_id)) for o in batch[::97] + batch[-1:])
        again = await q.offer("work", {"n": 2}, task_id="one")  # writes nothing: the probe is what WAIT confirms
        assert again == effectmq.Offered("one", False)
        assert wait_calls(primary.client()) - before == 2  # one per round trip, on the offers' connection

    async with effectmq.TaskQueue(QUEUE, url=primary.url) as plain:  # the default: no WAIT, no probe
        primary.client().delete(keys.write_probe)
        before = wait_calls(primary.client())
        await plain.offer("work", {"n": 3})
        await plain.offer_many([("work", {"n": 4})] * 3)
        assert wait_calls(primary.client()) == before
        assert not primary.client().exists(keys.write_probe)


async def test_too_few_replicas_within_the_timeout_raise_not_replicated(primary_and_replica):
    primary, replica = primary_and_replica
    keys = QueueKeys("emq", QUEUE)
    assert replica.proc is not None
    async with effectmq.TaskQueue(QUEUE, url=primary.url, replicas_to_confirm=1, confirm_timeout=0.3) as q:
        with paused(replica.proc.pid):
            started = time.monotonic()
            with pytest.raises(effectmq.NotReplicated) as raised:
                await q.offer("work", {"n": 1})  # a generated id: the error names it
            waited = time.monotonic() - started
            error = raised.value
            (generated,) = error.task_ids
            assert (error.acknowledged, error.wanted, error.timeout) == (0, 1, 0.3)
            assert 0.3 <= waited < 3, waited
            message = str(error)
            assert repr(generated) in message and "only 0 of the 1 replicas" in message, message
            assert "may or may not survive a failover" in message and "same task_id again is safe" in message
            assert isinstance(error, effectmq.EffectMQError)
            info = await q.get(generated)
            assert info is not None and info.state == "waiting"  # stored on the primary all the same

            with pytest.raises(effectmq.NotReplicated) as raised:
                await q.offer_many([("work", {"n": i}) for i in range(5)] + [("work", {}, {"task_id": "mine"})])
            batch_ids = raised.value.task_ids
            assert len(batch_ids) == 6 and batch_ids[-1] == "mine"

    # offered again with the same ids once the replica is back (caught up: a replica just
    # resumed on a loaded machine answered no WAIT within 0.3 s once in CI): confirmed,
    # nothing created twice
    wait_in_sync(primary.client(), replica.client())
    async with effectmq.TaskQueue(QUEUE, url=primary.url, replicas_to_confirm=1, confirm_timeout=5) as q:
        assert await q.offer("work", {"n": 1}, task_id=generated) == effectmq.Offered(generated, False)
        assert replica.client().hget(keys.task(generated), "state") == "waiting"
        again = await q.offer_many([("work", {}, {"task_id": tid}) for tid in batch_ids])
        assert [o.created for o in again] == [False] * 6
        assert (await q.stats()).waiting == 7


def test_the_sync_facade_takes_the_options_and_raises_not_replicated(primary_and_replica):
    primary, replica = primary_and_replica
    assert replica.proc is not None
    with effectmq.SyncTaskQueue(QUEUE, url=primary.url, replicas_to_confirm=1, confirm_timeout=0.2) as q:
        assert q.offer("work", {}, task_id="a").created
        with paused(replica.proc.pid), pytest.raises(effectmq.NotReplicated):
            q.offer("work", {}, task_id="b")
        assert q.offer_many([("work", {}, {"task_id": "b"})]) == [effectmq.Offered("b", False)]


@pytest.mark.parametrize("options, named", [
    ({"replicas_to_confirm": -1}, "replicas_to_confirm must be >= 0"),
    ({"replicas_to_confirm": MAX_REPLICAS_TO_CONFIRM + 1}, f"replicas_to_confirm must be <= {MAX_REPLICAS_TO_CONFIRM}"),
    ({"replicas_to_confirm": 1.5}, "replicas_to_confirm must be an integer"),
    ({"replicas_to_confirm": True}, "replicas_to_confirm must be an integer"),
    ({"replicas_to_confirm": 1, "confirm_timeout": 0}, "confirm_timeout must be >= 0.001"),
    ({"replicas_to_confirm": 1, "confirm_timeout": float("nan")}, "confirm_timeout must be a finite number"),
    ({"replicas_to_confirm": 1, "confirm_timeout": 3, "socket_timeout": 3},
     "confirm_timeout must be below the socket timeout (3 s)"),
    ({"replicas_to_confirm": 1, "confirm_timeout": 20}, "confirm_timeout must be below the socket timeout (15 s)"),
])
def test_the_options_are_bounded(options, named):
    with pytest.raises(effectmq.InvalidOption, match=named.replace("(", r"\(").replace(")", r"\)")):
        effectmq.TaskQueue(QUEUE, url="redis://127.0.0.1:1/0", **options)


def test_a_given_client_without_a_socket_timeout_takes_any_confirm_timeout():
    client = redis.asyncio.Redis(port=1, decode_responses=True, socket_timeout=None)  # never connected
    q = effectmq.TaskQueue(QUEUE, redis=client, replicas_to_confirm=2, confirm_timeout=60)
    assert (q.replicas_to_confirm, q.confirm_timeout) == (2, 60.0)


async def test_an_app_gives_the_options_to_its_queue():
    app = effectmq.App(QUEUE, url="redis://127.0.0.1:1/0", replicas_to_confirm=2, confirm_timeout=1.5)
    assert (app.queue.replicas_to_confirm, app.queue.confirm_timeout) == (2, 1.5)
    await app.close()


async def test_durable_offers_through_sentinel(sentinel_deployment):
    d = sentinel_deployment
    assert d.replica.proc is not None
    async with effectmq.TaskQueue(QUEUE, url=d.url(), replicas_to_confirm=1, confirm_timeout=0.5) as q:
        assert (await q.offer("work", {}, task_id="s1")).created
        assert d.replica.client().hget(QueueKeys("emq", QUEUE).task("s1"), "state") == "waiting"
        with paused(d.replica.proc.pid), pytest.raises(effectmq.NotReplicated) as raised:
            await q.offer("work", {}, task_id="s2")
        assert raised.value.task_ids == ["s2"]
        wait_in_sync(d.primary.client(), d.replica.client())
        assert await q.offer("work", {}, task_id="s2") == effectmq.Offered("s2", False)
        assert d.replica.client().hget(QueueKeys("emq", QUEUE).task("s2"), "state") == "waiting"


async def test_durable_offers_on_a_cluster_wait_on_the_master_of_the_queues_slot(redis_cluster):
    keys = QueueKeys("emq", QUEUE)
    master = redis_cluster.master_of_slot(redis_cluster.slot_of(keys.base))
    replica = next(n for n in redis_cluster.live() if n is not master
                   and n.client().info("replication").get("master_port") == master.port)
    assert replica.proc is not None
    async with effectmq.TaskQueue(QUEUE, url=redis_cluster.url(), replicas_to_confirm=1, confirm_timeout=0.5) as q:
        assert (await q.offer("work", {}, task_id="c1")).created
        before = wait_calls(master.client())
        assert (await q.offer_many([("work", {"n": i}) for i in range(600)]))[0].created
        assert (await q.offer("work", {}, task_id="c1")) == effectmq.Offered("c1", False)
        assert wait_calls(master.client()) - before == 2
        with replica.client() as reader:
            reader.execute_command("READONLY")
            assert reader.hget(keys.task("c1"), "state") == "waiting"
        with paused(replica.proc.pid), pytest.raises(effectmq.NotReplicated) as raised:
            await q.offer("work", {}, task_id="c2")
        assert raised.value.acknowledged == 0
        wait_in_sync(master.client(), replica.client())
        assert await q.offer("work", {}, task_id="c2") == effectmq.Offered("c2", False)


async def test_a_durable_offer_redirected_by_moved_is_confirmed_on_the_new_master(redis_cluster):
    """The queue's slot moved after the client read the slot map: the old master answers
    MOVED to the offer (and to the probe); the offer runs on the new master, and WAIT there
    confirms it: its replica is the one counted."""
    keys = QueueKeys("emq", QUEUE)
    slot = redis_cluster.slot_of(keys.base)
    source = redis_cluster.master_of_slot(slot)
    target = next(node for node in redis_cluster.masters() if node.port != source.port)
    target_replica = next(n for n in redis_cluster.live() if n is not target
                          and n.client().info("replication").get("master_port") == target.port)
    assert target_replica.proc is not None
    async with effectmq.TaskQueue(QUEUE, url=redis_cluster.url(), replicas_to_confirm=1, confirm_timeout=0.5) as q:
        await q.ping()  # the slot map is read: the slot is the source's
        for node in redis_cluster.masters():  # the slot holds no key yet: moved by decree
            node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", redis_cluster.node_id(target))
        before = wait_calls(target.client())
        assert (await q.offer("work", {}, task_id="moved")).created
        assert wait_calls(target.client()) > before  # confirmed where it ran
        assert target.client().hget(keys.task("moved"), "state") == "waiting"
        with paused(target_replica.proc.pid), pytest.raises(effectmq.NotReplicated):
            await q.offer("work", {}, task_id="moved")  # the new master's replica is the one counted


# ---- min-replicas-to-write: a primary without its replica refuses writes


def wait_good_replicas(primary: redis.Redis, count: int, timeout: float = 15) -> None:
    """Until the primary counts `count` replicas good enough to write (it recounts them once
    a second, so a replica in sync may not count yet)."""
    deadline = time.monotonic() + timeout
    while int(primary.info("replication").get("min_slaves_good_slaves", -1)) != count:
        assert time.monotonic() < deadline, primary.info("replication")
        time.sleep(0.05)


def snapshot(client: redis.Redis) -> dict[str, bytes]:
    """Every key's serialized value (DUMP): equal snapshots, nothing written."""
    raw = redis.Redis(port=client.connection_pool.connection_kwargs["port"])
    return {key: raw.dump(key) for key in sorted(raw.keys("*"))}


@pytest.mark.parametrize("functions", [True, False], ids=["fcall", "evalsha"])
async def test_a_primary_without_its_replica_refuses_offers_and_the_worker_waits(make_redis, functions):
    """min-replicas-to-write 1: with its replica gone the primary answers NOREPLICAS. An
    offer raises RedisUnavailable (retryable) and writes nothing; a worker keeps running,
    backs off instead of spinning, and serves the queue once the replica is back."""
    primary = make_redis(extra_args=("--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"))
    replica = make_redis(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))
    admin = primary.client()
    wait_in_sync(admin, replica.client())
    wait_good_replicas(admin, 1)
    done: list[str] = []

    async def work(payload, ctx):
        done.append(ctx.task_id)

    async with effectmq.TaskQueue(QUEUE, url=primary.url) as q:
        q._scripts.functions = functions
        await q.offer_many([("work", {}, {"task_id": f"early{i}"}) for i in range(3)])
        replica.stop()
        wait_good_replicas(admin, 0)
        before = snapshot(admin)
        for offer in (lambda: q.offer("work", {}, task_id="late"),
                      lambda: q.offer_many([("work", {}, {"task_id": "late"}), ("work", {})])):
            with pytest.raises(effectmq.RedisUnavailable) as raised:
                await offer()
            assert raised.value.code == "NOREPLICAS" and raised.value.retryable, raised.value
            assert "NOREPLICAS" in str(raised.value) and "refused for now" in str(raised.value)
        async with effectmq.TaskQueue(QUEUE, url=primary.url, replicas_to_confirm=1) as durable:
            durable._scripts.functions = functions
            with pytest.raises(effectmq.RedisUnavailable, match="NOREPLICAS"):
                await durable.offer("work", {}, task_id="late")
        assert snapshot(admin) == before  # rule 7: a refused offer wrote nothing

        worker = effectmq.Worker(q, {"work": work}, concurrency=2, maintenance_interval=0.5)
        running = asyncio.create_task(worker.run())
        stats_before = admin.info("stats")["total_error_replies"]
        await asyncio.sleep(4)
        refused = admin.info("stats")["total_error_replies"] - stats_before
        assert not running.done(), running.exception() if running.done() else None
        assert done == [] and snapshot(admin) == before
        assert 0 < refused < 80, f"{refused} error replies in 4 s: the worker spins"  # backoff 0.1 s doubling

        replica.start()
        wait_in_sync(admin, replica.client())
        wait_good_replicas(admin, 1)
        deadline = time.monotonic() + 20
        while len(done) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert sorted(done) == ["early0", "early1", "early2"]
        assert (await q.offer("work", {}, task_id="late")).created
        worker.stop()
        await asyncio.wait_for(running, 15)
