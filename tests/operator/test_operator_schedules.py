"""Schedules under the operator: ticks become tasks exactly once, also with two
operator replicas and a leader handover; bad schedules become conditions; the
status mirror reads only the schedules that changed, whoever changed them."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis
import yaml

import effectmq
from effectmq.scheduler import Scheduler, ScheduleSpec
from effectmq.scheduler.cron import parse_cron
from effectmq.scheduler.errors import InvalidSchedule
from effectmq_operator import builders
from effectmq_operator.redis_pool import SCHEDULER_NAMESPACE, Connections
from effectmq_operator.queue_controller import QueueController
from effectmq_operator.runtime.kube import Kube
from effectmq_operator.schedule_controller import ScheduleController
from effectmq_operator.schedule_status import ScheduleRuntime
from effectmq_operator.spec import RedisSpec
from effectmq_operator.status import schedule_progress
from tests.operator.test_operator_queues import apply, condition, events, get, queue_manifest
from tests.support.operator import controllers_fed_by_lists, default_kubeconfig, wait_for, wait_for_async
from tests.support.tracing import OtlpReceiver

FAST_LEASE = {"EFFECTMQ_OPERATOR_LEASE_SECONDS": "3"}


def schedule_manifest(name: str, queue: str, cron: str, **spec) -> str:
    body = {
        "apiVersion": "effectmq.io/v1alpha1", "kind": "Schedule", "metadata": {"name": name},
        "spec": {"queueRef": {"name": queue}, "schedule": cron, "task": {"name": "send_report",
                                                                         "payload": {"report": name}}, **spec},
    }
    return yaml.safe_dump(body)


def tick_tasks(redis_url: str, queue: str, schedule_id: str) -> list[str]:
    q = effectmq.SyncTaskQueue(queue, url=redis_url)
    try:
        tasks = q.list_tasks("waiting", limit=10_000)
    finally:
        q.close()
    return sorted(t.payload["tick"] for t in tasks if t.task_id.startswith(schedule_id + "/"))


def parse(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def test_one_task_per_tick_with_two_operators_and_a_handover(kube_control_plane, kube_namespace, start_operator,
                                                            redis_url):
    plane, ns = kube_control_plane, kube_namespace
    first = start_operator("operator-a", extra_env=FAST_LEASE)
    second = start_operator("operator-b", extra_env=FAST_LEASE)
    apply(plane, ns, queue_manifest("emails", redis_url, paused=True))  # nothing consumes the ticks
    apply(plane, ns, schedule_manifest("every-second", "emails", "* * * * * *",
                                       missedTicks="Backfill", maxBackfill=100))
    schedule_id = f"{ns}/every-second"
    wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/emails", schedule_id)) >= 4, timeout=30, what="ticks")
    leader = first if "acquired leadership" in first.log() else second
    leader.stop()  # the other replica takes over after the lease runs out
    count = len(tick_tasks(redis_url, f"{ns}/emails", schedule_id))
    wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/emails", schedule_id)) >= count + 6, timeout=40,
             what="ticks after the handover")
    ticks = [parse(t) for t in tick_tasks(redis_url, f"{ns}/emails", schedule_id)]
    assert len(ticks) == len(set(ticks))  # one task per tick
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if b - a != timedelta(seconds=1)]
    assert gaps == [], f"missing ticks: {gaps}"  # none missing, handover included

    status = wait_for(lambda: (s := get(plane, ns, "schedule", "every-second")["status"]).get("lastTickTime") and s,
                      what="mirrored status")
    assert status["lastTaskID"].startswith(schedule_id + "/")
    assert parse(status["nextTickTime"]) > parse(status["lastTickTime"])
    assert condition(get(plane, ns, "schedule", "every-second"), "Ready")["status"] == "True"
    printed = plane.kubectl("get", "schedules", "-n", ns).stdout
    assert "every-second" in printed and "* * * * * *" in printed


def test_bad_schedules_are_reported_and_others_keep_firing(kube_control_plane, kube_namespace, start_operator,
                                                           redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, paused=True))
    apply(plane, ns, schedule_manifest("bad-cron", "emails", "61 * * * *"))
    apply(plane, ns, schedule_manifest("bad-zone", "emails", "* * * * *", timeZone="Mars/Olympus_Mons"))
    apply(plane, ns, schedule_manifest("no-queue", "nowhere", "* * * * *"))
    apply(plane, ns, schedule_manifest("good", "emails", "* * * * * *"))

    def cond(name, type_):
        c = condition(get(plane, ns, "schedule", name), type_)
        return c and (c["status"], c["reason"], c["message"])

    status, reason, message = wait_for(lambda: cond("bad-cron", "ScheduleValid"), what="bad-cron condition")
    assert (status, reason) == ("False", "InvalidSchedule") and "61" in message
    with pytest.raises(InvalidSchedule) as parsed:  # the CRD's CEL rule checks the shape only: the parser tells
        parse_cron("61 * * * *")
    assert str(parsed.value) in message, message
    status, reason, message = wait_for(lambda: cond("bad-zone", "ScheduleValid"), what="bad-zone condition")
    assert (status, reason) == ("False", "InvalidSchedule") and "Mars/Olympus_Mons" in message
    status, reason, message = wait_for(lambda: cond("no-queue", "QueueFound"), what="no-queue condition")
    assert (status, reason) == ("False", "QueueNotFound") and f"{ns}/nowhere" in message
    for name, why in (("bad-cron", "InvalidSchedule"), ("no-queue", "QueueNotFound")):
        wait_for(lambda: any(t == "Warning" and r == why for t, r, _ in events(plane, ns, name)),
                 what=f"Event on {name}")
    wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/emails", f"{ns}/good")) >= 3, timeout=20,
             what="the good schedule fires")
    assert tick_tasks(redis_url, f"{ns}/emails", f"{ns}/bad-zone") == []
    # Fixing the cron heals the schedule.
    plane.kubectl("patch", "schedule", "bad-cron", "-n", ns, "--type=merge", "-p",
                  json.dumps({"spec": {"schedule": "* * * * * *"}}))
    wait_for(lambda: (cond("bad-cron", "Ready") or ("",))[0] == "True", timeout=20, what="healed")


def _fired_two_hours_ago() -> str:
    """A daily cron whose last tick was one and a half to two and a half hours ago."""
    return f"30 {(datetime.now(timezone.utc).hour - 2) % 24} * * *"


async def _tick_elsewhere(redis_url: str, schedule_id: str) -> str:
    """Another scheduler on the operator's schedules (the standalone CLI, an earlier
    leader's late pass) settles a tick the operator's own passes never see: the cursor
    goes three hours back and the tick two hours ago is materialized at once. Returns
    the tick's task id."""
    scheduler = Scheduler(redis_url, namespace=SCHEDULER_NAMESPACE)
    try:
        stored = await scheduler.status(schedule_id)
        assert stored is not None and stored.spec is not None and stored.last_task_id is None
        seconds, _ = await scheduler.redis.time()
        await scheduler.redis.hset(scheduler.store.key(schedule_id), "cursor", (seconds - 3 * 3600) * 1000)
        status = await scheduler.put(stored.spec)  # settles the missed tick, as put() does
        assert status.last_task_id is not None
        return status.last_task_id
    finally:
        await scheduler.close()


