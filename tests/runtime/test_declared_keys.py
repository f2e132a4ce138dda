"""Every Lua script declares in KEYS every key it touches.

Redis 7.0 lets a script touch undeclared keys of the same slot; Redis Cluster
proxies that route on KEYS do not, and the project's rule is that every script
declares its keys. The engine's and the scheduler's scripts run here through the
public API under `strict_keys` (tests/support/strict_keys.py), which reads MONITOR
and asks Redis which arguments of each command a script ran are keys.
"""

from __future__ import annotations

import asyncio

import redis

import effectmq
from effectmq.protocol import protocol
from effectmq.scheduler import Scheduler, ScheduleSpec
from effectmq.scheduler import store as schedule_store
from tests.scheduler.support import rewind
from tests.support.inprocess import make_worker, running, settled
from tests.support.strict_keys import known_scripts, strict_keys


def _scripts(kind: str) -> set[str]:
    return {name for name in known_scripts().values() if name.startswith(kind + ":")}


def _violations(check, kind: str) -> list:
    """Those of one kind's scripts (the scheduler's passes also offer through the engine)."""
    return [v for v in check.violations if not v.script.startswith(("engine:", "scheduler:"))
            or v.script.startswith(kind + ":")]


def _shown(violations: list) -> str:
    """One line per script and command (its first violation), with how many there were."""
    first: dict[tuple[str, str], tuple[object, int]] = {}
    for v in violations:
        seen, count = first.get((v.script, v.command[0]), (v, 0))
        first[(v.script, v.command[0])] = (seen, count + 1)
    return f"{len(violations)} in all\n" + "\n".join(f"{count}x {v}" for v, count in first.values())


# -- the checker itself can fail ------------------------------------------------------


