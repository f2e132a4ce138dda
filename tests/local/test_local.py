"""`effectmq local` driven as a subprocess: the example comes up, tasks flow, a
schedule fires, workers scale up and back down; SIGINT/SIGTERM drain and a restart
continues; invalid manifests name the file and field."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import effectmq
from tests.fixtures.redis import free_port, require_binary
from tests.support.processes import ROOT


class Local:
    def __init__(self, tmp: Path, *args: str, port: int, data_dir: Path | None = None):
        require_binary("redis-server", "install the Debian package redis-server")
        self.port = port
        self.out = tmp / f"local-{time.monotonic_ns()}.out"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "effectmq", "local", *args, "--no-view", "--redis-port", str(port),
             "--data-dir", str(data_dir or tmp / "data")],
            cwd=ROOT, env=env, stdout=open(self.out, "wb"), stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lines(self) -> list[str]:
        return self.out.read_text(errors="replace").splitlines()

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in reversed(self.lines()):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None:
                raise AssertionError(f"effectmq local exited {self.proc.returncode}:\n" + "\n".join(self.lines()[-30:]))
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s:\n" + "\n".join(self.lines()[-30:]))

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def fields(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def wait_status(local: Local, check, timeout: float) -> dict[str, int]:
    """Wait for a status line whose numbers satisfy `check`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in reversed(local.lines()):
            if "workers=" in line and check(f := fields(line)):
                return f
        if local.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError("status never matched:\n" + "\n".join(local.lines()[-20:]))


def test_example_comes_up_scales_and_comes_down(tmp_path):
    local = Local(tmp_path, "--burst", "400", port=free_port())
    try:
        # 400 tasks at 50 per replica want 8 workers: the first step starts 4, all tasks complete.
        wait_status(local, lambda f: f["workers"] >= 4, timeout=60)  # 0 -> 4 (the step limit)
        # Tasks flowed, and the digest schedule fired (its tasks count as completed too).
        wait_status(local, lambda f: f["completed"] >= 400 and f["ticks"] >= 1, timeout=90)
        # The queue is idle: after the 30 s stabilization window, workers go back down.
        peak = max(fields(line).get("workers", 0) for line in local.lines())
        down = wait_status(local, lambda f: f["waiting"] == 0 and f["workers"] < peak, timeout=90)
        assert down["failed"] == 0
    finally:
        assert local.stop() == 0
    assert "stopped; state kept" in local.lines()[-1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stop_drains_and_restart_continues(tmp_path, sig):
    manifest = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
    manifest["spec"]["worker"]["terminationGracePeriodSeconds"] = 6  # drains for 1 s
    manifest["spec"]["scaling"].update(minReplicas=1, pollIntervalSeconds=1)
    (tmp_path / "queue.yaml").write_text(yaml.safe_dump(manifest))
    port, data = free_port(), tmp_path / "data"
    local = Local(tmp_path, str(tmp_path / "queue.yaml"), port=port, data_dir=data)
    local.wait_line(r"workers=1", timeout=60)
    q = effectmq.SyncTaskQueue("default/emails", url=local.url)
    slow = q.offer("send_report", {"report": "slow", "seconds": 3}, task_id="slow").task_id
    quick = [q.offer("send_email", {"to": f"u{i}@example.com"}).task_id for i in range(20)]
    deadline = time.monotonic() + 30
    while q.get(slow).state != "active" and time.monotonic() < deadline:
        time.sleep(0.05)
    q.close()
    assert local.stop(sig) == 0  # the slow attempt is released by the drain, not stalled

    again = Local(tmp_path, str(tmp_path / "queue.yaml"), port=port, data_dir=data)
    try:
        again.wait_line(r"workers=1", timeout=60)
        q = effectmq.SyncTaskQueue("default/emails", url=again.url)
        result = q.wait(slow, timeout=60)
        assert (result["report"], result["tick"]) == ("slow", None)
        assert all(q.get(t).state == "completed" for t in quick)
        info = q.get(slow)
        assert info.stalled_attempt_count == 0 and info.handler_failure_count == 0
        q.close()
    finally:
        assert again.stop() == 0


@pytest.mark.parametrize("mutate, expected", [
    (lambda q: q["spec"]["scaling"].update(minReplicas=30), r"queue\.yaml: Queue emails: spec\.scaling: "
                                                            r"scaling\.minReplicas must be less than or equal"),
    (lambda q: q["spec"].update(lockTimeoutSeconds=-5), r"spec\.lockTimeoutSeconds: must be >= 1, got -5"),
    (lambda q: q["spec"]["retry"].update(backoff="Linear"), r"spec\.retry\.backoff: 'Linear' is not one of"),
    (lambda q: q["spec"].update(scalling={}), r"spec\.scalling: unknown field"),
    (lambda q: q["spec"].pop("redis"), r"spec\.redis: required"),
])
def test_invalid_manifests_name_file_and_field(tmp_path, mutate, expected):
    manifest = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
    manifest["spec"]["retry"] = {"backoff": "Exponential"}
    mutate(manifest)
    (tmp_path / "queue.yaml").write_text(yaml.safe_dump(manifest))
    res = subprocess.run([sys.executable, "-m", "effectmq", "local", str(tmp_path / "queue.yaml"), "--no-view"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])})
    assert res.returncode == 2, res.stderr
    assert re.search(expected, res.stderr), res.stderr


