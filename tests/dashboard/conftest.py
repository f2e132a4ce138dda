"""Fixtures of the dashboard tests: the real aiohttp app on a free port against a real
redis-server, and Debian's Chromium driven by Playwright (never a downloaded browser).

Under CI=true a missing chromium or playwright fails the test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import pytest
import pytest_asyncio

from tests.fixtures.redis import IN_CI, free_port

CHROMIUM = "/usr/bin/chromium"
# Headless and quiet: no GPU, no QUIC, nothing fetched from the network by the browser itself.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
TOKEN = "test-token-5d1c8a"


def missing(message: str) -> None:
    if IN_CI:
        pytest.fail(message)  # under CI a missing dependency is a failure, never a skip
    pytest.skip(message)


def dashboard_modules():
    try:
        from aiohttp import web  # noqa: F401

        from effectmq.dashboard.web import create_app  # noqa: F401
    except ModuleNotFoundError as exc:
        missing(f"{exc.name} is not installed: pip install -e '.[dashboard,test]'")


@dataclass
class RunningDashboard:
    base: str
    app: object
    token: str | None

    def url(self, path: str) -> str:
        return self.base + path


@pytest_asyncio.fixture
async def start_dashboard() -> AsyncIterator:
    """start(url, actions=False, queues=(), **config) -> RunningDashboard, served in this event loop."""
    dashboard_modules()
    from aiohttp import web

    from effectmq.dashboard import DashboardConfig
    from effectmq.dashboard.web import create_app

    runners = []

    async def start(url: str, *, actions: bool = False, queues: tuple[str, ...] = (),
                    token: str | None = TOKEN, **options) -> RunningDashboard:
        """options: any other DashboardConfig field (read_token, allowed_hosts, ...)."""
        config = DashboardConfig(url=url, queues=list(queues), actions=actions, token=token if actions else None,
                                 **options)
        app = create_app(config)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return RunningDashboard(f"http://127.0.0.1:{port}", app, config.token)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest_asyncio.fixture
async def browser() -> AsyncIterator:
    """A fresh Chromium context (its own user-data-dir) with a 1280x860 viewport."""
    try:
        from playwright.async_api import async_playwright
    except ModuleNotFoundError:
        missing("playwright is not installed (pip install playwright; the browser is Debian's chromium)")
    if not os.path.exists(CHROMIUM):
        missing(f"{CHROMIUM} not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="effectmq-chromium-") as profile:
        async with async_playwright() as p:
            context = await p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
                viewport={"width": 1280, "height": 860})
            try:
                yield context
            finally:
                with contextlib.suppress(Exception):
                    await context.close()


@pytest.fixture
def screenshot_dir(tmp_path) -> Path:
    """docs/screenshots when EFFECTMQ_UPDATE_SCREENSHOTS=1 (what docs/dashboard.md shows), else tmp_path."""
    if os.environ.get("EFFECTMQ_UPDATE_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        return SCREENSHOTS
    return tmp_path
