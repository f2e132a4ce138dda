"""Schedule definitions: validation with clear errors, tick ids and payloads."""

import dataclasses
import json

import pytest

from effectmq.scheduler import InvalidSchedule, ScheduleSpec
from effectmq.scheduler.policy import PlannedTick, Span

from .support import T

GOOD = dict(id="reports/nightly", queue="reports", cron="0 2 * * *", task="send_report")


def spec(**changes) -> ScheduleSpec:
    return ScheduleSpec(**{**GOOD, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"cron": "0 25 * * *"}, "invalid hour field '25'"),
    ({"cron": "every day"}, "has 2 fields"),
    ({"timezone": "Europe/Atlantis"}, "timezone 'Europe/Atlantis' is not a known IANA time zone"),
    ({"timezone": ""}, "timezone must be an IANA zone name"),
    ({"payload": [1, 2]}, "payload must be a JSON object or null"),
    ({"payload": {"when": float("nan")}}, "payload .* must be plain JSON"),
    ({"payload": {"data": {1, 2}}}, "payload .* must be plain JSON"),
    ({"payload": {"tick": "mine"}}, r"payload keys \['tick'\] are reserved"),
    ({"queue": "no spaces"}, "queue: invalid queue name"),
    ({"task": ""}, "task name must be a non-empty string"),
    ({"priority": 5000}, "priority must be between"),
    ({"max_retries": -1}, "max_retries must be >= 0"),
    ({"timeout": 0}, "timeout must be >= 0.001"),
    ({"delay": -5}, "delay must be >= 0"),
    ({"missed": "catch-up"}, "missed must be one of skip, coalesce, backfill"),
    ({"max_backfill": 0}, "max_backfill must be an integer from 1 to 1000"),
    ({"starting_deadline": 0}, "starting_deadline must be at least 1 second"),
    ({"missed_after": -1}, "missed_after must be 0-86400 seconds"),
    ({"suspend": "yes"}, "suspend must be true or false"),
])
def test_invalid_definitions_name_what_is_wrong(changes, message):
    with pytest.raises(InvalidSchedule, match=message) as info:
        spec(**changes)
    assert str(info.value).startswith("schedule 'reports/nightly': ")


@pytest.mark.parametrize("bad_id", ["", "/leading-slash", "has space", "x" * 201, None])
def test_invalid_ids(bad_id):
    with pytest.raises(InvalidSchedule, match="schedule id"):
        spec(id=bad_id)


def test_from_json_rejects_unknown_and_missing_fields():
    with pytest.raises(InvalidSchedule, match=r"unknown schedule fields \['crontab'\]"):
        ScheduleSpec.from_json({**GOOD, "crontab": "* * * * *"})
    with pytest.raises(InvalidSchedule, match=r"lacks required fields \['cron'\]"):
        ScheduleSpec.from_json({k: v for k, v in GOOD.items() if k != "cron"})
    with pytest.raises(InvalidSchedule, match="must be a JSON object"):
        ScheduleSpec.from_json(["not", "a", "dict"])


def test_json_round_trip():
    s = spec(payload={"kind": "daily"}, timezone="Europe/Berlin", priority=5, max_retries=2, timeout=30.0,
             delay=10.0, missed="backfill", max_backfill=3, starting_deadline=3600.0, missed_after=5.0, suspend=True)
    assert ScheduleSpec.from_json(json.loads(s.dumps())) == s
    assert dataclasses.replace(s, suspend=False).suspend is False


def test_tick_task_id_and_payload():
    s = spec(payload={"kind": "daily"})
    tick = T("2024-03-31T01:00:00Z")
    assert s.task_id(tick) == "reports/nightly/2024-03-31T01:00:00Z"
    assert s.task_payload(PlannedTick(tick)) == {"kind": "daily", "tick": "2024-03-31T01:00:00Z"}
    coalesced = PlannedTick(tick, Span(T("2024-03-30T01:00:00Z"), tick, 2))
    assert s.task_payload(coalesced) == {
        "kind": "daily", "tick": "2024-03-31T01:00:00Z",
        "span": {"first": "2024-03-30T01:00:00Z", "last": "2024-03-31T01:00:00Z", "count": 2}}
    assert spec().task_payload(PlannedTick(tick)) == {"tick": "2024-03-31T01:00:00Z"}


def test_offer_carries_task_options_and_the_remaining_delay():
    s = spec(priority=7, max_retries=1, max_stalled_count=2, timeout=9.5, delay=60, group="acme")
    tick = T("2024-03-31T01:00:00Z")
    item = s.offer(PlannedTick(tick), (tick + 15) * 1000)
    assert item == {"name": "send_report", "payload": {"tick": "2024-03-31T01:00:00Z"},
                    "task_id": "reports/nightly/2024-03-31T01:00:00Z", "delay": 45.0, "priority": 7,
                    "max_retries": 1, "max_stalled_count": 2, "timeout": 9.5, "group": "acme"}
    assert s.offer(PlannedTick(tick), (tick + 600) * 1000)["delay"] == 0.0  # a late tick is ready at once
