"""Rule 7: every script validates before its first write, so a refused call wrote nothing.

For each script, in scenarios that take its interesting paths, a traced run records its
steps (tests/support/write_rule.py): after the first write only writes and hints may
come. Then an error is injected at every step up to and including the first write (a
refused read, a denial, a value that cannot be encoded, a full Redis): the call must
fail, the keyspace must be byte for byte what it was, and sending the call again must
end where the clean run ended (every task in exactly its index, the same states and
counters). A denied hint (PUBLISH under an ACL without channels) must change nothing
the call promised. A write planted before a check is caught.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
from typing import Any, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

import effectmq
from effectmq.protocol import protocol, scripts
from effectmq.errors import TaskError
from effectmq.scheduler import store as schedule_store
from effectmq.scheduler.model import ScheduleSpec
from effectmq.scheduler.store import Outcome, ScheduleStore
from tests.support.write_rule import (TRACE_KEY, StepTrace, dump_all, instrument, queue_invariants, restore,
                                      snapshot)

_source = scripts.source


class Injector:
    """Which operation runs instrumented, and where its fault is (scripts.source and sha
    are patched to ask this)."""

    def __init__(self) -> None:
        self.operation: str | None = None
        self.fail_at = 0
        self.trace = False
        self.plant: Callable[[str], str] | None = None  # a test's edit of the script (a planted violation)

    def set(self, operation: str | None, *, fail_at: int = 0, trace: bool = False) -> None:
        self.operation, self.fail_at, self.trace = operation, fail_at, trace

    def text(self, operation: str, plain: str) -> str:
        if operation != self.operation:
            return plain
        if self.plant:
            plain = self.plant(plain)
        return instrument(plain, fail_at=self.fail_at, trace=self.trace)

    def source(self, operation: str) -> str:
        return self.text(operation, _source(operation))

    def sha(self, operation: str) -> str:
        return hashlib.sha1(self.source(operation).encode()).hexdigest()


@pytest.fixture
def injector(monkeypatch):
    inj = Injector()
    monkeypatch.setattr(scripts, "source", inj.source)
    monkeypatch.setattr(scripts, "sha", inj.sha)
    return inj


Action = Callable[[], Awaitable[Any]]


@dataclasses.dataclass
class Scenario:
    operation: str
    name: str
    setup: Callable[..., Awaitable[Action]]  # (queue) -> the call to inject into
    queue_options: dict = dataclasses.field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.operation}-{self.name}"


def _remembering(engine):
    """Put the engine's learnt ids back as they are now, before each run of an action."""
    ready, due, largest = list(engine._ready), list(engine._due), engine._largest

    def reset() -> None:
        engine._ready, engine._due, engine._largest = list(ready), list(due), largest
    return reset


async def _offered(q, n=6, **options):
    await q.offer_many([("t", {"i": i}, {"task_id": f"w{i}", **options}) for i in range(n)])


# -- scenarios: each returns the call to inject into ---------------------------------

async def offer_mixed(q):
    async def act():
        offered = await q.offer_many([
            ("t", {"i": 1}, {"task_id": "a"}), ("t", 2, {"task_id": "b", "delay": 30}),
            ("t", 3, {"task_id": "c", "priority": 5, "max_retries": 2}), ("t", 4, {"task_id": "a"}),
            ("t", 5, {"task_id": "known"})])
        return [o.created for o in offered]
    await q.offer("t", 0, task_id="known")
    return act


async def acquire_with_promotion(q):
    await _offered(q, 5)
    await q.offer("t", "later", task_id="later", delay=0.001)
    await asyncio.sleep(0.02)
    await q.acquire_many(1)  # w0; names the next ids and the due one
    reset = _remembering(q.engine)

    async def act():
        reset()
        leases, _ = await q.engine.acquire_many(3)
        return sorted(lease.task_id for lease in leases)
    return act


