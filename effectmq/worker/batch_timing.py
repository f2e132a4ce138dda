"""When a completion batch goes: the pure timing of acks.CompletionBatcher (no I/O).

Times are the worker's monotonic clock, passed in. Two moving averages (each moves 1/8
of the way to a new value) drive it: the usual handler time, from an attempt's start to
its completion, and the usual round trip of a batch that took leases along.

- A wave: the leases of one reply start together and, when their handlers are alike,
  finish within a fraction of a millisecond of each other. A batch about to go waits
  for the attempts expected to finish within WAVE_SHARE of the usual handler time (at
  most one round trip): any that finished just after it would wait for its reply anyway.
- Turns: the attempts a reply started may join the next batch when they finish within
  JOIN_TURNS turns of the loop; while handlers are short (under JOIN_WAIT), the batch
  also waits, at most twice their usual time and one round trip from the reply, for
  every attempt in flight.

An attempt in flight is expected by its start plus the usual time (or that of the
completions about to go, when longer: a wave late as a whole is still one); one far
past it is no longer expected (it failed, was released, or is slow).
"""

from __future__ import annotations

from typing import Iterable

JOIN_TURNS = 3  # a handler with no I/O reaches complete() in two turns of the loop
JOIN_WAIT = 0.004  # seconds: handlers shorter than this are waited for, at most twice their time
WAVE_SHARE = 0.125  # of the usual handler time: how long a batch waits for the rest of a wave
SMOOTHING = 8  # a moving average moves 1/SMOOTHING of the way to each new value


class BatchTiming:
    def __init__(self) -> None:
        self.handler_time = JOIN_WAIT  # the usual time from an attempt's start to its completion
        self.call_time = 0.0  # the usual round trip of a batch that took leases along
        self._pending_time = 0.0  # the longest time to completion among those pending
        # token -> when its attempt started, oldest first (insertion order)
        self._running: dict[str, float] = {}
        self._from_reply: set[str] = set()  # tokens of the attempts the last reply started
        self._replied_at = 0.0

    # -- what happened -------------------------------------------------------------

    def started(self, tokens: Iterable[str], now: float) -> None:
        """Attempts that began now (their handlers' time is measured from here)."""
        self._forget_overdue(now)
        for token in tokens:
            self._running[token] = now

    def completed(self, token: str, now: float) -> None:
        """An attempt's completion waits for the next batch."""
        self._from_reply.discard(token)
        started = self._running.pop(token, None)
        if started is not None:
            took = now - started
            self._pending_time = max(self._pending_time, took)
            self.handler_time += (took - self.handler_time) / SMOOTHING

    def batch_went(self) -> None:
        """The pending completions went in a batch."""
        self._pending_time = 0.0

    def replied(self, sent: float, now: float, started: Iterable[str]) -> None:
        """A batch that took leases along was answered (sent at `sent`); its leases'
        attempts (`started`, already counted by `started`) may join the next batch."""
        self._from_reply = set(started)
        self._replied_at = now
        self.call_time += (now - sent - self.call_time) / SMOOTHING

    # -- what to wait for ----------------------------------------------------------

    def wave_window(self) -> float:
        return min(self.call_time, WAVE_SHARE * self.handler_time)

    def wave_deadline(self, now: float) -> float | None:
        """Until when the batch about to go waits for the rest of a wave; None: it goes now."""
        window = self.wave_window()
        if window <= 0 or not self._running:
            return None
        self._forget_overdue(now)
        return now + window

    def expects_by(self, deadline: float) -> bool:
        """An attempt in flight is expected to finish by `deadline` (the first started first)."""
        return bool(self._running) and self._first_start() + self._expected_time() <= deadline

    def reply_started_unfinished(self) -> bool:
        """Attempts the last reply started have not completed yet (worth a turn of the loop)."""
        return bool(self._from_reply)

    def join_deadline(self) -> float | None:
        """Until when the next batch waits for every attempt in flight, after the turns;
        None while handlers are not short (it goes after the turns)."""
        if self.handler_time >= JOIN_WAIT:
            return None
        # At most one more round trip's time: when Redis is busy, batches grow.
        return self._replied_at + min(2 * self.handler_time, self.call_time)

    # -- in between ----------------------------------------------------------------

    def _expected_time(self) -> float:
        return max(self.handler_time, self._pending_time)

    def _first_start(self) -> float:
        return next(iter(self._running.values()))

    def _forget_overdue(self, now: float) -> None:
        """Attempts far past the usual time are not expected soon (or ended otherwise:
        failed, released, never started)."""
        oldest = now - self.wave_window() - self._expected_time()
        while self._running and self._first_start() < oldest:
            del self._running[next(iter(self._running))]
