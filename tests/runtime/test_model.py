"""Model-based test: random sequences of operations against real Redis and a pure
reference model, with the protocol's invariants checked after every step. Tasks may carry
a group: the model gives each entry into waiting its sequence number as
lua/includes/groups.lua describes it, and checks the waiting counts per group."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import redis as sync_redis
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import effectmq
from effectmq.protocol.keys import INDEXES

IDS = st.sampled_from([f"t{i}" for i in range(6)])
GROUPS = st.sampled_from([None, None, "a", "b"])
MAX_RETRIES = 2
MAX_STALLED = 1
RATE_PERIOD = 3600.0
STEPS = int(os.environ.get("EFFECTMQ_MODEL_STEPS", "50"))
EXAMPLES = int(os.environ.get("EFFECTMQ_MODEL_EXAMPLES", "200"))


# Which earlier outcomes of the same token each acknowledgement repeats.
SETTLES_AS = {"complete": {"completed"}, "fail": {"retry", "failed"}, "release": {"released"}}


@dataclass
class ModelTask:
    priority: int
    seq: int
    group: str | None = None
    state: str = "waiting"
    attempt: int = 0
    hfc: int = 0
    sac: int = 0
    token: str | None = None  # the current lease token, None unless active
    expired: bool = False  # the current lease ran out (by the simulated clock)
    last_token: str | None = None  # the token that last settled or released it
    last_outcome: str | None = None  # how it did: completed, retry, failed, released


@dataclass
class Model:
    tasks: dict[str, ModelTask] = field(default_factory=dict)
    seq: int = 0  # at least every sequence number handed out
    clocks: dict[str, int] = field(default_factory=dict)  # each group's last sequence number
    default_clock: int = 0  # the virtual time of the tasks without a group ('' in groups.lua)
    rate: int | None = None  # tasks per RATE_PERIOD (a period no example outlasts), None: no limit
    logged: int = 0  # starts in the log of starts (acquire.lua): all in the window, the newest `rate` kept
    held: bool = False  # starts held (hold_starts) for longer than any example

    def may_start(self) -> bool:
        return not self.held and (self.rate is None or self.logged < self.rate)

    def waiting_count(self, group: str) -> int:
        return sum(1 for t in self.tasks.values() if t.state == "waiting" and t.group == group)

    def next_seq(self, group: str | None, priority: int) -> int:
        """The sequence number a task entering waiting takes (groups.lua), from the state
        before it enters."""
        if group is None and not any(t.state == "waiting" and t.group for t in self.tasks.values()):
            self.seq += 1
            return self.seq
        band = [t.seq for t in self.tasks.values() if t.state == "waiting" and t.priority == priority]
        head = min(band) if band else self.seq
        if group is None:
            last = self.default_clock
        else:  # a group's clock is kept while it has waiting tasks
            last = self.clocks.get(group, 0) if self.waiting_count(group) else 0
        seq = max(last + 1, head + 1)
        if group is None:
            self.default_clock = seq
        else:
            self.clocks[group] = seq
        self.seq = max(self.seq, seq)
        return seq

    def enqueue(self, tid: str) -> None:
        t = self.tasks[tid]
        t.seq = self.next_seq(t.group, t.priority)
        t.state, t.token, t.expired = "waiting", None, False

    def next_waiting(self) -> set[str]:
        """The head of waiting: one task, or those sharing its score (two groups' n-th
        tasks), which acquire may lease in either order."""
        waiting = [(-t.priority, t.seq, tid) for tid, t in self.tasks.items() if t.state == "waiting"]
        if not waiting:
            return set()
        first = min(waiting)[:2]
        return {tid for *key, tid in waiting if tuple(key) == first}

    def owns(self, lease) -> bool:
        t = self.tasks[lease.task_id]
        return t.state == "active" and t.token == lease.token and not t.expired


class QueueMachine(RuleBasedStateMachine):
    redis_url: str = ""

    @initialize()
    def setup(self):
        self.loop = asyncio.new_event_loop()
        self.raw = sync_redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.raw.flushall()
        self.q = self.run(self.make_queue())
        self.model = Model()
        self.leases: list[effectmq.Lease] = []  # every lease ever granted, current or stale

    async def make_queue(self):
        return effectmq.TaskQueue("model", url=self.redis_url, lock_timeout=60, max_retries=MAX_RETRIES,
                                  max_stalled_count=MAX_STALLED, retry=effectmq.Fixed(0),
                                  retention_completed=None, retention_failed=None)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self):
        if hasattr(self, "q"):
            self.run(self.q.close())
            self.loop.close()
            self.raw.close()

    def pick(self, data_index: int):
        return self.leases[data_index % len(self.leases)] if self.leases else None

    @rule(tid=IDS, priority=st.integers(-2, 2), group=GROUPS)
    def offer(self, tid, priority, group):
        offered = self.run(self.q.offer("job", {"id": tid}, task_id=tid, priority=priority, group=group))
        assert offered.created == (tid not in self.model.tasks)
        if offered.created:
            self.model.tasks[tid] = ModelTask(priority, self.model.next_seq(group, priority), group)

    @rule(tasks=st.one_of(st.none(), st.integers(1, 3)))
    def rate_limit(self, tasks):
        self.run(self.q.configure(rate_limit=None if tasks is None else (tasks, RATE_PERIOD)))
        self.model.rate = tasks

    @rule()
    def hold(self):
        self.run(self.q.hold_starts(RATE_PERIOD))
        self.model.held = True

    @rule()
    def acquire(self):
        lease = self.run(self.q.acquire())
        expected = self.model.next_waiting() if self.model.may_start() else set()
        if not expected:
            assert lease is None
            return
        if self.model.rate is not None:
            self.model.logged = min(self.model.logged + 1, self.model.rate)
        assert lease is not None and lease.task_id in expected
        t = self.model.tasks[lease.task_id]
        t.state, t.token, t.expired = "active", lease.token, False
        t.attempt += 1
        assert lease.token not in {held.token for held in self.leases}  # unique per attempt
        assert (lease.attempt, lease.handler_failure_count, lease.stalled_attempt_count) == (t.attempt, t.hfc, t.sac)
        self.leases.append(lease)

    def fenced(self, lease, operation, kind: str | None = None):
        """Run an owned write: it must succeed iff the lease is current, or when it repeats
        the acknowledgement that this same token already made (same answer); a different
        acknowledgement of a settled token is AlreadySettled, naming how it settled."""
        owner = self.model.owns(lease)
        t = self.model.tasks[lease.task_id]
        settled_as = t.last_outcome if kind and t.last_token == lease.token else None
        repeat = settled_as is not None and settled_as in SETTLES_AS[kind]
        try:
            result = self.run(operation)
        except effectmq.AlreadySettled as exc:
            assert not owner and settled_as is not None and not repeat, "the current owner was rejected"
            assert exc.outcome == settled_as, (exc.outcome, settled_as)
            return False, None
        except effectmq.LeaseLost:
            assert not owner and settled_as is None, "the current owner was rejected"
            return False, None
        assert owner or repeat, "a stale lease was accepted"
        if not owner and kind == "fail":
            assert result == (settled_as == "retry"), "a resent fail answered differently"
        return owner, result

    def settled(self, lease, outcome: str) -> None:
        t = self.model.tasks[lease.task_id]
        t.last_token, t.last_outcome = lease.token, outcome

    @rule(i=st.integers(0, 1000))
    def complete(self, i):
        lease = self.pick(i)
        if lease and self.fenced(lease, lease.complete({"by": lease.token}), "complete")[0]:
            t = self.model.tasks[lease.task_id]
            t.state, t.token = "completed", None
            self.settled(lease, "completed")

    @rule(i=st.integers(0, 1000))
    def fail(self, i):
        lease = self.pick(i)
        if lease is None:
            return
        ok, retried = self.fenced(lease, lease.fail(effectmq.ErrorInfo("Boom")), "fail")
        if ok:
            t = self.model.tasks[lease.task_id]
            t.hfc += 1
            assert retried == (t.hfc <= MAX_RETRIES)
            self.settled(lease, "retry" if retried else "failed")
            if retried:
                self.model.enqueue(lease.task_id)
            else:
                t.state, t.token = "failed", None

    @rule(i=st.integers(0, 1000))
    def release(self, i):
        lease = self.pick(i)
        if lease and self.fenced(lease, lease.release(), "release")[0]:
            self.settled(lease, "released")
            self.model.enqueue(lease.task_id)

    @rule(i=st.integers(0, 1000))
    def renew_or_progress(self, i):
        lease = self.pick(i)
        if lease:
            self.fenced(lease, lease.renew())
            self.fenced(lease, lease.progress(i))

    @rule(tid=IDS)
    def expire(self, tid):
        """Simulate the passage of time for one lease: its deadline is now in the past."""
        t = self.model.tasks.get(tid)
        if t and t.state == "active":
            self.raw.hset(self.q.keys.task(tid), "lock_until", 0)
            self.raw.zadd(self.q.keys.key("active"), {tid: 0})
            t.expired = True

    @rule(batch=st.integers(1, 3))
    def maintain(self, batch):
        report = self.run(self.q.maintain(batch=batch))
        expired = sorted(tid for tid, t in self.model.tasks.items() if t.state == "active" and t.expired)
        swept = expired[:batch]
        assert report.recovered + report.stalled_failed == len(swept) <= batch
        for tid in swept:
            t = self.model.tasks[tid]
            t.sac += 1
            if t.sac > MAX_STALLED:
                t.state, t.token = "failed", None
            else:
                self.model.enqueue(tid)
        assert report.stalled_failed == sum(1 for tid in swept if self.model.tasks[tid].state == "failed")

    @rule(tid=IDS)
    def cancel(self, tid):
        was = self.run(self.q.cancel(tid))
        t = self.model.tasks.get(tid)
        assert was == (t.state if t else None)
        if t and t.state in ("waiting", "active"):
            t.state, t.token = "canceled", None

    @rule(tid=IDS)
    def retry(self, tid):
        was = self.run(self.q.retry(tid))
        t = self.model.tasks.get(tid)
        assert was == (t.state if t else None)
        if t and t.state in ("failed", "canceled"):
            t.hfc = t.sac = 0
            self.model.enqueue(tid)

    @invariant()
    def redis_matches_model(self):
        if not hasattr(self, "model"):
            return
        base = self.q.keys
        for tid, t in self.model.tasks.items():
            memberships = [idx for idx in INDEXES if self.raw.zscore(base.key(idx), tid) is not None]
            assert memberships == [t.state], (tid, memberships, t.state)  # exactly one index
            h = self.raw.hgetall(base.task(tid))
            assert h["state"] == t.state
            assert bool(h.get("token")) == (t.state == "active")  # a token iff active
            if t.state == "active":
                assert h["token"] == t.token
            assert (int(h["attempt"]), int(h["handler_failure_count"]), int(h["stalled_attempt_count"])) == \
                (t.attempt, t.hfc, t.sac)
        assert self.raw.zcard(base.key("starts")) == self.model.logged
        waiting = self.raw.zrange(base.key("waiting"), 0, -1)
        assert waiting == sorted(waiting, key=lambda tid: (-self.model.tasks[tid].priority, self.model.tasks[tid].seq,
                                                           tid))
        counts = {g: int(n) for g, n in self.raw.zrange(base.key("groups"), 0, -1, withscores=True)}
        assert counts == {g: n for g in ("a", "b") if (n := self.model.waiting_count(g))}


def test_protocol_against_reference_model(redis_url):
    QueueMachine.redis_url = redis_url
    QueueMachine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    QueueMachine.TestCase().runTest()