async def acquire_with_completions(q):
    await _offered(q, 6)
    first, _ = await q.acquire_many(3)
    reset = _remembering(q.engine)

    async def act():
        reset()
        outcomes, leases = await q.engine.complete_and_acquire(
            [(lease, '"done"') for lease in first] + [(first[0], '"again"')], 2)
        return [int(o) for o in outcomes], sorted(lease.task_id for lease in leases)
    return act


async def acquire_rate_limited(q):
    """Under a rate limit: the starts are read before the first write and logged after it."""
    await q.configure(rate_limit=(4, 600))
    await _offered(q, 6)
    await q.acquire_many(1)  # one start logged, the next ids named
    reset = _remembering(q.engine)

    async def act():
        reset()
        leases, wait = await q.engine.acquire_many(5)
        return sorted(lease.task_id for lease in leases), wait > 0
    return act


async def acquire_at_the_rate_limit(q):
    """No room left: the completions sent along are settled, nothing is leased."""
    await q.configure(rate_limit=(2, 600))
    await _offered(q, 4)
    first, _ = await q.acquire_many(2)
    reset = _remembering(q.engine)

    async def act():
        reset()
        outcomes, leases = await q.engine.complete_and_acquire([(lease, '"done"') for lease in first], 2)
        return [int(o) for o in outcomes], leases
    return act


async def hold_starts(q):
    await q.hold_starts(5)  # a shorter one than the call's: extended

    async def act():
        return 29 < await q.hold_starts(30) <= 30
    return act


async def complete_batch(q):
    await _offered(q, 4)
    leases, _ = await q.acquire_many(4)
    await q.redis.zadd(q.keys.key("waiters"), {leases[0].task_id: 2 ** 50})  # somebody waits on it

    async def act():
        settled = [(lease, f'{{"r":{i}}}') for i, lease in enumerate(leases[:3])] + [(leases[0], "null")]
        return [int(o) for o in await q.engine.complete_many(settled)]
    return act


async def fail_then_retry(q):
    await _offered(q, 1)
    (lease,), _ = await q.acquire_many(1)
    await q.engine.release(lease, 0)  # a history to append to
    (lease,), _ = await q.acquire_many(1)

    async def act():
        return int(await q.engine.fail(lease, TaskError("boom", data={"n": 10 ** 400, "deep": [[[1]]]}),
                                       retryable=True, retry=lambda n: 5.0, declared=()))
    return act


async def fail_for_good(q):
    await _offered(q, 1, max_retries=0)
    (lease,), _ = await q.acquire_many(1)

    async def act():
        return int(await q.engine.fail(lease, TaskError("boom"), retryable=True, retry=None, declared=()))
    return act


async def release_now(q):
    await _offered(q, 2)
    leases, _ = await q.acquire_many(2)

    async def act():
        return [int(await q.engine.release(lease, 0)) for lease in leases[:1]]
    return act


async def release_later(q):
    await _offered(q, 1)
    (lease,), _ = await q.acquire_many(1)

    async def act():
        return int(await q.engine.release(lease, 30))
    return act


async def renew_leases(q):
    await _offered(q, 3)
    leases, _ = await q.acquire_many(3)
    await leases[2].complete()

    async def act():
        return await q.engine.renew(leases)
    return act


async def progress_report(q):
    await _offered(q, 1)
    (lease,), _ = await q.acquire_many(1)

    async def act():
        return await q.engine.progress(lease, {"done": 0.5})
    return act


async def cancel_active(q):
    await _offered(q, 2)
    (lease,), _ = await q.acquire_many(1)
    await q.redis.zadd(q.keys.key("waiters"), {lease.task_id: 2 ** 50})

    async def act():
        return await q.cancel(lease.task_id)
    return act


async def retry_failed(q):
    await _offered(q, 1, max_retries=0)
    (lease,), _ = await q.acquire_many(1)
    await lease.fail(TaskError("boom"))

    async def act():
        return await q.retry("w0")
    return act


