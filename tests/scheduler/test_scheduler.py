"""The Scheduler against a real redis-server: materialization, cursors, downtime,
broken schedules, crashes between offer and cursor update."""

import asyncio
import json
import time

import pytest
import redis

import effectmq
from effectmq.scheduler import InvalidSchedule, Scheduler, ScheduleSpec, store

from .support import T, Z, clear_of_boundary, redis_now_ms, rewind


def minutely(schedule_id: str, queue: str, **options) -> ScheduleSpec:
    return ScheduleSpec(id=schedule_id, queue=queue, cron="* * * * *", task="work", **options)


def per_second(schedule_id: str, queue: str, **options) -> ScheduleSpec:
    return ScheduleSpec(id=schedule_id, queue=queue, cron="* * * * * *", task="work", **options)


async def task_ids(q) -> list[str]:
    """Ids of the tasks waiting (or delayed) in a queue, sorted."""
    ids = []
    for state in ("waiting", "delayed"):
        ids += [t.task_id for t in await q.list_tasks(state, limit=5000)]
    return sorted(ids)


async def drain(q) -> list[str]:
    """Acquire and complete everything ready; the ids in acquisition order."""
    done = []
    while (lease := await q.acquire()) is not None:
        done.append(lease.task_id)
        await lease.complete()
    return done


async def test_put_settles_a_new_schedule_and_tick_materializes_it(scheduler, make_queue):
    q = make_queue("basic")
    status = await scheduler.put(per_second("basic/one", "basic", payload={"x": 1}, priority=3))
    assert status.last_tick is None and status.materialized == 0 and status.last_error is None
    assert status.next_tick is not None and status.next_tick > status.cursor
    await asyncio.sleep(1.1)
    report = await scheduler.tick()
    assert report.materialized and all(m.created for m in report.materialized) and not report.errors
    first = report.materialized[0]
    assert first.task_id == f"basic/one/{Z(int(first.tick.timestamp()))}"
    info = await q.get(first.task_id)
    assert info.name == "work" and info.priority == 3
    assert info.payload == {"x": 1, "tick": Z(int(first.tick.timestamp()))}
    status = await scheduler.status("basic/one")
    assert status.last_task_id == report.materialized[-1].task_id
    assert status.materialized == len(report.materialized) and status.next_tick > status.last_tick
    assert report.next_due == status.next_tick


async def test_a_schedule_s_tasks_carry_its_group(scheduler, make_queue):
    q = make_queue("grouped")
    await scheduler.put(per_second("grouped/one", "grouped", group="acme"))
    await scheduler.put(per_second("grouped/none", "grouped"))
    assert (await scheduler.status("grouped/one")).spec.group == "acme"
    assert "group" not in (await scheduler.status("grouped/none")).spec.to_json()  # as stored before groups
    await asyncio.sleep(1.1)
    report = await scheduler.tick()
    groups = {m.schedule_id: (await q.get(m.task_id)).group for m in report.materialized}
    assert groups == {"grouped/one": "acme", "grouped/none": None}
    assert (await q.group_stats("acme")).waiting >= 1
    with pytest.raises(InvalidSchedule, match="MAX_GROUP_BYTES"):
        await scheduler.put(per_second("grouped/bad", "grouped", group="x" * 129))


