"""A scheduler process with injected faults, for process-level tests.

    python -m tests.scheduler.runner --url URL --namespace NS --fault slow-offer=1.5 --log offers.jsonl
    python -m tests.scheduler.runner --url URL --namespace NS --fault kill-after-offer

It runs the same loop as `effectmq scheduler run` (`serve`), with hooks around each
offer batch:
- slow-offer=S: sleep S seconds between deciding and offering, then note for every
  task id whether its record still exists, so a test can see re-offers of ticks
  whose tasks already completed and were removed;
- kill-after-offer: SIGKILL this process right after the first offer succeeded,
  before any cursor moved.
Each offer's results are appended to --log as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

from effectmq import TaskQueue
from effectmq.scheduler import Scheduler
from effectmq.scheduler.cli import serve


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--fault", required=True)
    parser.add_argument("--log")
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    fault, _, value = args.fault.partition("=")
    existed: dict[str, bool] = {}
    sent_at: dict[str, float] = {}

    def log(entry: dict) -> None:
        if args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps(entry) + "\n")

    async def before_offer(queue: str, task_ids: list[str]) -> None:
        if fault == "slow-offer":
            await asyncio.sleep(float(value))
            async with TaskQueue(queue, url=args.url) as q:
                for task_id in task_ids:
                    existed[task_id] = await q.get(task_id) is not None
            for task_id in task_ids:  # the offer leaves after this: a task done before it was done first
                sent_at[task_id] = time.time()

    async def after_offer(queue: str, offered) -> None:
        for o in offered:
            log({"task_id": o.task_id, "created": o.created, "record_before_offer": existed.pop(o.task_id, None),
                 "sent_at": sent_at.pop(o.task_id, None), "at": time.time()})
        if fault == "kill-after-offer":
            os.kill(os.getpid(), signal.SIGKILL)

    async with Scheduler(args.url, namespace=args.namespace, before_offer=before_offer,
                         after_offer=after_offer) as scheduler:
        await serve(scheduler, interval=args.interval)


if __name__ == "__main__":
    asyncio.run(main())
