"""Redis Cluster: queues, worker processes and the scheduler through a redis+cluster:// URL,
on a real cluster of 3 masters + 3 replicas (tests/fixtures/redis_cluster.py), and a
master SIGKILLed mid-run while its replica takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest
from redis.asyncio import RedisCluster

import effectmq
from effectmq.protocol import scripts
from effectmq.transport.connection import connect
from effectmq.errors import InvalidOption, RedisUnavailable
from effectmq.protocol.keys import QueueKeys
from effectmq.transport.redaction import INVALID_URL, redact_url, url_secrets
from effectmq.scheduler import Scheduler, ScheduleSpec
from tests.fixtures.redis import has_functions
from tests.scheduler.support import T
from tests.support.processes import WorkerProcess

from .test_sentinel import wait_until

QUEUES = [f"cluster/q{i}" for i in range(20)]
FAILOVER_TIMEOUT = 20.0  # seconds; a replica takes over in about 2.5 s here (node timeout 1 s)


def slots_by_master(cluster, names) -> dict[int, list[str]]:
    """The queues whose hash slot each master serves (by port)."""
    spread: dict[int, list[str]] = {}
    for name in names:
        node = cluster.master_of_slot(cluster.slot_of(QueueKeys("emq", name).base))
        spread.setdefault(node.port, []).append(name)
    return spread


async def wait_drained(queues, timeout: float) -> None:
    async def drained():
        stats = [await q.stats() for q in queues]
        return all(s.waiting + s.delayed + s.active == 0 for s in stats)
    await wait_until(drained, timeout, "every queue drained", interval=0.2)


def test_the_cluster_url_form_is_parsed_and_masked():
    url = "redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7001,10.0.0.3/0?socket_timeout=3"
    assert redact_url(url) == "redis+cluster://:***@10.0.0.1:7000,10.0.0.2:7001,10.0.0.3/0?socket_timeout=3"
    assert "s3cret" in url_secrets(url)
    assert redact_url("rediss+cluster://u:pw@h1:1") == "rediss+cluster://u:***@h1:1"
    assert redact_url("redis+cluster://:pw@h1:notaport,h2:2") == INVALID_URL
    for bad, why in (("redis+cluster://:s3cret@h1:1/3", "db 0"), ("redis+cluster://:s3cret@/0", "host"),
                     ("redis+cluster://:s3cret@h1:1?nonsense=1", "nonsense")):
        with pytest.raises(InvalidOption, match=why) as caught:
            connect(url=bad)
        assert "s3cret" not in str(caught.value)


async def test_a_cluster_with_no_reachable_seed_is_retryable_and_never_shows_the_password():
    async with effectmq.TaskQueue("q", url="redis+cluster://:s3cret@127.0.0.1:1,127.0.0.1:2") as q:
        with pytest.raises(RedisUnavailable, match="cannot be connected") as caught:
            await q.offer("work", {})
    assert caught.value.retryable and caught.value.code == "CLUSTER"
    assert "s3cret" not in str(caught.value) and "redis+cluster://:***@127.0.0.1:1" in str(caught.value)


async def test_a_wrong_password_for_a_cluster_is_an_auth_error_as_for_one_redis(make_redis_cluster):
    # redis-py wraps it in "cannot be connected" (retryable, as if no node answered)
    cluster = make_redis_cluster(password="right-one", aof=False)
    async with effectmq.TaskQueue("q", url=cluster.url(password="wrong-one")) as q:
        with pytest.raises(effectmq.RedisRefused) as caught:  # as docs/concepts.md says for one Redis
            await q.offer("work", {})
    assert caught.value.code == "AUTH"
    assert "wrong-one" not in str(caught.value) and "right-one" not in str(caught.value)


async def test_a_cluster_client_and_a_cluster_url_run_every_queue_operation(redis_cluster):
    """Was: AttributeError: 'RedisCluster' object has no attribute 'connection_pool'
    (a given client), and "not a redis:// ... URL" for the cluster URL."""
    spread = slots_by_master(redis_cluster, QUEUES)
    assert len(spread) == 3, spread  # the 20 queues live on every master
    given = RedisCluster.from_url(f"redis://127.0.0.1:{redis_cluster.nodes[0].port}", decode_responses=True)
    try:
        for client_options in ({"redis": given}, {"url": redis_cluster.url()}):
            for name in [names[0] for names in spread.values()]:
                async with effectmq.TaskQueue(name, lock_timeout=5, **client_options) as q:
                    offered = await q.offer("work", {"n": 1})
                    lease = await q.acquire()
                    assert lease is not None and lease.task_id == offered.task_id
                    await lease.complete({"ok": True})
                    assert await q.wait(offered.task_id, timeout=5) == {"ok": True}
                    assert (await q.stats()).completed >= 1
                    await q.ping()
    finally:
        await given.aclose()


async def test_group_caps_and_their_keys_work_on_a_cluster(redis_cluster):
    """The group keys are the queue's (its hash tag): parking, the hand-back and the
    refusal of a call without them (then sent again with them) on a cluster."""
    async with effectmq.TaskQueue("cluster/caps", lock_timeout=5, url=redis_cluster.url()) as q, \
            effectmq.TaskQueue("cluster/caps", lock_timeout=5, url=redis_cluster.url()) as other:
        await q.configure_group("a", max_active=1)
        await other.offer_many([("work", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(3)])
        leases, _ = await other.acquire_many(3)  # refused without the group keys, then sent with them
        assert [lease.task_id for lease in leases] == ["a0"] and other._scripts.group_keys
        assert (await q.stats()).parked == 2
        await leases[0].complete()
        stats = await q.group_stats("a")
        assert (stats.active, stats.waiting, stats.parked) == (0, 1, 1)


async def test_a_group_rate_limit_and_its_keys_work_on_a_cluster(redis_cluster):
    """The group rate limit's keys are the queue's too: starts logged, a pick parked, and
    the limit removed hands it back, on a cluster."""
    async with effectmq.TaskQueue("cluster/grate", lock_timeout=5, url=redis_cluster.url()) as q:
        await q.configure_group("a", rate_limit=(1, 60))
        await q.offer_many([("work", {}, {"group": "a", "task_id": f"a{i}"}) for i in range(2)])
        leased: list = []
        for _ in range(3):
            leased += (await q.acquire_many(2))[0]
        assert [lease.task_id for lease in leased] == ["a0"]
        assert (await q.group_stats("a")).parked == 1
        assert await q.redis.zcard(q.keys.key("group_starts")) == 1
        stats = await q.configure_group("a", rate_limit=0)
        assert (stats.parked, stats.waiting) == (0, 1)


async def test_a_node_url_on_a_cluster_is_a_retryable_error_naming_the_cluster_url(redis_cluster, tmp_path):
    """Was: through one node, the queues of other masters failed with MOVED (RedisRefused:
    `effectmq worker` exited 1, a crash loop). A MOVED never reaches the user raw: a
    retryable RedisUnavailable that says which URL to use; the worker waits, not ready."""
    node = redis_cluster.masters()[0]
    elsewhere = next(name for name in QUEUES if redis_cluster.master_of_slot(
        redis_cluster.slot_of(QueueKeys("emq", name).base)).port != node.port)
    async with effectmq.TaskQueue(elsewhere, url=redis_cluster.node_url(node)) as q:
        with pytest.raises(RedisUnavailable, match="redis\\+cluster://") as caught:
            await q.offer("work", {})
    assert caught.value.code == "MOVED" and caught.value.retryable
    worker = WorkerProcess(redis_cluster.node_url(node), elsewhere, tmp_path)
    try:
        await wait_until(lambda: _logged(worker, "connect with a redis+cluster:// URL"), 15, "the hint logged")
        assert worker.proc.poll() is None, worker.log()[-3000:]
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]


async def _logged(worker, text: str) -> bool:
    if worker.proc.poll() is not None:
        raise AssertionError(f"worker exited with {worker.proc.returncode}:\n{worker.log()[-3000:]}")
    return text in worker.log()


@contextlib.asynccontextmanager
async def stopped_after(workers, queues, *, clean_of: tuple[str, ...]):
    """Stop the worker processes and close the queues after the block; when it passed,
    no worker log holds any of `clean_of`."""
    try:
        yield
    finally:
        for w in workers:
            w.stop()
        for q in queues:
            await q.close()
    for w in workers:
        assert not any(word in w.log() for word in clean_of), w.log()[-3000:]


async def test_twenty_queues_on_every_master_complete_through_worker_processes(redis_cluster, tmp_path):
    url = redis_cluster.url(seeds=2)
    assert len(slots_by_master(redis_cluster, QUEUES)) == 3
    queues = [effectmq.TaskQueue(name, url=url) for name in QUEUES]
    workers = [WorkerProcess(url, name, tmp_path, name=f"w{i}", args=["--concurrency", "4"])
               for i, name in enumerate(QUEUES)]
    async with stopped_after(workers, queues, clean_of=("Error", "Traceback")):
        offered = {}
        for q in queues:
            for item in await q.offer_many([("work", {"n": n}) for n in range(10)]):
                offered[item.task_id] = q
        await wait_drained(queues, 40)
        for w in workers:
            assert w.proc.poll() is None, w.log()[-3000:]
        runs = Counter(line[1] for line in workers[0].effect_lines() if line[0] == "done")  # one file for all
        assert set(runs) == set(offered) and set(runs.values()) == {1}
        for task_id, q in offered.items():
            assert (await q.get(task_id)).state == "completed"


async def test_the_scheduler_through_the_cluster_url_materializes_every_tick_once(redis_cluster):
    url = redis_cluster.url()
    async with Scheduler(url, namespace="cluster") as scheduler:
        for name in QUEUES:
            await scheduler.put(ScheduleSpec(id=f"every/{name}", queue=name, cron="* * * * * *", task="work"))
        stop = asyncio.Event()
        runner = asyncio.create_task(scheduler.run(interval=0.2, stop=stop))
        await asyncio.sleep(4.5)
        stop.set()
        await asyncio.wait_for(runner, 10)
        statuses = await scheduler.statuses([f"every/{name}" for name in QUEUES])
    for name, status in zip(QUEUES, statuses):
        async with effectmq.TaskQueue(name, url=url) as q:
            waiting = await q.list_tasks("waiting", limit=100)
        assert status.last_error is None and status.materialized >= 3, status
        ids = [task.task_id for task in waiting]
        assert len(ids) == len(set(ids)) == status.materialized, (name, ids, status)
        instants = sorted(T(task_id.removeprefix(f"every/{name}/")) for task_id in ids)
        assert instants == list(range(instants[0], instants[0] + len(instants))), ids  # every second, no gap


async def replicated(cluster, timeout: float = 10) -> None:
    """Until every replica has everything its master has (what a test may count on
    across a failover: replication is asynchronous)."""
    async def caught_up():
        for node in cluster.live():
            info = node.client().info("replication")
            if info["role"] == "master":
                for i in range(int(info["connected_slaves"])):
                    if int(info[f"slave{i}"]["offset"]) < int(info["master_repl_offset"]):
                        return False
        return True
    await wait_until(caught_up, timeout, "replicas in sync")


@pytest.mark.slow
async def test_a_master_killed_mid_run_every_accepted_task_ends_in_one_terminal_state(redis_cluster, tmp_path):
    """SIGKILL the master of some of six busy queues (its replica takes over in about
    2.5 s): producers meanwhile get either an answer or RedisUnavailable, the worker
    processes ride it out, and every offer that was answered (and replicated before
    the kill, or made after it) ends completed, once."""
    url = redis_cluster.url()
    names = QUEUES[:6]
    spread = slots_by_master(redis_cluster, names)
    victim_port, victims = max(spread.items(), key=lambda item: len(item[1]))
    victim = next(node for node in redis_cluster.nodes if node.port == victim_port)
    queues = [effectmq.TaskQueue(name, url=url) for name in names]
    for q in queues:  # a lease lost with its master is recovered soon, and is no failure
        await q.configure(lock_timeout=2, max_stalled_count=10)
    workers = [WorkerProcess(url, name, tmp_path, name=f"w{i}",
                             args=["--concurrency", "4", "--lock-timeout", "2", "--maintenance-interval", "0.5"])
               for i, name in enumerate(names)]
    async with stopped_after(workers, queues, clean_of=("MovedError", "Traceback")):
        before = {}
        for q in queues:
            for item in await q.offer_many([("work", {"sleep": 0.05}) for _ in range(60)]):
                before[item.task_id] = q
        await replicated(redis_cluster)
        await wait_until(lambda: _some_done(workers), 20, "work under way")
        replica = redis_cluster.kill_master(victim)
        raw = []
        # Producers go on during the failover: an offer either returns or is retryable.
        after = {}
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        while time.monotonic() < deadline and not _promoted(replica):
            for q in queues:
                try:
                    item = await q.offer("work", {}, task_id=f"during-{time.monotonic_ns()}")
                    after[item.task_id] = q
                except RedisUnavailable:
                    pass
                except Exception as exc:  # what this test looks for
                    raw.append(exc)
            await asyncio.sleep(0.05)
        redis_cluster.wait_for_failover(replica)
        assert not raw, raw
        for q in queues:
            for item in await q.offer_many([("work", {}) for _ in range(20)]):
                after[item.task_id] = q
        try:
            await wait_drained(queues, 45)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{await _why_not_drained(queues, workers, victims)}") from None
        for w in workers:
            assert w.proc.poll() is None, w.log()[-3000:]
        for task_id, q in {**before, **after}.items():
            info = await q.get(task_id)
            assert info is not None and info.state == "completed", (task_id, info)
        states = Counter()
        for q in queues:
            stats = await q.stats()
            states.update(completed=stats.completed, failed=stats.failed, canceled=stats.canceled)
            assert stats.waiting + stats.delayed + stats.active == 0
        assert states["failed"] == states["canceled"] == 0
        assert states["completed"] == len(before) + len(after)  # one record each, in one state
        # The kill hit the work: a worker of a queue on that master saw its calls fail. Not
        # every one need have: one that was idle, or whose calls redis-py retried through
        # the failover, logs nothing (a CI run under the full suite's load).
        hit = [w.log() for w, name in zip(workers, names) if name in victims]
        assert any(" failed (" in log for log in hit), "\n---\n".join(log[-1500:] for log in hit)


async def _why_not_drained(queues, workers, victims) -> str:
    """What a test needs to tell a dead worker, one holding its slots and one that no
    longer asks apart: for each queue with work left, its stats, settings, the workers
    it lists (in flight, concurrency), its first waiting tasks, and its worker's log."""
    parts = []
    for q, w in zip(queues, workers):
        stats = await q.stats()
        if stats.waiting + stats.delayed + stats.active == 0:
            continue
        head = [(t.task_id, t.attempt, t.stalled_attempt_count) for t in await q.list_tasks("waiting", limit=5)]
        parts.append(f"queue {q.name} ({'on' if q.name in victims else 'not on'} the killed master): {stats}\n"
                     f"  settings {await q.settings()}\n  workers {await q.workers()}\n  waiting head {head}\n"
                     f"  worker exit code {w.proc.poll()}, log:\n{w.log()[-8000:]}")
    return "\n".join(parts)


