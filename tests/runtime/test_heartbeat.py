"""The pure decisions of the heartbeat (effectmq.worker.heartbeat): when to renew, when to stop."""

from __future__ import annotations

import pytest

from effectmq.worker import heartbeat
from effectmq.worker.heartbeat import Action


@pytest.mark.parametrize("lock_timeout, margin", [
    (0.2, 0.05),  # at least 50 ms
    (30.0, 3.0),  # a tenth of the lease
    (600.0, 5.0),  # at most 5 s
])
def test_safety_margin(lock_timeout, margin):
    assert heartbeat.safety_margin(lock_timeout) == pytest.approx(margin)


@pytest.mark.parametrize("lock_timeout, lock_refresh, interval", [
    (30.0, None, 10.0),  # a third of the lease
    (30.0, 5.0, 5.0),  # as asked
    (30.0, 29.0, 24.0),  # never later than two margins before the end
    (0.03, None, 0.01),  # at least 10 ms
])
def test_refresh_interval(lock_timeout, lock_refresh, interval):
    assert heartbeat.refresh_interval(lock_timeout, lock_refresh) == pytest.approx(interval)


@pytest.mark.parametrize("refresh, tick", [(10.0, 1.0), (2.0, 0.5), (0.01, 0.01)])
def test_tick(refresh, tick):
    assert heartbeat.tick(refresh) == pytest.approx(tick)


@pytest.mark.parametrize("now, action", [
    (5.0, Action.KEEP),
    (10.0, Action.RENEW),  # renewal due
    (27.0, Action.INTERRUPT),  # the margin before the confirmed end reached
])
def test_decide(now, action):
    assert heartbeat.decide(now, next_renew=10.0, confirmed_until=30.0, margin=3.0) is action


@pytest.mark.parametrize("now, spent", [(26.9, False), (27.0, True), (31.0, True)])
def test_a_lease_is_spent_a_safety_margin_before_its_confirmed_end(now, spent):
    assert heartbeat.spent(now, confirmed_until=30.0, lock_timeout=30.0) is spent
    # the same line where decide interrupts
    assert (heartbeat.decide(now, 100.0, 30.0, heartbeat.safety_margin(30.0)) is Action.INTERRUPT) is spent