async def maintain_everything(q):
    await q.configure(dedup_window=0.01)
    await _offered(q, 2)
    await q.offer("t", "fragile", task_id="fragile", max_stalled_count=0)
    await q.offer("t", "soon", task_id="soon", delay=0.001)
    leases, _ = await q.acquire_many(3, lock_timeout=0.03)
    await q.offer_many([("t", i, {"task_id": f"done{i}"}) for i in range(2)])
    done, _ = await q.acquire_many(2)
    for lease in done:
        await lease.complete()
    await asyncio.sleep(0.1)  # the leases ran out, the records and reservations expired

    async def act():
        return dataclasses.astuple(await q.maintain(batch=50))
    return act


async def offer_grouped(q):
    """Groups' turns, tasks without a group among them, and tasks put before ids already named."""
    await _offered(q, 8, group="a")
    await q.acquire_many(1)  # names the next ids: the offer puts b's before them

    async def act():
        offered = await q.offer_many([
            ("t", 1, {"task_id": "b1", "group": "b"}), ("t", 2, {"task_id": "b2", "group": "b", "priority": 3}),
            ("t", 3, {"task_id": "plain"}), ("t", 4, {"task_id": "a9", "group": "a"}),
            ("t", 5, {"task_id": "b3", "group": "b", "delay": 30}), ("t", 6, {"task_id": "w1", "group": "c"})])
        return [o.created for o in offered]
    return act


async def acquire_grouped(q):
    """Grouped leases counted, a grouped delayed task promoted, names after a moved mark."""
    await _offered(q, 8, group="a")
    await q.offer("t", "later", task_id="later", group="b", delay=0.001)
    await q.acquire_many(1)
    await q.offer_many([("t", i, {"task_id": f"c{i}", "group": "c"}) for i in range(3)])  # before the names
    await asyncio.sleep(0.02)
    reset = _remembering(q.engine)

    async def act():
        reset()
        leases, _ = await q.engine.acquire_many(2)
        return sorted(lease.task_id for lease in leases)
    return act


async def cancel_waiting_grouped(q):
    await _offered(q, 2, group="a")

    async def act():
        return await q.cancel("w1")
    return act


async def release_grouped(q):
    await _offered(q, 3, group="a")
    await q.offer("t", "b", task_id="b0", group="b")
    leases, _ = await q.acquire_many(1)

    async def act():
        return int(await q.engine.release(leases[0], 0))
    return act


async def retry_grouped(q):
    await _offered(q, 2, group="a", max_retries=0)
    (lease,), _ = await q.acquire_many(1)
    await lease.fail(TaskError("boom"))

    async def act():
        return await q.retry(lease.task_id)
    return act


async def maintain_grouped(q):
    await _offered(q, 3, group="a")
    await q.offer("t", "soon", task_id="soon", delay=0.001, group="b")
    await q.acquire_many(2, lock_timeout=0.03)
    await asyncio.sleep(0.1)  # the leases ran out, the delayed task is due

    async def act():
        return dataclasses.astuple(await q.maintain(batch=50))
    return act


async def _capped(q, n=4, **options):
    """Group a capped at 1 with its first task leased and the next parked; b beside it."""
    await q.configure_group("a", max_active=1)
    await q.offer_many([("t", i, {"task_id": f"a{i}", "group": "a", **options}) for i in range(n)] +
                       [("t", "b", {"task_id": "b0", "group": "b"})])
    first, _ = await q.acquire_many(1)
    await q.acquire_many(2)  # b0 leased, a1 parked
    return first[0]


async def acquire_parking(q):
    """A completion sent along frees a's slot (a1 handed back at the end of the call) while
    the picks of c, at its cap, are parked."""
    lease = await _capped(q, 2)
    await q.configure_group("c", max_active=1)
    await q.offer_many([("t", i, {"task_id": f"c{i}", "group": "c"}) for i in range(3)])
    await q.acquire_many(1)  # c0; names c1 and c2
    reset = _remembering(q.engine)

    async def act():
        reset()
        outcomes, leases = await q.engine.complete_and_acquire([(lease, "null")], 2)
        parked = await q.redis.zcard(q.keys.key("backlog"))
        return [int(o) for o in outcomes], sorted(x.task_id for x in leases), parked
    return act


