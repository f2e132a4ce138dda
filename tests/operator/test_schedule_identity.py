"""Schedules belong to the Redis they live in, not to the URL that reached it.

Was: garbage collection and "wanted" were computed per URL
(and TLS options), the scheduler store is per Redis. Two Queues reaching one Redis
through two spellings of its URL deleted each other's Schedules within a second of
the second one's tick loop starting; the Schedules stayed Ready (a status() of None
read as nothing to report) and were never stored again until an operator restart.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from datetime import datetime, timedelta, timezone

import redis
import yaml

import effectmq
from effectmq.scheduler import Scheduler, ScheduleSpec
from effectmq_operator import builders
from effectmq_operator.redis_pool import SCHEDULER_NAMESPACE, Connections, RedisTarget
from effectmq_operator.queue_controller import QueueController
from effectmq_operator.runtime.workqueue import DONE, RETRY
from effectmq_operator.schedule_controller import RESYNC_EVERY, ScheduleController
from tests.operator.test_operator_queues import apply, condition, events, get, queue_manifest
from tests.operator.test_operator_schedules import parse, schedule_manifest
from tests.support.operator import wait_for

RECORD_SECONDS = 125  # the tick record: at least two minutes


def spellings(port: int) -> dict[str, str]:
    """URLs of one redis-server (it listens on 127.0.0.1) that the operator takes as distinct."""
    return {"ip with db": f"redis://127.0.0.1:{port}/0", "name without db": f"redis://localhost:{port}",
            "ip without db": f"redis://127.0.0.1:{port}", "name with db": f"redis://localhost:{port}/0"}


# -- the store identity, on real redis-servers ---------------------------------------------


async def test_every_spelling_of_one_redis_reads_one_store_identity(make_redis):
    """One id per Redis database, whatever URL reaches it; another database or another
    server has its own; the id survives a restart (persistence), unlike the run_id."""
    server, other = make_redis(aof=True), make_redis()
    connections = Connections(kube=None)
    try:
        ids = {name: await connections.identity(RedisTarget(url)) for name, url in spellings(server.port).items()}
        assert len(set(ids.values())) == 1, ids
        here = ids["ip with db"]
        assert await connections.identity(RedisTarget(f"redis://127.0.0.1:{server.port}/1")) != here
        assert await connections.identity(RedisTarget(other.url)) != here
        run_id = server.client().info("server")["run_id"]
        server.restart()
        assert server.client().info("server")["run_id"] != run_id  # what the run_id would have said
        await connections.close()  # (their connections went with the server)
        connections = Connections(kube=None)
        for url in spellings(server.port).values():
            assert await connections.identity(RedisTarget(url)) == here, url
        server.client().flushall()  # a Redis that lost its schedules is another store
        assert await connections.identity(RedisTarget(server.url)) != here
    finally:
        await connections.close()


def _body(kind: str, namespace: str, name: str, spec: dict) -> dict:
    return {"kind": kind, "metadata": {"namespace": namespace, "name": name, "generation": 1,
                                       "resourceVersion": "1"}, "spec": spec}


class StatusOnly:
    """The Kubernetes side of a reconcile, in memory: the last status written and the Events."""

    def __init__(self):
        self.status: dict = {}
        self.events: list[tuple[str, str, str]] = []

    def check_leader(self) -> None:
        pass

    async def patch_status(self, plural: str, namespace: str, name: str, status: dict) -> None:
        self.status = {**self.status, **status}

    async def post_events(self, body: dict, events) -> None:
        self.events += [(e.type, e.reason, e.message) for e in events]

    def ready(self) -> tuple[str, str]:
        c = condition({"status": self.status}, "Ready")
        return c["status"], c["reason"]


async def test_garbage_collection_keeps_what_another_spelling_of_its_redis_placed(make_redis):
    """The comparison of a Redis' schedules with the live resources, in the operator's
    own code (no API server needed): each URL's pass keeps the other's schedules; a
    Schedule whose Queue moved to another Redis, or whose resource is gone, goes."""
    server, elsewhere = make_redis(), make_redis()
    urls = spellings(server.port)
    connections = Connections(kube=None)
    queues = QueueController(None, connections)
    controller = ScheduleController(None, connections, queues)
    try:
        a, b = RedisTarget(urls["ip with db"]), RedisTarget(urls["name without db"])
        placed = {("shop", "emails"): a, ("other", "billing"): b, ("moved", "reports"): RedisTarget(elsewhere.url)}
        for (namespace, queue), target in placed.items():
            queues.queues.put(_body("Queue", namespace, queue, {"redis": {"url": target.url}}))
            queues.targets[(namespace, queue)] = target
            spec = {"queueRef": {"name": queue}, "schedule": "* * * * * *", "task": {"name": "tick"}}
            controller.schedules.put(_body("Schedule", namespace, "every-second", spec))
            # each stored through its Queue's URL (the moved one still where it was before the move)
            await connections.scheduler(a if target is placed[("moved", "reports")] else target).put(
                ScheduleSpec.from_json(builders.schedule_spec(namespace, "every-second", spec)))
        await connections.scheduler(a).put(ScheduleSpec.from_json(builders.schedule_spec(
            "shop", "deleted", {"queueRef": {"name": "emails"}, "schedule": "@daily", "task": {"name": "tick"}})))

        assert await controller.ticks.collect_garbage(b) == 2  # the deleted one, and the moved one
        assert await controller.ticks.collect_garbage(a) == 0
        assert await controller.ticks.collect_garbage(b) == 0
        left = [s.id for s in await connections.scheduler(a).list()]
        assert left == ["other/every-second", "shop/every-second"], left

        # The two URLs' tick loops: one runs the passes, the other need not repeat them.
        passes = {a: 0, b: 0}
        for target in (a, b):
            scheduler = connections.scheduler(target)

            async def counted(tick=scheduler.tick, target=target):
                passes[target] += 1
                return await tick()
            scheduler.tick = counted
        controller.kube = controller.ticks.kube = StatusOnly()  # the tick loops check leadership
        loops = [asyncio.create_task(controller.ticks.loop(t)) for t in (a, b)]
        await asyncio.sleep(4.5)
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        assert sorted(passes.values())[0] <= 1 and sorted(passes.values())[1] >= 4, passes
        statuses = await connections.scheduler(b).statuses(left)
        assert all(s.materialized >= 3 for s in statuses), statuses
    finally:
        await connections.close()


async def test_a_reconcile_stores_a_missing_record_again_and_keeps_one_moved_between_spellings(make_redis):
    """The reconcile, in the operator's own code: a record gone behind its back is stored
    again (a Warning says so), Ready=False ScheduleMissing while that fails; a Queue
    whose URL becomes another spelling of its Redis keeps the record as it is (no
    remove and fresh put: the counters and the cursor stay)."""
    server = make_redis()
    urls = spellings(server.port)
    kube = StatusOnly()
    connections = Connections(kube=None)
    queues = QueueController(kube, connections)
    controller = ScheduleController(kube, connections, queues)
    key = ("shop", "every-second")
    try:
        queue = yaml.safe_load(queue_manifest("emails", urls["ip with db"]))
        queue["metadata"] = {"namespace": "shop", "name": "emails", "generation": 1, "resourceVersion": "1"}
        queues.queues.put(queue)
        body = _body("Schedule", *key, {"queueRef": {"name": "emails"}, "schedule": "* * * * * *",
                                        "task": {"name": "tick"}})
        controller.schedules.put(body)
        assert await controller.reconcile(key, body) == DONE
        assert kube.ready() == ("True", "Ready")
        scheduler = connections.scheduler(controller.runtime[key].placed)

        assert await scheduler.remove("shop/every-second")  # by hand
        server.client().config_set("maxmemory", 1)
        try:
            assert await controller.reconcile(key, body) == RETRY
            assert kube.ready() == ("False", "ScheduleMissing"), kube.status
            assert kube.events[-1][:2] == ("Warning", "ScheduleMissing")
            assert await scheduler.status("shop/every-second") is None
        finally:
            server.client().config_set("maxmemory", 0)
        assert await controller.reconcile(key, body) == DONE
        assert kube.ready() == ("True", "Ready")
        assert kube.events[-1][:2] == ("Warning", "ScheduleRestored"), kube.events
        assert await scheduler.status("shop/every-second") is not None

        await asyncio.sleep(1.1)
        await scheduler.tick()
        before = await scheduler.status("shop/every-second")
        assert before.materialized >= 1
        queue = {**queue, "spec": {**queue["spec"], "redis": {"url": urls["name without db"]}}}
        queue["metadata"] = {**queue["metadata"], "generation": 2, "resourceVersion": "2"}
        queues.queues.put(queue)
        posted = len(kube.events)
        assert await controller.reconcile(key, body) == DONE
        assert controller.runtime[key].placed == RedisTarget(urls["name without db"])
        after = await scheduler.status("shop/every-second")
        assert (after.created_at, after.cursor, after.materialized) == (
            before.created_at, before.cursor, before.materialized), "stored afresh"
        assert kube.ready() == ("True", "Ready") and len(kube.events) == posted
    finally:
        await connections.close()


# -- on the test control plane, with the operator running ------------------------------------


def start_watching(start_operator, monkeypatch, namespaces: list[str]):
    """An operator that watches these namespaces (OperatorProcess passes only its own)."""
    real = subprocess.Popen

    def popen(argv, *args, **kwargs):
        if "effectmq_operator" in argv:
            argv = [*argv, *(arg for namespace in namespaces for arg in ("--namespace", namespace))]
        return real(argv, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "Popen", popen)
        return start_operator()


def tick_record(redis_url: str, queue: str, schedule_id: str) -> dict[datetime, str]:
    """Each tick materialized for a schedule: nominal instant -> task id."""
    q = effectmq.SyncTaskQueue(queue, url=redis_url)
    try:
        tasks = q.list_tasks("waiting", limit=10_000)
    finally:
        q.close()
    record = {parse(t.payload["tick"]): t.task_id for t in tasks if t.task_id.startswith(schedule_id + "/")}
    for t in tasks:
        if t.task_id.startswith(schedule_id + "/"):
            assert t.task_id == f"{schedule_id}/{t.payload['tick']}", t.task_id  # the tick's deterministic id
    return record


def gaps(ticks: list[datetime]) -> list[tuple[datetime, datetime]]:
    return [(x, y) for x, y in zip(ticks, ticks[1:]) if y - x != timedelta(seconds=1)]


def test_two_urls_of_one_redis_in_two_namespaces_miss_no_tick(kube_control_plane, kube_namespace, start_operator,
                                                             redis_server, redis_url, monkeypatch):
    """Shop/emails on one spelling, billing on another, each with
    a Schedule every second: over two minutes, every tick of both is materialized."""
    plane, ns = kube_control_plane, kube_namespace
    other = f"{ns}-b"
    plane.kubectl("create", "namespace", other)
    clock = redis_server.client()
    try:
        operator = start_watching(start_operator, monkeypatch, [ns, other])
        urls = spellings(redis_server.port)
        sides = [(ns, "emails", urls["ip with db"]), (other, "billing", urls["name without db"])]
        for namespace, queue, url in sides:
            apply(plane, namespace, queue_manifest(queue, url, paused=True))  # nothing consumes the ticks
            apply(plane, namespace, schedule_manifest("every-second", queue, "* * * * * *"))
            wait_for(lambda: len(tick_record(redis_url, f"{namespace}/{queue}", f"{namespace}/every-second")) >= 2,
                     timeout=30, what=f"ticks in {namespace}")

        started = time.monotonic()
        first: dict[str, datetime] = {}
        while True:
            now = datetime.fromtimestamp(clock.time()[0], timezone.utc)
            for namespace, queue, _ in sides:
                record = tick_record(redis_url, f"{namespace}/{queue}", f"{namespace}/every-second")
                ticks = sorted(record)
                first.setdefault(namespace, ticks[-1])
                assert not gaps(ticks), f"{namespace}: ticks missing {gaps(ticks)}\n{operator.log()}"
                assert now - ticks[-1] <= timedelta(seconds=4), (
                    f"{namespace}: no tick since {ticks[-1]} (Redis time {now}), "
                    f"after {time.monotonic() - started:.0f}s\n{operator.log()}")
            if time.monotonic() - started >= RECORD_SECONDS:
                break
            time.sleep(3)

        for namespace, queue, url in sides:
            record = tick_record(redis_url, f"{namespace}/{queue}", f"{namespace}/every-second")
            ticks = sorted(record)
            recorded = [t for t in ticks if t >= first[namespace]]
            span = (recorded[-1] - recorded[0]).total_seconds()
            print(f"{namespace} ({url}): {len(ticks)} ticks in all, {ticks[0]} .. {ticks[-1]}; "
                  f"recorded {len(recorded)} over {span:.0f}s, missing {len(gaps(ticks))}; "
                  f"first ids {[record[t] for t in ticks[:2]]}, last {record[ticks[-1]]}")
            assert span >= 120 and len(recorded) == span + 1
            body = get(plane, namespace, "schedule", "every-second")
            assert condition(body, "Ready")["status"] == "True", body.get("status")
        assert "removed schedule" not in operator.log()
    finally:
        clock.close()
        plane.kubectl("delete", "namespace", other, "--wait=false", check=False)


async def _remove_by_hand(redis_url: str, schedule_id: str) -> bool:
    scheduler = Scheduler(redis_url, namespace=SCHEDULER_NAMESPACE)
    try:
        return await scheduler.remove(schedule_id)
    finally:
        await scheduler.close()


def test_a_schedule_removed_by_hand_is_stored_again_and_never_reads_ready_while_missing(
        kube_control_plane, kube_namespace, start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, paused=True))
    apply(plane, ns, schedule_manifest("every-second", "emails", "* * * * * *"))
    schedule_id = f"{ns}/every-second"
    server = redis.Redis.from_url(redis_url, decode_responses=True)
    key = f"{{emq-sched:{SCHEDULER_NAMESPACE}}}:s:{schedule_id}"  # the record status() reads

    def ready() -> tuple[str, str]:
        c = condition(get(plane, ns, "schedule", "every-second"), "Ready") or {}
        return c.get("status", ""), c.get("reason", "")

    def sample() -> tuple[tuple[str, str], bool]:
        """Ready, then whether the record exists: Ready=True read before a missing record is a lie."""
        shown = ready()
        return shown, bool(server.exists(key))

    try:
        wait_for(lambda: ready()[0] == "True", timeout=30, what="Ready")
        wait_for(lambda: len(tick_record(redis_url, f"{ns}/emails", schedule_id)) >= 2, timeout=30, what="ticks")

        # 1. Removed while Redis refuses writes: it cannot be stored again, and says so.
        server.config_set("maxmemory", 1)
        try:
            assert asyncio.run(_remove_by_hand(redis_url, schedule_id))
            removed = time.monotonic()
            status, reason = wait_for(lambda: (r := ready())[0] == "False" and r, timeout=RESYNC_EVERY + 10,
                                      what="Ready=False while the record is missing")
            noticed = time.monotonic() - removed
            assert reason == "ScheduleMissing", reason
            wait_for(lambda: any(t == "Warning" and r == "ScheduleMissing"
                                 for t, r, _ in events(plane, ns, "every-second")), what="a Warning Event")
            until = time.monotonic() + 5
            while time.monotonic() < until:
                (shown, _), exists = sample()
                assert not exists and shown == "False", (shown, exists)
                time.sleep(0.2)
            print(f"noticed missing and unstorable after {noticed:.1f}s")
        finally:
            server.config_set("maxmemory", 0)

        # ... and once Redis takes writes again it is back, Ready again, ticking again.
        while True:
            (shown, _), exists = sample()
            assert exists or shown != "True", "Ready=True while the record is missing"
            if exists:
                break
            assert time.monotonic() - removed < RESYNC_EVERY + 20, "not stored again within a resync"
            time.sleep(0.2)
        wait_for(lambda: ready()[0] == "True", timeout=20, what="Ready again")
        count = len(tick_record(redis_url, f"{ns}/emails", schedule_id))
        wait_for(lambda: len(tick_record(redis_url, f"{ns}/emails", schedule_id)) >= count + 2, timeout=20,
                 what="ticks again")

        # 2. Removed while Redis takes writes: stored again within a resync (the tick loop
        # notices the count of stored schedules change and nudges its reconcile: seconds).
        assert asyncio.run(_remove_by_hand(redis_url, schedule_id))
        removed = time.monotonic()
        while not server.exists(key):
            assert time.monotonic() - removed < RESYNC_EVERY + 10, "not stored again within a resync"
            time.sleep(0.2)
        print(f"stored again {time.monotonic() - removed:.1f}s after its removal")
        wait_for(lambda: any(t == "Warning" and r == "ScheduleRestored"
                             for t, r, _ in events(plane, ns, "every-second")),
                 what="a Warning Event that it was missing")
        count = len(tick_record(redis_url, f"{ns}/emails", schedule_id))
        wait_for(lambda: len(tick_record(redis_url, f"{ns}/emails", schedule_id)) >= count + 2, timeout=20,
                 what="ticks after")
        assert ready()[0] == "True"
    finally:
        server.close()
