"""A Schedule's suspension under the operator: the ticks that fall
due while it is suspended follow missedTicks whatever their age, and the grace for an
operator restart (missedAfterSeconds) is set from the resource."""

from __future__ import annotations

import json
import time

import redis

from effectmq_operator.redis_pool import SCHEDULER_NAMESPACE
from tests.operator.test_operator_queues import apply, get, queue_manifest
from tests.operator.test_operator_schedules import parse, schedule_manifest, tick_tasks
from tests.support.operator import wait_for


def redis_seconds(server: redis.Redis) -> float:
    seconds, micros = server.time()
    return seconds + micros / 1e6


def test_a_resumed_skip_schedule_fires_none_of_the_ticks_due_while_suspended(kube_control_plane, kube_namespace,
                                                                             start_operator, redis_url):
    """Was: a 75 s suspension of a */3 s Schedule with missedTicks Skip created 20 tasks at
    its resume (every tick less than 60 s late counted as on time)."""
    plane, ns = kube_control_plane, kube_namespace
    start_operator()
    apply(plane, ns, queue_manifest("emails", redis_url, paused=True))
    apply(plane, ns, schedule_manifest("every-3s", "emails", "*/3 * * * * *", missedTicks="Skip",
                                       missedAfterSeconds=45))
    schedule_id = f"{ns}/every-3s"
    server = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        key = f"{{emq-sched:{SCHEDULER_NAMESPACE}}}:s:{schedule_id}"
        stored = wait_for(lambda: server.hget(key, "spec"), timeout=30, what="the stored schedule")
        assert json.loads(stored)["missed_after"] == 45  # the grace, from the resource
        wait_for(lambda: len(tick_tasks(redis_url, f"{ns}/emails", schedule_id)) >= 2, timeout=30, what="ticks")

        suspended = redis_seconds(server)
        plane.kubectl("patch", "schedule", "every-3s", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
        wait_for(lambda: server.hget(key, "suspended") == "1", timeout=20, what="suspended in Redis")
        settled = redis_seconds(server)  # ticks after this are certainly after the suspension
        time.sleep(max(0.0, 12 - (settled - suspended)))
        resumed = redis_seconds(server)  # ticks before this certainly fell due while suspended
        plane.kubectl("patch", "schedule", "every-3s", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
        wait_for(lambda: server.hget(key, "suspended") == "0", timeout=20, what="resumed in Redis")
        wait_for(lambda: any(parse(t).timestamp() > resumed + 3
                             for t in tick_tasks(redis_url, f"{ns}/emails", schedule_id)),
                 timeout=30, what="ticks after the resume")
    finally:
        server.close()
    during = [t for t in tick_tasks(redis_url, f"{ns}/emails", schedule_id)
              if settled < parse(t).timestamp() <= resumed]
    assert resumed - settled >= 9  # at least three ticks fell due in there
    assert during == [], f"ticks due while suspended were fired at the resume: {during}"
    status = get(plane, ns, "schedule", "every-3s").get("status") or {}
    assert (status.get("missedTicks") or {}).get("skipped", 0) >= 3, status