async def complete_capped(q):
    lease = await _capped(q)

    async def act():
        return [int(o) for o in await q.engine.complete_many([(lease, "null")])]
    return act


async def fail_capped(q):
    lease = await _capped(q)

    async def act():
        return int(await q.engine.fail(lease, TaskError("boom"), retryable=True, retry=lambda n: 0.0, declared=()))
    return act


async def release_capped(q):
    lease = await _capped(q)

    async def act():
        return int(await q.engine.release(lease, 30))
    return act


async def cancel_parked(q):
    await _capped(q)

    async def act():
        return await q.cancel("a1")
    return act


async def cancel_active_capped(q):
    lease = await _capped(q)

    async def act():
        return await q.cancel(lease.task_id)
    return act


async def maintain_capped(q):
    await q.configure_group("a", max_active=1)
    await q.offer_many([("t", i, {"task_id": f"a{i}", "group": "a"}) for i in range(3)])
    await q.acquire_many(3, lock_timeout=0.03)  # a0 leased, the others parked
    await asyncio.sleep(0.1)

    async def act():
        return dataclasses.astuple(await q.maintain(batch=50))
    return act


async def reclaim_capped(q):
    lease = await _capped(q)
    prefix = lease.token.rsplit(":", 1)[0]

    async def act():
        return (await q._scripts.run(protocol.ReclaimArgs(prefix, ["a0", "a1"]))).reclaimed
    return act


async def resume_group(q):
    await q.pause_group("a")
    await q.offer_many([("t", i, {"task_id": f"a{i}", "group": "a"}) for i in range(5)])
    await q.acquire_many(5)  # all parked

    async def act():
        return (await q._scripts.run(protocol.ConfigureGroupArgs("a", "3", "0", batch=2))).more
    return act


async def pause_group(q):
    async def act():
        return (await q.pause_group("a")).paused
    return act


async def default_cap_raised(q):
    await q.configure(group_max_active=1)
    await q.offer_many([("t", i, {"task_id": f"{g}{i}", "group": g}) for g in "ab" for i in range(3)])
    await q.acquire_many(6)  # one of each leased, the others parked
    await q.redis.hset(q.keys.key("meta"), "group_max_active", "2")

    async def act():
        return (await q._scripts.run(protocol.ConfigureGroupArgs(""))).more
    return act


async def configure_group_default(q):
    async def act():
        await q.configure(group_max_active=2)
    return act


async def acquire_rate_parking(q):
    """a at its rate limit: its picks parked (its due time written) while b's lease; a's
    starts in the window counted, its start logged, its old starts and a stopped group's trimmed."""
    await q.configure_group("a", rate_limit=(2, 60))
    await q.offer_many([("t", i, {"task_id": f"a{i}", "group": "a"}) for i in range(4)] +
                       [("t", "b", {"task_id": "b0", "group": "b"})])
    await q.acquire_many(1)  # a0
    await q.redis.zadd(q.keys.key("group_starts"), {"a\0000000000000001\0" + "1": 0,  # long gone
                                                    "c\0000000000000001\0" + "2": 0})  # a stopped group's: swept
    reset = _remembering(q.engine)

    async def act():
        reset()
        leases, next_due = await q.acquire_many(4)
        return sorted(lease.task_id for lease in leases), next_due is not None
    return act


async def acquire_rate_due(q):
    """a's window allows a start again: its parked tasks go back (and, in the same call, its
    attempt's end sent along hands back after them)."""
    await q.configure_group("a", rate_limit=(1, 0.05))
    await q.offer_many([("t", i, {"task_id": f"a{i}", "group": "a"}) for i in range(4)] +
                       [("t", "b", {"task_id": "b0", "group": "b"})])
    (first,), _ = await q.acquire_many(1)  # a0
    for _ in range(3):
        await q.acquire_many(4)  # b0 leased, the other a's parked
    await asyncio.sleep(0.1)
    reset = _remembering(q.engine)

    async def act():
        reset()
        outcomes, leases = await q.engine.complete_and_acquire([(first, "null")], 2)
        return [int(o) for o in outcomes], sorted(x.task_id for x in leases)
    return act


