"""The stored settings a queue acts on are one frozen value: `refresh_settings()` swaps it
whole, so a reader sees all of one refresh or all of the one before, never a mix."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest

from effectmq import Exponential, Fixed
from effectmq.protocol.settings import STORED, QueueSettings

A = {"lock_timeout": 5.0, "max_retries": 7, "max_stalled_count": 2, "retention_completed": 60.0,
     "retention_failed": 120.0, "retry": Fixed(3.0)}
B = {"lock_timeout": 9.0, "max_retries": 1, "max_stalled_count": 4, "retention_completed": 30.0,
     "retention_failed": 90.0, "retry": Exponential(2.0, 20.0)}


def seen(settings: QueueSettings) -> dict:
    """The adopted settings (rate_limit is the TaskQueue's own: acquire.lua reads the stored one)."""
    return {field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)
            if field.name != "rate_limit"}


async def test_a_refresh_replaces_every_setting_at_once(make_queue):
    q, admin = make_queue("settings-swap"), make_queue("settings-swap")
    held = q.config
    before = seen(held)
    await admin.configure(**A)
    await q.refresh_settings()
    assert seen(q.config) == A
    assert q.config is not held and seen(held) == before  # a reader holding the old value still sees all of it


async def test_a_reader_in_another_thread_never_sees_half_of_a_refresh(make_queue):
    q, admin = make_queue("settings-race"), make_queue("settings-race")
    await admin.configure(**A)
    await q.refresh_settings()
    mixed: list[dict] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            now = seen(q.config)
            if now != A and now != B:
                mixed.append(now)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: a refresh that wrote field by field was caught mid-way
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for turn in range(500):
            await admin.configure(**(B if turn % 2 == 0 else A))
            await q.refresh_settings()
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert mixed == []


def test_the_settings_cannot_be_changed_in_place(make_queue):
    q = make_queue("settings-frozen", max_retries=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.config.max_retries = 9  # type: ignore[misc]
    assert q.config.max_retries == 5


def test_every_field_is_a_stored_setting_of_the_table():
    assert {f.name for f in dataclasses.fields(QueueSettings)} <= set(STORED)