def _promoted(replica) -> bool:
    try:
        return replica.client().info("replication")["role"] == "master"
    except Exception:  # not up yet
        return False


async def _some_done(workers) -> bool:
    return sum(1 for line in workers[0].effect_lines() if line[0] == "done") >= 20  # one file for all


@pytest.mark.slow
async def test_a_worker_started_while_its_master_is_down_waits_then_serves(redis_cluster, tmp_path):
    """A seed node and the queue's master are down when the worker starts: it logs a
    retryable error and keeps trying (never exit 1), then serves after the failover."""
    name = QUEUES[0]
    master = redis_cluster.master_of_slot(redis_cluster.slot_of(QueueKeys("emq", name).base))
    others = [node for node in redis_cluster.nodes if node is not master]
    url = f"redis+cluster://127.0.0.1:{master.port},127.0.0.1:{others[0].port}"
    replica = redis_cluster.kill_master(master)
    worker = WorkerProcess(url, name, tmp_path, args=["--lock-timeout", "2"])
    try:
        redis_cluster.wait_for_failover(replica)
        async with effectmq.TaskQueue(name, url=url) as q:
            offered = await q.offer("work", {})
            assert await q.wait(offered.task_id, timeout=20) == {"attempt": 1, "pid": worker.proc.pid}
        assert worker.proc.poll() is None
    finally:
        code = worker.stop()
    assert code == 0, worker.log()[-3000:]
    assert "Traceback" not in worker.log(), worker.log()[-3000:]


