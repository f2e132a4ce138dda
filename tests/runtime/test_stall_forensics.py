"""Stall forensics against a real Redis: a worker announces its pod with its lease tokens'
prefix, the operator records how the pod ended, and maintenance writes the cause of a
stall into the attempt's history, counts it per minute and points out poison tasks."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import REGISTRY

import effectmq
from effectmq.client.models import STALL_CAUSES, PodIdentity, WorkerEnding, stall_cause_text
from effectmq.errors import InvalidOption
from effectmq.protocol import protocol, scripts
from effectmq.transport.clock import server_time_ms
from tests.runtime.test_bad_input import cli
from tests.support.inprocess import make_worker, running

POD = PodIdentity("emails-worker-7d9f-x2", "0b7c3e1a-5d2f-4e8a-9c41-7a1e2f3b4c5d", "n1")
LEASE = 0.05  # seconds: leases that run out at once


async def stall(q: effectmq.TaskQueue, task_id: str, *, pod: PodIdentity | None = POD, **offer) -> None:
    """Offer `task_id` (unless it waits already), let this queue's process lease it (after
    announcing `pod`), and let the lease run out."""
    if await q.get(task_id) is None:
        await q.offer("job", {}, task_id=task_id, max_stalled_count=offer.pop("max_stalled_count", 10), **offer)
    if pod is not None:
        await q.worker_beat("w", 1, 1, 60, pod=pod)
    lease = await q.acquire(lock_timeout=LEASE)
    assert lease is not None and lease.task_id == task_id
    await asyncio.sleep(LEASE + 0.05)


async def last_cause(q: effectmq.TaskQueue, task_id: str) -> dict:
    info = await q.get(task_id)
    assert info is not None and info.attempts and info.attempts[-1].outcome == "stalled"
    return info.attempts[-1].cause


async def now_ms(q: effectmq.TaskQueue) -> int:
    return await server_time_ms(q.redis, q.keys.base)


ENDINGS = [  # (cause, exit code, message, the sentence after "stalled: ")
    ("oom_killed", 137, "", "pod emails-worker-7d9f-x2 OOMKilled (exit 137) on node n1"),
    ("evicted", None, "The node was low on resource: memory.",
     "pod emails-worker-7d9f-x2 Evicted on node n1: The node was low on resource: memory."),
    ("error_exit", 1, "", "pod emails-worker-7d9f-x2 Error (exit 1) on node n1"),
    ("deleted", 143, "", "pod emails-worker-7d9f-x2 deleted (exit 143) on node n1"),
    ("node_lost", None, "", "pod emails-worker-7d9f-x2 lost with its node on node n1"),
    ("drained", 0, "", "pod emails-worker-7d9f-x2 drained (exit 0) on node n1"),
]


@pytest.mark.parametrize("cause, exit_code, message, sentence", ENDINGS, ids=[e[0] for e in ENDINGS])
async def test_a_stall_names_how_its_workers_pod_ended(make_queue, cause, exit_code, message, sentence):
    q = make_queue("forensics", lock_timeout=LEASE)
    await stall(q, "t1")
    await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, POD.node, cause, exit_code, message,
                                              await now_ms(q)))
    report = await q.maintain()
    assert report.recovered == 1 and report.stall_causes == {cause: 1}
    expected = {"kind": cause, "pod": POD.name, "node": "n1"}
    if exit_code is not None:
        expected["exit_code"] = exit_code
    if message:
        expected["message"] = message
    assert await last_cause(q, "t1") == expected
    assert stall_cause_text(expected) == sentence
    assert await q.recent_stalls() == {cause: 1}
    assert (await q.get("t1")).pod_kills == (0 if cause == "drained" else 1)


async def test_an_unknown_cause_says_how_old_the_last_heartbeat_was(make_queue):
    q = make_queue("forensics-unknown", lock_timeout=LEASE)
    await q.offer("job", {}, task_id="t1")
    lease = await q.acquire(lock_timeout=10)  # the worker outside Kubernetes announced no pod
    renewed = await now_ms(q)
    await q.redis.hset(q.keys.task("t1"), "lock_until", renewed + 10_000 - 30_000)  # renewed 30 s ago, lease of 10 s
    await q.configure(lock_timeout=10)
    await q.redis.zadd(q.keys.key("active"), {"t1": renewed - 20_000})
    report = await q.maintain()
    assert report.stall_causes == {"unknown": 1}
    cause = await last_cause(q, "t1")
    assert cause["kind"] == "unknown" and set(cause) == {"kind", "heartbeat_age_ms"}
    assert 30_000 <= cause["heartbeat_age_ms"] < 35_000
    seconds = round(cause["heartbeat_age_ms"] / 1000)
    assert stall_cause_text(cause) == f"cause unknown (last heartbeat {seconds} s before)"
    assert lease.task_id == "t1"


async def test_an_announced_pod_without_an_ending_is_named_but_unknown(make_queue):
    q = make_queue("forensics-no-ending", lock_timeout=LEASE)
    await stall(q, "t1")
    await q.maintain()
    cause = await last_cause(q, "t1")
    assert cause["kind"] == "unknown" and (cause["pod"], cause["node"]) == (POD.name, "n1")
    assert 0 <= cause["heartbeat_age_ms"] < 5_000
    assert stall_cause_text(cause).endswith(f", pod {POD.name} on node n1")


async def test_the_ending_of_an_earlier_run_of_the_same_pod_is_not_blamed(make_queue, redis_url):
    first = make_queue("forensics-runs", lock_timeout=LEASE)
    await first.worker_beat("w", 0, 1, 60, pod=POD)  # the first run of the container
    await asyncio.sleep(0.01)
    await first.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137,
                                                  finished_at_ms=await now_ms(first)))
    await asyncio.sleep(1.1)  # a restarted container's process starts seconds later (finishedAt is whole seconds)
    second = make_queue("forensics-runs", lock_timeout=LEASE)  # the container restarted: a new process, same pod uid
    assert second.engine.token_prefix != first.engine.token_prefix
    await stall(second, "t1")
    await second.maintain()
    assert (await last_cause(second, "t1"))["kind"] == "unknown"
    await stall(second, "t1")
    await second.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "error_exit", 2,
                                                   finished_at_ms=await now_ms(second)))
    await second.maintain()
    assert await last_cause(second, "t1") == {"kind": "error_exit", "pod": POD.name, "node": "n1", "exit_code": 2}


@pytest.mark.parametrize("before_ms, blamed", [(500, "oom_killed"), (1500, "unknown")])
async def test_a_run_that_ended_in_the_second_it_announced_itself_is_blamed(make_queue, before_ms, blamed):
    """The kubelet's finishedAt is whole seconds: truncated, it may read up to a second
    before the run's first announcement (Redis time, milliseconds); earlier is another run."""
    q = make_queue(f"forensics-grain-{before_ms}", lock_timeout=LEASE)
    await stall(q, "t1")
    since = int((await q.redis.hget(q.keys.key("pods"), q.engine.token_prefix)).split()[1])
    await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137,
                                              finished_at_ms=since - before_ms))
    await q.maintain()
    assert (await last_cause(q, "t1"))["kind"] == blamed


