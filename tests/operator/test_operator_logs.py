"""What the operator logs about the API requests kopf retries: a retry is routine (an
API server restarting, a new CRD's storage initializing), so it is no ERROR; a request
that runs out of retries still is. Driven through kopf's own request code against a
real HTTP server on loopback."""

from __future__ import annotations

import logging

import kopf
from aiohttp import web
from kopf._cogs.clients import api, auth
from kopf._cogs.structs import credentials

from effectmq_operator.handlers import quiet_kopf_logs

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
