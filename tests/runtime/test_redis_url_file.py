"""EFFECTMQ_REDIS_URL_FILE: the Redis URL (with its password) read from a file, as the
operator mounts it from a Secret, instead of an environment variable that crash dumps,
/proc/<pid>/environ and child processes show. Against real redis-servers and real
`effectmq` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import effectmq
from effectmq.transport.connection import DEFAULT_URL, connect
from tests.dashboard.test_cli import Dashboard, get
from tests.runtime.test_bad_input import cli
from tests.support.processes import ROOT

PASSWORD = "f1le-Only-s3cret"
DEAD_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def url_file(tmp_path, content: str, name: str = "url"):
    path = tmp_path / name
    path.write_text(content)
    path.chmod(0o600)
    return path


def clean_env(**extra: str) -> dict[str, str]:
    """This process' environment without any EFFECTMQ_ variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTMQ_")}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra})
    return env


@pytest.fixture
def no_url_env(monkeypatch):
    monkeypatch.delenv("EFFECTMQ_REDIS_URL", raising=False)
    monkeypatch.delenv("EFFECTMQ_REDIS_URL_FILE", raising=False)
    return monkeypatch


async def test_the_url_file_reaches_a_redis_with_a_password(make_redis, tmp_path, no_url_env):
    server = make_redis(password=PASSWORD)
    no_url_env.setenv("EFFECTMQ_REDIS_URL_FILE", str(url_file(tmp_path, server.url + "\n")))  # as kubectl writes it
    async with effectmq.TaskQueue("from-file") as q:
        assert PASSWORD not in q.url and f"127.0.0.1:{server.port}" in q.url
        await q.offer("t", {"n": 1}, task_id="one")
    async with effectmq.TaskQueue("from-file", url=server.url) as q:
        assert (await q.stats()).waiting == 1


def test_which_url_wins(tmp_path, no_url_env):
    in_file = url_file(tmp_path, "redis://file-host:6379/0\n")
    assert connect()[2] == DEFAULT_URL
    no_url_env.setenv("EFFECTMQ_REDIS_URL_FILE", str(in_file))
    assert connect()[2] == "redis://file-host:6379/0"
    assert connect(url="redis://given:6379/0")[2] == "redis://given:6379/0"  # an explicit URL wins
    no_url_env.delenv("EFFECTMQ_REDIS_URL_FILE")
    no_url_env.setenv("EFFECTMQ_REDIS_URL", "redis://env-host:6379/0")
    assert connect()[2] == "redis://env-host:6379/0"
    # both: which one was meant is not for us to guess
    no_url_env.setenv("EFFECTMQ_REDIS_URL_FILE", str(in_file))
    with pytest.raises(effectmq.InvalidOption) as both:
        connect()
    assert "EFFECTMQ_REDIS_URL and EFFECTMQ_REDIS_URL_FILE are both set" in str(both.value)
    assert connect(url="redis://given:6379/0")[2] == "redis://given:6379/0"  # unless the caller says which


def test_an_unusable_url_file_is_a_clear_error_that_never_shows_its_content(tmp_path, no_url_env):
    (tmp_path / "a-directory").mkdir()
    cases = {
        "missing": (tmp_path / "missing", "cannot be read"),
        "directory": (tmp_path / "a-directory", "cannot be read"),
        "empty": (url_file(tmp_path, "", "empty"), "is empty"),
        "only a newline": (url_file(tmp_path, "\n", "newline"), "is empty"),
        "a bare password": (url_file(tmp_path, PASSWORD + "\n", "bare"), "does not hold a"),
        "two lines": (url_file(tmp_path, f"redis://:{PASSWORD}@h:6379/0\nredis://other\n", "two"),
                      "does not hold a"),
        "not UTF-8": (tmp_path / "binary", "cannot be read"),
    }
    (tmp_path / "binary").write_bytes(b"redis://:\xff\xfe" + PASSWORD.encode())
    for case, (path, why) in cases.items():
        no_url_env.setenv("EFFECTMQ_REDIS_URL_FILE", str(path))
        with pytest.raises(effectmq.InvalidOption) as caught:
            connect()
        message = str(caught.value)
        assert f"EFFECTMQ_REDIS_URL_FILE ({path})" in message and why in message, (case, message)
        assert PASSWORD not in message, case