def test_schedule_pointing_at_a_missing_queue_is_rejected(tmp_path):
    (tmp_path / "s.yaml").write_text((ROOT / "examples/k8s/schedule.yaml").read_text())
    other_queue = (ROOT / "examples/k8s/queue.yaml").read_text().replace("name: emails", "name: other")
    (tmp_path / "q.yaml").write_text(other_queue)
    res = subprocess.run([sys.executable, "-m", "effectmq", "local", str(tmp_path), "--no-view"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])})
    assert res.returncode == 2
    assert re.search(r"s\.yaml: Schedule nightly-report: spec\.queueRef\.name: no Queue 'emails'", res.stderr)


def test_a_full_redis_pauses_the_ticks_and_the_system_goes_on(tmp_path):
    """Was: `effectmq local` stopped (exit 1) on the first tick pass Redis refused when
    full (maxmemory, noeviction): a retryable error ended the whole system."""
    import redis

    local = Local(tmp_path, port=free_port())
    try:
        local.wait_line(r"ticks=\d+", timeout=60)
        server = redis.Redis(port=local.port)
        try:
            server.config_set("maxmemory", 1)
            # a tick fell due (every 10 s)
            local.wait_line(r"effectmq local: Redis refused .*OOM.*; retrying", timeout=30)
            assert local.proc.poll() is None, "\n".join(local.lines()[-30:])
        finally:
            server.config_set("maxmemory", 0)
        local.wait_line(r"effectmq local: Redis answers again", timeout=30)
        before = wait_status(local, lambda f: True, timeout=10)["ticks"]
        wait_status(local, lambda f: f["ticks"] > before, timeout=30)  # the digest fires again
        q = effectmq.SyncTaskQueue("default/emails", url=local.url)
        task = q.offer("send_email", {"to": "after@example.com"}).task_id
        assert q.wait(task, timeout=60) is not None
        q.close()
        server.close()
    finally:
        assert local.stop() == 0, "\n".join(local.lines()[-30:])


PASSWORD = "l0cal-Only-s3cret"