async def group_rate_removed(q):
    await q.configure_group("a", rate_limit=(1, 60))
    await q.offer_many([("t", i, {"task_id": f"a{i}", "group": "a"}) for i in range(4)])
    for _ in range(3):
        await q.acquire_many(4)  # a0 leased, the others parked

    async def act():
        return (await q._scripts.run(protocol.ConfigureGroupArgs("a", rate_limit="0", batch=2))).more
    return act


async def group_rate_set(q):
    async def act():
        return (await q.configure_group("a", rate_limit=(3, 1))).rate_limit
    return act


async def configure_group_rate_default(q):
    async def act():
        await q.configure(group_rate_limit=(5, 1))
    return act


async def configure_settings(q):
    async def act():
        await q.configure(max_active=3, paused=True, retention_completed=60)
    return act


async def announce_worker(q):
    await q.worker_beat("other", 1, 4, 0.001)
    await asyncio.sleep(0.01)  # past its expiry: dropped by the next announcement

    async def act():
        await q.worker_beat("me", 2, 8, 30)
    return act


POD = effectmq.PodIdentity("pod-a", "uid-a", "node-a")


async def maintain_with_causes(q):
    await _offered(q, 3)
    await q.worker_beat("w", 1, 1, 60, pod=POD)
    await q.acquire_many(3, lock_timeout=0.03)
    await q.redis.hset(q.keys.task("w0"), "pod_kills", 1)  # its second pod death: poison
    await q.redis.zadd(q.keys.key("poison"), {"gone": 1})  # its record deleted meanwhile
    await q.record_worker_ending(effectmq.WorkerEnding("pod-a", "uid-a", "node-a", "oom_killed", 137, "out of memory"))
    await asyncio.sleep(0.1)  # the leases ran out

    async def act():
        return dataclasses.astuple(await q.maintain(batch=50))
    return act


async def announce_pod(q):
    await q.redis.hset(q.keys.key("pods"), "old", "1000 1000 uid-old  pod-old old")  # long gone: swept
    await q.worker_beat("other", 1, 4, 0.001)
    await asyncio.sleep(0.01)

    async def act():
        await q.worker_beat("me", 2, 8, 30, pod=POD)
    return act


async def record_ending(q):
    await q.redis.hset(q.keys.key("endings"), "gone-uid", "1000 []")  # recorded long ago: swept
    await q.record_worker_ending(effectmq.WorkerEnding("pod-a", "uid-a", "", "error_exit", 1, "", 1_700_000_000_000))

    async def act():
        await q.record_worker_ending(effectmq.WorkerEnding("pod-a", "uid-a", "node-a", "oom_killed", 137,
                                                           "out of memory", 1_700_000_000_500))
    return act


async def reclaim_lost(q):
    await _offered(q, 3)
    leases, _ = await q.acquire_many(2)
    prefix = leases[0].token.rsplit(":", 1)[0]
    from effectmq.protocol import protocol
    reclaim_args = getattr(protocol, "ReclaimArgs", None)
    if reclaim_args is None:
        pytest.fail("protocol.ReclaimArgs is missing: the reclaim script has no typed call")

    async def act():
        return (await q._scripts.run(reclaim_args(prefix, ["w0", "w1", "w2"]))).reclaimed
    return act


