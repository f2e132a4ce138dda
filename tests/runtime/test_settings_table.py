"""One table of queue settings (effectmq/protocol/settings.py), and everything that follows from it."""

from __future__ import annotations

import inspect
import math

import pytest

from effectmq import TaskQueue, Worker, errors
from effectmq.protocol import settings
from effectmq.protocol.settings import STORED, Kind
from tooling import sync_settings


def test_the_crds_and_the_reference_page_are_written_from_the_table():
    assert sync_settings.check() == []


def test_taskqueue_defaults_are_the_tables():
    signature = inspect.signature(TaskQueue.__init__).parameters
    for name in ("lock_timeout", "max_retries", "max_stalled_count", "retention_completed", "retention_failed"):
        assert signature[name].default == settings.default(name), name
    assert inspect.signature(Worker.__init__).parameters["concurrency"].default == settings.default("concurrency")


def test_every_stored_setting_has_one_meta_field_and_bounds():
    fields = [s.redis for s in STORED.values()]
    assert len(fields) == len(set(fields))
    for setting in STORED.values():
        if setting.kind in (Kind.COUNT, Kind.SECONDS, Kind.RETENTION):
            assert setting.minimum is not None and setting.maximum is not None, setting.name
            assert setting.minimum <= setting.default <= setting.maximum, setting.name


def test_the_resource_bounds_never_admit_what_python_refuses():
    for setting in settings.TABLE:
        if setting.field is None or setting.name is None or setting.kind not in (Kind.COUNT, Kind.SECONDS):
            continue
        assert setting.resource_minimum >= setting.minimum, setting.field
        assert (setting.field in settings.resource_maxima()) or setting.maximum in (None, 2**31 - 1)


async def test_configure_takes_each_setting_within_its_bounds_and_reads_it_back(make_queue):
    q = make_queue("settings-table")
    bounded = {n: s for n, s in STORED.items() if s.kind in (Kind.COUNT, Kind.SECONDS, Kind.RETENTION)}
    for name, setting in bounded.items():
        for bad in (setting.minimum - 1, setting.maximum * 2, math.inf):
            with pytest.raises(errors.InvalidOption, match=name):
                await q.configure(**{name: bad})
    await q.configure(**{name: s.maximum for name, s in bounded.items()})
    stored = await q.settings()
    for name, setting in bounded.items():
        assert stored[name] == setting.maximum, name
    await q.configure(**{name: s.default for name, s in STORED.items() if s.kind is not Kind.RETRY})
    stored = await q.settings()
    for name, setting in STORED.items():
        if setting.kind is not Kind.RETRY:  # a default of None (rate_limit) is stored as no field
            assert stored.get(name) == setting.default, name
    raw = await q.redis.hgetall(q.keys.key("meta"))
    assert raw["max_stalled_count"] == str(settings.default("max_stalled_count"))
    assert raw["lock_timeout_ms"] == str(int(settings.default("lock_timeout") * 1000))


async def test_a_worker_adopts_stored_settings_clamped_to_the_table(make_queue):
    q = make_queue("settings-clamp")
    await q.redis.hset(q.keys.key("meta"), mapping={"max_stalled_count": str(2**40), "lock_timeout_ms": "1"})
    await q.refresh_settings()
    assert q.config.max_stalled_count == STORED["max_stalled_count"].maximum
    assert q.config.lock_timeout == STORED["lock_timeout"].minimum