@pytest.mark.parametrize("mode", ["skip", "coalesce", "backfill"])
async def test_hours_of_downtime_produce_exactly_what_the_policy_promises(scheduler, make_queue, mode):
    q = make_queue(f"down-{mode}")
    sid = f"down/{mode}"
    await scheduler.put(minutely(sid, q.name, missed=mode, max_backfill=5))
    cursor = await rewind(scheduler, sid, 3 * 3600 + 17)  # three hours of downtime
    report = await scheduler.tick()
    now = int(report.now.timestamp() * 1000)
    # Expected, computed independently: every whole minute after the cursor up to now;
    # a tick less than 60 s late is on time, the others were missed.
    due = [m * 60 for m in range(cursor // 60_000 + 1, now // 60_000 + 1)]
    on_time = [t for t in due if now - t * 1000 < 60_000]
    missed = [t for t in due if now - t * 1000 >= 60_000]
    assert len(missed) >= 179
    expected = {"skip": on_time, "coalesce": missed[-1:] + on_time, "backfill": missed[-5:] + on_time}[mode]
    assert await task_ids(q) == sorted(f"{sid}/{Z(t)}" for t in expected)
    assert [m.task_id for m in report.materialized] == [f"{sid}/{Z(t)}" for t in expected]  # oldest first

    status = await scheduler.status(sid)
    assert status.materialized == len(expected) and status.last_tick.timestamp() == due[-1]
    assert status.next_tick.timestamp() == due[-1] + 60
    counts = {"skip": (len(missed), 0, 0), "coalesce": (0, len(missed) - 1, 0),
              "backfill": (len(missed) - 5, 0, 5)}[mode]
    assert (status.skipped, status.coalesced, status.backfilled) == counts
    if mode == "coalesce":
        span = (await q.get(f"{sid}/{Z(missed[-1])}")).payload["span"]
        assert span == {"first": Z(missed[0]), "last": Z(missed[-1]), "count": len(missed)}


async def test_starting_deadline_drops_stale_ticks(scheduler, make_queue):
    q = make_queue("deadline")
    await scheduler.put(minutely("deadline/s", "deadline", missed="backfill", max_backfill=1000,
                                 starting_deadline=600))
    cursor = await rewind(scheduler, "deadline/s", 3 * 3600)
    report = await scheduler.tick()
    now = int(report.now.timestamp() * 1000)
    due = [m * 60 for m in range(cursor // 60_000 + 1, now // 60_000 + 1)]
    fresh = [t for t in due if now - t * 1000 <= 600_000]
    assert 9 <= len(fresh) <= 11
    assert await task_ids(q) == sorted(f"deadline/s/{Z(t)}" for t in fresh)
    status = await scheduler.status("deadline/s")
    assert status.skipped == len(due) - len(fresh) and status.materialized == len(fresh)


async def test_a_hundred_thousand_missed_ticks_do_not_wedge_a_schedule(scheduler, make_queue):
    q = make_queue("backlog")
    await scheduler.put(per_second("backlog/s", "backlog"))
    cursor = await rewind(scheduler, "backlog/s", 100_000)
    started = time.monotonic()
    report = await scheduler.tick()
    assert time.monotonic() - started < 10  # generous; it is milliseconds
    now = int(report.now.timestamp() * 1000)
    due = now // 1000 - cursor // 1000
    on_time = [t for t in range(cursor // 1000 + 1, now // 1000 + 1) if now - t * 1000 < 60_000]
    coalesced_task, *rest = report.materialized
    assert len(rest) == len(on_time) == 60 and report.created == 61
    span = (await q.get(coalesced_task.task_id)).payload["span"]
    assert span["count"] == due - 60 and span["first"] == Z(cursor // 1000 + 1)
    status = await scheduler.status("backlog/s")
    assert status.coalesced == due - 61 and status.skipped == 0
    # the schedule simply continues: the next pass offers the next second, on time
    await asyncio.sleep(1.1)
    later = await scheduler.tick()
    assert later.materialized and all(m.tick.timestamp() > now / 1000 for m in later.materialized)
    assert all(["span" not in (await q.get(m.task_id)).payload for m in later.materialized])


async def test_broken_schedules_report_errors_and_never_stop_the_others(scheduler, redis_url):
    await scheduler.put(per_second("good/a", "mixed"))
    await scheduler.put(per_second("good/b", "mixed", timezone="Europe/Berlin"))
    # Definitions that reach Redis without passing validation (an older or newer
    # writer, a zone missing on this host, hand edits): stored straight into the hash.
    good = per_second("x", "mixed").to_json()
    broken = {
        "bad/json": "{not json",
        "bad/zone": {**good, "id": "bad/zone", "timezone": "Mars/Olympus_Mons"},
        "bad/cron": {**good, "id": "bad/cron", "cron": "* * * * 8"},
        "bad/payload": {**good, "id": "bad/payload", "payload": ["not", "an", "object"]},
        "bad/fields": {"id": "bad/fields", "queue": "mixed"},
    }
    now = await redis_now_ms(scheduler)
    for sid, definition in broken.items():
        raw = definition if isinstance(definition, str) else json.dumps(definition)
        await scheduler.redis.hset(scheduler.store.key(sid), mapping={"spec": raw, "version": 1, "cursor": now})
    broken["bad/cursor"] = None
    await scheduler.redis.hset(scheduler.store.key("bad/cursor"), mapping={
        "spec": json.dumps({**good, "id": "bad/cursor"}), "version": 1, "cursor": "yesterday"})
    # written by hand without version or cursor: usable, it starts from now
    await scheduler.redis.hset(scheduler.store.key("hand/written"), "spec", json.dumps({**good, "id": "hand/written"}))
    for sid in [*broken, "hand/written"]:
        await scheduler.redis.zadd(scheduler.store.due_key, {sid: 0})
        await scheduler.redis.zadd(scheduler.store.index_key, {sid: 0})
    assert (await scheduler.tick()).errors.keys() == broken.keys()
    await asyncio.sleep(1.1)
    for sid in broken:  # due again now, so this pass shows each error next to the good schedules
        await scheduler.redis.zadd(scheduler.store.due_key, {sid: 0})

    report = await scheduler.tick()
    assert {m.schedule_id for m in report.materialized} == {"good/a", "good/b", "hand/written"}
    assert set(report.errors) == set(broken)
    assert "stored cursor is not a number" in report.errors["bad/cursor"]
    assert "not valid JSON" in report.errors["bad/json"]
    assert "timezone 'Mars/Olympus_Mons' is not a known IANA time zone" in report.errors["bad/zone"]
    assert "invalid day-of-week field '8'" in report.errors["bad/cron"]
    assert "payload must be a JSON object" in report.errors["bad/payload"]
    assert "lacks required fields" in report.errors["bad/fields"]
    for sid in broken:
        status = await scheduler.status(sid)
        assert status.last_error == report.errors[sid] and status.last_error_at is not None and not status.healthy
    listed = {s.id: s for s in await scheduler.list()}
    assert set(listed) == set(broken) | {"good/a", "good/b", "hand/written"} and listed["good/a"].healthy

    # broken schedules are retried after a back-off, not on every pass
    await asyncio.sleep(1.1)
    report = await scheduler.tick()
    assert {m.schedule_id for m in report.materialized} == {"good/a", "good/b", "hand/written"}
    assert not report.errors
    # a fixed definition runs again and its error clears
    await scheduler.put(per_second("bad/zone", "mixed", timezone="Asia/Tokyo"))
    await asyncio.sleep(1.1)
    report = await scheduler.tick()
    assert "bad/zone" in {m.schedule_id for m in report.materialized}
    assert (await scheduler.status("bad/zone")).last_error is None


async def test_invalid_definitions_are_refused_by_put(scheduler):
    with pytest.raises(InvalidSchedule, match="invalid minute field"):
        await scheduler.put({"id": "x", "queue": "q", "cron": "99 * * * *", "task": "t"})
    with pytest.raises(InvalidSchedule, match="not a known IANA time zone"):
        await scheduler.put({"id": "x", "queue": "q", "cron": "* * * * *", "task": "t", "timezone": "Nowhere"})
    assert await scheduler.list() == []


async def test_crash_between_offer_and_cursor_update_offers_the_same_tick_again(make_queue, redis_url):
    q = make_queue("crash")

    async def crash(queue, offered):
        raise RuntimeError("killed right after the offer")

    async with Scheduler(redis_url, namespace="crash", after_offer=crash) as doomed, \
            Scheduler(redis_url, namespace="crash") as survivor:
        await survivor.put(per_second("crash/s", "crash"))
        await asyncio.sleep(1.1)
        with pytest.raises(RuntimeError):
            await doomed.tick()
        offered = await task_ids(q)
        assert offered
        status = await survivor.status("crash/s")
        assert status.last_tick is None and status.materialized == 0  # the cursor did not move
        report = await survivor.tick()
        again = {m.task_id: m.created for m in report.materialized}
        assert all(again[tid] is False for tid in offered)  # the same ids, not created twice
        assert (await survivor.status("crash/s")).last_tick is not None
    ran = await drain(q)
    assert sorted(ran) == sorted(again) and len(set(ran)) == len(ran)


async def test_reoffer_after_the_task_finished_and_was_removed_does_not_run_it_again(scheduler, make_queue):
    q = make_queue("gone")
    await q.configure(retention_completed=0)  # records vanish at completion; the ids stay reserved
    await scheduler.put(per_second("gone/s", "gone"))
    await asyncio.sleep(1.1)
    first = await scheduler.tick()
    ids = [m.task_id for m in first.materialized]
    assert await drain(q) == ids
    assert all([await q.get(tid) is None for tid in ids])
    await rewind(scheduler, "gone/s", 4)  # a slow scheduler with an old view of the cursor
    again = await scheduler.tick()
    repeated = [m for m in again.materialized if m.task_id in ids]
    assert repeated and not any(m.created for m in repeated)
    assert not set(await drain(q)) & set(ids)


async def test_concurrent_schedulers_offer_each_tick_once(redis_url, make_queue):
    q = make_queue("race")
    schedulers = [Scheduler(redis_url, namespace="race") for _ in range(4)]
    try:
        # put settles a schedule at once: under load a second boundary passes during the
        # 20 puts, and the put of a later one offers its first tick itself
        by_put = sum([(await schedulers[0].put(per_second(f"race/{i}", "race"))).materialized for i in range(20)])
        await asyncio.sleep(1.2)
        reports = await asyncio.gather(*(s.tick() for s in schedulers))
        created = [m.task_id for r in reports for m in r.materialized if m.created]
        offered = {m.task_id for r in reports for m in r.materialized}
        assert len(created) == len(set(created)) == len(offered) >= 20
        ids = await task_ids(q)
        assert set(created) <= set(ids) and len(ids) == len(created) + by_put
        statuses = await schedulers[1].list()
        assert sum(s.materialized for s in statuses) == len(ids)  # each decision counted once
    finally:
        for s in schedulers:
            await s.close()


async def test_suspended_schedules_do_not_fire_and_resume_through_the_policy(scheduler, make_queue):
    q = make_queue("susp")
    await scheduler.put(minutely("susp/s", "susp", suspend=True))
    await rewind(scheduler, "susp/s", 600)  # ten minutes pass while suspended (and it looks due)
    assert (await scheduler.tick()).materialized == []
    assert await scheduler.redis.zscore(scheduler.store.due_key, "susp/s") is None  # off the due set
    status = await scheduler.status("susp/s")
    assert status.suspended and status.next_tick is None
    status = await scheduler.put(minutely("susp/s", "susp"))  # resume: the missed ticks coalesce
    assert not status.suspended and status.materialized >= 1 and status.coalesced >= 8
    ids = await task_ids(q)
    assert 1 <= len(ids) <= 2 and "span" in (await q.get(ids[0])).payload


async def test_a_new_timing_restarts_the_cursor_but_other_edits_keep_it(scheduler, make_queue):
    q = make_queue("edit")
    await scheduler.put(minutely("edit/s", "edit"))
    await rewind(scheduler, "edit/s", 3600)
    await scheduler.put(minutely("edit/s", "edit", payload={"v": 2}))  # same timing: the backlog stays due
    assert len(await task_ids(q)) >= 1
    before = await task_ids(q)
    await rewind(scheduler, "edit/s", 3600)
    status = await scheduler.put(ScheduleSpec(id="edit/s", queue="edit", cron="*/2 * * * *", task="work"))
    assert await task_ids(q) == before and status.next_tick.timestamp() % 120 == 0


async def test_catch_up_never_reaches_past_the_queue_dedup_window(scheduler, make_queue):
    q = make_queue("short-dedup")
    await q.configure(dedup_window=600)  # finished ids are remembered for 10 minutes only
    await scheduler.put(minutely("dd/s", "short-dedup", missed="backfill", max_backfill=1000))
    await rewind(scheduler, "dd/s", 3 * 3600)
    report = await scheduler.tick()
    now = report.now.timestamp()
    ages = [now - m.tick.timestamp() for m in report.materialized]
    assert ages and max(ages) <= 540  # the window less two plan ages: a re-offer stays deduplicated
    assert (await scheduler.status("dd/s")).skipped >= 170


async def test_passes_read_only_due_schedules(scheduler, make_queue):
    for i in range(300):
        await scheduler.store.put(ScheduleSpec(id=f"yearly/{i}", queue="idle", cron="0 0 1 1 *", task="work"))
    first = await scheduler.tick()  # settles each new schedule once: next fire next January
    assert first.examined == 300 and first.materialized == []
    for _ in range(3):
        assert (await scheduler.tick()).examined == 0


async def test_status_list_and_remove(scheduler):
    for i in range(5):
        await scheduler.put(minutely(f"list/{i}", "q"))
    page = await scheduler.list(limit=2)
    assert [s.id for s in page] == ["list/0", "list/1"]
    assert [s.id for s in await scheduler.list(after="list/1", limit=10)] == ["list/2", "list/3", "list/4"]
    assert await scheduler.status("nope") is None
    assert await scheduler.remove("list/3") is True and await scheduler.remove("list/3") is False
    assert await scheduler.status("list/3") is None
    assert [s.id for s in await scheduler.list()] == ["list/0", "list/1", "list/2", "list/4"]
    assert (await scheduler.tick()).errors == {}
    as_json = (await scheduler.status("list/0")).to_json()
    assert as_json["spec"]["cron"] == "* * * * *" and as_json["next_tick"].endswith("Z")


async def test_scripts_refuse_a_schedule_hash_not_declared_in_keys(scheduler):
    put = scheduler.redis.register_script(store.source("put"))
    spec = minutely("keys/undeclared", "q")
    undeclared = r"schedule hash \{emq-sched:test\}:s:keys/undeclared is not declared in KEYS"
    with pytest.raises(redis.ResponseError, match=undeclared):
        await put(keys=scheduler.store.keys, args=[spec.id, spec.dumps(), spec.timing, 0])
    assert await scheduler.status("keys/undeclared") is None


async def test_an_estimate_of_redis_time_that_falls_short_delays_a_due_schedule_by_one_pass(scheduler, make_queue):
    q = make_queue("short")
    await clear_of_boundary(scheduler, 60, 10)  # no minute may start before the first tick
    await scheduler.put(minutely("short/s", "short"))
    assert (await scheduler.tick()).examined == 0  # nothing due; the store has seen Redis time
    await rewind(scheduler, "short/s", 120)
    await scheduler.redis.zadd(scheduler.store.due_key, {"short/s": await redis_now_ms(scheduler) - 1000})
    # As after a clock step: the local estimate of Redis time is an hour behind, so the
    # candidates read stop before the due schedule.
    scheduler.store._redis_clock_offset_ms -= 3_600_000
    first = await scheduler.tick()
    assert first.examined == 0 and first.more  # reported as next: run() passes again at once
    second = await scheduler.tick()
    assert second.examined == 1 and second.materialized and len(await task_ids(q)) == len(second.materialized)


async def test_every_state_change_is_numbered_in_the_change_feed(scheduler, make_queue):
    make_queue("feed")
    await clear_of_boundary(scheduler, 60, 10)  # a minute starting meanwhile makes ticks due (it did)
    for name in ("a", "b", "c"):
        await scheduler.store.put(minutely(f"feed/{name}", "feed"))
    start = await scheduler.store.last_change()
    assert [i for i, _ in await scheduler.store.changes()] == ["feed/a", "feed/b", "feed/c"]
    assert await scheduler.store.changes(after=start) == []
    await rewind(scheduler, "feed/b", 120)
    await scheduler.tick()  # settles a and c (their first next tick) and materializes b
    changed = await scheduler.store.changes(after=start)
    assert sorted(i for i, _ in changed) == ["feed/a", "feed/b", "feed/c"]
    numbers = [n for _, n in changed]
    assert numbers == sorted(numbers) and numbers[0] > start and len(set(numbers)) == 3
    after_tick = await scheduler.store.last_change()
    assert await scheduler.tick() and await scheduler.store.changes(after=after_tick) == []  # nothing due
    await scheduler.remove("feed/a")
    assert [i for i, _ in await scheduler.store.changes()] == ["feed/b", "feed/c"]  # one entry per schedule
    page = await scheduler.store.changes(after=start, limit=1)
    assert page + await scheduler.store.changes(after=page[-1][1]) == await scheduler.store.changes(after=start)


async def test_a_full_redis_delays_ticks_and_loses_none(scheduler, make_queue, redis_url):
    """Redis at maxmemory (noeviction): a pass offers nothing and raises RedisUnavailable
    (it cannot record the failure either) without moving the cursor; once Redis has room
    the next pass offers exactly the ticks due, each once."""
    q = make_queue("full-sched")
    sid = "full/s"
    await scheduler.put(minutely(sid, q.name, missed="backfill", max_backfill=10))
    await clear_of_boundary(scheduler, 60, 15)
    cursor = await rewind(scheduler, sid, 3 * 60)
    admin = redis.Redis.from_url(redis_url)
    admin.config_set("maxmemory", "1")
    try:
        with pytest.raises(effectmq.RedisUnavailable, match="OOM"):  # `run()` backs off and passes again
            await scheduler.tick()
        assert await task_ids(q) == []
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
    report = await scheduler.tick()
    now = int(report.now.timestamp() * 1000)
    expected = [f"{sid}/{Z(m * 60)}" for m in range(cursor // 60_000 + 1, now // 60_000 + 1)]
    assert len(expected) == 3 and not report.errors, report
    assert [m.task_id for m in report.materialized] == expected
    assert await task_ids(q) == expected
    assert (await scheduler.tick()).materialized == []  # each tick once


def _span_ticks(task) -> set[int]:
    """The tick instants (s) a materialized task stands for: its own, or its span's."""
    span = task.payload.get("span")
    if span is None:
        return {T(task.payload["tick"])}
    return set(range(T(span["first"]), T(span["last"]) + 1))  # per-second schedules only


@pytest.mark.parametrize("mode", ["skip", "coalesce"])
async def test_ticks_that_fell_due_while_suspended_follow_the_policy_whatever_their_age(scheduler, make_queue,
                                                                                        mode):
    """Was: a resume fired every tick of the last 60 s, even with
    `skip` (a 75 s suspension of a */3 s Schedule created 20 tasks at resume): ticks less
    than `missed_after` late counted as on time, right after a restart, wrong after a
    deliberate suspension."""
    q = make_queue(f"susp-{mode}")
    sid = f"susp-age/{mode}"
    await scheduler.put(per_second(sid, q.name, missed=mode))
    await asyncio.sleep(1.1)
    await scheduler.tick()
    suspended = await scheduler.put(per_second(sid, q.name, missed=mode, suspend=True))
    after_suspend = await redis_now_ms(scheduler) // 1000
    before = {t.task_id for t in await q.list_tasks("waiting", limit=5000)}
    await asyncio.sleep(3.2)  # three or four ticks fall due while suspended, all younger than 60 s
    before_resume = await redis_now_ms(scheduler) // 1000
    status = await scheduler.put(per_second(sid, q.name, missed=mode))
    created = [await q.get(tid) for tid in await task_ids(q) if tid not in before]
    suspended_ticks = set(range(after_suspend + 1, before_resume + 1))  # certainly after the suspension
    assert len(suspended_ticks) >= 3
    if mode == "skip":
        assert not [t.task_id for t in created if _span_ticks(t) & suspended_ticks]
        assert status.skipped >= len(suspended_ticks)
    else:
        coalescing = [t for t in created if "span" in t.payload]
        assert len(coalescing) == 1, [t.payload for t in created]
        span = coalescing[0].payload["span"]
        covered = _span_ticks(coalescing[0])
        assert suspended_ticks <= covered and span["count"] == len(covered)
        assert min(covered) > int(suspended.cursor.timestamp())  # nothing settled before is counted again
        assert status.coalesced == span["count"] - 1
        # the other tasks: on-time ticks after the resume (or, under load, just before the suspension)
        assert not [t.payload for t in created if t is not coalescing[0] and _span_ticks(t) & suspended_ticks]


@pytest.mark.parametrize("mode", ["skip", "coalesce", "backfill"])
async def test_a_pass_killed_between_offer_and_advance_is_redone_with_the_same_counts(make_queue, redis_url, mode):
    """Was: after a leader stopped between its offers and its cursor
    update, the next leader decided afresh at a later time, so a coalesced span (or
    Skip's `skipped`) counted ticks the first pass had already run as tasks (`span.count`
    45 with 44 missing): a handler trusting span.count did one tick twice."""
    q = make_queue(f"redo-{mode}")
    sid = f"redo/{mode}"

    async def killed(outcomes):
        raise asyncio.CancelledError("leader stopped before its cursor update")

    async with Scheduler(redis_url, namespace="redo") as doomed, Scheduler(redis_url, namespace="redo") as survivor:
        spec = per_second(sid, q.name, missed=mode, max_backfill=2, missed_after=2)
        await survivor.put(spec)
        start = await rewind(survivor, sid, 10)  # 10 s down: some ticks missed, the last two on time
        doomed.store.advance = killed  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await doomed.tick()
        first = set(await task_ids(q))
        assert first and (await survivor.status(sid)).cursor.timestamp() * 1000 == start  # the cursor did not move
        await asyncio.sleep(3.5)  # the first pass's on-time ticks are now more than missed_after late
        redo = await survivor.tick()  # the killed pass, redone: the same ticks, none created again
        assert {m.task_id: m.created for m in redo.materialized} == dict.fromkeys(first, False)
        for _ in range(2):
            await survivor.tick()
        status = await survivor.status(sid)

    tasks = [await q.get(tid) for tid in await task_ids(q)]
    assert first <= {t.task_id for t in tasks}
    covered = [_span_ticks(t) for t in tasks]
    every = set(range(start // 1000 + 1, int(status.cursor.timestamp()) + 1))  # the ticks settled since `start`
    assert sum(len(c) for c in covered) == len(set().union(*covered)), \
        f"a tick counted twice: {[t.payload for t in tasks]}"
    assert set().union(*covered) <= every
    ran = set().union(*covered)
    # each settled tick is counted once: its own task, a span, or skipped
    assert status.materialized == len(tasks)
    assert status.skipped == len(every - ran)
    assert status.materialized + status.coalesced + status.skipped == len(every)


async def test_put_records_the_suspension_a_resume_ends(scheduler):
    """The bookkeeping behind the suspension policy: a suspension is (suspended_at, resumed_at];
    one that begins before the last one's ticks were settled extends it; a schedule
    suspended before suspensions were recorded is missed from its cursor."""
    store, sid = scheduler.store, "susp-book/s"

    async def window() -> tuple[int, int] | None:
        return (await store.rows([sid])).rows[0].suspended

    version, cursor, created = await store.put(per_second(sid, "q", suspend=True))
    since = int(await scheduler.redis.hget(store.key(sid), "suspended_at"))
    assert since == created and await window() is None  # not resumed yet: no window
    await asyncio.sleep(0.01)  # resumed after the cursor (its creation): the window holds unsettled time
    _, _, resumed = await store.put(per_second(sid, "q"))
    assert await window() == (since, resumed)
    await store.put(per_second(sid, "q", payload={"edit": 1}))  # an edit that is no resume
    assert await window() == (since, resumed)
    await store.put(per_second(sid, "q", suspend=True))  # again before a pass settled the first one
    _, _, again = await store.put(per_second(sid, "q"))
    assert await window() == (since, again)

    await asyncio.sleep(1.1)
    assert (await scheduler.put(per_second(sid, "q"))).cursor.timestamp() * 1000 > again  # a pass settled it
    await store.put(per_second(sid, "q", suspend=True))
    later = int(await scheduler.redis.hget(store.key(sid), "suspended_at"))
    assert later > again

    await scheduler.redis.hdel(store.key(sid), "suspended_at", "resumed_at")  # as stored before this change
    cursor = int(await scheduler.redis.hget(store.key(sid), "cursor"))
    _, _, resumed = await store.put(per_second(sid, "q"))
    assert await window() == (cursor, resumed)


async def test_a_recorded_decision_too_old_to_redo_safely_is_made_afresh(scheduler, make_queue):
    """A pass redone long after it was decided would re-offer ticks the queue's dedup window
    may have forgotten (a finished task would run again): then it is decided afresh, and
    every tick offered is still within what the window protects."""
    q = make_queue("redo-old")
    await q.configure(dedup_window=600)  # a re-offer is safe up to 540 s after its tick
    await scheduler.put(per_second("redo/old", q.name, missed="backfill", max_backfill=1000))
    cursor = await rewind(scheduler, "redo/old", 600)
    version = await scheduler.redis.hget(scheduler.store.key("redo/old"), "version")
    decided = cursor + 550_000  # a pass 50 s ago decided from this cursor (ticks up to 540 s old), then stopped
    await scheduler.redis.hset(scheduler.store.key("redo/old"), "decided_at", f"{decided}:{version}:{cursor}")
    report = await scheduler.tick()
    now = report.now.timestamp()
    ages = [now - m.tick.timestamp() for m in report.materialized]
    assert ages and max(ages) <= 540
    assert max(m.tick.timestamp() for m in report.materialized) * 1000 > decided  # decided at now, not then
