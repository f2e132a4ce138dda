"""The inspection CLI, human and JSON output, against a real Redis."""

import asyncio
import json
import os
import subprocess
import sys

import effectmq
from tests.runtime.test_bad_input import cli
from tests.support.processes import ROOT, WorkerProcess


async def test_offer_stats_task_and_dead_letters(redis_url):
    common = ["--queue", "cliq", "--url", redis_url]
    res = cli("offer", "resize", '{"w": 10}', "--task-id", "img-1", *common)
    assert res.returncode == 0 and "offered: img-1" in res.stdout
    res = cli("offer", "resize", '{"w": 10}', "--task-id", "img-1", *common)
    assert "already known: img-1" in res.stdout

    stats = json.loads(cli("stats", "--json", *common).stdout)
    assert stats["waiting"] == 1 and stats["queue"] == "cliq"
    assert "waiting: 1" in cli("stats", *common).stdout

    task = json.loads(cli("task", "img-1", "--json", *common).stdout)
    assert task["payload"] == {"w": 10} and task["state"] == "waiting"
    missing = cli("task", "nope", *common)
    assert missing.returncode == 1 and "no task 'nope'" in missing.stderr

    q = effectmq.TaskQueue("cliq", url=redis_url)
    lease = await q.acquire()
    await lease.fail(effectmq.ErrorInfo("TooBig", "image too big"), retryable=False)
    table = cli("dead-letters", *common).stdout
    assert "img-1" in table and "TooBig: image too big" in table
    rows = json.loads(cli("dead-letters", "--json", *common).stdout)
    assert [r["task_id"] for r in rows] == ["img-1"]
    assert cli("dead-letters", "--retry-all", *common).returncode == 0
    assert (await q.get("img-1")).state == "waiting"

    assert cli("pause", *common).returncode == 0 and (await q.stats()).paused
    assert cli("resume", *common).returncode == 0 and not (await q.stats()).paused
    assert cli("cancel", "img-1", *common).returncode == 0
    assert (await q.get("img-1")).state == "canceled"
    await q.close()


def test_worker_maintenance_batch_from_the_flag_or_the_environment(monkeypatch):
    from effectmq.cli import build_parser

    assert build_parser().parse_args(["worker", "m:app"]).maintenance_batch == 100
    assert build_parser().parse_args(["worker", "m:app", "--maintenance-batch", "500"]).maintenance_batch == 500
    monkeypatch.setenv("EFFECTMQ_MAINTENANCE_BATCH", "250")  # how the operator would configure a pod
    assert build_parser().parse_args(["worker", "m:app"]).maintenance_batch == 250


async def _loop_of_a_worker(redis_url, tmp_path, name, args=(), env=None):
    """The event loop module a real `effectmq worker` process ran a handler on."""
    q = effectmq.TaskQueue(f"loop-{name}", url=redis_url)
    await q.offer("loop_kind", None, task_id="probe")
    w = WorkerProcess(redis_url, f"loop-{name}", tmp_path, args=list(args), env=env, name=name)
    try:
        return await q.wait("probe", timeout=20)
    except TimeoutError:
        raise AssertionError(w.log()) from None
    finally:
        w.stop()
        await q.close()


async def test_the_worker_runs_on_asyncio_unless_asked_for_uvloop(redis_url, tmp_path):
    assert await _loop_of_a_worker(redis_url, tmp_path, "default") == "asyncio.unix_events"
    assert await _loop_of_a_worker(redis_url, tmp_path, "flag", ["--loop", "uvloop"]) == "uvloop"
    assert await _loop_of_a_worker(redis_url, tmp_path, "auto", ["--loop", "auto"]) == "uvloop"
    assert await _loop_of_a_worker(redis_url, tmp_path, "env", env={"EFFECTMQ_LOOP": "uvloop"}) == "uvloop"


