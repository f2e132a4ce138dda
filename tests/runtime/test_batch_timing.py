"""The pure timing of the completion batcher (effectmq.worker.batch_timing): when a batch goes."""

from __future__ import annotations

import pytest

from effectmq.worker.batch_timing import JOIN_WAIT, BatchTiming


def timing(handler_time: float, call_time: float) -> BatchTiming:
    t = BatchTiming()
    t.handler_time, t.call_time = handler_time, call_time
    return t


@pytest.mark.parametrize("handler_time, call_time, window", [
    (0.010, 0.002, 0.00125),  # an eighth of a 10 ms handler
    (0.010, 0.0005, 0.0005),  # at most one round trip
    (0.100, 0.002, 0.002),
    (JOIN_WAIT, 0.0, 0.0),  # no call answered yet: no wave to wait for
])
def test_wave_window(handler_time, call_time, window):
    assert timing(handler_time, call_time).wave_window() == pytest.approx(window)


@pytest.mark.parametrize("started_ago, expected", [
    (0.0095, True),  # due within the window: the batch waits for it
    (0.0080, False),  # due after the window closes: the batch goes
    (0.0105, True),  # a little late (within the window) is still expected
    (0.0200, False),  # far past the usual time: forgotten (failed, released, slow)
])
def test_a_batch_waits_for_attempts_expected_within_the_wave_window(started_ago, expected):
    t = timing(0.010, 0.002)  # window 1.25 ms
    t.started(["a"], 100.0 - started_ago)
    deadline = t.wave_deadline(100.0)
    assert deadline == pytest.approx(100.00125)
    assert t.expects_by(deadline) is expected


def test_nothing_in_flight_or_no_call_yet_sends_at_once():
    assert timing(0.010, 0.002).wave_deadline(1.0) is None  # nothing in flight
    t = timing(0.010, 0.0)
    t.started(["a"], 0.995)
    assert t.wave_deadline(1.0) is None  # no round trip measured yet


def test_a_wave_late_as_a_whole_is_still_expected():
    """The completions about to go took longer than usual: the rest of their wave, as late,
    is waited for (not forgotten as overdue)."""
    t = timing(0.010, 0.002)
    t.started(["a", "b"], 0.0)
    t.completed("a", 0.030)  # three times the usual time
    deadline = t.wave_deadline(0.030)
    assert deadline is not None and t.expects_by(deadline)
    t.batch_went()  # the longest pending time is reset with each batch
    deadline = t.wave_deadline(0.030)
    assert deadline is not None and not t.expects_by(deadline)  # a lone late one now is overdue


@pytest.mark.parametrize("times, handler_time", [
    ([], JOIN_WAIT),  # before any: short enough to wait for
    ([0.012], JOIN_WAIT + (0.012 - JOIN_WAIT) / 8),  # 1/8 of the way to each new time
    ([0.012] * 150, 0.012),  # settles at a steady time
])
def test_the_usual_handler_time_is_a_moving_average(times, handler_time):
    t = BatchTiming()
    for i, took in enumerate(times):
        t.started([f"t{i}"], 10.0 * i)
        t.completed(f"t{i}", 10.0 * i + took)
    assert t.handler_time == pytest.approx(handler_time)


def test_a_completion_of_an_attempt_not_timed_changes_nothing():
    t = BatchTiming()
    t.completed("unknown", 5.0)  # failed elsewhere, or forgotten as overdue
    assert t.handler_time == JOIN_WAIT


@pytest.mark.parametrize("handler_time, call_time, deadline", [
    (0.001, 0.0005, 10.0005),  # short handlers: one round trip at most
    (0.001, 0.005, 10.002),  # twice their time, when shorter
    (JOIN_WAIT, 0.0005, None),  # not short: the batch goes after the turns
    (0.010, 0.0005, None),
])
def test_after_a_reply_short_handlers_are_waited_for(handler_time, call_time, deadline):
    t = timing(handler_time, 0.0)
    t.replied(sent=10.0 - call_time * 8, now=10.0, started=["a"])  # one call moves call_time 1/8 of the way
    assert t.call_time == pytest.approx(call_time)
    t.call_time = call_time
    assert t.join_deadline() == (None if deadline is None else pytest.approx(deadline))


def test_the_attempts_a_reply_started_are_worth_a_turn_until_they_complete():
    t = BatchTiming()
    assert not t.reply_started_unfinished()
    t.started(["a", "b"], 1.0)
    t.replied(sent=0.999, now=1.0, started=["a", "b"])
    t.completed("a", 1.0001)
    assert t.reply_started_unfinished()
    t.completed("b", 1.0002)
    assert not t.reply_started_unfinished()