def child_environs(parent: int) -> dict[int, str]:
    """The environments (/proc/<pid>/environ) of the processes `parent` started."""
    found = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat_path.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                found[int(stat_path.parent.name)] = (stat_path.parent / "environ").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def test_a_url_from_a_secret_reaches_local_workers_by_a_private_file(tmp_path, make_redis):
    """As in a pod: a Queue whose URL a Secret holds gets it through
    EFFECTMQ_REDIS_URL_FILE, never the workers' environment (which their child processes
    inherit and /proc/<pid>/environ shows). Locally the runner writes the URL of the
    Redis it runs on to a file only its user reads, and removes it when it stops."""
    server = make_redis(password=PASSWORD)
    manifest = yaml.safe_load((ROOT / "examples/k8s/queue.yaml").read_text())
    manifest["spec"]["redis"] = {"urlFrom": {"secretKeyRef": {"name": "redis-credentials", "key": "url"}}}
    manifest["spec"]["scaling"].update(minReplicas=1, pollIntervalSeconds=1)
    (tmp_path / "queue.yaml").write_text(yaml.safe_dump(manifest))
    local = Local(tmp_path, str(tmp_path / "queue.yaml"), "--url", server.url, port=free_port())
    try:
        local.wait_line(r"workers=1", timeout=60)
        q = effectmq.SyncTaskQueue("default/emails", url=server.url)
        assert q.wait(q.offer("send_email", {"to": "a@example.com"}).task_id, timeout=60)["delivered_to"] \
            == "a@example.com"
        q.close()
        workers = {pid: environ for pid, environ in child_environs(local.proc.pid).items()
                   if "EFFECTMQ_QUEUE=default/emails\0" in environ}
        assert workers, "no worker process found"
        for environ in workers.values():
            variables = dict(v.split("=", 1) for v in environ.split("\0") if "=" in v)
            assert PASSWORD not in environ and "EFFECTMQ_REDIS_URL" not in variables
            url_file = Path(variables["EFFECTMQ_REDIS_URL_FILE"])
            assert url_file.read_text() == server.url
            assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
            assert stat.S_IMODE(url_file.parent.stat().st_mode) == 0o700
    finally:
        assert local.stop() == 0, "\n".join(local.lines()[-30:])
    assert not url_file.parent.exists()
    assert PASSWORD not in "\n".join(local.lines())


def test_url_is_the_flag_of_every_command_and_redis_url_warns(tmp_path, capsys):
    """`effectmq local` alone took --redis-url; it takes --url as every command does, and
    the old spelling still works with a warning."""
    from effectmq.cli import build_parser

    assert build_parser().parse_args(["local", "--url", "redis://h:1/0"]).url == "redis://h:1/0"
    assert capsys.readouterr().err == ""
    assert build_parser().parse_args(["local", "--redis-url", "redis://h:1/0"]).url == "redis://h:1/0"
    assert "effectmq: warning: --redis-url is deprecated: use --url" in capsys.readouterr().err
    path = os.pathsep.join([str(ROOT), str(ROOT / "operator")])
    res = subprocess.run([sys.executable, "-m", "effectmq", "local", str(tmp_path / "none.yaml"), "--no-view",
                          "--redis-url", "redis://127.0.0.1:1/0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": path})
    assert res.returncode == 2 and "effectmq: warning: --redis-url is deprecated: use --url" in res.stderr, res.stderr
    assert "effectmq: error: " in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_without_the_operator_extra_it_says_what_to_install(tmp_path):
    """Was a traceback ending in "No module named 'celpy'" (manifests are checked with CEL)."""
    hide = tmp_path / "hide" / "celpy"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'celpy'\", name='celpy')\n")
    res = subprocess.run([sys.executable, "-m", "effectmq", "local", "--no-view", "--redis-port", str(free_port()),
                          "--data-dir", str(tmp_path / "data")], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(hide.parent), str(ROOT),
                                                                          str(ROOT / "operator")])})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("effectmq: error: ") and "pip install 'effectmq[operator]'" in res.stderr, res.stderr
    assert not (tmp_path / "data").exists()  # refused before it started anything


def test_the_view_says_when_the_last_scaling_was_decided():
    """Its counts are of that moment: beside the row's counts of now they need a time."""
    from types import SimpleNamespace

    from effectmq_operator.local import view

    stats = SimpleNamespace(waiting=0, delayed=0, active=1, completed=5, failed=0)
    row = view.QueueRow("emails", stats, 1, "1 -> 0 replicas: 0 tasks (0 waiting + 0 active)", last_scale_age=14.2)
    text = view.render("redis://127.0.0.1:6379/0", [row], [], [], Path("/tmp/logs"))
    assert "  last scaling, 14 s ago: 1 -> 0 replicas: 0 tasks (0 waiting + 0 active)" in text.splitlines()