async def test_without_uvloop_auto_falls_back_and_an_explicit_ask_fails_clearly(redis_url, tmp_path):
    hide = tmp_path / "hide"
    (hide / "uvloop").mkdir(parents=True)
    (hide / "uvloop" / "__init__.py").write_text("raise ImportError('uvloop is hidden by the test')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hide), str(ROOT)])}
    assert await _loop_of_a_worker(redis_url, tmp_path, "fallback", ["--loop", "auto"], env=env) \
        == "asyncio.unix_events"
    res = subprocess.run([sys.executable, "-m", "effectmq", "worker", "tests.support.handlers:app", "--queue", "x",
                          "--url", redis_url, "--loop", "uvloop"], env={**os.environ, **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "--loop uvloop: uvloop cannot be imported" in res.stderr
    bad = subprocess.run([sys.executable, "-m", "effectmq", "worker", "m:app", "--loop", "trio"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'trio'" in bad.stderr
    bad_env = subprocess.run([sys.executable, "-m", "effectmq", "worker", "m:app"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env={**os.environ, "EFFECTMQ_LOOP": "trio"})
    assert bad_env.returncode == 2
    assert "EFFECTMQ_LOOP must be one of auto, uvloop, asyncio, got 'trio'" in bad_env.stderr


async def test_the_worker_serves_the_apps_own_redis_and_options_unless_told_otherwise(redis_url, tmp_path):
    """`effectmq worker mod:app` with no --url or EFFECTMQ_REDIS_URL uses the URL and queue
    options the App was built with (it used localhost:6379 and the default prefix)."""
    (tmp_path / "billing_app.py").write_text(
        "import os, effectmq\n"
        "app = effectmq.App('billing', url=os.environ['BILLING_REDIS'], prefix='billing')\n"
        "@app.task\n"
        "async def charge(payload):\n"
        "    return payload['cents'] * 2\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env.update(BILLING_REDIS=redis_url, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), PYTHONUNBUFFERED="1")
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "effectmq", "worker", "billing_app:app"], env=env, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    q = effectmq.TaskQueue("billing", url=redis_url, prefix="billing")
    try:
        await q.offer("charge", {"cents": 21}, task_id="c1")
        try:
            assert await q.wait("c1", timeout=20) == 42
        except TimeoutError:
            raise AssertionError(log.read_text()) from None
        # an explicit flag still wins over the App: the same App, told another prefix, finds no such queue
        override = subprocess.run([sys.executable, "-m", "effectmq", "stats", "--queue", "billing", "--url", redis_url,
                                   "--prefix", "other", "--json"], env=env, cwd=ROOT, capture_output=True, text=True)
        assert override.returncode == 2 and "no queue found under prefix 'other'" in override.stderr, override.stderr
        same = subprocess.run([sys.executable, "-m", "effectmq", "stats", "--queue", "billing", "--url", redis_url,
                               "--prefix", "billing", "--json"], env=env, cwd=ROOT, capture_output=True, text=True)
        assert json.loads(same.stdout)["completed"] == 1, same.stderr
    finally:
        proc.terminate()
        proc.wait(20)
        await q.close()


async def test_worker_json_writes_its_log_as_json_lines(redis_url, tmp_path):
    """`worker --json` was accepted and did nothing; it makes the log one JSON object a
    line (for log collectors), as its help says."""
    w = WorkerProcess(redis_url, "jsonlog", tmp_path, args=["--json"], name="jsonlog")
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while "serving queue" not in w.log():
            assert w.proc.poll() is None and asyncio.get_running_loop().time() < deadline, w.log()
            await asyncio.sleep(0.1)
    finally:
        assert w.stop() == 0, w.log()
    lines = [line for line in w.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line: a JSON object
    serving = [r for r in records if "serving queue 'jsonlog'" in r["message"]]
    assert serving and serving[0]["level"] == "INFO" and serving[0]["logger"].startswith("effectmq")
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records), records


async def test_maintain_and_the_worker_name_the_batch_alike(redis_url, capsys, monkeypatch):
    """`maintain --batch` and `worker --maintenance-batch` were two names of one setting."""
    from effectmq.cli import build_parser

    assert build_parser().parse_args(["maintain", "--maintenance-batch", "7"]).maintenance_batch == 7
    assert capsys.readouterr().err == ""
    assert build_parser().parse_args(["maintain", "--batch", "7"]).maintenance_batch == 7
    assert "effectmq: warning: --batch is deprecated: use --maintenance-batch" in capsys.readouterr().err
    monkeypatch.setenv("EFFECTMQ_MAINTENANCE_BATCH", "250")
    assert build_parser().parse_args(["maintain"]).maintenance_batch == 250
    monkeypatch.delenv("EFFECTMQ_MAINTENANCE_BATCH")
    async with effectmq.TaskQueue("maint", url=redis_url) as q:
        await q.offer("x", {})
    done = cli("maintain", "--queue", "maint", "--url", redis_url, "--maintenance-batch", "5", "--json")
    assert done.returncode == 0 and "promoted" in json.loads(done.stdout), done.stderr
    old = cli("maintain", "--queue", "maint", "--url", redis_url, "--batch", "5")
    assert old.returncode == 0 and "--batch is deprecated: use --maintenance-batch" in old.stderr, old.stderr


async def test_a_groups_cap_and_pause_from_the_command_line(redis_url):
    common = ["--queue", "capped", "--url", redis_url]
    assert cli("offer", "work", "1", "--group", "acme", *common).returncode == 0
    q = effectmq.TaskQueue("capped", url=redis_url)
    shown = cli("group", "acme", *common)
    assert shown.stdout.strip() == "group acme of queue capped: 0 running (no cap), 1 waiting, 0 parked"
    capped = cli("group", "acme", "--max-active", "3", *common)
    assert capped.stdout.strip() == "group acme of queue capped: 0 running (at most 3), 1 waiting, 0 parked"
    paused = json.loads(cli("group", "acme", "--pause", "--json", *common).stdout)
    assert paused == {"group": "acme", "waiting": 1, "active": 0, "parked": 0, "max_active": 3, "paused": True,
                      "rate_limit": None}
    assert await q.acquire() is None  # parked
    assert "0 running (at most 3), paused, 0 waiting, 1 parked" in cli("group", "acme", *common).stdout
    resumed = cli("group", "acme", "--resume", "--max-active", "-1", *common)
    assert resumed.stdout.strip() == "group acme of queue capped: 0 running (no cap), 1 waiting, 0 parked"
    for bad, says in ((["--max-active", "-2"], "max_active must be >= -1"), (["--max-active", "x"], "invalid int"),
                      (["--pause", "--resume"], "not allowed with argument"), (["--max-active", str(2**31)], "<= ")):
        refused = cli("group", "acme", *bad, *common)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, bad
    refused = cli("group", "a\tb", *common)
    assert refused.returncode == 2 and "control characters" in refused.stderr
    assert cli("group", "acme", "--queue", "nobody", "--url", redis_url).returncode != 0  # an unknown queue
    assert (await q.group_stats("acme")).max_active == 0
    await q.close()


async def test_a_groups_rate_limit_from_the_command_line(redis_url):
    common = ["--queue", "grouprate", "--url", redis_url]
    assert cli("offer", "work", "1", "--group", "acme", *common).returncode == 0
    limited = cli("group", "acme", "--rate-limit", "5/2s", *common)
    assert limited.stdout.strip() == ("group acme of queue grouprate: 0 running (no cap), 1 waiting, 0 parked; "
                                      "at most 5 starts in any 2s"), limited.stderr
    shown = json.loads(cli("group", "acme", "--json", *common).stdout)
    assert shown["rate_limit"] == [5, 2.0]
    async with effectmq.TaskQueue("grouprate", url=redis_url) as q:
        await q.configure(group_rate_limit=(3, 1))
        assert "at most 3 starts in any 1s" in cli("group", "acme", "--rate-limit", "default", *common).stdout
        off = cli("group", "acme", "--rate-limit", "off", *common)
        assert off.stdout.strip() == "group acme of queue grouprate: 0 running (no cap), 1 waiting, 0 parked"
        assert (await q.group_stats("acme")).rate_limit is None
    for bad, says in ((["--rate-limit", "5"], "TASKS/PERIOD"), (["--rate-limit", "0/1s"], ">= 1")):
        refused = cli("group", "acme", *bad, *common)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, bad


async def test_parked_tasks_from_the_command_line(redis_url):
    common = ["--queue", "parking", "--url", redis_url]
    q = effectmq.TaskQueue("parking", url=redis_url)
    await q.pause_group("acme")
    await q.offer_many([("work", i, {"group": g, "task_id": f"{g}-{i}"}) for g in ("acme", "beta") for i in range(3)])
    assert cli("parked", *common).stdout.strip() == "no parked tasks"
    leases, _ = await q.acquire_many(3)  # beta's three; acme's parked on the way
    assert sorted(lease.task_id for lease in leases) == ["beta-0", "beta-1", "beta-2"]
    table = cli("parked", "--group", "acme", *common).stdout.splitlines()
    assert table[0].split() == ["TASK", "ID", "GROUP", "NAME", "PRIORITY", "CREATED"]
    assert [line.split()[:4] for line in table[1:]] == [[f"acme-{i}", "acme", "work", "0"] for i in range(3)]
    rows = json.loads(cli("parked", "--json", "--limit", "2", "--offset", "1", *common).stdout)
    assert [(r["task_id"], r["state"]) for r in rows] == [("acme-1", "waiting"), ("acme-2", "waiting")]
    assert cli("parked", "--group", "beta", *common).stdout.strip() == "no parked tasks of group beta"
    for bad, says in ((["--limit", "0"], "limit must be >= 1"), (["--offset", "-1"], "offset must be >= 0"),
                      (["--group", "a\tb"], "control characters"), (["--limit", "x"], "invalid int")):
        refused = cli("parked", *bad, *common)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, bad
    await q.close()


async def test_rate_limit_and_hold_from_the_command_line(redis_url):
    common = ["--queue", "limited", "--url", redis_url]
    assert cli("offer", "call_api", "1", *common).returncode == 0
    q = effectmq.TaskQueue("limited", url=redis_url)
    assert cli("rate-limit", *common).stdout.strip() == "queue limited: no rate limit"
    done = cli("rate-limit", "100/1s", *common)
    assert done.stdout.strip() == "queue limited: at most 100 starts in any 1s (0 in the current window)"
    assert (await q.settings())["rate_limit"] == (100, 1.0)
    assert json.loads(cli("rate-limit", "5/0.5", "--json", *common).stdout)["rate_limit"] == [5, 0.5]
    assert "rate_limit: 5 per 0.5s\n" in cli("stats", *common).stdout  # was "(5, 0.5)"
    for bad, says in (("100", "a rate limit is TASKS/PERIOD"), ("x/1s", "a rate limit is TASKS/PERIOD"),
                      ("0/1s", "rate_limit tasks must be >= 1"), ("10/0", "must be >= 0.001"),
                      ("1000000/1s", "must be <= 100000")):
        refused = cli("rate-limit", bad, *common)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, bad
    assert (await q.settings())["rate_limit"] == (5, 0.5)  # a refused limit changed nothing
    assert cli("rate-limit", "off", *common).stdout.strip() == "queue limited: no rate limit"
    assert (await q.settings()).get("rate_limit") is None

    held = cli("hold", "30", *common)
    assert held.returncode == 0 and held.stdout.startswith("queue limited: no task starts for 30")
    assert await q.acquire() is None and 25 < (await q.stats()).starts_held_for <= 30
    assert "starts held for" in cli("rate-limit", *common).stdout
    refused = cli("hold", "inf", *common)
    assert refused.returncode == 2 and "seconds must be a finite number" in refused.stderr
    await q.close()
