"""Schedules under the operator: ticks become tasks exactly once, also with two
operator replicas and a leader handover; bad schedules become conditions."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import yaml

import effectmq
from tests.operator.test_operator_queues import apply, condition, events, get, queue_manifest
from tests.support.operator import wait_for

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
    assert status["lastTaskId"].startswith(schedule_id + "/")
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
