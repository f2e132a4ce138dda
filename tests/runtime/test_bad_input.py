"""Bad input gets a clear error and loses nothing."""

import math
import os
import subprocess
import sys

import pytest

import effectmq
from effectmq.protocol.codec import MAX_DEPTH
from tests.fixtures.redis import free_port
from tests.support.processes import ROOT


@pytest.mark.parametrize("payload, fragment", [
    ({1, 2}, "not JSON serializable"),
    ({"x": math.nan}, "Out of range float"),
    (b"bytes", "not JSON serializable"),
    ({"when": object()}, "not JSON serializable"),
])
async def test_non_json_payloads_are_rejected_at_offer(queue, payload, fragment):
    with pytest.raises(effectmq.InvalidPayload, match=fragment) as err:
        await queue.offer("x", payload)
    assert "payload of 'x' must be plain JSON" in str(err.value)
    assert (await queue.stats()).waiting == 0


def nested(depth: int):
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 990, 100_000])
async def test_payloads_nested_too_deep_are_rejected_at_offer(queue, depth):
    """Deep JSON is refused with a clear error (not a RecursionError), below the depth a
    worker can no longer decode, and nothing is stored."""
    with pytest.raises(effectmq.InvalidPayload) as err:
        await queue.offer("x", {"v": nested(depth)})
    assert str(err.value) == f"payload of 'x' is nested more than {MAX_DEPTH} levels deep"
    with pytest.raises(effectmq.InvalidPayload, match="nested more than"):
        await queue.offer_many([("x", {"v": 1}), ("x", nested(depth))])
    assert (await queue.stats()).waiting == 0


async def test_a_payload_nested_to_the_limit_is_accepted(queue):
    await queue.offer("x", nested(MAX_DEPTH - 1), task_id="deep")
    assert (await queue.stats()).waiting == 1


@pytest.mark.parametrize("options, fragment", [
    ({"delay": -1}, "delay must be >= 0"),
    ({"delay": math.inf}, "delay must be a finite number"),
    ({"priority": 5000}, "priority must be between -1000 and 1000"),
    ({"priority": 1.5}, "priority must be an integer"),
    ({"max_retries": -2}, "max_retries must be >= 0"),
    ({"max_stalled_count": "3"}, "max_stalled_count must be an integer"),
    ({"timeout": 0}, "timeout must be >= 0.001"),
    ({"task_id": ""}, "task_id must be a non-empty string"),
    ({"retry": lambda n: 1}, "custom retry policy"),
])
async def test_invalid_options_are_rejected(queue, options, fragment):
    with pytest.raises(effectmq.InvalidOption, match=fragment):
        await queue.offer("x", None, **options)


async def test_one_bad_item_rejects_the_whole_batch(queue):
    with pytest.raises(effectmq.InvalidPayload):
        await queue.offer_many([("x", 1), ("x", {2, 3}), ("x", 4)])
    with pytest.raises(effectmq.InvalidOption, match="invalid offer options"):
        await queue.offer_many([{"name": "x", "payload": 1, "colour": "red"}])
    assert (await queue.stats()).waiting == 0
    assert len(await queue.offer_many([("x", 1), {"name": "x", "payload": 2, "priority": 3}])) == 2


async def test_invalid_queue_names_and_settings(queue):
    for name in ("", "has space", "{tag}", "x" * 300):
        with pytest.raises(effectmq.InvalidOption, match="invalid queue name"):
            effectmq.TaskQueue(name)
    with pytest.raises(effectmq.InvalidOption, match="unknown queue setting 'max_activ'"):
        await queue.configure(max_activ=3)
    with pytest.raises(effectmq.InvalidOption, match="unknown retry backoff"):
        effectmq.client.retry.from_json({"backoff": "Linear"})
    with pytest.raises(effectmq.InvalidOption, match="lock_timeout"):
        effectmq.TaskQueue("q", lock_timeout=-1)


async def test_unknown_task_name_is_named_in_the_error(queue):
    app = effectmq.App("q")
    app.use_queue(queue)

    @app.task
    def resize(payload):
        return payload

    with pytest.raises(effectmq.UnknownTask, match=r"unknown task 'resise' for queue 'q' \(registered: resize\)"):
        await app.offer("resise", {})
    assert (await queue.stats()).waiting == 0


async def test_unreachable_redis_gives_a_clear_error():
    url = f"redis://127.0.0.1:{free_port()}/0"
    q = effectmq.TaskQueue("q", url=url)
    with pytest.raises(effectmq.RedisUnavailable, match=f"Redis unavailable at {url}"):
        await q.offer("x", {"a": 1})
    with pytest.raises(ConnectionError):  # RedisUnavailable is a ConnectionError too
        await q.stats()
    await q.close()


def cli(*args, env=None, timeout=30):
    return subprocess.run([sys.executable, "-m", "effectmq", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_a_bad_option_in_the_environment_is_a_clear_error_not_a_traceback():
    # how the operator configures worker pods: a typo in a Queue's worker env lands here
    for name, value, kind in [("EFFECTMQ_CONCURRENCY", "ten", "an integer"),
                              ("EFFECTMQ_LOCK_TIMEOUT", "30s", "a number"),
                              ("EFFECTMQ_LOOP_BLOCK_WARNING", "abc", "a number")]:
        res = cli("worker", "tests.support.handlers:app", "--queue", "q", env={**os.environ, name: value})
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{name} must be {kind}, got {value!r}" in res.stderr


def test_worker_cli_reports_bad_handlers():
    url = f"redis://127.0.0.1:{free_port()}/0"
    res = cli("worker", "tests.support.nope:app", "--queue", "q", "--url", url)
    assert res.returncode != 0 and "cannot import handler module 'tests.support.nope'" in res.stderr
    res = cli("worker", "tests.support.handlers:missing", "--queue", "q", "--url", url)
    assert res.returncode != 0 and "has no attribute 'missing'" in res.stderr
    res = cli("worker", "no-colon", "--queue", "q", "--url", url)
    assert res.returncode != 0 and "must look like 'package.module:app'" in res.stderr


def test_offer_cli_rejects_invalid_json(redis_url):
    res = cli("offer", "x", "{not json", "--queue", "q", "--url", redis_url)
    assert res.returncode == 2 and "payload is not valid JSON" in res.stderr


@pytest.mark.parametrize("depth, code", [(MAX_DEPTH + 1, 1), (5000, 2)])  # refused by the queue; unreadable
def test_offer_cli_rejects_json_nested_too_deep(redis_url, depth, code):
    res = cli("offer", "x", "[" * depth + "]" * depth, "--queue", "q", "--url", redis_url)
    assert res.returncode == code and "Traceback" not in res.stderr, res.stderr
    assert "nested more than" in res.stderr or "nested too deep to decode" in res.stderr, res.stderr
    assert "must be plain JSON" not in res.stderr  # one clear reason, not two wrapped
