"""A rolling upgrade: this version beside an older one, on one queue of one real Redis.

The older version is OLD_VERSION's effectmq/ (and its operator package, whose subcommand its
`effectmq` command loads), taken out of this repository's history with
`git archive` (a clone has it). Its processes import it first (PYTHONPATH, and
PYTHONSAFEPATH so that `python -m` does not put this checkout first) and run this
checkout's test handlers (tests/support/chaos_handlers.py, whose results name the attempt,
its lease token and the worker's pid). Each version calls its own scripts: the older one
by EVALSHA only, this one as a function library (FCALL); both are checked to have run.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
import redis

from tests.fixtures.redis import IN_CI, has_functions, require_binary
from tests.support.processes import ROOT, WorkerProcess

# The last version that ran its scripts by EVALSHA only (the function library came with
# acf8cf8); it already had receipts, `extra` and the lean task hash.
OLD_VERSION = "4ef51f4"
HANDLERS = "tests.support.chaos_handlers:app"

# What the old version offers (and a check that it is the old version that runs): 30 by
# offer_many, 5 delayed, 5 with a higher priority, 5 with explicit ids, offered twice.
PRODUCER = """
import asyncio, json, sys, effectmq

async def main(queue, url, first):
    q = effectmq.TaskQueue(queue, url=url)
    ids = [o.task_id for o in await q.offer_many([("chaos", {"i": first + i}) for i in range(30)])]
    for i in range(5):
        ids.append((await q.offer("chaos", {"i": first + 100 + i}, delay=0.3)).task_id)
        ids.append((await q.offer("chaos", {"i": first + 200 + i}, priority=5)).task_id)
    again = []
    for _ in range(2):
        again.append([(await q.offer("chaos", {"i": i}, task_id=f"x{first}-{i}")).created for i in range(5)])
    ids += [f"x{first}-{i}" for i in range(5)]
    await q.close()
    print(json.dumps({"effectmq": effectmq.__file__, "ids": ids, "created": again}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


# A lease held by one version that runs out, then every write it can send, each refused.
STALE = """
import asyncio, json, sys, effectmq

async def main(queue, url):
    q = effectmq.TaskQueue(queue, url=url)
    lease = await q.acquire(lock_timeout=0.5)
    print(json.dumps({"effectmq": effectmq.__file__, "task": lease.task_id, "attempt": lease.attempt}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    writes = {"renew": lease.renew, "progress": lambda: lease.progress({"stale": True}),
              "complete": lambda: lease.complete({"stale": True}),
              "fail": lambda: lease.fail(RuntimeError("stale")), "release": lease.release}
    out = {}
    for op, write in writes.items():
        try:
            await write()
            out[op] = "accepted"
        except effectmq.LeaseLost:
            out[op] = "LeaseLost"
        except Exception as exc:
            out[op] = repr(exc)
    print(json.dumps(out), flush=True)
    await q.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    git = require_binary("git", "git takes the older version out of this repository's history")
    # its operator package too: the older `effectmq` command loads effectmq_operator's
    # subcommand, which must be of its own version (this checkout's is installed too)
    archive = subprocess.run([git, "-C", str(ROOT), "archive", OLD_VERSION, "effectmq", "operator/effectmq_operator"],
                             capture_output=True)
    if archive.returncode != 0:
        message = f"git archive {OLD_VERSION} failed (a checkout without history?): {archive.stderr.decode()}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    tree = tmp_path_factory.mktemp(f"effectmq-{OLD_VERSION}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def versions(old_tree) -> tuple[dict[str, dict], dict[str, str]]:
    """Each version's environment for a process of it, and where its effectmq is."""
    envs = {"old": {"PYTHONPATH": os.pathsep.join([str(old_tree), str(old_tree / "operator"), str(ROOT)]),
                    "PYTHONSAFEPATH": "1"},
            "new": {"PYTHONPATH": str(ROOT)}}
    return envs, {"old": str(old_tree), "new": str(ROOT / "effectmq")}


def offer(version_env: dict, queue: str, url: str, first: int) -> dict:
    """Run PRODUCER in a process of that version (versions())."""
    env = {**os.environ, **version_env}
    done = subprocess.run([sys.executable, "-c", PRODUCER, queue, url, str(first)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def script_calls(url: str) -> dict[str, int]:
    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "fcall")}


def worker(version_env: dict, url: str, queue: str, tmp, name: str, *args: str) -> WorkerProcess:
    return WorkerProcess(url, queue, tmp, name=name, handlers=HANDLERS, env=version_env,
                         args=["--concurrency", "4", "--maintenance-interval", "0.2", *args])


async def settled(q, ids: list[str], proc: WorkerProcess, timeout: float = 30.0) -> dict:
    """The tasks' records once every one has completed."""
    deadline = time.monotonic() + timeout
    while True:
        infos = {i: await q.get(i) for i in ids}
        if all(info is not None and info.state == "completed" for info in infos.values()):
            return infos
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            states = sorted({(info.state if info else "gone") for info in infos.values()})
            raise AssertionError(f"not all completed (states {states}); worker log:\n{proc.log()[-3000:]}")
        await asyncio.sleep(0.05)


def runs(effects, ids) -> dict[str, int]:
    """How many handler runs finished, per task."""
    done = [json.loads(line) for line in effects.read_text().splitlines() if line.strip()]
    return {i: sum(1 for e in done if e["task"] == i and e["ev"] == "done") for i in ids}


@pytest.mark.parametrize("producer", ["old", "new"])
async def test_tasks_one_version_offered_run_on_the_other(redis_url, make_queue, old_tree, tmp_path, producer):
    q = make_queue("upgrade")
    runner = "new" if producer == "old" else "old"
    envs, trees = versions(old_tree)
    produced = offer(envs[producer], "upgrade", redis_url, 0)
    assert produced["effectmq"].startswith(trees[producer]), produced["effectmq"]
    assert produced["created"] == [[True] * 5, [False] * 5]  # an explicit id is offered once
    before = script_calls(redis_url)
    running = worker(envs[runner], redis_url, "upgrade", tmp_path, runner)
    try:
        infos = await settled(q, produced["ids"], running)
    finally:
        assert running.stop() == 0, running.log()[-3000:]
    assert {info.result["pid"] for info in infos.values()} == {running.proc.pid}
    assert set(runs(running.effects, produced["ids"]).values()) == {1}  # each ran once, to its end
    calls = script_calls(redis_url)
    if runner == "old" or not has_functions():  # its own scripts ran, by SHA (as every script on 6.2)
        assert calls["evalsha"] > before["evalsha"] and calls["fcall"] == before["fcall"]
    else:
        assert calls["fcall"] > before["fcall"]
    stats = await q.stats()
    assert (stats.waiting, stats.delayed, stats.active, stats.failed) == (0, 0, 0, 0)


@pytest.mark.parametrize("stale", ["old", "new"])
async def test_a_lease_one_version_lost_is_fenced_under_the_other(redis_url, make_queue, old_tree, tmp_path, stale):
    """A process of one version leases the task for 0.5 s and lets the lease run out; a
    worker of the other version recovers it (a stall) and runs it again. While that
    attempt runs, the stale lease's every write goes to Redis, through its own version's
    scripts, against the record the other version wrote: each is refused (LeaseLost), and
    the task completes with the second attempt's result."""
    q = make_queue("fence")
    envs, trees = versions(old_tree)
    task_id = (await q.offer("chaos", {"sleep": 2.0})).task_id
    holder = subprocess.Popen([sys.executable, "-c", STALE, "fence", redis_url], env={**os.environ, **envs[stale]},
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    current = None
    try:
        leased = json.loads(holder.stdout.readline() or "{}")
        assert leased.get("effectmq", "").startswith(trees[stale]), (leased, holder.stderr.read())
        assert (leased["task"], leased["attempt"]) == (task_id, 1)
        other = "new" if stale == "old" else "old"
        current = worker(envs[other], redis_url, "fence", tmp_path, other)
        current.wait_for_effect(lambda lines: any('"attempt": 2' in " ".join(line) for line in lines))
        holder.stdin.write("go\n")  # the second attempt holds the task now
        holder.stdin.flush()
        refused = json.loads(holder.stdout.readline() or "{}")
        assert refused == {op: "LeaseLost" for op in ("renew", "progress", "complete", "fail", "release")}, \
            (refused, holder.stderr.read())
        info = (await settled(q, [task_id], current))[task_id]
        assert (info.result["attempt"], info.result["pid"]) == (2, current.proc.pid)
        assert (info.attempt, info.stalled_attempt_count, info.handler_failure_count) == (2, 1, 0)
        assert info.progress is None
    finally:
        holder.kill()
        holder.wait()
        if current is not None:
            assert current.stop() == 0, current.log()[-3000:]
