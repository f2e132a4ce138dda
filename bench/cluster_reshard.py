"""How long a resharding of a busy queue's slot refuses its calls, per tasks in the slot.

    python bench/cluster_reshard.py                          # 10,000 then 100,000 tasks, redis-cli
    python bench/cluster_reshard.py --tasks 100000 --tool manual --pipeline 100
    python bench/cluster_reshard.py --aof --json /tmp/reshard.json

For each size: a private Redis Cluster (3 masters + 3 replicas, tests/fixtures/
redis_cluster.py; appendonly off unless --aof, which is appendfsync always), a queue
holding that many tasks (delayed an hour: they stay in the slot while it moves), a
Worker in this process serving live tasks that a producer offers every 5 ms, and the
queue's slot moved to another master while both run (the scenario of
tests/runtime/test_cluster_reshard.py). --tool redis-cli runs `redis-cli --cluster
reshard --cluster-slots 1` (the queue is in slot 0, the first master's lowest, the one
it moves); --tool manual runs the same steps from Python (SETSLOT IMPORTING/MIGRATING,
MIGRATE --pipeline keys at a time, SETSLOT NODE).

Printed per size: the keys moved and how long the move took (IMPORTING to the last
NODE: the window in which Redis refuses every script call of the queue), the window the
clients saw (first to last refusal), the longest one call was held back, how many
offers raised, whether any live task failed or stalled, and whether the worker stopped.
Exit status 1 when something was lost, an offer raised, or the worker stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.redis_cluster import start_redis_cluster  # noqa: E402
from tests.runtime.test_cluster_reshard import NAME_IN_SLOT_0, busy_queue_through_a_move, slot_of  # noqa: E402


@dataclass
class ReshardResult:
    tasks: int
    tool: str
    pipeline: int
    aof: bool
    lock_timeout: float
    keys: int
    move_seconds: float  # IMPORTING .. last NODE (redis-cli: its whole run)
    refused_seconds: float  # first refusal .. last, as the clients saw it
    longest_held: float  # the longest one call was held back
    refusals: int
    calls_given_up: int  # calls whose patience ran out (their refusal raised)
    offers: int
    offers_raised: int
    longest_offer: float
    not_completed: int  # live tasks not completed, or completed after a stall
    loop_failures: int
    worker_stopped: bool

    @property
    def ok(self) -> bool:
        return not (self.offers_raised or self.not_completed or self.worker_stopped or self.calls_given_up)


async def measure(tasks: int, tool: str, pipeline: int, aof: bool, lock: float) -> ReshardResult:
    workdir = Path(tempfile.mkdtemp(prefix="effectmq-reshard-"))
    cluster = start_redis_cluster(workdir, aof=aof)
    try:
        slot = slot_of(cluster, NAME_IN_SLOT_0)
        source = cluster.master_of_slot(slot)
        target = next(node for node in cluster.masters() if node.port != source.port)

        def move():
            if tool == "redis-cli":
                return cluster.reshard(slot, target, pipeline=pipeline)
            return cluster.migrate_slot(slot, target, pipeline=pipeline)

        outcome = await busy_queue_through_a_move(cluster, NAME_IN_SLOT_0, move, backlog=tasks, lock=lock)
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # 100k tasks: the nodes' AOF files
    print(outcome.report(tasks), flush=True)
    worker, producer = outcome.refusals
    return ReshardResult(
        tasks, tool, pipeline, aof, lock, outcome.migration.keys, round(outcome.migration.seconds, 3),
        round(max(worker.window, producer.window), 3), round(max(worker.longest, producer.longest), 3),
        worker.replies + producer.replies, worker.gave_up + producer.gave_up, len(outcome.producer.offered),
        len(outcome.producer.errors), round(outcome.producer.longest, 3), len(outcome.not_completed),
        len(outcome.loop_failures), outcome.worker_stopped_early)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, nargs="+", default=[10_000, 100_000], help="tasks in the slot")
    parser.add_argument("--tool", choices=["redis-cli", "manual"], default="redis-cli")
    parser.add_argument("--pipeline", type=int, default=10, help="keys per MIGRATE (redis-cli's default: 10)")
    parser.add_argument("--aof", action="store_true", help="appendonly yes, appendfsync always (default: off)")
    parser.add_argument("--lock-timeout", type=float, default=30.0, help="the worker's lease (default 30 s)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = []
    for tasks in args.tasks:
        results.append(asyncio.run(measure(tasks, args.tool, args.pipeline, args.aof, args.lock_timeout)))
    print(f"\n{'tasks':>8} {'keys':>8} {'move s':>8} {'refused s':>10} {'held s':>8} {'offers':>7} "
          f"{'raised':>7} {'lost':>5} {'stopped':>8}")
    for r in results:
        print(f"{r.tasks:>8} {r.keys:>8} {r.move_seconds:>8.3f} {r.refused_seconds:>10.3f} {r.longest_held:>8.3f} "
              f"{r.offers:>7} {r.offers_raised:>7} {r.not_completed:>5} {str(r.worker_stopped):>8}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
