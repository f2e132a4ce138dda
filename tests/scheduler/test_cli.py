"""`python -m effectmq scheduler ...` as a subprocess."""

import json
import signal
import subprocess
import sys
import time

import pytest

from .support import ROOT, SchedulerProcess, cli, cli_json, wait_until

NS = ("--scheduler-namespace", "cli")


def test_scheduler_is_a_subcommand_of_effectmq():
    done = subprocess.run([sys.executable, "-m", "effectmq", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "scheduler" in done.stdout
    done = subprocess.run([sys.executable, "-m", "effectmq", "scheduler", "--help"], cwd=ROOT, capture_output=True,
                          text=True)
    for command in ("run", "tick", "add", "remove", "list", "status", "suspend", "resume"):
        assert command in done.stdout


def test_add_list_status_suspend_resume_remove(redis_url):
    added = cli_json(redis_url, "add", "cli/nightly", "--queue", "reports", "--cron", "0 2 * * *",
                     "--timezone", "Europe/Berlin", "--task", "send_report", "--payload", '{"kind": "daily"}',
                     "--priority", "5", "--missed", "backfill", "--max-backfill", "3", "--starting-deadline", "3600",
                     *NS)
    assert added["spec"]["timezone"] == "Europe/Berlin" and added["spec"]["payload"] == {"kind": "daily"}
    assert added["spec"]["missed"] == "backfill" and added["spec"]["max_backfill"] == 3
    assert added["next_tick"].endswith("Z") and added["last_error"] is None

    human = cli(redis_url, "list", *NS)
    assert human.returncode == 0 and "cli/nightly" in human.stdout and "0 2 * * *" in human.stdout
    assert [s["id"] for s in cli_json(redis_url, "list", *NS)] == ["cli/nightly"]
    assert cli(redis_url, "list", "--scheduler-namespace", "elsewhere").stdout.strip() == "no schedules"

    status = cli(redis_url, "status", "cli/nightly", *NS)
    assert status.returncode == 0 and "next tick" in status.stdout and "Europe/Berlin" in status.stdout
    assert cli_json(redis_url, "suspend", "cli/nightly", *NS)["suspended"] is True
    resumed = cli_json(redis_url, "resume", "cli/nightly", *NS)
    assert resumed["suspended"] is False and resumed["next_tick"]

    assert cli_json(redis_url, "remove", "cli/nightly", *NS) == {"id": "cli/nightly", "removed": True}
    gone = cli(redis_url, "remove", "cli/nightly", *NS)
    assert gone.returncode == 1
    missing = cli(redis_url, "status", "cli/nightly", *NS)
    assert missing.returncode == 1 and "no schedule 'cli/nightly'" in missing.stderr


@pytest.mark.parametrize("args, code, message", [  # bad input: exit 2 (docs/cli.md)
    (["--cron", "61 * * * *"], 2, "invalid minute field '61'"),
    (["--cron", "* * * * *", "--timezone", "Moon/Tranquility"], 2, "not a known IANA time zone"),
    (["--cron", "* * * * *", "--payload", "{oops"], 2, "--payload is not valid JSON"),
    (["--cron", "* * * * *", "--payload", "[1, 2]"], 2, "payload must be a JSON object"),
    (["--cron", "* * * * *", "--missed", "later"], 2, "must be Skip, Coalesce or Backfill, got 'later'"),
])
def test_add_refuses_invalid_definitions_with_clear_errors(redis_url, args, code, message):
    done = cli(redis_url, "add", "cli/bad", "--queue", "q", "--task", "t", *args, *NS)
    assert done.returncode == code and message in done.stderr, done.stderr
    assert "effectmq: error: " in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert cli_json(redis_url, "list", *NS) == []


def test_tick_runs_one_pass(redis_url):
    cli_json(redis_url, "add", "cli/every-second", "--queue", "q", "--cron", "* * * * * *", "--task", "work", *NS)
    time.sleep(1.1)
    report = cli_json(redis_url, "tick", *NS)
    assert report["materialized"] and report["materialized"][0]["task_id"].startswith("cli/every-second/")
    assert report["errors"] == {} and report["next_due"]
    human = cli(redis_url, "tick", *NS)
    assert human.returncode == 0 and ("already known" in human.stdout or "created" in human.stdout
                                      or "nothing due" in human.stdout)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_materializes_until_signalled_and_exits_cleanly(redis_url, tmp_path, sig):
    cli_json(redis_url, "add", "cli/run", "--queue", "q", "--cron", "* * * * * *", "--task", "work", *NS)
    runner = SchedulerProcess(redis_url, "cli", tmp_path, name=f"run-{sig.name}")
    try:
        wait_until(lambda: sum(len(r["materialized"]) for r in runner.reports()) >= 2, 20,
                   f"two ticks from the running scheduler:\n{runner.text()}")
    finally:
        code = runner.stop(sig)
    assert code == 0, runner.text()
    assert "scheduler stopped" in runner.text()
    ticks = [m["tick"] for r in runner.reports() for m in r["materialized"]]
    assert ticks == sorted(ticks) and all(json.dumps(r) for r in runner.reports())


def test_run_fails_fast_without_redis():
    done = cli("redis://127.0.0.1:1/0", "run", *NS, timeout=30)
    assert done.returncode == 3 and "effectmq: error: Redis unavailable" in done.stderr  # 3: docs/cli.md


def test_the_old_namespace_flag_still_works_and_says_it_is_deprecated(redis_url):
    """`-n/--namespace` read as a Kubernetes namespace to kubectl users: it is
    --scheduler-namespace now, as the dashboard's flag; the old spelling warns."""
    cli_json(redis_url, "add", "cli/old", "--queue", "q", "--cron", "0 2 * * *", "--task", "t", *NS)
    for flag in ("-n", "--namespace"):
        done = cli(redis_url, "list", flag, "cli", "--json")
        assert done.returncode == 0, done.stderr
        assert [s["id"] for s in json.loads(done.stdout)] == ["cli/old"]
        assert f"effectmq: warning: {flag} is deprecated: use --scheduler-namespace" in done.stderr, done.stderr


@pytest.mark.parametrize("given, shown", [("Skip", "Skip"), ("skip", "Skip"), ("BACKFILL", "Backfill"),
                                          ("coalesce", "Coalesce")])
def test_missed_takes_the_crds_spelling_in_any_case(redis_url, given, shown):
    """A Schedule says `missedTicks: Skip`; the CLI took only `skip`."""
    added = cli_json(redis_url, "add", "cli/missed", "--queue", "q", "--cron", "0 2 * * *", "--task", "t",
                     "--missed", given, *NS)
    assert added["spec"]["missed"] == shown.lower()
    human = cli(redis_url, "status", "cli/missed", *NS)
    assert f"missed ticks: {shown}" in human.stdout, human.stdout
    helped = " ".join(cli(redis_url, "add", "--help").stdout.split())
    assert "--missed {Skip,Coalesce,Backfill}" in helped and "(default: Coalesce)" in helped


async def test_schedules_of_every_scheduler_namespace_are_found(redis_url):
    """Were invisible: the operator keeps its schedules under scheduler namespace `k8s`,
    `effectmq local` under `local`, and the CLI looked in `default` only."""
    from effectmq.scheduler import DEFAULT_NAMESPACE, Scheduler, ScheduleSpec
    from effectmq_operator.redis_pool import SCHEDULER_NAMESPACE as OPERATOR_NAMESPACE
    from effectmq_operator.local.runner import SCHEDULER_NAMESPACE as LOCAL_NAMESPACE

    for namespace, schedule_id in ((OPERATOR_NAMESPACE, "shop/nightly"), (LOCAL_NAMESPACE, "default/digest"),
                                   (DEFAULT_NAMESPACE, "by-hand"), ("other", "by-hand")):
        async with Scheduler(redis_url, namespace=namespace) as scheduler:
            await scheduler.put(ScheduleSpec(id=schedule_id, queue="q", cron="0 2 * * *", task="t"))

    listed = cli_json(redis_url, "list")
    assert sorted((s["namespace"], s["id"]) for s in listed) == [
        ("default", "by-hand"), ("k8s", "shop/nightly"), ("local", "default/digest"), ("other", "by-hand")]
    human = cli(redis_url, "list")
    assert human.returncode == 0 and "NAMESPACE" in human.stdout and "shop/nightly" in human.stdout
    assert [s["id"] for s in cli_json(redis_url, "list", "--scheduler-namespace", "k8s")] == ["shop/nightly"]

    # one schedule by its id: found in whichever namespace holds it
    assert cli_json(redis_url, "status", "shop/nightly")["namespace"] == "k8s"
    assert cli_json(redis_url, "suspend", "default/digest")["suspended"] is True
    async with Scheduler(redis_url, namespace=LOCAL_NAMESPACE) as scheduler:
        assert (await scheduler.status("default/digest")).suspended
    # an id in two namespaces must be told which
    both = cli(redis_url, "status", "by-hand")
    assert both.returncode == 2 and "effectmq: error: schedule 'by-hand' is in scheduler namespaces default, " \
        "other: give --scheduler-namespace" in both.stderr, both.stderr
    assert cli_json(redis_url, "status", "by-hand", "--scheduler-namespace", "other")["namespace"] == "other"
    missing = cli(redis_url, "status", "nope")
    assert missing.returncode == 1 and "no schedule 'nope' in any scheduler namespace" in missing.stderr

    # what is written goes to the one default, which `run` and `tick` serve
    cli_json(redis_url, "add", "new", "--queue", "q", "--cron", "0 2 * * *", "--task", "t")
    async with Scheduler(redis_url, namespace=DEFAULT_NAMESPACE) as scheduler:
        assert await scheduler.status("new") is not None