async def test_a_slot_that_moves_is_followed_through_ask_and_moved(redis_cluster):
    """A resharding while a client holds the old slot map. While the slot migrates, the
    source answers ASK and the importing node, after ASKING, TRYAGAIN (a multi-key call
    whose keys are not all there yet): sent again until the call's patience (here the
    socket timeout, 1 s) runs out, then retryable. Once it moved, the source answers
    MOVED: the map is read again and the call runs on the new master."""
    name = QUEUES[0]
    slot = redis_cluster.slot_of(QueueKeys("emq", name).base)
    source = redis_cluster.master_of_slot(slot)
    target = next(node for node in redis_cluster.masters() if node.port != source.port)
    node_id = {node.port: node.client().execute_command("CLUSTER MYID") for node in (source, target)}
    async with effectmq.TaskQueue(name, url=redis_cluster.url() + "?socket_timeout=1") as q:
        await q.ping()  # the slot map is read: the slot is the source's
        target.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", node_id[source.port])
        source.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", node_id[target.port])
        with pytest.raises(RedisUnavailable) as caught:
            await q.offer("work", {"n": 1})
        assert caught.value.code == "TRYAGAIN"  # from the target: without ASKING it would answer MOVED
        assert q.engine.scripts.refusals.asked > 0 and q.engine.scripts.refusals.gave_up == 1
        for node in redis_cluster.masters():
            node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", node_id[target.port])
        offered = await q.offer("work", {"n": 1})  # the source answers MOVED
        assert target.client().exists(QueueKeys("emq", name).task(offered.task_id))
        lease = await q.acquire()
        assert lease is not None and lease.task_id == offered.task_id
        await lease.complete("done")
        assert (await q.get(offered.task_id)).state == "completed"
    assert redis_cluster.master_of_slot(slot).port == target.port


