"""Schedulers as real processes: three at once, one killed mid-pass, one with a skewed clock."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

import effectmq
from effectmq.scheduler import Scheduler, ScheduleSpec
from tests.fixtures.redis import require_binary
from tests.support.processes import WorkerProcess

from .support import SchedulerProcess, T, Z, cli_json

ZONES = {"three/utc": "UTC", "three/berlin": "Europe/Berlin", "three/new-york": "America/New_York"}
RUN_FOR = 55.0  # seconds of per-second ticks: more than 50 per schedule


async def wait_drained(q: effectmq.TaskQueue, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await q.stats()
        if stats.waiting + stats.active + stats.delayed == 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"queue not drained: {await q.stats()}")


@pytest.mark.slow
async def test_three_scheduler_processes_materialize_every_tick_exactly_once(redis_url, tmp_path):
    q = effectmq.TaskQueue("ticks", url=redis_url)
    await q.configure(retention_completed=0)  # finished tasks vanish at once; their ids stay reserved
    async with Scheduler(redis_url, namespace="three") as admin:
        for sid, zone in ZONES.items():
            await admin.put(ScheduleSpec(id=sid, queue="ticks", cron="* * * * * *", timezone=zone, task="work",
                                         payload={"schedule": sid}))
        # The first tick expected is the first after the schedule's creation: its cursor may
        # have passed it already (put settles the schedule at once, a second later under load).
        created = {sid: (await admin.status(sid)).created_at.timestamp() for sid in ZONES}
        worker = WorkerProcess(redis_url, "ticks", tmp_path, name="worker")
        schedulers = [
            SchedulerProcess(redis_url, "three", tmp_path, name="fast-1"),
            SchedulerProcess(redis_url, "three", tmp_path, name="fast-2"),
            # decides, then waits 1.5 s before offering: by then the fast ones offered the
            # tick and the worker completed it and its record is gone
            SchedulerProcess(redis_url, "three", tmp_path, name="slow", fault="slow-offer=1.5"),
        ]
        try:
            end = time.monotonic() + RUN_FOR
            while time.monotonic() < end:
                for p in schedulers:
                    assert p.proc.poll() is None, f"{p.name} exited early:\n{p.text()[-3000:]}"
                await asyncio.sleep(0.5)
        finally:
            codes = {p.name: p.stop() for p in schedulers}  # SIGTERM: each finishes its pass and exits
        assert codes == {"fast-1": 0, "fast-2": 0, "slow": 0}, {p.name: p.text()[-2000:] for p in schedulers}
        try:
            await wait_drained(q)
        finally:
            worker.stop()
        statuses = {sid: await admin.status(sid) for sid in ZONES}
    await q.close()

    runs = Counter(line[1] for line in worker.effect_lines() if line[0] == "start")
    done_at = {line[1]: float(line[4]) for line in worker.effect_lines() if line[0] == "done"}
    for sid, status in statuses.items():
        first, last = int(created[sid]) + 1, int(status.last_tick.timestamp())
        expected = {f"{sid}/{Z(t)}" for t in range(first, last + 1)}  # every second, none missing
        assert len(expected) >= 50
        ran = {tid for tid in runs if tid.startswith(sid + "/")}
        assert ran == expected, f"{sid}: missing {sorted(expected - ran)[:5]}, extra {sorted(ran - expected)[:5]}"
        assert status.materialized == len(expected) and status.skipped == status.coalesced == 0
    assert set(runs.values()) == {1}, [tid for tid, n in runs.items() if n > 1]  # exactly once each

    # The slow scheduler offered ticks whose tasks had completed and been removed:
    # each such offer found the id reserved and created nothing.
    slow = schedulers[2].offer_log()
    # (done before the offer was sent: stamped after an offer returns, a task this offer
    # created and the worker finished at once would look late)
    late = [o for o in slow if o["record_before_offer"] is False and o["task_id"] in done_at
            and done_at[o["task_id"]] < o["sent_at"]]
    assert len(late) >= 10, f"too few late re-offers: {len(late)} of {len(slow)}"
    assert not any(o["created"] for o in late)
    # Ticks were offered by more than one process; one task each all the same.
    offered_by = Counter(m["task_id"] for p in schedulers[:2] for r in p.reports() for m in r["materialized"])
    offered_by.update(o["task_id"] for o in slow)
    assert sum(1 for n in offered_by.values() if n > 1) >= 10


async def test_scheduler_killed_between_offer_and_cursor_update_runs_the_tick_once(redis_url, tmp_path):
    q = effectmq.TaskQueue("killq", url=redis_url)
    await q.configure(retention_completed=0)
    async with Scheduler(redis_url, namespace="killed") as admin:
        await admin.put(ScheduleSpec(id="killed/s", queue="killq", cron="* * * * * *", task="work"))
        cursor = (await admin.status("killed/s")).cursor
        await asyncio.sleep(1.1)  # a tick is due
        doomed = SchedulerProcess(redis_url, "killed", tmp_path, name="doomed", fault="kill-after-offer")
        assert doomed.wait(30) == -signal.SIGKILL, doomed.text()[-3000:]
        offered = doomed.offer_log()
        assert offered and all(o["created"] for o in offered)
        status = await admin.status("killed/s")
        assert status.cursor == cursor and status.last_tick is None and status.materialized == 0

        ran = []  # a worker runs what was offered
        while (lease := await q.acquire()) is not None:
            ran.append(lease.task_id)
            await lease.complete()
        ids = [o["task_id"] for o in offered]
        assert ran == ids

        # the next scheduler pass re-offers the same tick ids: nothing is created again
        report = cli_json(redis_url, "tick", "--namespace", "killed")
        again = {m["task_id"]: m["created"] for m in report["materialized"]}
        assert all(again[tid] is False for tid in ids), again
        status = await admin.status("killed/s")
        assert status.last_tick is not None and status.materialized >= len(ids)  # the cursor moved on
        while (lease := await q.acquire()) is not None:
            assert lease.task_id not in ids
            await lease.complete()
    await q.close()


LIBFAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


@pytest.mark.parametrize("skew", ["-2h", "+2h"])
async def test_redis_time_decides_not_the_scheduler_clock(redis_url, skew):
    if not os.path.exists(LIBFAKETIME):
        require_binary("libfaketime", f"{LIBFAKETIME} missing: install the Debian package libfaketime")
    q = effectmq.TaskQueue("skewq", url=redis_url)
    async with Scheduler(redis_url, namespace="skew") as admin:
        await admin.put(ScheduleSpec(id="skew/s", queue="skewq", cron="* * * * * *", task="work"))
        await asyncio.sleep(1.1)
    env = {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": skew}
    skewed_now = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env={**os.environ, **env},
                                capture_output=True, text=True, check=True)
    assert abs(abs(float(skewed_now.stdout) - time.time()) - 7200) < 60, "the clock was not skewed"
    report = cli_json(redis_url, "tick", "--namespace", "skew", env=env)
    assert report["materialized"] and not report["errors"]
    for m in report["materialized"]:
        assert abs(time.time() - T(m["tick"])) < 30, f"tick {m['tick']} follows the skewed clock"
    assert len(await q.list_tasks("waiting")) == len(report["materialized"])
    await q.close()