def test_a_tick_settled_outside_the_operators_passes_is_mirrored_promptly(kube_control_plane, kube_namespace,
                                                                           start_operator, redis_url):
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, paused=True))
    apply(plane, ns, schedule_manifest("daily", "emails", _fired_two_hours_ago()))
    wait_for(lambda: (condition(get(plane, ns, "schedule", "daily"), "Ready") or {}).get("status") == "True",
             what="the schedule stored")
    wait_for(lambda: (condition(get(plane, ns, "queue", "emails"), "Ready") or {}).get("status") == "True",
             what="the queue settled")  # its status writes no longer re-reconcile the schedule
    time.sleep(2)
    task_id = asyncio.run(_tick_elsewhere(redis_url, f"{ns}/daily"))
    started = time.monotonic()
    wait_for(lambda: get(plane, ns, "schedule", "daily")["status"].get("lastTaskID") == task_id, timeout=10,
             interval=0.1, what="the tick mirrored")  # a full reconcile would come only after 60 s
    took = time.monotonic() - started
    assert took < 5, f"mirrored after {took:.1f}s"


def _redis_calls(client) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in client.info("commandstats").items()}


async def test_a_mirror_round_reads_only_the_schedules_that_changed(kube_control_plane, kube_namespace, effectmq_crds,
                                                                    redis_url, redis_server):
    """2,000 schedules, none changing: a mirror round costs a few Redis commands, not a
    read per schedule; the ones that change (whoever changed them) are read and written."""
    plane, ns = kube_control_plane, kube_namespace
    daily = _fired_two_hours_ago()
    apply(plane, ns, schedule_manifest("watched", "emails", daily))  # no operator runs: this test is it
    with default_kubeconfig(plane.kubeconfig):
        kube = Kube()
        connections = Connections(kube)
        controller = ScheduleController(kube, connections, QueueController(kube, connections))
        counter = redis_server.client()
        try:
            target = await connections.target(ns, RedisSpec(url=redis_url))
            scheduler = connections.scheduler(target)
            bodies = [get(plane, ns, "schedule", "watched")] + [
                {"metadata": {"namespace": ns, "name": f"s{i}", "generation": 1},
                 "spec": {"queueRef": {"name": "emails"}, "schedule": daily, "task": {"name": "work"}}}
                for i in range(1999)]
            for body in bodies:
                name = body["metadata"]["name"]
                await scheduler.store.put(ScheduleSpec.from_json(builders.schedule_spec(ns, name, body["spec"])))
            await scheduler.tick()  # settles each new schedule: its next tick
            for body, state in zip(bodies, await scheduler.statuses([f"{ns}/{b['metadata']['name']}" for b in bodies])):
                body["status"] = schedule_progress(state)  # as if mirrored before
                controller.schedules.put(body)
                controller.runtime[(ns, body["metadata"]["name"])] = ScheduleRuntime(placed=target)

            before = _redis_calls(counter)
            await controller.mirror.round(target)  # the term's full round, a slice per round: nothing differs
            await controller.mirror.round(target)
            assert _redis_calls(counter)["hgetall"] - before.get("hgetall", 0) == 2000
            assert "status" not in get(plane, ns, "schedule", "watched")  # the registry's copy was current
            before = _redis_calls(counter)
            for _ in range(5):
                await controller.mirror.round(target)
            idle = {k: v - before.get(k, 0) for k, v in _redis_calls(counter).items() if v != before.get(k, 0)}
            idle.pop("info", None)
            assert idle == {"zrangebyscore": 5}, f"five idle rounds ran {idle}"

            task_id = await _tick_elsewhere(redis_url, f"{ns}/watched")
            for i in range(5):  # changed by another writer: no resource of theirs exists, nothing is written
                await scheduler.put(ScheduleSpec.from_json(builders.schedule_spec(ns, f"s{i}", {
                    **bodies[i + 1]["spec"], "schedule": "45 3 * * *"})))
            before = _redis_calls(counter)
            await controller.mirror.round(target)
            read = _redis_calls(counter)
            assert read["hgetall"] - before["hgetall"] == 6  # the six that changed, nothing else
            assert get(plane, ns, "schedule", "watched")["status"]["lastTaskID"] == task_id

            # A change the feed lost (its key restored from an old backup, deleted by hand):
            # the next full round finds it, and the cursor follows the feed's new numbers.
            await scheduler.redis.delete(scheduler.store.changes_key)
            status = await scheduler.put(ScheduleSpec.from_json(builders.schedule_spec(ns, "watched", {
                **bodies[0]["spec"], "schedule": "59 23 * * *"})))
            await controller.mirror.round(target)
            assert get(plane, ns, "schedule", "watched")["status"]["nextTickTime"] != schedule_progress(status)[
                "nextTickTime"]  # not seen yet
            controller.mirror.feeds[target].full_at = 0.0  # the full round, due every MIRROR_RESYNC_EVERY
            for _ in range(3):  # 2,000 schedules: two slices
                await controller.mirror.round(target)
            assert get(plane, ns, "schedule", "watched")["status"]["nextTickTime"] == schedule_progress(status)[
                "nextTickTime"]
            controller.runtime[(ns, "watched")].mirrored_at = None  # as once MIRROR_EVERY has passed
            await scheduler.put(ScheduleSpec.from_json(builders.schedule_spec(ns, "watched", bodies[0]["spec"])))
            await controller.mirror.round(target)
            assert get(plane, ns, "schedule", "watched")["status"]["nextTickTime"] != schedule_progress(status)[
                "nextTickTime"]  # the feed's new numbers are read again
        finally:
            counter.close()
            await connections.close()