async def test_recording_an_ending_again_changes_nothing(make_queue):
    q = make_queue("forensics-idempotent")
    ending = WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137, "", 1_700_000_000_000)
    await q.record_worker_ending(ending)
    stored = await q.redis.hget(q.keys.key("endings"), POD.uid)
    await q.record_worker_ending(ending)
    assert await q.redis.hget(q.keys.key("endings"), POD.uid) == stored
    reply = await q._scripts.run(protocol.WorkerEndingArgs(POD.uid, POD.name, "n1", "oom_killed", "137", "",
                                                           1_700_000_000_000))
    assert reply.recorded is False
    for i in range(protocol.ENDINGS_KEPT + 3):  # bounded per pod: the newest few
        await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "error_exit", 1, "",
                                                  1_700_000_000_001 + i))
    endings = json.loads((await q.redis.hget(q.keys.key("endings"), POD.uid)).split(" ", 1)[1])
    assert [e["f"] for e in endings] == [1_700_000_000_001 + i for i in range(3, protocol.ENDINGS_KEPT + 3)]


HOSTILE = [
    (dict(cause="unknown"), "unknown worker ending cause 'unknown'"),
    (dict(cause="exploded"), "unknown worker ending cause 'exploded'; known: oom_killed, evicted"),
    (dict(exit_code=2**40), "exit_code must be None or an integer of 32 bits"),
    (dict(exit_code=True), "exit_code must be None or an integer of 32 bits"),
    (dict(finished_at_ms=10**30), "finished_at_ms must be None or ms since the epoch"),
    (dict(finished_at_ms=-5), "finished_at_ms must be None or ms since the epoch"),
    (dict(message="\udcff bad bytes"), "message must be text that UTF-8 can encode"),
    (dict(message=b"bytes"), "message must be a string"),
    (dict(pod="x" * 300), "pod must be 1 to 253"),
    (dict(pod="a b"), "pod must be 1 to 253"),
    (dict(uid=""), "uid must be 1 to 253"),
    (dict(node="n1\n"), "node must be empty or 1 to 253"),
]


