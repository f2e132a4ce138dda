"""Credentials never leave their URL.

A password planted in a Redis URL (userinfo or ``?password=``) must not show up in
logs, error messages, exception text, repr(), metrics or CLI output. The unit
tables pin `effectmq.transport.redaction`; the rest starts a real redis-server with
`requirepass` and real `effectmq` processes, then searches everything they said
for the planted string and its percent-encoded form.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

import effectmq
from effectmq.scheduler import Scheduler
from tests.fixtures.redis import RedisServer, free_port
from tests.support.processes import ROOT, WorkerProcess, stop_process

PLANTED = "pl4nted-S3cret-xyz"  # distinctive: found anywhere means leaked
PASSWORD = PLANTED + "+/@:"  # the server's password; needs percent-encoding in a URL
WRONG = PLANTED + "-wr0ng/@"  # a wrong password of the same family
NEEDLES = (PLANTED, PASSWORD, quote(PASSWORD, safe=""), WRONG, quote(WRONG, safe=""))


def redaction():
    """Imported per test, so each test fails on its own while the module is missing."""
    return importlib.import_module("effectmq.transport.redaction")


def assert_clean(text: str, where: str) -> None:
    for needle in NEEDLES:
        assert needle not in text, f"password leaked in {where}: {text[-3000:]}"


def url_for(port: int, password: str, user: str = "default") -> str:
    return f"redis://{user}:{quote(password, safe='')}@127.0.0.1:{port}/0"


def shown(port: int, user: str = "default") -> str:
    """How such a URL appears in messages."""
    return f"redis://{user}:***@127.0.0.1:{port}/0"


def child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**env, **extra}


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "effectmq", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env or child_env(), timeout=timeout)


@pytest.fixture
def secured(make_redis) -> RedisServer:
    return make_redis(password=PASSWORD)


# -- the helper ---------------------------------------------------------------------

@pytest.mark.parametrize("url, expected", [
    ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
    ("rediss://:s3cret@host/0", "rediss://:***@host/0"),
    ("redis://:p%40ss%2Fw0rd%3A@host:6380/2", "redis://:***@host:6380/2"),
    ("redis://user@host:6379/0", "redis://user@host:6379/0"),
    ("redis://host:6379", "redis://host:6379"),
    ("redis://localhost", "redis://localhost"),
    ("redis://:@host/0", "redis://:@host/0"),
    ("redis://:s3cret@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
    ("redis://host:6379/0?password=s3cret&socket_timeout=5", "redis://host:6379/0?password=***&socket_timeout=5"),
    ("redis://host/0?ssl_password=s3cret", "redis://host/0?ssl_password=***"),
    ("redis://u:s3cret@host/0?password=s3cret2", "redis://u:***@host/0?password=***"),
    ("unix:///var/run/redis.sock?db=1&password=s3cret", "unix:///var/run/redis.sock?db=1&password=***"),
    ("unix://:s3cret@/var/run/redis.sock?db=0", "unix://:***@/var/run/redis.sock?db=0"),
    ("unix:///var/run/redis.sock", "unix:///var/run/redis.sock"),
    ("redis+sentinel://:s3cret@h1:26379,h2:26380,h3/mymaster/0",
     "redis+sentinel://:***@h1:26379,h2:26380,h3/mymaster/0"),
    ("redis+sentinel://u:p%40ss@h1/mymaster?sentinel_password=s%2F3cret&socket_timeout=2",
     "redis+sentinel://u:***@h1/mymaster?sentinel_password=***&socket_timeout=2"),
    ("rediss+sentinel://h1:1,[::1]:2/svc/3?password=s3cret", "rediss+sentinel://h1:1,[::1]:2/svc/3?password=***"),
    ("redis+sentinel://h1:26379/svc", "redis+sentinel://h1:26379/svc"),
])
def test_redact_url_hides_the_password_and_keeps_the_rest(url, expected):
    assert redaction().redact_url(url) == expected


@pytest.mark.parametrize("garbage", [
    "s3cret", "", "   ", "http://user:s3cret@host/", "redis//:s3cret@host", "redis://[::1",
    "redis://:s3/cret@host/0",  # unencoded '/': the "host" would be a fragment of the password
    "redis://:s3cret#x@host/0",  # unencoded '#'
    "redis://:12/s3cret@host/0",  # parses with port 12, the rest of the password in the path
    "redis://:12?s3cret@host",  # ... or in the query
    "redis://host:notaport/0",
    "redis+sentinel://:s3/cret@h1,h2/svc",  # unencoded '/' in a Sentinel URL's password
    "redis+sentinel://:s3cret@h1:1,h2:x/svc",  # a Sentinel port that is not a number
    "redis+sentinel://:s3cret@h1,[::1/svc",
    "redis+sentinel://:s3cret#x@h1/svc",
    "redis+sentinel://:12?s3cret@h1/svc",  # the rest of the password in the query
    None, 12345, b"redis://:s3cret@host",
])
def test_redact_url_never_echoes_what_it_cannot_parse(garbage):
    out = redaction().redact_url(garbage)
    assert out == redaction().INVALID_URL and "s3cret" not in out


@pytest.mark.parametrize("text, secrets, expected", [
    ("auth s3cret failed", ("s3cret",), "auth *** failed"),
    ("s3cret and s3cret again", ("s3cret",), "*** and *** again"),
    ("url redis://:p%40ss%2F@h and p@ss/", ("p@ss/",), "url redis://:***@h and ***"),
    ("a+b or a%20b or a b", ("a b",), "*** or *** or ***"),
    ("abcdef then abc", ("abc", "abcdef"), "*** then ***"),  # the longer secret first: no tail left
    ("nothing to hide", ("", "s3cret"), "nothing to hide"),
    ("nothing to hide", (), "nothing to hide"),
])
def test_scrub(text, secrets, expected):
    assert redaction().scrub(text, *secrets) == expected


@pytest.mark.parametrize("url, expected", [
    ("redis://user:p%40ss@host/0", {"p@ss", "p%40ss"}),
    ("redis://:s3cret@host/0", {"s3cret"}),
    ("redis://host/0?password=q%2Fq&db=1", {"q/q", "q%2Fq"}),
    ("redis://u:one@host/0?password=two", {"one", "two"}),
    ("unix://:pw@/tmp/redis.sock?db=0", {"pw"}),
    ("redis://user@host/0", set()),
    ("redis+sentinel://:one@h1,h2/svc?sentinel_password=t%2Fwo", {"one", "t/wo", "t%2Fwo"}),
    ("redis://host:6379", set()),
    ("", set()),
    ("s3cret", {"s3cret"}),  # not a URL: all of it may be secret
])
def test_url_secrets(url, expected):
    assert set(redaction().url_secrets(url)) == expected


def test_scrub_with_url_secrets_removes_every_form():
    url = url_for(6379, PASSWORD)
    r = redaction()
    text = f"connecting to {url} with {PASSWORD}"
    assert_clean(r.scrub(text, *r.url_secrets(url)), "scrubbed text")
    assert_clean(r.redact_url(url), "redacted URL")


# -- objects in-process ---------------------------------------------------------------

async def test_queue_and_scheduler_repr_and_errors_hide_a_wrong_password(secured):
    url = url_for(secured.port, WRONG)
    q = effectmq.TaskQueue("q", url=url)
    scheduler = Scheduler(url, namespace="leak")
    try:
        for obj in (q, scheduler):
            assert_clean(repr(obj), f"repr({type(obj).__name__})")
            assert_clean(str(obj), f"str({type(obj).__name__})")
            assert_clean(obj.url, f"{type(obj).__name__}.url")
            assert_clean(repr(obj.redis), "repr of the redis client")
            assert_clean(repr(obj.redis.connection_pool), "repr of the connection pool")
        for call in (q.ping, lambda: q.offer("work", {}), scheduler.ping, scheduler.list):
            with pytest.raises(effectmq.RedisRefused) as err:  # a wrong password (docs/concepts.md)
                await call()
            assert shown(secured.port) in str(err.value)
            for text in (str(err.value), repr(err.value), "".join(traceback.format_exception(err.value))):
                assert_clean(text, "RedisRefused")
    finally:
        await q.close()
        await scheduler.close()


@pytest.mark.parametrize("message, chained", [
    (f"boom, AUTH {PASSWORD} refused", False),  # were redis-py ever to quote it
    (f"boom at redis://:{quote(PASSWORD, safe='')}@host/0", False),
    ("Error 111 connecting to 127.0.0.1:1. Connection refused.", True),
])
async def test_redis_errors_are_mapped_in_one_place_and_scrubbed(message, chained):
    import redis.exceptions as redis_errors

    from effectmq.transport.connection import RedisErrors

    q = effectmq.TaskQueue("q", url=url_for(1, PASSWORD))
    try:
        with pytest.raises(effectmq.RedisUnavailable) as err:
            with RedisErrors(q.redis, "at somewhere"):
                raise redis_errors.ConnectionError(message)
        assert str(err.value).startswith("Redis unavailable at somewhere: ")
        assert (err.value.__cause__ is not None) == chained
        assert_clean("".join(traceback.format_exception(err.value)), "mapped error and its traceback")
    finally:
        await q.close()


async def test_a_url_redis_cannot_parse_is_refused_without_echoing_it():
    bad = f"redis://:{PLANTED}/xyz@127.0.0.1:1/0"  # '/' not encoded: redis-py would say the port is the password
    for make in (lambda: effectmq.TaskQueue("q", url=bad), lambda: Scheduler(bad)):
        with pytest.raises(effectmq.InvalidOption) as err:
            make()
        assert "Redis URL" in str(err.value)
        assert_clean("".join(traceback.format_exception(err.value)), "InvalidOption")


@pytest.fixture
def secured_sentinels(make_sentinel):
    """Primary and replica with requirepass PASSWORD, Sentinels with requirepass SENTINEL_PASSWORD."""
    return make_sentinel(password=PASSWORD, sentinel_password=SENTINEL_PASSWORD)


SENTINEL_PASSWORD = PLANTED + "-sentinel&=/@"
SENTINEL_NEEDLES = (SENTINEL_PASSWORD, quote(SENTINEL_PASSWORD, safe=""))


def assert_sentinel_clean(text: str, where: str) -> None:
    assert_clean(text, where)
    for needle in SENTINEL_NEEDLES:
        assert needle not in text, f"Sentinel password leaked in {where}: {text[-3000:]}"


@pytest.mark.parametrize("fault", ["right", "wrong-password", "wrong-sentinel-password"])
async def test_sentinel_url_passwords_never_show(secured_sentinels, fault):
    """Neither the primary's password nor the Sentinels' own shows in reprs, the URL or errors."""
    url = secured_sentinels.url(password=WRONG if fault == "wrong-password" else None,
                                sentinel_password=WRONG if fault == "wrong-sentinel-password" else None)
    hosts = ",".join(f"127.0.0.1:{s.port}" for s in secured_sentinels.sentinels)
    expected = f"redis+sentinel://:***@{hosts}/mymaster/0?sentinel_password=***"
    q = effectmq.TaskQueue("q", url=url)
    scheduler = Scheduler(url, namespace="leak")
    try:
        for obj in (q, scheduler):
            assert obj.url == expected
            for text in (repr(obj), str(obj), repr(obj.redis), repr(obj.redis.connection_pool),
                         repr(obj.redis.connection_pool.sentinel_manager)):
                assert_sentinel_clean(text, f"repr of {type(obj).__name__} and its client")
        calls = (q.ping, lambda: q.offer("work", {}, task_id="x"), q.stats, scheduler.ping, scheduler.list)
        for call in calls:
            if fault == "right":
                await call()
                continue
            with pytest.raises(effectmq.RedisRefused) as err:  # a wrong password, of a Sentinel or the primary
                await call()
            assert expected in str(err.value) and err.value.code == "AUTH"
            for text in (str(err.value), repr(err.value), "".join(traceback.format_exception(err.value))):
                assert_sentinel_clean(text, "RedisRefused")
    finally:
        await q.close()
        await scheduler.close()


def test_cli_errors_name_the_sentinel_url_but_no_password(secured_sentinels):
    url = secured_sentinels.url(sentinel_password=WRONG)
    done = cli("stats", "--queue", "q", "--url", url)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # refused: exit 1 (docs/cli.md)
    assert "Redis refused at redis+sentinel://:***@127.0.0.1:" in done.stderr and "Traceback" not in output, output
    assert_sentinel_clean(output, "`effectmq stats` output")


# -- the worker as a process ------------------------------------------------------------

def test_worker_with_a_wrong_password_exits_naming_the_url_without_the_password(secured):
    done = subprocess.run([sys.executable, "-m", "effectmq", "worker", "tests.support.handlers:app"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=child_env(EFFECTMQ_REDIS_URL=url_for(secured.port, WRONG), EFFECTMQ_QUEUE="leak"))
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"Redis refused at {shown(secured.port)}" in output and "Traceback" not in output, output
    assert_clean(output, "worker output")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


@pytest.fixture(scope="module")
def redis_lost_mid_run(tmp_path_factory):
    """A worker with the right password serves a task, then its Redis is killed.

    Returns (worker log, metrics scraped before and after the kill, redis port)."""
    tmp = tmp_path_factory.mktemp("redaction")
    server = RedisServer(Path(tempfile.mkdtemp(prefix="effectmq-redis-")), password=PASSWORD).start()
    metrics_port = free_port()
    worker = WorkerProcess(server.url, "leak", tmp, name="leak",
                           args=["--metrics-port", str(metrics_port), "--lock-timeout", "1",
                                 "--maintenance-interval", "0.2"])
    try:
        wait_for(lambda: "serving queue" in worker.log() or worker.proc.poll() is not None, 30, "worker start")
        assert worker.proc.poll() is None, worker.log()
        subprocess.run([sys.executable, "-m", "effectmq", "offer", "work", '{"sleep": 0}', "--queue", "leak",
                        "--url", server.url], cwd=ROOT, env=child_env(), check=True, capture_output=True)
        worker.wait_for_effect(lambda lines: any(line[0] == "done" for line in lines))
        wait_for(lambda: "effectmq_maintenance_last_success" in scrape(metrics_port), 15, "a maintenance pass")
        before = scrape(metrics_port)
        server.stop("kill")
        wait_for(lambda: worker.log().count("Redis unavailable") >= 3, 30, "the worker to notice")
        after = scrape(metrics_port)
        code = worker.stop()
        return worker.log(), code, before + after, server.port
    finally:
        stop_process(worker.proc)
        server.stop("kill")


def test_worker_losing_redis_mid_run_logs_where_but_not_the_password(redis_lost_mid_run):
    log, code, _metrics, port = redis_lost_mid_run
    assert code == 0, log[-3000:]
    assert f"serving queue 'leak' at {shown(port, user='')}" in log, log[-3000:]
    assert f"Redis unavailable at {shown(port, user='')}" in log, log[-3000:]
    assert_clean(log, "worker log")


def test_worker_metrics_never_carry_the_password(redis_lost_mid_run):
    _log, _code, metrics, _port = redis_lost_mid_run
    assert "effectmq_outcomes_total{" in metrics and 'task="work"' in metrics  # the served task was counted
    assert_clean(metrics, "metrics endpoint")


# -- CLI commands -----------------------------------------------------------------------

COMMANDS = {
    "stats": ["stats", "--queue", "q"],
    "offer": ["offer", "work", '{"a": 1}', "--queue", "q"],
    "scheduler-list": ["scheduler", "list"],
    "scheduler-run": ["scheduler", "run"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("fault", ["wrong-password", "unreachable"])
def test_cli_errors_name_the_url_but_not_the_password(secured, command, fault):
    port = secured.port if fault == "wrong-password" else free_port()
    password = WRONG if fault == "wrong-password" else PASSWORD
    done = cli(*COMMANDS[command], "--url", url_for(port, password))
    output = done.stdout + done.stderr
    # a wrong password is a refusal (exit 1), no answer is unavailability (exit 3): docs/cli.md
    said, code = ("Redis refused", 1) if fault == "wrong-password" else ("Redis unavailable", 3)
    assert done.returncode == code, output
    assert f"{said} at {shown(port)}" in done.stderr and "Traceback" not in output, output
    assert_clean(output, f"`effectmq {' '.join(COMMANDS[command])}` output")


@pytest.mark.parametrize("command", COMMANDS)
def test_cli_refuses_an_unparsable_url_without_echoing_it(command):
    bad = f"redis://:{PLANTED}/xyz@127.0.0.1:1/0"
    done = cli(*COMMANDS[command], "--url", bad)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Redis URL" in done.stderr and "Traceback" not in output, output
    assert_clean(output, f"`effectmq {command}` output")
