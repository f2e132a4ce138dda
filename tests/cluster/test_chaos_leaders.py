"""The checks bench/chaos_cluster.py runs after its control plane's faults (the API server
stopped, the leading operator replica cut from it): on recorded histories, a clean one passes
and each planted violation is found (two replicas leading at once by their own logs, an
operator Event written by a pod that did not hold the Lease, a cut leader nobody took over
from). Pure functions: no cluster."""

from __future__ import annotations

import copy
import time

import pytest

from bench import _chaos_checks as checks
from tests.cluster.test_chaos import T0, recorded

A, B = "effectmq-5d8c7-aaaaa", "effectmq-5d8c7-bbbbb"  # the two operator pods


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def with_cut() -> dict:
    """A's replica leads, is cut from the API server at +20 s for 30 s; B takes over at +37 s
    (A stopped at +30 s, its renew deadline) and posts an Event at +40 s."""
    history = recorded()
    history["faults"].append({"kind": "leader_cut", "target": "operator", "start": T0 + 20, "end": T0 + 50,
                              "note": f"{A} 30s"})
    history["leases"] = [[T0 + s, f"{A}-1" if s < 37 else f"{B}-1"] for s in range(0, 60)]
    history["leadership"] = [{"identity": f"{A}-1", "start": T0 - 5, "end": T0 + 30},
                             {"identity": f"{B}-1", "start": T0 + 37, "end": None}]
    history["operator_events"] = [
        {"instance": A, "reason": "Scaled", "object": "Queue/jobs", "first": stamp(T0 + 10), "last": stamp(T0 + 15)},
        {"instance": B, "reason": "Scaled", "object": "Queue/jobs", "first": stamp(T0 + 40), "last": stamp(T0 + 40)}]
    return history


def failing(history: dict) -> set[str]:
    return {name for name, found in checks.check(history).items() if found}


def test_a_clean_takeover_passes():
    assert failing(with_cut()) == set()


def test_histories_without_the_control_plane_faults_are_not_judged():
    assert failing(recorded()) == set()


@pytest.mark.parametrize("change, caught", [
    # the cut replica still thought it led after B took over
    (lambda h: h["leadership"][0].update(end=T0 + 45), "two operator leaders at once"),
    (lambda h: h["leadership"][0].update(end=None), "two operator leaders at once"),
    # A wrote an Event after the heal while B held the Lease
    (lambda h: h["operator_events"].append({"instance": A, "reason": "Scaled", "object": "Queue/jobs",
                                            "first": stamp(T0 + 52), "last": stamp(T0 + 52)}),
     "operator Events not from the Lease's holder"),
    (lambda h: h.update(leases=[[t, f"{A}-1"] for t, _ in h["leases"]]), "leader cuts not taken over"),
])
def test_the_checks_catch_a_planted_violation(change, caught):
    history = copy.deepcopy(with_cut())
    change(history)
    assert caught in failing(history)


def test_a_deleted_leaders_open_term_ends_with_its_pod():
    history = with_cut()
    history["leadership"][0]["end"] = None
    history["faults"].append({"kind": "operator_delete", "target": "operator", "start": T0 + 33, "end": T0 + 60,
                              "note": A})
    assert failing(history) == set()