@pytest.mark.parametrize("change, error", HOSTILE, ids=[e for _, e in HOSTILE])
async def test_a_hostile_ending_is_refused_with_a_clear_error_and_writes_nothing(make_queue, change, error):
    q = make_queue("forensics-hostile")
    fields = dict(pod=POD.name, uid=POD.uid, node="n1", cause="oom_killed", exit_code=137, message="",
                  finished_at_ms=1_700_000_000_000)
    with pytest.raises(InvalidOption, match=error.replace("(", r"\(")):
        await q.record_worker_ending(WorkerEnding(**{**fields, **change}))
    assert await q.redis.exists(q.keys.key("endings")) == 0


RAW_HOSTILE = [  # past the Python checks: the script refuses them itself (rule 7)
    (dict(cause="unknown"), "unknown cause"),
    (dict(cause="oom_killed evicted"), "unknown cause"),
    (dict(exit_code="99999999999"), "exit_code"),
    (dict(exit_code="1e3"), "exit_code"),
    (dict(finished_at_ms=2**60), "finished_at_ms"),
    (dict(finished_at_ms=1.5), "finished_at_ms"),
    (dict(message="\xff\xfe".encode("latin-1")), "message"),
    (dict(message="x" * 1025), "message"),
    (dict(uid="a b"), "uid"),
    (dict(pod=""), "pod"),
    (dict(kept=0), "retention_ms must be >= 0 and kept between 1 and 100"),
]


@pytest.mark.parametrize("change, error", RAW_HOSTILE, ids=[e + str(i) for i, (_, e) in enumerate(RAW_HOSTILE)])
async def test_the_script_refuses_hostile_arguments_itself(make_queue, change, error):
    q = make_queue("forensics-raw")
    fields = dict(uid=POD.uid, pod=POD.name, node="n1", cause="oom_killed", exit_code="137", message="",
                  finished_at_ms=1_700_000_000_000)
    args = protocol.WorkerEndingArgs(**{**fields, **change})
    with pytest.raises(Exception, match=f"invalid worker ending: {error}"):
        await q._scripts.run(args)
    assert await q.redis.exists(q.keys.key("endings")) == 0


async def test_a_long_message_is_cut_to_its_bound(make_queue):
    q = make_queue("forensics-long", lock_timeout=LEASE)
    await stall(q, "t1")
    await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "evicted", None, "é" * 10_000,
                                              await now_ms(q)))
    await q.maintain()
    assert (await last_cause(q, "t1"))["message"] == "é" * protocol.MAX_ENDING_MESSAGE


async def test_an_ending_without_finished_at_counts_from_when_it_is_recorded(make_queue):
    q = make_queue("forensics-no-time", lock_timeout=LEASE)
    await stall(q, "t1")
    await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "", "deleted"))
    await q.maintain()
    assert await last_cause(q, "t1") == {"kind": "deleted", "pod": POD.name, "node": "n1"}  # node: as announced