SCENARIOS = [
    Scenario("offer", "mixed", offer_mixed),
    Scenario("acquire", "promotion", acquire_with_promotion, {"lock_timeout": 60}),
    Scenario("acquire", "completions", acquire_with_completions, {"lock_timeout": 60, "retention_completed": 0}),
    Scenario("acquire", "completions-kept", acquire_with_completions, {"lock_timeout": 60}),
    Scenario("acquire", "rate-limit", acquire_rate_limited, {"lock_timeout": 60}),
    Scenario("acquire", "at-the-rate-limit", acquire_at_the_rate_limit, {"lock_timeout": 60, "retention_completed": 0}),
    Scenario("hold", "extend", hold_starts),
    Scenario("complete", "batch", complete_batch, {"lock_timeout": 60, "retention_completed": 0}),
    Scenario("complete", "batch-kept", complete_batch, {"lock_timeout": 60}),
    Scenario("fail", "retry", fail_then_retry, {"lock_timeout": 60}),
    Scenario("fail", "for-good", fail_for_good, {"lock_timeout": 60, "retention_failed": 0}),
    Scenario("fail", "for-good-kept", fail_for_good, {"lock_timeout": 60}),
    Scenario("release", "now", release_now, {"lock_timeout": 60}),
    Scenario("release", "later", release_later, {"lock_timeout": 60}),
    Scenario("renew", "leases", renew_leases, {"lock_timeout": 60}),
    Scenario("progress", "report", progress_report, {"lock_timeout": 60}),
    Scenario("cancel", "active", cancel_active, {"lock_timeout": 60}),
    Scenario("retry", "failed", retry_failed, {"lock_timeout": 60}),
    Scenario("maintain", "everything", maintain_everything, {"retention_completed": 0.01}),
    Scenario("configure", "settings", configure_settings),
    Scenario("maintain", "stall-causes", maintain_with_causes, {"lock_timeout": 0.03}),
    Scenario("workers", "announce", announce_worker),
    Scenario("workers", "announce-pod", announce_pod),
    Scenario("worker_ending", "record", record_ending),
    Scenario("reclaim", "lost", reclaim_lost, {"lock_timeout": 60}),
    Scenario("offer", "grouped", offer_grouped, {"lock_timeout": 60}),
    Scenario("acquire", "grouped", acquire_grouped, {"lock_timeout": 60}),
    Scenario("cancel", "waiting-grouped", cancel_waiting_grouped),
    Scenario("release", "grouped", release_grouped, {"lock_timeout": 60}),
    Scenario("retry", "grouped", retry_grouped, {"lock_timeout": 60}),
    Scenario("maintain", "grouped", maintain_grouped),
    Scenario("acquire", "parking", acquire_parking, {"lock_timeout": 60}),
    Scenario("complete", "capped", complete_capped, {"lock_timeout": 60}),
    Scenario("fail", "capped", fail_capped, {"lock_timeout": 60}),
    Scenario("release", "capped", release_capped, {"lock_timeout": 60}),
    Scenario("cancel", "parked", cancel_parked, {"lock_timeout": 60}),
    Scenario("cancel", "active-capped", cancel_active_capped, {"lock_timeout": 60}),
    Scenario("maintain", "capped", maintain_capped),
    Scenario("reclaim", "capped", reclaim_capped, {"lock_timeout": 60}),
    Scenario("configure_group", "resume", resume_group, {"lock_timeout": 60}),
    Scenario("configure_group", "pause", pause_group),
    Scenario("configure_group", "default-raised", default_cap_raised, {"lock_timeout": 60}),
    Scenario("configure", "group-default", configure_group_default),
    Scenario("acquire", "rate-parking", acquire_rate_parking, {"lock_timeout": 60}),
    Scenario("acquire", "rate-due", acquire_rate_due, {"lock_timeout": 60}),
    Scenario("configure_group", "rate-removed", group_rate_removed, {"lock_timeout": 60}),
    Scenario("configure_group", "rate-set", group_rate_set),
    Scenario("configure", "group-rate-default", configure_group_rate_default),
]


async def _trace(raw) -> list[StepTrace]:
    """The traced calls since the last read, one StepTrace per call."""
    steps = [s.decode() for s in await raw.lrange(TRACE_KEY, 0, -1)]
    await raw.delete(TRACE_KEY)
    calls: list[list[str]] = []
    for step in steps:
        if step == "begin":
            calls.append([])
        else:
            calls[-1].append(step)
    return [StepTrace(tuple(c)) for c in calls]


