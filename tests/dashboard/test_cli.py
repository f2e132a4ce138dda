"""`effectmq dashboard` as a process, the way the chart runs it: startup errors, probes,
the default bind address, and a Redis that goes away and comes back (the page shows
"Redis unreachable", never a traceback, and recovers by itself)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from effectmq import TaskQueue
from tests.fixtures.redis import free_port
from tests.support.processes import ROOT, stop_process

pytestmark = pytest.mark.timeout(180)


def env(**extra: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_DASHBOARD_")}
    return {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", **extra}


def run(*args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "effectmq", "dashboard", *args], env=env(**extra), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_actions_without_a_token_is_a_startup_error(tmp_path):
    done = run("--url", "redis://127.0.0.1:1/0", "--actions")
    assert done.returncode == 2
    assert "--actions needs a token" in done.stderr
    assert "Traceback" not in done.stderr
    done = run("--url", "redis://127.0.0.1:1/0", "--actions", "--token-file", str(tmp_path / "missing"))
    assert (done.returncode, "cannot read the token file" in done.stderr) == (2, True)
    (tmp_path / "empty").write_text("\n")
    done = run("--url", "redis://127.0.0.1:1/0", "--actions", "--token-file", str(tmp_path / "empty"))
    assert (done.returncode, "is empty" in done.stderr) == (2, True)


def test_a_short_token_is_a_startup_error(tmp_path):
    """A token shorter than 16 characters is refused at startup (a one-character one was accepted)."""
    (tmp_path / "short").write_text("x\n")
    done = run("--url", "redis://127.0.0.1:1/0", "--actions", "--token-file", str(tmp_path / "short"))
    assert done.returncode == 2 and "at least 16 characters" in done.stderr, done.stderr
    done = run("--url", "redis://127.0.0.1:1/0", "--actions", EFFECTMQ_DASHBOARD_TOKEN="tok-123")
    assert done.returncode == 2 and "at least 16 characters" in done.stderr, done.stderr
    done = run("--url", "redis://127.0.0.1:1/0", "--read-token-file", str(tmp_path / "short"))
    assert done.returncode == 2 and "at least 16 characters" in done.stderr, done.stderr


def run_briefly(*args: str, **extra: str) -> subprocess.CompletedProcess | None:
    """The dashboard's exit when it refuses to start; None (and stopped) when it started."""
    proc = subprocess.Popen([sys.executable, "-m", "effectmq", "dashboard", *args], env=env(**extra), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_non_loopback_bind_without_a_read_token_is_refused(tmp_path, redis_url):
    """Was: `--host 0.0.0.0` started silently, every queue readable by
    anyone who reaches the port. Now it needs a read token, or the explicit
    --unauthenticated-reads (said loudly in the log)."""
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        done = run_briefly("--url", redis_url, "--host", host, "--port", str(free_port()))
        assert done is not None, f"--host {host} started without a read token"
        assert done.returncode == 2 and "--read-token-file" in done.stderr and "--unauthenticated-reads" in done.stderr
        assert "Traceback" not in done.stderr
    (tmp_path / "read").write_text("read-token-4f0c2e9a1b\n")
    with_token = Dashboard(tmp_path, "--url", redis_url, "--host", "0.0.0.0", "--read-token-file",
                           str(tmp_path / "read"))
    try:
        assert get(with_token.base + "/api/queues")[0] == 401
    finally:
        assert stop_process(with_token.proc) == 0, with_token.log()
    open_reads = Dashboard(tmp_path, "--url", redis_url, "--host", "0.0.0.0", "--unauthenticated-reads")
    try:
        assert get(open_reads.base + "/api/queues")[0] == 200
        assert "WARNING" in open_reads.log() and "without a read token" in open_reads.log()
    finally:
        assert stop_process(open_reads.proc) == 0, open_reads.log()


class Dashboard:
    def __init__(self, tmp: Path, *args: str, **extra: str):
        self.port = free_port()
        self.log_path = tmp / "dashboard.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "effectmq", "dashboard", "--port", str(self.port), *args],
                                     env=env(**extra), cwd=ROOT, stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if get(self.base + "/healthz") == (200, "ok"):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"dashboard did not start:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


async def test_probes_and_a_redis_outage(make_redis, tmp_path, browser):
    server = make_redis(password="probe-pw", aof=True)  # its tasks outlive the restart
    async with TaskQueue("emails", url=server.url) as q:
        await q.offer("send_email", {"to": "a@example.com"})
    token = tmp_path / "token"
    token.write_text("tok-123-4567-89ab\n")
    # the URL from the environment, as the chart passes it from a Secret
    dash = Dashboard(tmp_path, "--actions", "--token-file", str(token), EFFECTMQ_REDIS_URL=server.url)
    try:
        assert "dashboard on http://127.0.0.1:" in dash.log()  # bound to loopback by default
        assert get(dash.base + "/readyz") == (200, "ok")
        status, page = get(dash.base + "/")
        assert status == 200 and 'data-queue="emails"' in page and "probe-pw" not in page

        browser_page = await browser.new_page()
        await browser_page.goto(dash.base + "/")
        server.stop()
        assert get(dash.base + "/healthz") == (200, "ok")  # the process runs: liveness holds
        status, text = get(dash.base + "/readyz")
        assert (status, text) == (503, "Redis unreachable")
        status, page = get(dash.base + "/queues/emails")
        assert status == 503 and "Redis unreachable" in page and "Traceback" not in page
        assert "probe-pw" not in page
        banner = browser_page.locator("#banner")
        await banner.wait_for(state="visible", timeout=15_000)
        assert "Redis unreachable" in await banner.text_content()
        await browser_page.goto(dash.base + "/queues/emails")  # a fresh page while Redis is down
        assert "Redis unreachable" in await browser_page.text_content("main")

        server.start()  # same port: the dashboard reconnects by itself
        await browser_page.wait_for_selector('.tabs [data-count="waiting"]', timeout=20_000)  # reloaded itself
        assert (await browser_page.text_content('.tabs [data-count="waiting"] .n')).strip() == "1"
        deadline = time.monotonic() + 10
        while get(dash.base + "/readyz")[0] != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert "Traceback" not in dash.log()
    finally:
        assert stop_process(dash.proc) == 0, dash.log()


def test_no_answer_of_the_process_names_a_version(tmp_path, redis_url):
    """Was: `Server: Python/3.11 aiohttp/3.x`, also on the answers aiohttp's own
    parser gives to malformed requests (test_exposure covers those of the app)."""
    import socket

    dash = Dashboard(tmp_path, "--url", redis_url)
    try:
        for raw in (b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: x\r\n\r\n",
                    b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as conn:
                conn.sendall(raw)
                head = conn.recv(65536).split(b"\r\n\r\n")[0].decode()
            server = [line for line in head.splitlines() if line.lower().startswith("server:")]
            assert server == ["Server: effectmq-dashboard"], head
    finally:
        assert stop_process(dash.proc) == 0, dash.log()


def test_startup_errors_have_the_one_prefix_of_effectmq():
    """Was "effectmq dashboard: ..."; every command now says "effectmq: error: ..." (docs/cli.md)."""
    done = run("--url", "redis://127.0.0.1:1/0", "--actions")
    assert done.returncode == 2 and done.stderr.startswith("effectmq: error: --actions needs a token"), done.stderr


async def test_the_schedules_of_every_scheduler_namespace_are_shown(tmp_path, redis_url):
    """Was: the chart's dashboard showed no schedules: the operator keeps them under
    scheduler namespace `k8s`, the dashboard looked in `default` only."""
    import json

    from effectmq.scheduler import Scheduler, ScheduleSpec
    from effectmq_operator.redis_pool import SCHEDULER_NAMESPACE as OPERATOR_NAMESPACE

    for namespace, schedule_id in ((OPERATOR_NAMESPACE, "shop/nightly"), ("default", "by-hand"),
                                   ("other", "by-hand")):
        async with Scheduler(redis_url, namespace=namespace) as scheduler:
            await scheduler.put(ScheduleSpec(id=schedule_id, queue="emails", cron="0 2 * * *", task="job"))
    token = tmp_path / "token"
    token.write_text("tok-123-4567-89ab\n")
    dash = Dashboard(tmp_path, "--url", redis_url, "--actions", "--token-file", str(token))
    try:
        status, body = get(dash.base + "/api/schedules")
        assert status == 200, body
        shown = sorted((s["namespace"], s["id"]) for s in json.loads(body)["schedules"])
        assert shown == [("default", "by-hand"), ("k8s", "shop/nightly"), ("other", "by-hand")]

        def post(path: str) -> tuple[int, str]:
            request = urllib.request.Request(dash.base + path, method="POST",
                                             headers={"Authorization": "Bearer tok-123-4567-89ab"})
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        status, body = post("/api/schedules/shop%2Fnightly/suspend")
        assert status == 200, body
        async with Scheduler(redis_url, namespace=OPERATOR_NAMESPACE) as scheduler:
            assert (await scheduler.status("shop/nightly")).suspended
        status, body = post("/api/schedules/by-hand/suspend")  # which one? it does not guess
        assert status == 409 and "?namespace=" in body, body
        status, body = post("/api/schedules/by-hand/suspend?namespace=other")  # as the page's button asks
        assert status == 200, body
        async with Scheduler(redis_url, namespace="other") as scheduler:
            assert (await scheduler.status("by-hand")).suspended
        async with Scheduler(redis_url, namespace="default") as scheduler:
            assert not (await scheduler.status("by-hand")).suspended
        status, body = post("/api/schedules/by-hand/suspend?namespace=nowhere")
        assert status == 404, body
        status, page = get(dash.base + "/schedules")
        assert status == 200 and "<th>namespace</th>" in page and '<td class="muted">other</td>' in page, page
    finally:
        assert stop_process(dash.proc) == 0, dash.log()
    only = Dashboard(tmp_path, "--url", redis_url, "--scheduler-namespace", "k8s")
    try:
        status, body = get(only.base + "/api/schedules")
        assert status == 200 and "shop/nightly" in body and "by-hand" not in body, body
    finally:
        assert stop_process(only.proc) == 0, only.log()