async def test_recent_stalls_counts_per_minute_within_the_window(make_queue):
    q = make_queue("forensics-minutes", lock_timeout=LEASE)
    assert await q.recent_stalls() == {}
    now_minute = await now_ms(q) // 60_000
    slots = 180
    old = now_minute - 5  # five minutes ago: in a 10-minute window, not in a 1-minute one
    await q.redis.hset(q.keys.key("stall_minutes"), mapping={f"m:{old % slots}": old, f"oom_killed:{old % slots}": 3,
                                                             f"evicted:{old % slots}": 1})
    stale = now_minute - slots - 2  # a slot of three hours ago, reused for nothing since
    await q.redis.hset(q.keys.key("stall_minutes"), mapping={f"m:{stale % slots}": stale,
                                                             f"unknown:{stale % slots}": 9})
    await stall(q, "t1", pod=None)
    await q.maintain()
    assert await q.recent_stalls(60) == {"unknown": 1}
    assert await q.recent_stalls(600) == {"unknown": 1, "oom_killed": 3, "evicted": 1}
    assert await q.recent_stalls(slots * 60) == {"unknown": 1, "oom_killed": 3, "evicted": 1}
    for bad in (0, -1, slots * 60 + 1, float("nan"), "600"):
        with pytest.raises(InvalidOption):
            await q.recent_stalls(bad)


async def test_a_task_that_killed_its_workers_pod_twice_is_poison_until_its_record_goes(make_queue):
    q = make_queue("forensics-poison", retention_failed=0.3, lock_timeout=LEASE)
    for attempt in range(2):
        await stall(q, "bomb", max_stalled_count=1)
        await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137, "",
                                                  await now_ms(q) + attempt))
        report = await q.maintain()
        assert report.stall_causes == {"oom_killed": 1}
        poison = [t.task_id for t in await q.poison_tasks()]
        assert poison == ([] if attempt == 0 else ["bomb"])
    info = await q.get("bomb")
    assert info.state == "failed" and info.pod_kills == 2
    await asyncio.sleep(0.4)  # past the failed record's retention
    assert (await q.maintain()).expired_records == 1
    assert await q.redis.zcard(q.keys.key("poison")) == 0


async def test_a_poison_task_deleted_at_once_leaves_the_poison_set_at_the_next_maintenance(make_queue):
    q = make_queue("forensics-poison-deleted", lock_timeout=LEASE, retention_completed=0)
    await stall(q, "bomb")
    await q.redis.hset(q.keys.task("bomb"), "pod_kills", 1)
    await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "evicted", None, "", await now_ms(q)))
    await q.maintain()
    assert await q.poison_count() == 1
    lease = await make_queue("forensics-poison-deleted", lock_timeout=10, retention_completed=0).acquire()
    await lease.complete("at last")  # kept for 0 s: the record goes, the poison set is not touched
    assert await q.get("bomb") is None and await q.poison_count() == 1 and await q.poison_tasks() == []
    await q.offer("job", {}, task_id="soon", delay=0.001)  # something for maintenance to do
    await asyncio.sleep(0.01)
    assert (await q.maintain()).promoted == 1
    assert await q.poison_count() == 0


async def test_the_poison_set_is_bounded(make_queue):
    q = make_queue("forensics-poison-bound", lock_timeout=LEASE)
    for i in range(3):
        await stall(q, f"t{i}", max_stalled_count=0)
        await q.redis.hset(q.keys.task(f"t{i}"), "pod_kills", 1)
        await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137, "", await now_ms(q)))
        await q._scripts.run(protocol.MaintainArgs(10, 10, "{}", -1, "{}", 30_000, poison_kept=2,
                                                   candidates=[f"t{i}"]))
        await asyncio.sleep(0.002)
    assert await q.redis.zrange(q.keys.key("poison"), 0, -1) == ["t1", "t2"]  # the most recent


