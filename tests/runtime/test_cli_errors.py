"""What `effectmq` says when the input is bad or Redis is not there: one prefix
on stderr (`effectmq: error: ...`), no traceback, and the exit codes docs/cli.md lists:
0 done, 1 failed, 2 bad input (usage), 3 Redis unavailable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

import effectmq
from effectmq.transport.redaction import SCHEMES
from tests.fixtures.redis import free_port
from tests.support.processes import ROOT

PREFIX = "effectmq: error: "


def cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    return subprocess.run([sys.executable, "-m", "effectmq", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**clean, "PYTHONPATH": str(ROOT), **env})


def assert_error(done: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """The exit code, one error line with the prefix, no traceback; returns the line."""
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith(PREFIX)]
    assert len(errors) == 1, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, done.stderr)
    return errors[0]


# -- values that do not parse --------------------------------------------------------

@pytest.mark.parametrize("args, env, fragments", [
    (["stats", "--queue", "q", "--log-level", "verbose"], {},
     ["--log-level", "DEBUG, INFO, WARNING, ERROR, CRITICAL", "'verbose'"]),
    (["stats", "--queue", "q"], {"EFFECTMQ_LOG_LEVEL": "verbose"}, ["EFFECTMQ_LOG_LEVEL must be", "'verbose'"]),
    (["scheduler", "list", "--log-level", "loud"], {}, ["--log-level", "'loud'"]),
    (["worker", "tests.support.handlers:app", "--queue", "q", "--metrics-port", "99999"], {},
     ["--metrics-port", "a port number", "'99999'"]),
    (["worker", "tests.support.handlers:app", "--queue", "q"], {"EFFECTMQ_METRICS_PORT": "-1"},
     ["EFFECTMQ_METRICS_PORT must be a port number"]),
    (["dashboard", "--port", "70000"], {}, ["--port", "a port number", "'70000'"]),
    (["worker", "json:dumps", "--queue", "q"], {}, ["json:dumps", "effectmq.App", "takes arguments"]),
    (["worker", "json:JSONDecoder", "--queue", "q"], {}, ["json:JSONDecoder", "effectmq.App", "JSONDecoder"]),
    (["worker", "json:__name__", "--queue", "q"], {}, ["json:__name__", "effectmq.App", "str"]),
    (["worker", "no-colon", "--queue", "q"], {}, ["must look like 'package.module:app'"]),
    (["worker", "tests.support.nope:app", "--queue", "q"], {}, ["cannot import handler module 'tests.support.nope'"]),
    (["worker", "tests.support.handlers:app"], {"EFFECTMQ_LOOP": "trio"},
     ["EFFECTMQ_LOOP must be one of auto, uvloop, asyncio, got 'trio'"]),
    (["worker", "--queue", "q"], {}, ["worker needs handlers"]),
    (["stats"], {}, ["no queue given"]),
    (["offer", "x", "{not json", "--queue", "q"], {}, ["payload is not valid JSON"]),
    (["stats", "--queue", "has space"], {}, ["invalid queue name"]),
    (["stats", "--queue", "q", "--nope"], {}, ["unrecognized arguments: --nope"]),
])
def test_bad_input_is_a_usage_error_with_one_prefix(args, env, fragments):
    """Was: a traceback (log level, port, a handlers spec that is no App) or exit 1."""
    dead = f"redis://127.0.0.1:{free_port()}/0"  # bad input is refused before Redis is asked
    assert_error(cli(*args, EFFECTMQ_REDIS_URL=dead, **env), 2, *fragments)


def test_the_help_states_the_choices_and_the_default():
    done = cli("worker", "--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0, done.stderr
    assert "--log-level {DEBUG,INFO,WARNING,ERROR,CRITICAL}" in text and "(default: INFO)" in text
    assert "--concurrency" in text and "(default: 10)" in text


# -- Redis URLs ----------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "unix:/tmp/redis.sock", "redis:127.0.0.1",
                                 "redis+sentinel:127.0.0.1:26379/mymaster", "localhost:6379"])
@pytest.mark.parametrize("command", [["stats", "--queue", "q"], ["scheduler", "list"], ["dashboard"]])
def test_one_bad_url_message_names_every_scheme(url, command):
    """Was two messages: ours named 5 of the 7 schemes, redis-py's (for `unix:/x`,
    `redis:host`) 3 and quoted the URL."""
    line = assert_error(cli(*command, "--url", url), 2, "the Redis URL is not")
    for scheme in SCHEMES:
        assert f"{scheme}://" in line, (scheme, line)
    assert url not in line  # a bad URL may hold a password: never echoed


def test_the_operator_names_the_same_url_forms():
    from effectmq.transport.connection import URL_KINDS
    from effectmq_operator.redis_pool import ConfigProblem, Connections
    from effectmq_operator.spec import RedisSpec

    import asyncio

    async def target():
        return await Connections(kube=None).target("shop", RedisSpec(url="http://redis:6379"))

    with pytest.raises(ConfigProblem) as caught:
        asyncio.run(target())
    assert URL_KINDS in caught.value.message


# -- Redis that is not there, refuses, or has no primary ------------------------------

def test_unreachable_redis_exits_3():
    url = f"redis://127.0.0.1:{free_port()}/0"
    for command in (["stats", "--queue", "q"], ["offer", "x", "--queue", "q"], ["scheduler", "list"],
                    ["scheduler", "run"]):
        assert_error(cli(*command, "--url", url), 3, f"Redis unavailable at {url}")


async def test_a_wrong_or_missing_password_is_redis_refused(make_redis):
    """docs/concepts.md says so; it was RedisUnavailable (retry with backoff: it never helps)."""
    server = make_redis(password="the-right-one")
    wrong = server.url.replace("the-right-one", "a-wrong-one")
    missing = f"redis://127.0.0.1:{server.port}/0"
    for url, reply in ((wrong, "invalid username-password pair"), (missing, "Authentication required")):
        async with effectmq.TaskQueue("q", url=url) as q:
            with pytest.raises(effectmq.RedisRefused, match=reply) as caught:
                await q.stats()
        assert caught.value.code == "AUTH" and caught.value.answered
        line = assert_error(cli("stats", "--queue", "q", "--url", url), 1, "Redis refused at", reply)
        assert "a-wrong-one" not in line


def test_a_sentinel_with_no_primary_for_the_service_says_so_briefly(make_sentinel):
    """Was ~1,500 characters of redis-py's reprs of each Sentinel's client and pool."""
    deployment = make_sentinel()
    url = deployment.url().replace("/mymaster/", "/no-such-service/")
    line = assert_error(cli("stats", "--queue", "q", "--url", url), 3, "Redis unavailable at redis+sentinel://",
                        "no Sentinel names a primary for 'no-such-service'")
    assert "<redis." not in line and "ConnectionPool" not in line and len(line) < 400, line
    # A Redis that is no Sentinel at all: its refusal is named, shortly. redis-py 5 passes the
    # error reply on as it is (a refusal: exit 1); later versions collect it with the others.
    url = f"redis+sentinel://127.0.0.1:{deployment.primary.port}/mymaster"
    done = cli("stats", "--queue", "q", "--url", url)
    if int(redis.__version__.split(".")[0]) >= 6:
        line = assert_error(done, 3, "no Sentinel names a primary for 'mymaster'",
                            f"127.0.0.1:{deployment.primary.port}: ResponseError: unknown command")
    else:
        line = assert_error(done, 1, "Redis refused at", "unknown command")
    assert "<redis." not in line and len(line) < 400, line


# -- queues that do not exist --------------------------------------------------------

async def test_a_mistyped_queue_is_an_error_with_the_known_queues(redis_url):
    """Was: zeros and exit 0 for `stats`, "no dead letters" for `dead-letters`."""
    async with effectmq.TaskQueue("emails", url=redis_url) as q:
        await q.offer("send", {}, task_id="t1")
    async with effectmq.TaskQueue("reports", url=redis_url) as q:
        await q.configure(max_active=2)  # configured, never offered to: it exists too
    client = redis.Redis.from_url(redis_url)
    before = sorted(client.keys("*"))
    for command in (["stats"], ["dead-letters"], ["dead-letters", "--retry-all"], ["task", "t1"], ["retry", "t1"],
                    ["cancel", "t1"], ["resume"], ["maintain"]):
        assert_error(cli(*command, "--queue", "emials", "--url", redis_url), 2,
                     "no queue 'emials'", "known queues: emails, reports")
    assert_error(cli("stats", "--queue", "emails", "--prefix", "other", "--url", redis_url), 2,
                 "no queue 'emails'", "no queue found under prefix 'other'")
    assert sorted(client.keys("*")) == before  # a read creates nothing
    assert cli("stats", "--queue", "emails", "--url", redis_url).returncode == 0
    client.close()


async def test_pause_of_an_unknown_queue_creates_nothing_unless_told_to(redis_url):
    """Was: "paused queue no-such-queue", exit 0, and {emq:no-such-queue}:meta created."""
    client = redis.Redis.from_url(redis_url)
    assert_error(cli("pause", "--queue", "no-such-queue", "--url", redis_url), 2, "no queue 'no-such-queue'",
                 "pause --create")
    assert client.keys("*") == []
    done = cli("pause", "--queue", "not-yet", "--create", "--url", redis_url)
    assert done.returncode == 0 and "paused queue not-yet" in done.stdout, done.stderr
    async with effectmq.TaskQueue("not-yet", url=redis_url) as q:
        assert (await q.stats()).paused
    client.close()
