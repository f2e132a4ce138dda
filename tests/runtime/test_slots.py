"""The worker's slot ledger (effectmq.worker.slots): pure, no Redis.

free = concurrency + ahead - attempts - asking, at most `concurrency` handlers run, the
rest of the attempts are held (oldest first) or settling, and every slot a call asked
for comes back when the call does.
"""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from effectmq.worker.slots import SlotLedger


def ledger(concurrency: int, ahead: int = 0) -> SlotLedger[str]:
    return SlotLedger(concurrency, lambda: ahead)


@pytest.mark.parametrize("concurrency, ahead, attempts, asking, free", [
    (10, 0, 0, 0, 10),  # idle: every slot
    (10, 10, 0, 0, 20),  # idle with prefetch: the places to hold leases ahead too
    (10, 0, 4, 0, 6),  # four attempts in flight
    (10, 0, 4, 6, 0),  # and a call out asking for the rest
    (2, 0, 4, 0, -2),  # a batch's reply refilled the slots its attempts still hold
])
def test_free(concurrency, ahead, attempts, asking, free):
    slots = ledger(concurrency, ahead)
    for i in range(attempts):
        slots.admit(f"token-{i}", f"task-{i}", f"attempt-{i}")
    slots.reserve(asking)
    assert slots.free() == free
    slots.check()


def test_a_call_reserves_the_free_slots_until_it_answers():
    freed = []
    slots: SlotLedger[str] = SlotLedger(3, lambda: 0, lambda: freed.append(True))
    assert slots.ask() == 3 and slots.asking == 3
    assert slots.ask() == 0  # a second call finds nothing free
    assert slots.free() == 0
    slots.answered(0)
    assert not freed  # answering for nothing frees nothing
    slots.answered(3)
    assert freed and slots.asking == 0 and slots.free() == 3
    slots.check()


def test_handlers_run_up_to_concurrency_the_rest_are_held_oldest_first():
    slots = ledger(2, ahead=2)
    assert [slots.admit(t, t, f"a-{t}") for t in ("t1", "t2", "t3", "t4")] == [True, True, False, False]
    assert (slots.running, slots.held_count, slots.in_flight, slots.free()) == (2, 2, 4, 0)
    assert slots.next_held() is None  # no handler slot free
    assert slots.returned("t1") and not slots.returned("t1")  # said once
    assert not slots.returned("t3")  # held: never ran
    assert slots.next_held() == "a-t3" and slots.is_running("t3")  # the oldest held runs in t1's slot
    assert slots.next_held() is None
    assert slots.in_flight == 4  # t1 settles: its slot is taken until it leaves
    slots.leave("t1", "t1")
    assert (slots.running, slots.held_count, slots.in_flight, slots.free()) == (2, 1, 3, 1)
    slots.leave("t4", "t4")  # a held one handed back
    assert (slots.held_count, slots.held()) == (0, [])
    slots.check()


def test_the_newest_attempt_of_a_task_is_the_one_that_counts():
    slots = ledger(4)
    slots.admit("old", "task", "first")
    slots.admit("new", "task", "second")
    assert slots.newest("task") == "second"
    slots.leave("old", "task")  # the older one leaving does not forget the newer
    assert slots.newest("task") == "second"
    slots.leave("new", "task")
    assert slots.newest("task") is None and slots.in_flight == 0
    slots.leave("new", "task")  # twice: nothing more
    slots.check()


def test_the_check_catches_a_ledger_out_of_balance():
    slots = ledger(1)
    slots.answered(1)  # answered for a reservation nobody made
    with pytest.raises(AssertionError, match="more slots answered than asked for"):
        slots.check()


class LedgerMachine(RuleBasedStateMachine):
    """Random operations against a reference model; the invariant after every step."""

    def __init__(self):
        super().__init__()
        self.concurrency = 3
        self.ahead = 0
        self.slots: SlotLedger[str] = SlotLedger(self.concurrency, lambda: self.ahead)
        self.states: dict[str, str] = {}  # token -> running | held | settling, in admission order
        self.task_of: dict[str, str] = {}
        self.newest: dict[str, str] = {}
        self.calls: list[int] = []  # slots each call out reserved
        self.tokens = 0

    @rule(ahead=st.integers(0, 4))
    def prefetch_changes(self, ahead):
        self.ahead = ahead

    @rule()
    def ask(self):
        expected = max(0, self.concurrency + self.ahead - len(self.states) - sum(self.calls))
        assert self.slots.ask() == expected
        self.calls.append(expected)

    @precondition(lambda self: self.calls)
    @rule(i=st.integers(0, 100), more=st.integers(0, 3))
    def reserve_more(self, i, more):
        self.slots.reserve(more)
        self.calls[i % len(self.calls)] += more

    @precondition(lambda self: self.calls)
    @rule(i=st.integers(0, 100))
    def answer(self, i):
        self.slots.answered(self.calls.pop(i % len(self.calls)))

    @rule(task=st.sampled_from(["a", "b", "c", "d"]))
    def admit(self, task):
        self.tokens += 1
        token = f"t{self.tokens}"
        runs = list(self.states.values()).count("running") < self.concurrency
        assert self.slots.admit(token, task, f"attempt-{token}") == runs
        self.states[token] = "running" if runs else "held"
        self.task_of[token] = task
        self.newest[task] = token

    @precondition(lambda self: self.states)
    @rule(i=st.integers(0, 100))
    def handler_returns(self, i):
        token = list(self.states)[i % len(self.states)]
        was_running = self.states[token] == "running"
        assert self.slots.returned(token) == was_running
        if was_running:
            self.states[token] = "settling"

    @rule()
    def next_held(self):
        held = [t for t, state in self.states.items() if state == "held"]
        free_handler = list(self.states.values()).count("running") < self.concurrency
        got = self.slots.next_held()
        if held and free_handler:
            assert got == f"attempt-{held[0]}"
            self.states[held[0]] = "running"
        else:
            assert got is None

    @precondition(lambda self: self.states)
    @rule(i=st.integers(0, 100))
    def leave(self, i):
        token = list(self.states)[i % len(self.states)]
        task = self.task_of[token]
        self.slots.leave(token, task)
        del self.states[token]
        if self.newest.get(task) == token:
            del self.newest[task]

    @invariant()
    def matches_the_model(self):
        self.slots.check()
        states = list(self.states.values())
        assert self.slots.asking == sum(self.calls)
        assert self.slots.free() == self.concurrency + self.ahead - len(states) - sum(self.calls)
        assert (self.slots.running, self.slots.held_count, self.slots.in_flight) == \
            (states.count("running"), states.count("held"), len(states))
        assert self.slots.held() == [f"attempt-{t}" for t, state in self.states.items() if state == "held"]
        for task in "abcd":
            assert self.slots.newest(task) == (f"attempt-{self.newest[task]}" if task in self.newest else None)

    def teardown(self):
        """Once every call is back and every attempt gone, every slot is free again."""
        while self.calls:
            self.slots.answered(self.calls.pop())
        for token in list(self.states):
            self.slots.leave(token, self.task_of.pop(token))
        self.slots.check()
        assert (self.slots.asking, self.slots.in_flight, self.slots.running) == (0, 0, 0)
        assert self.slots.free() == self.concurrency + self.ahead


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_ledger_against_a_model = LedgerMachine.TestCase
