"""The worker's default event loop: asyncio's own, with timers that fall due on time."""

import asyncio
import select
import socket
import statistics
import threading
import time

import pytest

from effectmq.eventloop.loops import PreciseEpollSelector, loop_factory, precise_event_loop

SLEEP = 0.0023  # epoll would wait 3 ms: 0.7 ms late every time


def lateness_of_sleeps(new_loop, count: int = 40) -> float:
    """The median lateness, in seconds, of `count` sleeps of SLEEP on a loop from `new_loop`."""
    async def sleeps():
        late = []
        for _ in range(count):
            start = time.perf_counter()
            await asyncio.sleep(SLEEP)
            late.append(time.perf_counter() - start - SLEEP)
        return late
    with asyncio.Runner(loop_factory=new_loop) as runner:
        late = runner.run(sleeps())
    assert min(late) >= -1e-4, "a timer never falls due early"
    return statistics.median(late)


def test_timers_fall_due_within_a_fraction_of_a_millisecond():
    assert loop_factory("asyncio") is precise_event_loop
    assert lateness_of_sleeps(precise_event_loop) < 0.0003


def test_the_precise_loop_still_wakes_for_io_threads_and_signals():
    async def main():
        loop = asyncio.get_running_loop()
        assert isinstance(loop._selector, PreciseEpollSelector)
        a, b = socket.socketpair()
        readable = asyncio.Event()
        loop.add_reader(a, readable.set)
        threading.Timer(0.05, b.send, (b"x",)).start()
        start = time.perf_counter()
        await asyncio.wait_for(readable.wait(), 5)  # the wait is long; the byte ends it
        io_after = time.perf_counter() - start
        loop.remove_reader(a)
        woken = asyncio.Event()
        threading.Timer(0.05, loop.call_soon_threadsafe, (woken.set,)).start()
        await asyncio.wait_for(woken.wait(), 5)
        a.close(), b.close()
        return io_after
    with asyncio.Runner(loop_factory=precise_event_loop) as runner:
        assert 0.04 < runner.run(main()) < 1.0


def test_a_descriptor_select_cannot_take_falls_back_to_epolls_own_wait(monkeypatch):
    def out_of_range(*_args):
        raise ValueError("filedescriptor out of range in select()")
    monkeypatch.setattr(select, "select", out_of_range)
    sel = PreciseEpollSelector()
    a, b = socket.socketpair()
    try:
        sel.register(a, 1)  # EVENT_READ
        assert sel.select(0.01) == []
        b.send(b"x")
        assert [key.fileobj for key, _ in sel.select(1.0)] == [a]
    finally:
        sel.close(), a.close(), b.close()


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
def test_auto_without_uvloop_and_asyncio_choose_the_precise_loop(choice, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_uvloop(name, *args, **kwargs):
        if name == "uvloop":
            raise ImportError("hidden")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert loop_factory(choice) is precise_event_loop