def test_a_schedule_whose_ticks_redis_refuses_says_so_and_recovers(kube_control_plane, kube_namespace,
                                                                   start_operator, redis_url):
    """Was: with its Redis full (maxmemory, noeviction) the operator's tick passes failed,
    only its log said so, and the Schedule stayed Ready (its status read still worked)."""
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, paused=True))
    apply(plane, ns, schedule_manifest("every-second", "emails", "* * * * * *"))
    schedule_id = f"{ns}/every-second"
    wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/emails", schedule_id)) >= 2, timeout=30, what="ticks")

    def ready():
        c = condition(get(plane, ns, "schedule", "every-second"), "Ready")
        return c and (c["status"], c["reason"], c["message"])

    server = redis.Redis.from_url(redis_url)
    try:
        server.config_set("maxmemory", 1)
        status, reason, message = wait_for(lambda: (r := ready()) and r[0] == "False" and r, timeout=20,
                                           what="Ready=False while Redis refuses the ticks")
        assert reason == "TicksFailing" and "OOM" in message, (reason, message)
        ticks = condition(get(plane, ns, "schedule", "every-second"), "TicksMaterialized")
        assert (ticks["status"], ticks["reason"]) == ("False", "TicksFailing"), ticks
        assert condition(get(plane, ns, "schedule", "every-second"), "Reconciling")["status"] == "True"
        wait_for(lambda: any(t == "Warning" and r == "TicksFailing" for t, r, _ in events(plane, ns, "every-second")),
                 what="a Warning Event")
        during = len(tick_tasks(redis_url, f"{ns}/emails", schedule_id))
    finally:
        server.config_set("maxmemory", 0)
        server.close()
    wait_for(lambda: (ready() or ("",))[0] == "True", timeout=20, what="Ready again once Redis takes writes")
    assert condition(get(plane, ns, "schedule", "every-second"), "TicksMaterialized")["status"] == "True"
    wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/emails", schedule_id)) >= during + 2, timeout=20,
             what="ticks again")