async def test_our_slot_map_reread_and_redis_pys_own_do_not_race(redis_cluster):
    """Was (CI, redis-py 5.3, a master killed): a worker died of `RuntimeError:
    dictionary changed size during iteration`. Its script runner re-read the slot map
    while redis-py re-initialized the same client; both walk the startup nodes, and the
    first one to finish rewrites them under the other, still waiting on a dead seed."""
    from redis.asyncio.cluster import ClusterNode

    from effectmq.protocol import routing

    held: list[asyncio.StreamWriter] = []

    async def silent(_reader, writer):  # a seed that accepts and never answers
        held.append(writer)

    dead = await asyncio.start_server(silent, "127.0.0.1", 0)
    dead_port = dead.sockets[0].getsockname()[1]
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", dead_port),
                                         ClusterNode("127.0.0.1", redis_cluster.nodes[0].port)],
                          decode_responses=True)
    try:
        topology = routing._topology(client)
        ours = asyncio.create_task(topology.refresh(client, topology.epoch))
        theirs = asyncio.create_task(client.initialize())
        async def both_done():
            waiting = [writer for writer in held if not writer.is_closing()]
            if waiting:  # one re-read at a time goes on from the dead seed to the live one
                waiting[0].close()
            return ours.done() and theirs.done()

        await wait_until(both_done, 10, "both re-reads done", interval=0.2)
        await asyncio.gather(ours, theirs)
        assert client.nodes_manager.get_node_from_slot(0) is not None
    finally:
        for writer in held:
            writer.close()
        dead.close()
        await client.aclose()

