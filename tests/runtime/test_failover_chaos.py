"""Short runs of bench/chaos_failover.py: worker processes and a producer on a queue while
Redis fails over underneath, then the chaos checks (bench/_chaos_checks.py).

Each run is seeded (EFFECTMQ_CHAOS_SEED=<seed> replays the fault sequence; the timing is
the machine's) and uses durable offers (TaskQueue(replicas_to_confirm=1): each confirmed by
WAIT 1 on the connection that carried it), so nothing is exempt: no accepted task lost, no stale acknowledgement
accepted, every task in exactly one state, every superseded attempt explained by a fault.
The last test plants defects into a real run's history and sees the checks fail.
"""

from __future__ import annotations

import copy
import os
import random

import pytest

from bench import _chaos_checks as checks
from bench.chaos_failover import NOT_APPLICABLE, report, run_failover_chaos, table

SECONDS = 20.0
FIRST_FAULTS = {"sentinel": {"primary_kill", "primary_pause"}, "cluster": {"master_kill", "reshard", "replica_kill"}}


def seed() -> int:
    given = os.environ.get("EFFECTMQ_CHAOS_SEED")
    return int(given) if given else random.randrange(100_000)


def assert_clean(result: dict, history: dict) -> None:
    s = result["summary"]
    context = f"failover chaos, seed {result['seed']} (replay: EFFECTMQ_CHAOS_SEED={result['seed']})\n{table(result)}"
    assert s["passed"], context
    assert s["offers"] >= 20, context  # the producer was not stuck throughout
    assert s["handler runs"] >= s["offers"], context
    assert not s["plain offers lost by asynchronous replication"], context  # durable: nothing exempt
    done = {f["kind"] for f in history["faults"]}
    assert done & FIRST_FAULTS[history["topology"]], context
    assert not history["harness_errors"], context  # no fault failed to recover, no worker exited
    assert result["summary"]["checks"] == {name: 0 for name in checks.CHECKS if name not in NOT_APPLICABLE}, context


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["sentinel", "cluster"])
def test_failover_chaos_with_durable_offers(topology, tmp_path):
    result, history = run_failover_chaos(topology, seed(), SECONDS, tmp_path, durable=True)
    print("\n" + table(result))
    assert_clean(result, history)
    if topology == "cluster":
        planted_defects_fail_the_checks(history)


def planted_defects_fail_the_checks(history: dict) -> None:
    """The run's own history, each time with one defect planted: the checks catch it."""
    completed = sorted(t for t, info in history["tasks"].items() if info["state"] == "completed")
    assert len(completed) >= 3
    lost = copy.deepcopy(history)
    del lost["tasks"][completed[0]]  # a durable offer gone
    assert report(lost)["problems"]["accepted tasks lost"]

    stale = copy.deepcopy(history)  # the record's token is not the one its run acknowledged with
    stale["tasks"][completed[1]]["result"]["token"] = "0" * 16
    assert report(stale)["problems"]["stale acknowledgements accepted"]

    twice = copy.deepcopy(history)  # one index too many
    twice["tasks"][completed[2]]["indexes"].append("waiting")
    assert report(twice)["problems"]["tasks not in exactly one state"]

    unexplained = copy.deepcopy(history)  # an extra run far from any fault
    tid = completed[0]
    unexplained["tasks"][tid]["attempt"] += 1
    unexplained["tasks"][tid]["result"]["attempt"] += 1
    for e in unexplained["runs"]:
        if e["task"] == tid:
            e["attempt"] += 1
    early = {"task": tid, "attempt": 1, "token": "f" * 16, "pod": "w0"}  # run and ended an hour before any fault
    unexplained["runs"] += [{"ev": "start", **early, "t": unexplained["t0"] - 3600},
                            {"ev": "done", **early, "t": unexplained["t0"] - 3599}]
    assert report(unexplained)["problems"]["extra runs not explained by a fault"]
