"""What the operator logs about routine work. The API requests kopf retries: a retry
is routine (an API server restarting, a new CRD's storage initializing), so it is no
ERROR; a request that runs out of retries still is. Driven through kopf's own request
code against a real HTTP server on loopback. The liveness and readiness probes: an
answered probe is DEBUG (before, each wrote two INFO lines), a failed one keeps its
level; through kopf's own health server, and in the operator process itself."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request

import kopf
import pytest
from aiohttp import web
from kopf._cogs.clients import api, auth
from kopf._cogs.structs import credentials
from kopf._core.engines import probing

from effectmq_operator.handlers import quiet_kopf_logs
from tests.fixtures.redis import free_port

RETRY_LATER = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "storage is (re)initializing",
               "reason": "TooManyRequests", "details": {"retryAfterSeconds": 0}, "code": 429}


async def serve(answers: list[int]) -> tuple[web.AppRunner, str]:
    """A server that answers GETs with the given statuses in turn (429s, then 200s)."""
    async def answer(_request: web.Request) -> web.Response:
        status = answers.pop(0) if answers else 200
        return web.json_response(RETRY_LATER if status == 429 else {"kind": "List", "items": []}, status=status)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def get(server: str, backoffs: list[float]) -> None:
    context = auth.APIContext(credentials.ConnectionInfo(server=server))
    try:
        await api.request("get", "/apis/effectmq.io/v1alpha1/queues", settings=kopf.OperatorSettings(),
                          backoffs=backoffs, context=context, logger=logging.getLogger("kopf._cogs.clients.watching"))
    finally:
        await context.session.close()


async def test_a_retried_api_request_is_a_warning_and_one_that_gives_up_an_error(caplog):
    caplog.set_level(logging.DEBUG, logger="kopf")
    quiet_kopf_logs()
    runner, server = await serve([429])
    try:
        await get(server, backoffs=[0.01])  # 429, then 200
    finally:
        await runner.cleanup()
    (retry,) = [r for r in caplog.records if "will retry" in r.getMessage()]
    assert "storage is (re)initializing" in retry.getMessage()
    assert retry.levelno == logging.WARNING and retry.levelname == "WARNING"

    caplog.clear()
    runner, server = await serve([429, 429])
    try:
        try:
            await get(server, backoffs=[0.01])  # 429, 429: no retry left
        except kopf._cogs.clients.errors.APITooManyRequestsError:
            pass
        else:
            raise AssertionError("a request out of retries must raise")
    finally:
        await runner.cleanup()
    (gave_up,) = [r for r in caplog.records if "escalating" in r.getMessage()]
    assert gave_up.levelno == logging.ERROR


async def probed(answer, times: int) -> list[int]:
    """kopf's health server with one probe handler, GET `times` times; the statuses."""
    registry = kopf.OperatorRegistry()
    kopf.on.probe(registry=registry, id="effectmq")(answer)
    port, ready = free_port(), asyncio.Event()
    server = asyncio.create_task(probing.health_reporter(
        f"http://127.0.0.1:{port}/healthz", memo=kopf.Memo(), indices={}, registry=registry,
        settings=kopf.OperatorSettings(), ready_flag=ready))

    def get() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        await asyncio.wait_for(ready.wait(), 10)
        return [await asyncio.to_thread(get) for _ in range(times)]
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


def probe_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name in ("aiohttp.access", "kopf.activities.probe")]


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
async def test_an_answered_probe_is_debug(caplog, level):
    caplog.set_level(level)
    quiet_kopf_logs()
    assert await probed(lambda **_: {"leader": True}, times=3) == [200, 200, 200]
    records = probe_records(caplog)
    assert not [r for r in records if r.levelno > logging.DEBUG], [r.getMessage() for r in records]
    if level == logging.DEBUG:  # still there for --verbose
        messages = [r.getMessage() for r in records]
        assert sum('"GET /healthz' in m for m in messages) == 3, messages
        assert "Activity 'effectmq' succeeded." in messages, messages


async def test_a_failed_probe_keeps_its_level(caplog):
    caplog.set_level(logging.INFO)
    quiet_kopf_logs()

    def dead(**_):
        raise kopf.PermanentError("loops stopped: effectmq-queues")

    assert await probed(dead, times=1) == [500]
    levels = {r.name: r.levelno for r in probe_records(caplog)}
    assert levels.get("kopf.activities.probe") == logging.ERROR, levels
    assert levels.get("aiohttp.access") == logging.INFO, levels


def test_the_operator_process_logs_no_probe_at_info(start_operator):
    op = start_operator()  # its start already waited on /healthz
    for _ in range(3):
        assert op.alive()
    lines = [line for line in op.log_path.read_text().splitlines()
             if "/healthz" in line or "Activity 'effectmq' succeeded" in line]
    assert lines == [], "\n".join(lines[:5])
