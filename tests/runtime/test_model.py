"""Model-based test: random sequences of operations against real Redis and a pure
reference model, with the protocol's invariants checked after every step. Tasks may carry
a group: the model gives each entry into waiting its sequence number as
lua/includes/groups.lua describes it, and checks the waiting counts per group. Groups may
be capped, rate-limited or paused (lua/includes/group_caps.lua): the model counts each
group's attempts and its logged starts (a period no example outlasts: a group's limit is a
budget of starts here) and hands its parked tasks back as the scripts do; which picks
acquire parked it reads from Redis and checks (each was waiting ahead of the lease, its
group paused or full)."""

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
    parked: bool = False  # waiting, held back by its group's cap or pause (in the backlog)
    counted: bool = False  # its current lease counts against its group


@dataclass
class Model:
    tasks: dict[str, ModelTask] = field(default_factory=dict)
    seq: int = 0  # at least every sequence number handed out
    clocks: dict[str, int] = field(default_factory=dict)  # each group's last sequence number
    default_clock: int = 0  # the virtual time of the tasks without a group ('' in groups.lua)
    rate: int | None = None  # tasks per RATE_PERIOD (a period no example outlasts), None: no limit
    logged: int = 0  # starts in the log of starts (acquire.lua): all in the window, the newest `rate` kept
    held: bool = False  # starts held (hold_starts) for longer than any example
    counting: bool = False  # a cap or pause came: leases count against their group
    caps: dict[str, int] = field(default_factory=dict)  # a group's own cap (0: none)
    default_cap: int = 0  # the queue's group_max_active (0: none)
    paused: set[str] = field(default_factory=set)
    group_rates: dict[str, int] = field(default_factory=dict)  # a group's own rate limit's tasks (0: none)
    default_group_rate: int = 0  # the queue's group_rate_limit's tasks (0: none)
    group_logged: dict[str, int] = field(default_factory=dict)  # a group's starts in group_starts

    def group_rate(self, group: str) -> int:
        """Its rate limit's tasks per RATE_PERIOD in force; 0: none."""
        return self.group_rates.get(group, self.default_group_rate)

    def may_start(self) -> bool:
        return not self.held and (self.rate is None or self.logged < self.rate)

    def waiting_count(self, group: str) -> int:
        return sum(1 for t in self.tasks.values() if t.state == "waiting" and not t.parked and t.group == group)

    def running(self, group: str) -> int:
        return sum(1 for t in self.tasks.values() if t.state == "active" and t.counted and t.group == group)

    def room(self, group: str, *, window: bool = True) -> float:
        """How many more of the group may start; `window`: as a script that sees its rate
        limit's window counts it (acquire, configure_group), else by its cap and pause only."""
        if group in self.paused:
            return 0
        cap = self.caps.get(group, self.default_cap)
        room = float("inf") if cap == 0 else max(cap - self.running(group), 0)
        if window and self.group_rate(group):
            room = min(room, max(self.group_rate(group) - self.group_logged.get(group, 0), 0))
        return room

    def parked_in(self, group: str) -> list[str]:
        """A group's parked tasks in backlog order: their waiting score, then id."""
        return sorted((tid for tid, t in self.tasks.items() if t.parked and t.group == group),
                      key=lambda tid: (-self.tasks[tid].priority, self.tasks[tid].seq, tid))

    def hand_back(self, group: str, most: float) -> None:
        for tid in self.parked_in(group)[:int(min(most, 1000))]:
            self.tasks[tid].parked = False  # back in waiting at its old turn

    def freed(self, groups: list[str | None]) -> None:
        """Attempts of these groups ended in one call: for each, one parked task goes back
        while the group has room by its cap (16 without a cap; none of a rate-limited group
        without a cap: these scripts cannot see its window, and its due time is far off)."""
        for group in sorted({g for g in groups if g}):
            frees = sum(1 for g in groups if g == group)
            capped = self.caps.get(group, self.default_cap) != 0
            if capped or not self.group_rate(group):
                self.hand_back(group, min(self.room(group, window=False), frees if capped else 16))

    def started(self, group: str | None) -> None:
        """A lease of `group` started: logged when its rate limit counts it; the call sweeps
        the other group's starts, all of them when it has no limit now (group_caps.lua)."""
        if not group or not self.counting or not self.group_rate(group):
            return
        self.group_logged[group] = self.group_logged.get(group, 0) + 1
        other = "b" if group == "a" else "a"
        if self.group_logged.get(other) and not self.group_rate(other):
            del self.group_logged[other]

    def forget_idle_clocks(self) -> None:
        """A group's clock goes with its last waiting task (groups.lua)."""
        for group in [g for g in self.clocks if not self.waiting_count(g)]:
            del self.clocks[group]

    def next_seq(self, group: str | None, priority: int) -> int:
        """The sequence number a task entering waiting takes (groups.lua), from the state
        before it enters."""
        if group is None and not any(t.state == "waiting" and not t.parked and t.group for t in self.tasks.values()):
            self.seq += 1
            return self.seq
        band = [t.seq for t in self.tasks.values() if t.state == "waiting" and not t.parked and t.priority == priority]
        head = min(band) if band else self.seq
        if group is None:
            last = self.default_clock
        else:  # a group's clock is kept while it has waiting tasks
            last = self.clocks.get(group, 0)
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
        t.state, t.token, t.expired, t.counted = "waiting", None, False, False

    def order(self, tid: str) -> tuple[int, int]:
        return -self.tasks[tid].priority, self.tasks[tid].seq

    def next_waiting(self, left_out: set[str] = frozenset()) -> set[str]:
        """The head of waiting (but `left_out`) among tasks whose group may start one more:
        one task, or those sharing its score (two groups' n-th tasks), which acquire may
        lease in either order."""
        waiting = [(*self.order(tid), tid) for tid, t in self.tasks.items() if t.state == "waiting"
                   and not t.parked and tid not in left_out and (not t.group or self.room(t.group) > 0)]
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
        model = self.model
        in_backlog = {m.split("\0", 1)[1][16:] for m in self.raw.zrange(self.q.keys.key("backlog"), 0, -1)}
        parked = {tid for tid in in_backlog if not model.tasks[tid].parked}
        for tid in parked:  # each was waiting, its group paused or full, and ahead of the lease
            t = model.tasks[tid]
            assert t.state == "waiting" and t.group and model.room(t.group) == 0, (tid, t)
            assert lease is None or model.order(tid) <= model.order(lease.task_id), (tid, lease)
            t.parked = True
        model.forget_idle_clocks()
        expected = model.next_waiting() if model.may_start() else set()
        if not expected:
            assert lease is None
            return
        if model.rate is not None:
            model.logged = min(model.logged + 1, model.rate)
        assert lease is not None and lease.task_id in expected, (lease, expected, parked)
        t = model.tasks[lease.task_id]
        model.started(t.group)
        t.state, t.token, t.expired, t.counted = "active", lease.token, False, model.counting
        t.attempt += 1
        model.seq += 1  # the lease token's sequence number, from the same counter
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
            self.ended([t])

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
            ended = self.ending(t)
            if retried:
                self.model.enqueue(lease.task_id)
            else:
                t.state, t.token = "failed", None
            self.ended(ended)

    @rule(i=st.integers(0, 1000))
    def release(self, i):
        lease = self.pick(i)
        if lease and self.fenced(lease, lease.release(), "release")[0]:
            self.settled(lease, "released")
            ended = self.ending(self.model.tasks[lease.task_id])
            self.model.enqueue(lease.task_id)
            self.ended(ended)

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
        ended = [t for tid in swept for t in self.ending(self.model.tasks[tid])]
        for tid in swept:
            t = self.model.tasks[tid]
            t.sac += 1
            if t.sac > MAX_STALLED:
                t.state, t.token = "failed", None
            else:
                self.model.enqueue(tid)
        self.ended(ended)
        assert report.stalled_failed == sum(1 for tid in swept if self.model.tasks[tid].state == "failed")

    @rule(tid=IDS)
    def cancel(self, tid):
        was = self.run(self.q.cancel(tid))
        t = self.model.tasks.get(tid)
        assert was == (t.state if t else None)
        if t and t.state in ("waiting", "active"):
            ended = self.ending(t)
            t.state, t.token, t.parked = "canceled", None, False
            self.ended(ended)

    @rule(tid=IDS)
    def retry(self, tid):
        was = self.run(self.q.retry(tid))
        t = self.model.tasks.get(tid)
        assert was == (t.state if t else None)
        if t and t.state in ("failed", "canceled"):
            t.hfc = t.sac = 0
            self.model.enqueue(tid)

    def ending(self, t: ModelTask) -> list[ModelTask]:
        """The task, when its attempt counts against its group (it ends now)."""
        return [t] if t.state == "active" and t.counted else []

    def ended(self, tasks: list[ModelTask]) -> None:
        """Counted attempts of these tasks ended in one call: their groups hand back."""
        for t in tasks:
            t.counted = False
        self.model.freed([t.group for t in tasks])
        self.model.forget_idle_clocks()

    @rule(group=st.sampled_from(["a", "b"]), cap=st.sampled_from([-1, 0, 1, 2]))
    def cap_group(self, group, cap):
        stats = self.run(self.q.configure_group(group, max_active=cap))
        model = self.model
        model.counting = model.counting or cap > 0
        if cap < 0:
            model.caps.pop(group, None)
        else:
            model.caps[group] = cap
        model.hand_back(group, model.room(group))
        assert (stats.active, stats.parked) == (model.running(group), len(model.parked_in(group)))

    @rule(cap=st.sampled_from([0, 1]))
    def default_cap(self, cap):
        self.run(self.q.configure(group_max_active=cap))
        model = self.model
        model.counting = model.counting or cap > 0
        model.default_cap = cap
        for group in ("a", "b"):
            model.hand_back(group, model.room(group))

    @rule(group=st.sampled_from(["a", "b"]), rate=st.sampled_from([-1, 0, 1, 2]))
    def rate_group(self, group, rate):
        stats = self.run(self.q.configure_group(group, rate_limit=(rate, RATE_PERIOD) if rate > 0 else rate))
        model = self.model
        model.counting = model.counting or rate > 0
        if rate < 0:
            model.group_rates.pop(group, None)
        else:
            model.group_rates[group] = rate
        model.hand_back(group, model.room(group))
        assert (stats.active, stats.parked) == (model.running(group), len(model.parked_in(group)))
        assert stats.rate_limit == ((model.group_rate(group), RATE_PERIOD) if model.group_rate(group) else None)

    @rule(rate=st.sampled_from([0, 1, 2]))
    def default_group_rate(self, rate):
        model = self.model
        was = model.default_group_rate
        self.run(self.q.configure(group_rate_limit=(rate, RATE_PERIOD) if rate else None))
        model.counting = model.counting or rate > 0
        model.default_group_rate = rate
        if was:  # a limit changed or removed: the parked tasks the limits in force let go
            for group in ("a", "b"):
                model.hand_back(group, model.room(group))

    @rule(group=st.sampled_from(["a", "b"]), pause=st.booleans())
    def pause_group(self, group, pause):
        stats = self.run(self.q.pause_group(group) if pause else self.q.resume_group(group))
        model = self.model
        if pause:
            model.counting = True
            model.paused.add(group)
        else:
            model.paused.discard(group)
            model.hand_back(group, model.room(group))
        assert stats.paused == pause

    @invariant()
    def redis_matches_model(self):
        if not hasattr(self, "model"):
            return
        base = self.q.keys
        in_backlog = {m.split("\0", 1)[1][16:] for m in self.raw.zrange(base.key("backlog"), 0, -1)}
        for tid, t in self.model.tasks.items():
            memberships = [idx for idx in INDEXES if self.raw.zscore(base.key(idx), tid) is not None]
            memberships += ["parked"] if tid in in_backlog else []
            assert memberships == ["parked" if t.parked else t.state], (tid, memberships, t.state)  # one index
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
        running = {f[2:]: int(n) for f, n in self.raw.hgetall(base.key("group_ctl")).items() if f.startswith("a:")}
        assert running == {g: n for g in ("a", "b") if (n := self.model.running(g))}
        logged: dict[str, int] = {}
        for member in self.raw.zrange(base.key("group_starts"), 0, -1):
            logged[member.split("\0")[0]] = logged.get(member.split("\0")[0], 0) + 1
        assert logged == {g: n for g, n in self.model.group_logged.items() if n}


def test_protocol_against_reference_model(redis_url):
    QueueMachine.redis_url = redis_url
    QueueMachine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    QueueMachine.TestCase().runTest()