async def test_a_schedule_the_watch_has_not_reported_is_reconciled_within_seconds(kube_control_plane, kube_namespace,
                                                                                  effectmq_crds, redis_url):
    """As test_a_queue_the_watch_has_not_reported_is_reconciled_within_seconds, for a
    Schedule: no watch event reaches the controllers; their own lists find both objects
    (a CI run saw a Schedule's first tick not come within 20 s of its creation)."""
    plane, ns = kube_control_plane, kube_namespace
    async with controllers_fed_by_lists(plane, ns) as (_, schedules):
        await asyncio.wait_for(schedules.synced.wait(), 10)  # its first list: no Schedule yet
        apply(plane, ns, queue_manifest("emails", redis_url))
        apply(plane, ns, schedule_manifest("unreported", "emails", "* * * * * *", timeZone="UTC"))
        await wait_for_async(lambda: ((get(plane, ns, "schedule", "unreported") or {}).get("status") or {})
                             .get("lastTaskID"), timeout=15, what="a tick")


async def test_the_first_tick_is_mirrored_at_once_after_a_change_without_one(kube_control_plane, kube_namespace,
                                                                             effectmq_crds, redis_url):
    """Was: a Schedule applied right after its Queue could show its first tick only 30 s
    later (a CI run waited for it in vain). Its tick loop was already running: the
    mirror copied the change that placed it (no tick yet) into its status, which started
    the MIRROR_EVERY hold, and the first tick was held back behind it."""
    plane, ns = kube_control_plane, kube_namespace
    apply(plane, ns, schedule_manifest("fresh", "emails", "* * * * * *", timeZone="UTC"))  # no operator runs
    with default_kubeconfig(plane.kubeconfig):
        kube = Kube()
        connections = Connections(kube)
        controller = ScheduleController(kube, connections, QueueController(kube, connections))
        try:
            target = await connections.target(ns, RedisSpec(url=redis_url))
            scheduler = connections.scheduler(target)
            await scheduler.redis.delete(scheduler.store.changes_key)
            body = get(plane, ns, "schedule", "fresh")
            controller.schedules.put(body)
            controller.runtime[(ns, "fresh")] = ScheduleRuntime(placed=target)
            await controller.mirror.round(target)  # the loop's first round, before the Schedule is stored
            await scheduler.put(ScheduleSpec.from_json(builders.schedule_spec(ns, "fresh", body["spec"])))
            await controller.mirror.round(target)  # the change that placed it: written, no tick in it
            status = get(plane, ns, "schedule", "fresh").get("status") or {}
            assert status.get("nextTickTime") and not status.get("lastTickTime"), status
            await asyncio.sleep(1.1)
            report = await scheduler.tick()
            assert any(m.created for m in report.materialized), report
            await controller.mirror.round(target)
            status = get(plane, ns, "schedule", "fresh").get("status") or {}
            assert status.get("lastTickTime"), f"the first tick was held back: {status}"
        finally:
            await connections.close()