async def test_every_command_reads_the_url_file(make_redis, tmp_path):
    server = make_redis(password=PASSWORD)
    env = clean_env(EFFECTMQ_REDIS_URL_FILE=str(url_file(tmp_path, server.url + "\n")))
    res = cli("offer", "send", '{"to": "a@b.c"}', "--queue", "files", "--task-id", "t1", env=env)
    assert res.returncode == 0 and "offered: t1" in res.stdout, res.stderr
    assert json.loads(cli("stats", "--queue", "files", "--json", env=env).stdout)["waiting"] == 1
    res = cli("scheduler", "add", "files/nightly", "--queue", "files", "--cron", "0 2 * * *", "--task", "send",
              env=env)
    assert res.returncode == 0, res.stderr
    listed = cli("scheduler", "list", "--json", env=env)
    assert [s["id"] for s in json.loads(listed.stdout)] == ["files/nightly"], listed.stderr
    assert "EFFECTMQ_REDIS_URL_FILE" in cli("stats", "--help").stdout  # --url's help names both variables
    for output in (res.stdout + res.stderr, listed.stdout + listed.stderr):
        assert PASSWORD not in output

    dash = Dashboard(tmp_path, EFFECTMQ_REDIS_URL_FILE=env["EFFECTMQ_REDIS_URL_FILE"])
    try:
        assert get(dash.base + "/readyz") == (200, "ok"), dash.log()
        status, page = get(dash.base + "/")
        assert status == 200 and 'data-queue="files"' in page and PASSWORD not in page
        assert f"Redis redis://:***@127.0.0.1:{server.port}/0" in dash.log()
    finally:
        dash.proc.terminate()
        dash.proc.wait(20)


async def test_the_worker_takes_the_url_file_over_the_apps_own_url(make_redis, tmp_path):
    """As EFFECTMQ_REDIS_URL does: under the operator the mounted file names the Redis,
    whatever the App was built with."""
    server = make_redis(password=PASSWORD)
    (tmp_path / "filed_app.py").write_text(
        "import effectmq\n"
        f"app = effectmq.App('filed', url={DEAD_URL!r})\n"
        "@app.task\n"
        "async def double(payload):\n"
        "    return payload * 2\n")
    env = clean_env(EFFECTMQ_REDIS_URL_FILE=str(url_file(tmp_path, server.url + "\n")),
                    PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    log = tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "effectmq", "worker", "filed_app:app"], env=env, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    try:
        async with effectmq.TaskQueue("filed", url=server.url) as q:
            await q.offer("double", 21, task_id="d1")
            try:
                assert await q.wait("d1", timeout=20) == 42
            except TimeoutError:
                raise AssertionError(log.read_text()) from None
    finally:
        proc.terminate()
        proc.wait(20)
    assert PASSWORD not in log.read_text()


def test_the_commands_say_what_is_wrong_with_the_url_variables(tmp_path):
    bare = url_file(tmp_path, PASSWORD + "\n")
    res = cli("stats", "--queue", "q", env=clean_env(EFFECTMQ_REDIS_URL_FILE=str(bare)))
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert f"EFFECTMQ_REDIS_URL_FILE ({bare}) does not hold a" in res.stderr and PASSWORD not in res.stderr
    both = clean_env(EFFECTMQ_REDIS_URL=DEAD_URL, EFFECTMQ_REDIS_URL_FILE=str(bare))
    for command in (["stats", "--queue", "q"], ["scheduler", "list"], ["worker", "tests.support.handlers:app"],
                    ["dashboard"]):
        res = cli(*command, env=both)
        assert res.returncode != 0 and "Traceback" not in res.stderr, (command, res.stderr)
        assert "EFFECTMQ_REDIS_URL and EFFECTMQ_REDIS_URL_FILE are both set" in res.stderr, (command, res.stderr)
    # an explicit --url is all a command needs: the environment is not read at all
    res = cli("stats", "--queue", "q", "--url", DEAD_URL, "--json", env=both, timeout=60)
    assert "both set" not in res.stderr and "127.0.0.1:1" in res.stderr, res.stderr
