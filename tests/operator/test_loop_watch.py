"""The operator's event-loop watchdog: a blocked loop runs no reconcile and renews no
Lease, so the operator says where it is stuck, with its own words and histogram."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import REGISTRY

from effectmq_operator.handlers import loop_watch

LAG = "effectmq_operator_event_loop_lag_seconds"


def list_all_queues_the_slow_way():
    time.sleep(1.2)  # a sync call on the loop, as a mistaken kube call would be


async def test_a_blocked_operator_loop_is_logged_with_where_it_is_stuck(caplog):
    caplog.set_level(logging.WARNING, logger="effectmq.operator")
    def lags_over_a_second() -> float:
        total = REGISTRY.get_sample_value(f"{LAG}_count") or 0
        return total - (REGISTRY.get_sample_value(f"{LAG}_bucket", {"le": "1.0"}) or 0)

    late_before = lags_over_a_second()
    watch = loop_watch(warn_after=0.5)
    watch.start(asyncio.get_running_loop())
    try:
        await asyncio.sleep(0.3)
        list_all_queues_the_slow_way()
        await asyncio.sleep(0.3)
    finally:
        watch.stop()
    late = lags_over_a_second()
    (warning,) = [r for r in caplog.records if r.getMessage().startswith("event loop blocked")]
    assert warning.name == "effectmq.operator"
    text = warning.getMessage()
    assert "no reconcile, tick pass or Lease renewal runs until it returns" in text
    assert "in list_all_queues_the_slow_way" in text and "time.sleep(1.2)" in text
    assert "handler" not in text and "leases of this process" not in text  # the worker's words are not the operator's
    assert late - late_before == 1  # the one tick that came 1.2 s late