async def inject_everywhere(raw, base: bytes, inj: Injector, operation: str, act: Action,
                            summarize: Callable[[], Awaitable[Any]]) -> int:
    """The traced run, then a fault at every step up to the first write and at every
    hint; returns the number of points injected."""
    saved, before = await dump_all(raw), await snapshot(raw)
    inj.set(operation, trace=True)
    clean = await act()
    calls = await _trace(raw)
    inj.set(None)
    assert calls, f"{operation} never ran"
    for call in calls:
        assert not call.violations(), f"{operation}: after the first write: {call.violations()}\n{call.steps}"
    expected = await summarize()
    first = calls[0]
    assert first.first_write <= len(first.steps), f"{operation}: the scenario wrote nothing: {first.steps}"
    points = 0
    for k in [*range(1, first.first_write + 1), *first.hints()]:
        await restore(raw, saved)
        inj.set(operation, fail_at=k)
        if k <= first.first_write:
            try:
                await act()
            except Exception:  # any refusal: what matters is what it left
                assert await snapshot(raw) == before, (
                    f"{operation}: step {k} ({first.steps[k - 1]}) failed after a write")
                inj.set(None)
                assert await act() == clean, f"{operation}: the call sent again after step {k} failed"
            else:  # a step the script guards (a decode under pcall): it settles all the same
                assert first.steps[k - 1].startswith("codec:"), f"{operation}: a fault at step {k} went unnoticed"
        else:  # a denied hint: the call goes through
            assert await act() == clean, f"{operation}: a denied hint at step {k} changed the reply"
        inj.set(None)
        assert await summarize() == expected, f"{operation}: after a fault at step {k}"
        points += 1
    return points


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
async def test_a_fault_before_the_first_write_writes_nothing(redis_url, injector, scenario):
    q = effectmq.TaskQueue("rule7", url=redis_url, **scenario.queue_options)
    q._scripts.functions = False  # by SHA, so that the instrumented text is what runs
    raw = aioredis.Redis.from_url(redis_url)
    try:
        act = await scenario.setup(q)
        base = q.keys.base.encode()
        points = await inject_everywhere(raw, base, injector, scenario.operation, act,
                                         lambda: queue_invariants(raw, base))
        assert points >= 2
        print(f"{scenario.id}: {points} fault points")
    finally:
        await q.close()
        await raw.aclose()


# -- the scheduler's scripts -----------------------------------------------------------

def _spec(i: int, cron: str = "* * * * *") -> ScheduleSpec:
    return ScheduleSpec(id=f"s{i}", queue="q", cron=cron, task="tick")


async def _schedules_summary(raw) -> dict:
    out = {}
    async for key in raw.scan_iter(match=b"{emq-sched:rule7}:*"):
        kind = await raw.type(key)
        if kind == b"hash":
            h = await raw.hgetall(key)
            out[key] = {k: v for k, v in h.items() if not k.endswith(b"_at") and k != b"cursor"}  # times: now
        elif kind == b"zset":
            out[key] = [m for m, _ in await raw.zrange(key, 0, -1, withscores=True)]
    return out


