"""Offered payloads are capped (there was no limit at all: a 1 MB payload per task,
read back by every list page). A payload's JSON is capped, by default at
DEFAULT_MAX_PAYLOAD_BYTES (1 MiB), per TaskQueue with max_payload_bytes (None: no cap);
an offer over it is refused before anything is sent, naming the limit."""

from __future__ import annotations

import pytest

from effectmq import TaskQueue
from effectmq.errors import InvalidOption
from effectmq.client.queue import DEFAULT_MAX_PAYLOAD_BYTES, offer_argv

MIB = 1 << 20


def payload_of(size: int) -> str:
    """A string whose JSON ("...") is exactly `size` bytes."""
    return "x" * (size - 2)


def test_the_default_cap_is_one_mib():
    assert DEFAULT_MAX_PAYLOAD_BYTES == MIB
    offer_argv("job", payload_of(MIB))
    with pytest.raises(InvalidOption, match=r"payload of 'job' is 1,048,577 bytes of JSON; at most 1 MiB "
                                            r"\(max_payload_bytes\)"):
        offer_argv("job", payload_of(MIB + 1))


def test_bytes_are_counted_in_utf8():
    offer_argv("job", "é" * 499, max_payload_bytes=1000)  # 998 bytes + 2 quotes
    with pytest.raises(InvalidOption, match="1,002 bytes of JSON; at most 1,000 bytes"):
        offer_argv("job", "é" * 500, max_payload_bytes=1000)


async def test_offers_over_the_cap_are_refused_and_nothing_is_stored(redis_url):
    async with TaskQueue("capped", url=redis_url) as q:
        with pytest.raises(InvalidOption, match="max_payload_bytes"):
            await q.offer("job", {"blob": "x" * MIB}, task_id="big")
        with pytest.raises(InvalidOption, match="max_payload_bytes"):
            await q.offer_many([("job", {"n": 1}, {"task_id": "small"}), ("job", payload_of(MIB + 1))])
        assert (await q.stats()).waiting == 0  # a batch is validated whole before anything is sent
        assert (await q.offer("job", payload_of(MIB), task_id="at-the-cap")).created
    async with TaskQueue("small-cap", url=redis_url, max_payload_bytes=100) as small:
        await small.offer("job", payload_of(100))
        with pytest.raises(InvalidOption, match="at most 100 bytes"):
            await small.offer("job", payload_of(101))
        with pytest.raises(InvalidOption, match="at most 100 bytes"):
            await small.offer_many([("job", payload_of(101))])
    async with TaskQueue("uncapped", url=redis_url, max_payload_bytes=None) as uncapped:
        assert (await uncapped.offer("job", payload_of(2 * MIB))).created


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1", True, 2**40])
def test_the_cap_is_checked(bad):
    with pytest.raises(InvalidOption, match="max_payload_bytes"):
        TaskQueue("q", url="redis://127.0.0.1:1/0", max_payload_bytes=bad)
