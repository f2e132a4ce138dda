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
    token.write_text("tok-123\n")
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