async def test_announced_pods_are_forgotten_after_the_retention(make_queue):
    q = make_queue("forensics-pods")
    await q.redis.hset(q.keys.key("pods"), "aaaa", "1000 1000 old-uid  old-pod old")  # announced long ago
    for _ in range(10):  # each announcement looks at two entries at random
        await q.worker_beat("w", 0, 1, 60, pod=POD)
    assert await q.redis.hkeys(q.keys.key("pods")) == [q.engine.token_prefix]
    with pytest.raises(Exception, match="invalid pod identity"):
        await q._scripts.run(protocol.WorkersArgs("w", 0, 1, 60_000, "p", "bad pod", "uid", ""))


def test_the_scripts_know_the_causes_python_knows():
    lua = (scripts.resources.files(scripts.__package__) / "lua" / "includes" / "forensics.lua").read_text()
    listed = lua.split("local function stall_causes()", 1)[1].split("end", 1)[0]
    assert tuple(c for c in listed.split("'")[1::2]) == STALL_CAUSES
    died = lua.split("local function pod_died(cause)", 1)[1].split("\nend", 1)[0]
    assert set(died.split("'")[1::2]) == set(protocol.POD_DEATHS)


def test_the_pod_identity_comes_from_the_environment():
    env = {"EFFECTMQ_POD_NAME": POD.name, "EFFECTMQ_POD_UID": POD.uid, "EFFECTMQ_NODE_NAME": "n1"}
    assert PodIdentity.from_env(env) == POD
    assert PodIdentity.from_env({**env, "EFFECTMQ_NODE_NAME": ""}) == PodIdentity(POD.name, POD.uid, "")
    assert PodIdentity.from_env({"HOSTNAME": "laptop"}) is None
    with pytest.raises(InvalidOption, match="pod name"):
        PodIdentity.from_env({**env, "EFFECTMQ_POD_NAME": "a b"})


async def test_a_worker_announces_its_pod_and_counts_stalls_by_cause(make_queue):
    q = make_queue("forensics-worker")
    other = make_queue("forensics-worker", lock_timeout=LEASE)  # a process that died holding a lease
    await stall(other, "t1")
    await other.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137, "",
                                                  await now_ms(other)))
    before = REGISTRY.get_sample_value("effectmq_stalls_total", {"queue": "forensics-worker",
                                                                 "cause": "oom_killed"}) or 0
    mine = PodIdentity("emails-worker-7d9f-y3", "uid-2", "n2")
    worker = make_worker(q, {"job": lambda payload, ctx: None}, pod=mine)
    async with running(worker):
        for _ in range(200):
            if (await q.get("t1")).state == "completed":
                break
            await asyncio.sleep(0.02)
        announced = await q.redis.hget(q.keys.key("pods"), q.engine.token_prefix)
    assert (await q.get("t1")).state == "completed"
    assert announced.split(" ")[2:] == ["uid-2", "n2", "emails-worker-7d9f-y3", worker.name]
    after = REGISTRY.get_sample_value("effectmq_stalls_total", {"queue": "forensics-worker", "cause": "oom_killed"})
    assert after == before + 1
    # every cause's series is there from the worker's start, at 0 until it counts one
    assert REGISTRY.get_sample_value("effectmq_stalls_total", {"queue": "forensics-worker", "cause": "evicted"}) == 0


async def test_the_task_command_renders_the_cause(make_queue, redis_url):
    q = make_queue("forensics-cli", lock_timeout=LEASE)
    await stall(q, "t1")
    await q.record_worker_ending(WorkerEnding(POD.name, POD.uid, "n1", "oom_killed", 137, "", await now_ms(q)))
    await q.maintain()
    await stall(make_queue("forensics-cli", lock_timeout=LEASE), "t1", pod=None)  # a process without a pod
    await q.maintain()
    text = cli("task", "t1", "--queue", "forensics-cli", "--url", redis_url).stdout
    assert f"stalled: pod {POD.name} OOMKilled (exit 137) on node n1" in text
    assert "stalled: cause unknown (last heartbeat 0 s before)" in text
    shown = json.loads(cli("task", "t1", "--json", "--queue", "forensics-cli", "--url", redis_url).stdout)
    assert shown["attempts"][0]["cause"]["kind"] == "oom_killed"
    assert shown["attempts"][0]["cause_text"] == f"pod {POD.name} OOMKilled (exit 137) on node n1"
