"""The leader election's liveness: the decision (liveness_problem) on planted facts and
clock readings, and what the elector records for it, driven by a stand-in API whose
calls fail to connect, answer with a status or hang, on a fake clock; and the operator's
probe, which fails with the election's problem. No API server here:
tests/operator/test_leader.py runs the elector against a real one."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import SimpleNamespace
from typing import Any, Callable

import kopf
import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from effectmq_operator.handlers import probe
from effectmq_operator.runtime.leader import REFUSED_AFTER, STUCK_LEASES, ElectionFacts, LeaderElector, \
    liveness_problem

STUCK, REFUSED = 60.0, 120.0


def problem(now: float, state: str = "running", answered_at: float = 0.0,
            refused_since: float | None = None) -> str | None:
    return liveness_problem(ElectionFacts(state, answered_at, refused_since), now, stuck_after=STUCK,
                            refused_after=REFUSED)


def test_a_running_election_whose_calls_come_back_is_live():
    assert problem(now=1.0) is None
    assert problem(now=1000.0, answered_at=999.0) is None  # however long it has been running
    assert problem(now=1.0, state="new") is None  # run() about to start


@pytest.mark.parametrize("state", ["stopped", "died"])
def test_an_election_that_ended_is_not_live(state):
    assert problem(now=0.0, state=state) == f"the leader election {state}"


def test_no_call_coming_back_for_longer_than_stuck_after_is_stuck():
    assert problem(now=STUCK, answered_at=0.0) is None
    stuck = problem(now=STUCK + 0.5, answered_at=0.0)
    assert stuck and "stuck" in stuck and "60s" in stuck
    assert problem(now=STUCK + 0.5, state="new") == stuck  # run() never started calling


def test_refusals_for_longer_than_refused_after_are_a_problem():
    assert problem(now=500.0, answered_at=499.0, refused_since=500.0 - REFUSED) is None
    refused = problem(now=500.0, answered_at=499.0, refused_since=499.0 - REFUSED)
    assert refused and "401/403" in refused and "121s" in refused


def test_an_ended_election_is_reported_before_anything_else():
    assert problem(now=1000.0, state="died", refused_since=0.0) == "the leader election died"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StandInApi:
    """The three Lease calls the elector makes; each runs `answer` (on the elector's thread)."""

    def __init__(self) -> None:
        self.api_client = kubernetes.client.ApiClient()
        self.answer: Callable[[], Any] = refuse_connection
        self.calls = 0

    def _call(self, *_, **__) -> Any:
        self.calls += 1
        return self.answer()

    read_namespaced_lease = create_namespaced_lease = replace_namespaced_lease = _call


def refuse_connection() -> Any:
    raise ConnectionRefusedError(111, "Connection refused")


def answer(status: int) -> Callable[[], Any]:
    def call() -> Any:
        raise ApiException(status=status, reason=f"status {status}")
    return call


@contextlib.asynccontextmanager
async def running(**kwargs):
    """An elector on a stand-in API and a fake clock, run() in a task; quick real rounds
    (0.05 s apart), while the facts are timed by the fake clock alone."""
    api, clock = StandInApi(), FakeClock()
    elector = LeaderElector(api, namespace="ns", name="lease", identity="a", clock=clock,  # type: ignore[arg-type]
                            lease_seconds=15, renew_deadline=10, retry_period=0.05, **kwargs)
    task = asyncio.create_task(elector.run())
    try:
        yield elector, api, clock
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        api.api_client.close()


async def next_answer(api: StandInApi) -> None:
    """Until the elector has made another call and it has come back."""
    calls = api.calls
    for _ in range(200):
        await asyncio.sleep(0.01)
        if api.calls > calls + 1:
            return
    raise AssertionError("the elector made no more calls")


async def test_an_api_server_down_for_ten_leases_leaves_the_elector_live():
    async with running() as (elector, api, clock):
        await next_answer(api)
        for _ in range(10):  # ten lease durations without a single call that worked
            clock.now += elector.lease_seconds
            await next_answer(api)
            assert elector.healthy(), elector.problem()
        for status in (500, 503, 429, 0):  # the server, or something in front of it, failing: still live
            api.answer = answer(status)
            clock.now += elector.lease_seconds
            await next_answer(api)
            assert elector.healthy(), (status, elector.problem())
        assert not elector.is_leader


@pytest.mark.parametrize("status", [401, 403])
async def test_refusals_fail_the_liveness_after_refused_after_and_an_authorized_answer_ends_them(status):
    async with running(refused_after=100) as (elector, api, clock):
        api.answer = answer(status)
        await next_answer(api)
        began = clock.now
        assert elector.facts().refused_since == began
        clock.now += 100
        await next_answer(api)
        assert elector.healthy(), elector.problem()
        for other in (500, 429, 0):  # no verdict on our credentials: the refusal goes on
            api.answer = answer(other)
            await next_answer(api)
            assert elector.facts().refused_since == began
        api.answer = refuse_connection  # nor a server out of reach
        clock.now += 1
        await next_answer(api)
        refused = elector.problem()
        assert refused and "401/403" in refused and "101s" in refused
        api.answer = answer(404 if status == 403 else 409)  # an answer only an authorized caller gets
        await next_answer(api)
        assert elector.facts().refused_since is None and elector.healthy()


async def test_calls_that_never_come_back_are_stuck_after_stuck_after():
    release = threading.Event()

    def hang() -> Any:
        release.wait(30)
        refuse_connection()

    async with running() as (elector, api, clock):
        assert elector.stuck_after == STUCK_LEASES * 15
        await next_answer(api)
        api.answer = hang
        answered, hung = clock.now, api.calls + 2
        while api.calls < hung:  # both threads hang
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.5 * elector.call_timeout)  # the calls queued behind them time out, unheard
        assert api.calls == hung and elector.facts().answered_at == answered
        clock.now += elector.stuck_after
        assert elector.healthy(), elector.problem()
        clock.now += 1
        stuck = elector.problem()
        assert stuck and "stuck" in stuck
        api.answer = refuse_connection
        release.set()  # the hung calls come back, late: the threads work again
        await next_answer(api)
        assert elector.healthy(), elector.problem()