def test_the_operator_exports_each_tick_as_the_root_of_a_trace(kube_control_plane, kube_namespace, start_operator,
                                                               redis_url):
    """With OTEL_* set (the chart's tracing values), the operator sets up the SDK and each
    Schedule tick it offers is a `send <queue>` span, the root of the tick task's trace."""
    plane, ns = kube_control_plane, kube_namespace
    with OtlpReceiver() as otlp:
        op = start_operator(extra_env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
                                       "OTEL_RESOURCE_ATTRIBUTES": f"k8s.namespace.name={ns}"})
        apply(plane, ns, queue_manifest("traced", redis_url, paused=True))
        apply(plane, ns, schedule_manifest("each-second", "traced", "* * * * * *"))
        schedule_id = f"{ns}/each-second"
        wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/traced", schedule_id)) >= 2, timeout=30, what="ticks")
        ticks = wait_for(lambda: [(p, r, s, a) for p, r, s in otlp.spans() if s.name == f"send {ns}/traced"
                                  and "effectmq.schedule.name" in (a := {a.key: a.value.string_value
                                                                       for a in s.attributes})],
                         timeout=15, what="the ticks' spans")
        op.stop()
    assert "exporting traces (OTEL_* variables): otlp" in op.log()
    path, resource, span, attributes = ticks[0]
    assert path == "/v1/traces" and resource["service.name"] == "effectmq-operator"
    assert resource["k8s.namespace.name"] == ns
    assert span.parent_span_id == b"" and span.kind == span.SPAN_KIND_PRODUCER
    assert attributes["effectmq.schedule.name"] == schedule_id
    assert attributes["messaging.message.id"].startswith(schedule_id + "/")
    keys = effectmq.TaskQueue(f"{ns}/traced", url=redis_url).keys  # (no connection is made)
    stored = redis.Redis.from_url(redis_url).hget(keys.task(attributes["messaging.message.id"]), "trace")
    # the tick's task carries the span's context: its attempts join this trace
    assert json.loads(stored)["traceparent"].split("-")[1] == span.trace_id.hex()