@pytest.mark.parametrize("operation", ["put", "advance", "due", "remove"])
async def test_the_schedulers_scripts_keep_the_rule(redis_url, operation):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    raw = aioredis.Redis.from_url(redis_url)
    store = ScheduleStore(client, namespace="rule7")
    inj = Injector()

    def arm() -> None:
        text = schedule_store.source(operation)
        store._scripts[operation] = client.register_script(
            inj.text(operation, text) if inj.operation else text)

    try:
        for i in range(3):
            await store.put(_spec(i))
        await raw.hdel(store.key("s2"), "cursor")  # written by hand: due gives it a cursor
        version, cursor, now = await store.put(_spec(1, "*/5 * * * *"))

        async def act():
            arm()
            if operation == "put":
                return (await store.put(_spec(0, "0 * * * *")))[0]
            if operation == "advance":
                return await store.advance([
                    Outcome("s1", version, cursor, cursor + 1, now + 60_000, last_tick=cursor + 1, task="t1",
                            materialized=1),
                    Outcome("s0", "1", None, None, now + 1000, error="broken"),
                    Outcome("s1", version, cursor, cursor + 2, now + 60_000)])
            if operation == "due":
                return [(r.id, r.version) for r in (await store.due(10)).rows]
            return await store.remove("s1")

        async def traced(**kwargs):
            inj.set(operation, **kwargs)
            return await act()

        async def plain():
            inj.set(None)
            return await act()

        saved, before = await dump_all(raw), await snapshot(raw)
        clean = await traced(trace=True)
        calls = await _trace(raw)
        assert calls and not calls[0].violations(), calls
        expected = await _schedules_summary(raw)
        first = calls[0]
        assert first.first_write <= len(first.steps), first.steps
        for k in range(1, first.first_write + 1):
            await restore(raw, saved)
            with pytest.raises(effectmq.RedisRefused, match="injected fault"):
                await traced(fail_at=k)
            assert await snapshot(raw) == before, f"{operation}: step {k} ({first.steps[k - 1]})"
            assert await plain() == clean
            assert await _schedules_summary(raw) == expected
        print(f"scheduler {operation}: {first.first_write} fault points")
    finally:
        await client.aclose()
        await raw.aclose()


# -- the test catches a planted violation ----------------------------------------------

async def test_a_write_planted_before_a_check_is_caught(redis_url, injector):
    """fail.lua with its first write sent at once, before the reads and checks that follow
    (the write order of 8519fde): the rule check names the steps after it, and a fault
    at one of them leaves the task active in no index: lost."""
    injector.plant = lambda text: re.sub(
        r"\nwrite\('ZREM', K_ACTIVE, id\)", "\nredis.call('ZREM', K_ACTIVE, id)", text, count=1)
    q = effectmq.TaskQueue("planted", url=redis_url, lock_timeout=60)
    q._scripts.functions = False
    raw = aioredis.Redis.from_url(redis_url)
    try:
        act = await fail_then_retry(q)
        base = q.keys.base.encode()
        saved = await dump_all(raw)
        with pytest.raises(AssertionError, match="after the first write: .*read:HGET"):
            await inject_everywhere(raw, base, injector, "fail", act, lambda: queue_invariants(raw, base))
        await restore(raw, saved)
        injector.set("fail", trace=True)
        await act()
        (call,) = await _trace(raw)
        after_write = int(call.violations()[0].split()[1])
        await restore(raw, saved)
        injector.set("fail", fail_at=after_write)
        with pytest.raises(effectmq.RedisRefused, match="injected fault"):
            await act()
        with pytest.raises(AssertionError, match="state 'active' but in indexes \\[\\]"):
            await queue_invariants(raw, base)
    finally:
        await q.close()
        await raw.aclose()


async def test_a_failure_decodes_only_its_own_error_not_the_history(redis_url, injector):
    """Suspected from reading 8519fde and confirmed: every fail, release and stall decoded
    and encoded the whole history (20 entries, each error up to 1 MiB). Now a failure
    decodes its own error once, to check it, and appends to the history as text."""
    q = effectmq.TaskQueue("history", url=redis_url, lock_timeout=60, max_retries=50)
    q._scripts.functions = False
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await q.offer("t", 1, task_id="a")
        for n in range(22):
            (lease,), _ = await q.acquire_many(1)
            injector.set("fail", trace=True)
            await q.engine.fail(lease, TaskError(f"boom {n}", data="x" * 10_000), retryable=True,
                                retry=lambda failures: 0.0, declared=())
            injector.set(None)
            (call,) = await _trace(raw)
            codecs = [step for step in call.steps if step.startswith("codec:")]
            # Its own error checked once; the one encode is the wake message naming the task.
            assert codecs == ["codec:decode", "codec:encode"], (n, codecs)
        history = (await q.get("a")).attempts
        assert len(history) == 20 and history[-1].error.message == "boom 21"
    finally:
        await q.close()
        await raw.aclose()