async def test_wake_ups_and_waits_are_heard_on_a_cluster(redis_cluster):
    """The wake signal and wait() subscribe on a cluster too (a PUBLISH reaches every
    node): an offer wakes an idle worker, a completion answers a waiting producer, both
    well before the fallback re-checks (5 s)."""
    async with effectmq.TaskQueue(QUEUES[1], url=redis_cluster.url()) as q:
        wake = await q.wake_signal().start()
        try:
            wake.event.clear()
            await q.offer("work", {})
            await asyncio.wait_for(wake.event.wait(), 2)
        finally:
            await wake.close()
        lease = await q.acquire()

        async def complete_soon():
            await asyncio.sleep(0.3)
            await lease.complete("done")

        started = time.monotonic()
        completing = asyncio.create_task(complete_soon())
        assert await q.wait(lease.task_id, timeout=10) == "done"
        await completing
        assert time.monotonic() - started < 2


async def test_scripts_are_loaded_again_after_a_script_flush_on_every_master(redis_cluster):
    async with effectmq.TaskQueue(QUEUES[2], url=redis_cluster.url()) as q:
        await q.offer("work", {})
        for node in redis_cluster.masters():
            node.client().script_flush()
            if has_functions():
                node.client().function_flush()
        await q.offer("work", {})  # NOSCRIPT or 'Function not found': loaded, sent again
        assert (await q.stats()).waiting == 2


@pytest.mark.redis7
async def test_a_stale_library_is_unloaded_from_every_master(redis_cluster):
    stale = "effectmq_00000000000000aa"
    masters = redis_cluster.masters()
    for node in masters:
        node.client().function_load(
            f"#!lua name={stale}\nredis.register_function('{stale}_noop', function() return 1 end)\n")
    async with effectmq.TaskQueue(QUEUES[2], url=redis_cluster.url()) as q:
        await q.redis.hset(scripts.LIBRARIES_KEY, stale, "0")  # loaded last at the epoch
        await q.offer("work", {})  # this version's library is loaded: the stale one goes
        for node in masters:
            assert [scripts.library_name_of(lib) for lib in node.client().function_list()] == [scripts.library()[0]]