def test_the_check_reports_an_undeclared_key_and_accepts_a_declared_one(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    undeclared = client.register_script("redis.call('SET', KEYS[1], 1); return redis.call('HGET', '{t}:other', 'f')")
    declared = client.register_script("redis.call('SET', KEYS[1], 1); redis.call('TIME');"
                                      " return redis.call('HGET', KEYS[2], 'f')")
    with strict_keys(redis_url) as check:
        undeclared(keys=["{t}:mine"])
        declared(keys=["{t}:mine", "{t}:other"])
        client.eval("return redis.call('DEL', 'spaced key', KEYS[1])", 1, "x")
    assert [(v.command, v.key) for v in check.violations] == [
        (("HGET", "{t}:other", "f"), "{t}:other"), (("DEL", "spaced key", "x"), "spaced key")]
    assert check.violations[0].script == undeclared.sha and check.violations[1].script.startswith("EVAL ")
    assert len(check.seen) == 3 and check.calls >= 3  # a first EVALSHA may answer NOSCRIPT (it ran nothing)
    client.close()


def test_every_known_script_is_named():
    assert _scripts("engine") == {f"engine:{op}" for op in protocol.SCRIPTS} and len(_scripts("engine")) == 18
    assert _scripts("scheduler") == {f"scheduler:{op}" for op in schedule_store.OPERATIONS}
    # no SHA or function name shared: the engine's by SHA (EVALSHA) and by function (FCALL)
    assert len(set(known_scripts())) == 2 * len(_scripts("engine")) + len(_scripts("scheduler"))


# -- the engine ------------------------------------------------------------------------


class Flaky(Exception):
    pass


async def test_every_engine_script_declares_the_keys_it_touches(redis_url):
    queue = effectmq.TaskQueue("strict", url=redis_url, lock_timeout=0.3, retry=effectmq.Fixed(0.01))
    app = effectmq.App("strict")
    app.use_queue(queue)
    attempts: dict[str, int] = {}

    @app.task(errors=(Flaky,))
    async def work(payload, ctx):
        await ctx.progress(1)
        attempts[ctx.task_id] = attempts.get(ctx.task_id, 0) + 1
        if payload == "flaky" and ctx.attempt == 1:
            raise Flaky("once")  # a retry
        if payload == "broken":
            raise Flaky("always")  # retried once, then failed
        return payload

    try:
        with strict_keys(redis_url) as check:
            await queue.configure(dedup_window=3600, max_active=100, rate_limit=(1000, 1.0))  # logs the starts
            await queue.offer("work", "a", task_id="by-hand")
            await queue.offer_many([("work", "b", {"task_id": "stalls"}), ("work", "c", {"task_id": "canceled"})])
            await queue.offer("work", "d", task_id="later", delay=0.2)

            lease = await queue.acquire()  # by hand: progress, renew, release, then fail
            assert lease is not None and lease.task_id == "by-hand"
            await lease.progress(50)
            await lease.renew()
            await lease.release()
            assert await queue.cancel("canceled") == "waiting"
            assert await queue.retry("canceled") == "canceled"
            lease = await queue.acquire()
            await lease.fail(RuntimeError("no"), retryable=False)
            await queue.retry(lease.task_id)

            stalled = [await queue.acquire(lock_timeout=0.05) for _ in range(3)]  # never renewed
            assert {s.task_id for s in stalled if s} >= {"stalls"}
            await asyncio.sleep(0.3)
            await queue.worker_beat("by-hand", 1, 1, 60, pod=effectmq.PodIdentity("pod-a", "uid-a", "node-a"))
            await queue.record_worker_ending(effectmq.WorkerEnding("pod-a", "uid-a", "node-a", "oom_killed", 137))
            report = await queue.maintain()  # recovers the expired leases (named oom_killed), promotes "later"
            assert report.recovered >= 1 and report.stall_causes == {"oom_killed": report.recovered}
            await queue.sweep(budget=0.1)

            await queue.offer_many([("work", "flaky", {"task_id": "flaky"}),
                                    ("work", "broken", {"task_id": "broken", "max_retries": 1}),
                                    ("work", "ok", {"task_id": "ok"})])
            async with running(make_worker(queue, app, lock_refresh=0.05)):
                for task_id in ("by-hand", "stalls", "canceled", "later", "flaky", "ok"):
                    assert (await settled(queue, task_id)).state == "completed", task_id
                assert (await settled(queue, "broken")).state == "failed"
                await queue.workers()
            await queue.offer("work", "e", task_id="direct")  # completed by hand (a worker's go along with acquire)
            lease = await queue.acquire()
            assert lease is not None and lease.task_id == "direct"
            await lease.complete("by hand")
            await queue.offer("work", "f", task_id="lost-reply")  # leased by a call whose reply is lost
            lease = await queue.acquire()
            prefix = lease.token.rsplit(":", 1)[0]
            assert (await queue._scripts.run(protocol.ReclaimArgs(prefix, ["lost-reply"]))).reclaimed == 1
            await queue.configure_group("g", max_active=1)  # group caps: tasks parked and handed back
            await queue.offer_many([("work", "g", {"task_id": f"g{i}", "group": "g"}) for i in range(5)])
            leased = [await queue.acquire() for _ in range(3)]  # one of g leased, the picks after it parked
            held = [lease for lease in leased if lease and lease.task_id.startswith("g")]
            assert len(held) == 1 and (await queue.stats()).parked >= 1
            await held[0].release()  # a parked one goes back
            held = [await queue.acquire()]
            await held[0].fail(RuntimeError("no"), retryable=False)
            held = [await queue.acquire()]
            parked = (await queue.redis.zrange(queue.keys.key("backlog"), 0, 0))[0].split("\0")[1][16:]
            assert await queue.cancel(parked) == "waiting"
            await queue.pause_group("g")
            await held[0].complete("ok")
            await queue.resume_group("g")
            await queue.configure(group_max_active=2)
            assert (await queue.group_stats("g")).max_active == 1
            await queue.stats()
            await queue.hold_starts(0)
    finally:
        await queue.close()
    assert attempts["flaky"] == 2 and attempts["broken"] == 2
    assert _scripts("engine") - check.seen == set(), "engine scripts never run by this test"
    violations = _violations(check, "engine")
    assert not violations, "scripts touched keys they did not declare:\n" + _shown(violations)


# -- the scheduler ---------------------------------------------------------------------


async def test_every_scheduler_script_declares_the_keys_it_touches(redis_url):
    scheduler = Scheduler(redis_url, namespace="strict")
    try:
        with strict_keys(redis_url) as check:
            await scheduler.put(ScheduleSpec(id="strict/every-second", queue="strict-ticks", cron="* * * * * *",
                                             task="tick"))
            await scheduler.put(ScheduleSpec(id="strict/suspended", queue="strict-ticks", cron="* * * * *",
                                             task="tick", suspend=True))
            await scheduler.put(ScheduleSpec(id="strict/gone", queue="strict-ticks", cron="* * * * *", task="tick"))
            await rewind(scheduler, "strict/every-second", 3)  # ticks due: read, offered, advanced
            report = await scheduler.tick()
            assert report.materialized and not report.errors
            assert await scheduler.remove("strict/gone")
            assert not await scheduler.remove("strict/never-was")
            await scheduler.tick()
    finally:
        await scheduler.close()
    assert _scripts("scheduler") - check.seen == set(), "scheduler scripts never run by this test"
    violations = _violations(check, "scheduler")
    assert not violations, "scripts touched keys they did not declare:\n" + _shown(violations)