def test_the_bounds_are_validated():
    api: Any = type("Api", (), {"api_client": None})()
    timings = {"lease_seconds": 15, "renew_deadline": 10, "retry_period": 2}  # calls wait at most 2.4 + 5 s
    assert LeaderElector(api, namespace="ns", name="l", **timings).stuck_after == 60.0
    assert LeaderElector(api, namespace="ns", name="l", **timings).refused_after == REFUSED_AFTER
    assert LeaderElector(api, namespace="ns", name="l", stuck_after=15, **timings).stuck_after == 15.0
    with pytest.raises(ValueError, match="stuck_after"):
        LeaderElector(api, namespace="ns", name="l", stuck_after=14.5, **timings)
    with pytest.raises(ValueError, match="refused_after"):
        LeaderElector(api, namespace="ns", name="l", refused_after=0, **timings)
    # calls that may take a minute each: the default grows with them rather than failing
    slow = LeaderElector(api, namespace="ns", name="l", request_timeout=(30.0, 30.0), **timings)
    assert slow.stuck_after == pytest.approx(2 * (1.2 * 2 + 61))


def test_the_probe_fails_with_the_elections_problem_only():
    clock = FakeClock()
    api: Any = type("Api", (), {"api_client": None})()
    elector = LeaderElector(api, namespace="ns", name="l", clock=clock, lease_seconds=15, renew_deadline=10)
    memo: Any = SimpleNamespace(running=SimpleNamespace(tasks=[], elector=elector))
    assert probe(memo)["leader"] is False
    clock.now += elector.stuck_after + 1  # nothing came back: here, since run() never started calling
    with pytest.raises(kopf.PermanentError, match="the leader election is stuck"):
        probe(memo)
