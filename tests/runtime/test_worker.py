"""The Worker in-process: handlers, failures, timeouts, wake-up, heartbeats, drain."""

import asyncio
import logging
import time

import pytest
import redis.asyncio

import effectmq
from effectmq.worker import heartbeat, prefetch
from tests.support.inprocess import make_worker, running, settled, until_drained


async def test_async_and_sync_handlers_with_context(queue):
    seen = {}

    async def add(payload, ctx):
        await ctx.progress(50)
        seen["ctx"] = (ctx.task_id, ctx.attempt, ctx.queue)
        return payload["a"] + payload["b"]

    def shout(payload):
        return payload.upper()

    async with running(make_worker(queue, {"add": add, "shout": shout})):
        await queue.offer("add", {"a": 1, "b": 2}, task_id="add1")
        await queue.offer("shout", "hi", task_id="shout1")
        assert await queue.wait("add1", timeout=5) == 3
        assert await queue.wait("shout1", timeout=5) == "HI"
    assert seen["ctx"] == ("add1", 1, "q")
    assert (await queue.get("add1")).progress == 50


async def test_declared_errors_retry_then_dead_letter(make_queue):
    q = make_queue("typed", retry=effectmq.Fixed(0.01))

    class MailboxFull(Exception):
        pass

    app = effectmq.App("typed")
    app.use_queue(q)
    calls = []

    @app.task(errors=(MailboxFull,), max_retries=2)
    async def send(payload):
        calls.append(payload)
        raise MailboxFull("try later")

    async with running(make_worker(q, app)):
        offered = await app.offer("send", {"to": "x"})
        info = await settled(q, offered.task_id)
    assert info.state == "failed" and info.error.tag == "MailboxFull"
    assert info.handler_failure_count == 3 and len(calls) == 3 and info.stalled_attempt_count == 0


async def test_undeclared_exception_is_a_defect(queue):
    async def broken(payload):
        raise KeyError("missing")

    async with running(make_worker(queue, {"broken": broken})):
        await queue.offer("broken", None, task_id="d", max_retries=0)
        info = await settled(queue, "d")
    assert info.error.tag == effectmq.DEFECT and "KeyError" in info.error.message


async def test_handler_timeout(queue):
    async def slow(payload):
        await asyncio.sleep(10)

    async with running(make_worker(queue, {"slow": slow})):
        await queue.offer("slow", None, task_id="t", timeout=0.1, max_retries=0)
        info = await settled(queue, "t")
    assert info.state == "failed" and info.error.tag == effectmq.TIMEOUT


async def test_unknown_task_and_corrupt_payload_never_run(queue):
    ran = []

    async def known(payload):
        ran.append(payload)

    await queue.offer("nobody-handles-this", {"x": 1}, task_id="u", max_retries=0)
    await queue.offer("known", {"x": 1}, task_id="c")
    await queue.redis.hset(queue.keys.task("c"), "payload", "{not json")
    async with running(make_worker(queue, {"known": known})):
        unknown = await settled(queue, "u")
        corrupt = await settled(queue, "c")
    assert unknown.state == "failed" and "no handler for task 'nobody-handles-this'" in unknown.error.message
    assert corrupt.state == "failed" and corrupt.error.tag == effectmq.DEFECT
    assert "not valid JSON" in corrupt.error.message and corrupt.corrupt
    assert ran == [] and corrupt.handler_failure_count == 1  # not retried: bad data stays bad


async def test_a_stored_payload_too_deep_to_decode_fails_the_task_and_the_worker_goes_on(queue):
    """Another producer may store JSON nested deeper than Python decodes: the task fails
    at once as corrupt (not stuck active until its lease runs out), and others run."""
    ran = []

    async def known(payload):
        ran.append(payload)

    await queue.offer("known", {"x": 1}, task_id="deep")
    await queue.offer("known", {"x": 2}, task_id="fine")
    await queue.redis.hset(queue.keys.task("deep"), "payload", '{"x":' + "[" * 5000 + "]" * 5000 + "}")
    async with running(make_worker(queue, {"known": known})):
        deep = await settled(queue, "deep")
        await settled(queue, "fine")
    assert deep.state == "failed" and deep.error.tag == effectmq.DEFECT and deep.corrupt
    assert "nested too deep to decode" in deep.error.message
    assert ran == [{"x": 2}]


async def test_schema_is_checked_at_offer_and_before_running(queue):
    app = effectmq.App("q")
    app.use_queue(queue)

    @app.task(schema={"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}})
    async def email(payload):
        return payload["to"]

    with pytest.raises(effectmq.InvalidPayload, match="'to' is a required property"):
        await app.offer("email", {"subject": "hi"})
    with pytest.raises(effectmq.UnknownTask, match="unknown task 'emali'"):
        await app.offer("emali", {"to": "a"})
    await queue.offer("email", {"to": 5}, task_id="raw")  # bypasses the app: caught by the worker
    async with running(make_worker(queue, app)):
        info = await settled(queue, "raw")
    assert info.state == "failed" and "does not match its schema" in info.error.message


async def test_idle_worker_starts_new_task_without_polling_floor(queue):
    started = asyncio.Event()
    stamps = {}

    async def mark(payload):
        stamps["start"] = time.monotonic()
        started.set()

    async with running(make_worker(queue, {"mark": mark}, idle_poll=30)):
        await asyncio.sleep(0.3)  # the worker is now blocked waiting for a signal
        sent = time.monotonic()
        await queue.offer("mark", None)
        await asyncio.wait_for(started.wait(), 5)
    assert stamps["start"] - sent < 0.5  # generous bound: the idle poll is 30 s


async def long(payload):
    """Outlives a 0.4 s lease several times over: it needs its renewals."""
    await asyncio.sleep(1.5)
    return "done"


async def test_heartbeat_keeps_a_long_task_owned(make_queue):
    q = make_queue("long", lock_timeout=0.4)
    async with running(make_worker(q, {"long": long})):
        await q.offer("long", None, task_id="l")
        info = await settled(q, "l")
    assert info.state == "completed" and info.stalled_attempt_count == 0 and info.attempt == 1


async def test_a_shorter_lease_than_the_workers_own_gets_its_renewals_in_time(make_queue):
    # The heartbeat sleeps a quarter of the renewal interval of the leases in flight (up
    # to 1 s) and wakes early only for a lease that needs a faster tick: here the queue's
    # lock timeout drops to 0.4 s while the worker idles with its own 30 s.
    q = make_queue("shorter", lock_timeout=30)
    async with running(make_worker(q, {"long": long})):
        await asyncio.sleep(0.3)  # the heartbeat is asleep for its 1 s tick
        await q.configure(lock_timeout=0.4)
        await q.offer("long", None, task_id="s")
        info = await settled(q, "s")
    assert info.state == "completed" and info.stalled_attempt_count == 0 and info.attempt == 1


async def test_canceled_task_interrupts_its_handler(queue):
    entered, interrupted = asyncio.Event(), asyncio.Event()

    async def wait_forever(payload):
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            interrupted.set()
            raise

    async with running(make_worker(queue, {"w": wait_forever}, lock_refresh=0.05)):
        await queue.offer("w", None, task_id="c")
        await asyncio.wait_for(entered.wait(), 5)
        await queue.cancel("c")
        await asyncio.wait_for(interrupted.wait(), 5)
    assert (await queue.get("c")).state == "canceled"


async def test_heartbeat_loss_interrupts_the_handler(tcp_proxy, make_queue):
    """Connection cut for longer than the safety window: the handler is stopped
    before its lease can run out, and the task is recovered later (one stall)."""
    through_proxy = make_queue("cut", url=tcp_proxy.url, lock_timeout=1.0)
    direct = make_queue("cut", lock_timeout=1.0)
    entered, interrupted = asyncio.Event(), asyncio.Event()
    stamps = {}

    async def hold(payload):
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stamps["interrupted"] = time.monotonic()
            (attempt,) = worker.slots.attempts()
            stamps["confirmed_until"] = attempt.lease.confirmed_until  # the last renewal's word
            interrupted.set()
            raise

    worker = make_worker(through_proxy, {"hold": hold}, maintenance_interval=60)
    async with running(worker):
        await direct.offer("hold", None, task_id="h")
        await asyncio.wait_for(entered.wait(), 5)
        cut_at = time.monotonic()
        tcp_proxy.cut()
        await asyncio.wait_for(interrupted.wait(), 5)
        assert stamps["interrupted"] - cut_at < 1.0  # before the lease (1 s) could expire
        # when the safety window closes, not a heartbeat tick later (83 ms of a 100 ms margin:
        # a loaded CI machine once saw the interrupt 9 ms after the lease could have run out).
        # A tick late measured 85-90 ms; 50 ms leaves a loaded loop room and still tells.
        window_closed = stamps["confirmed_until"] - heartbeat.safety_margin(1.0)
        assert stamps["interrupted"] - window_closed < 0.05, stamps["interrupted"] - window_closed
        tcp_proxy.restore()
    await asyncio.sleep(1.0)
    report = await direct.maintain()
    assert report.recovered == 1
    info = await direct.get("h")
    assert info.state == "waiting" and info.stalled_attempt_count == 1 and info.handler_failure_count == 0


async def test_drain_finishes_short_work_and_releases_the_rest(queue):
    async def quick(payload):
        await asyncio.sleep(0.1)
        return "ok"

    async def stuck(payload):
        await asyncio.sleep(60)

    worker = make_worker(queue, {"quick": quick, "stuck": stuck}, drain_timeout=0.5)
    task = asyncio.create_task(worker.run())
    await queue.offer("quick", None, task_id="quick")
    await queue.offer("stuck", None, task_id="stuck")
    while worker.in_flight < 2:
        await asyncio.sleep(0.01)
    worker.stop()
    await asyncio.wait_for(task, 10)
    quick_info, stuck_info = await queue.get("quick"), await queue.get("stuck")
    assert quick_info.state == "completed"
    assert stuck_info.state == "waiting"  # released, not stalled, not failed
    assert (stuck_info.stalled_attempt_count, stuck_info.handler_failure_count) == (0, 0)


async def test_worker_rejects_invalid_options(queue):
    with pytest.raises(effectmq.InvalidOption, match="concurrency"):
        effectmq.Worker(queue, {"x": print}, concurrency=0)
    with pytest.raises(effectmq.InvalidOption, match="lock_refresh"):
        effectmq.Worker(queue, {"x": print}, lock_refresh=5, lock_timeout=1)
    with pytest.raises(effectmq.InvalidOption, match="at least one handler"):
        effectmq.Worker(queue, {})


async def test_worker_announces_its_load_and_leaves(queue):
    entered = asyncio.Event()

    async def hold(payload):
        entered.set()
        await asyncio.sleep(3)  # longer than one announcement interval

    worker = make_worker(queue, {"hold": hold}, concurrency=3, name="pod-a")
    async with running(worker):
        await queue.offer("hold", None)
        await asyncio.wait_for(entered.wait(), 5)
        for _ in range(100):
            if (await queue.workers()).get("pod-a") == (1, 3):
                break
            await asyncio.sleep(0.05)
        assert (await queue.workers())["pod-a"] == (1, 3)
    assert "pod-a" not in await queue.workers()


async def test_non_json_result_is_a_defect_not_retried(queue):
    async def returns_a_set(payload):
        return {1, 2}

    async with running(make_worker(queue, {"bad": returns_a_set})):
        await queue.offer("bad", None, task_id="nj", max_retries=5)
        info = await settled(queue, "nj")
    assert info.state == "failed" and info.error.tag == effectmq.DEFECT
    assert "result of 'bad' must be plain JSON" in info.error.message and info.attempt == 1


async def test_custom_retry_policy_on_the_handler(queue):
    delays_asked = []

    def policy(failures):
        delays_asked.append(failures)
        return 0.05 * failures

    app = effectmq.App("q")
    app.use_queue(queue)

    @app.task(retry=policy, max_retries=2)
    async def flaky(payload, ctx):
        if ctx.attempt < 3:
            raise effectmq.TaskError("not yet")
        return ctx.attempt

    async with running(make_worker(queue, app)):
        offered = await app.offer("flaky", None)
        assert await queue.wait(offered.task_id, timeout=10) == 3
    assert delays_asked == [1, 2]
    info = await queue.get(offered.task_id)
    assert info.handler_failure_count == 2 and info.error.tag == "TaskError"


async def test_a_worker_never_runs_more_than_its_concurrency(make_queue):
    # A worker leases from two places: its acquire loop, and the leases its completion
    # batches take along. Both counted the same free slots: while the loop's call was out,
    # a batch asked for those slots too, and the worker ran 6 handlers at concurrency 4.
    q = make_queue("slots")
    gate, release_held, release_all = asyncio.Event(), asyncio.Event(), asyncio.Event()
    late_started = asyncio.Event()
    calls, running_now, peak = 0, 0, 0
    fast = q.acquire_many

    async def acquire_many(count, **options):  # the loop's second call is slow
        nonlocal calls
        calls += 1
        if calls > 1:
            await gate.wait()
        return await fast(count, **options)
    q.acquire_many = acquire_many

    async def job(payload):
        nonlocal running_now, peak
        running_now += 1
        peak = max(peak, running_now)
        if payload == "held":
            await release_held.wait()
        elif payload == "late":
            late_started.set()
            await release_all.wait()
        running_now -= 1

    async def second_call():  # the quick ones finished, their batch found nothing: the loop asks again
        while calls < 2:
            await asyncio.sleep(0.01)

    await q.offer_many([("job", "quick"), ("job", "quick"), ("job", "held"), ("job", "held")])
    async with running(make_worker(q, {"job": job}, concurrency=4)):
        try:
            await asyncio.wait_for(second_call(), 10)
            await q.offer_many([("job", "late")] * 10)
            release_held.set()  # their batch takes leases along while the loop's call is still out
            await asyncio.wait_for(late_started.wait(), 10)
            await asyncio.sleep(0.1)
            gate.set()
            await asyncio.sleep(0.3)
            assert peak <= 4, f"{peak} handlers ran at once at concurrency 4"
        finally:
            release_all.set()
        await asyncio.wait_for(until_drained(q), 10)


async def test_a_newer_attempt_of_a_task_interrupts_the_older_one_and_a_stale_one_never_starts(make_queue):
    # One worker may be handed two attempts of one task: its lease ran out unseen (a
    # paused process) and the task came back to it. The newer attempt owns the task.
    q = make_queue("two-attempts", max_stalled_count=3)
    await q.offer("job", None, task_id="t")
    first = await q.acquire(lock_timeout=0.1)
    await asyncio.sleep(0.25)
    await q.maintain()  # the spent lease: a stall, the task waits again
    second = await q.acquire()
    assert (first.attempt, second.attempt) == (1, 2)
    first.confirmed_until = time.monotonic() + 30  # as the paused worker still believes

    started, interrupted = [], []

    async def job(payload, ctx):
        started.append(ctx.attempt)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            interrupted.append(ctx.attempt)
            raise

    worker = make_worker(q, {"job": job})
    worker._start(first)
    await asyncio.sleep(0.05)
    worker._start(second)
    await asyncio.sleep(0.05)
    assert started == [1, 2] and interrupted == [1]

    late = make_worker(q, {"job": job})
    late._start(second)
    late._start(first)  # delivered after the attempt that replaced it
    await asyncio.sleep(0.05)
    assert started == [1, 2, 2] and late.in_flight == 1
    for w in (worker, late):
        for attempt in w.slots.attempts():
            attempt.task.cancel()
        await asyncio.gather(*(a.task for a in w.slots.attempts()), return_exceptions=True)


async def test_a_completion_waits_for_a_hung_call_no_longer_than_its_own_lease(tcp_proxy):
    # The batcher bounds each completion by its lease, not only the call it joins: one that
    # waits behind a call whose leases run longer gives up when its own lease ends.
    q = effectmq.TaskQueue("hung-ack", url=tcp_proxy.url, lock_timeout=30, retention_completed=0)
    try:
        await q.offer_many([("x", i) for i in range(2)])
        (long, short), _ = await q.acquire_many(2)
        short.confirmed_until = time.monotonic() + 0.5  # as if its last renewal was long ago
        batcher = effectmq.worker.acks.CompletionBatcher(q.engine)
        tcp_proxy.cut(drop_existing=False)  # every call from now on hangs
        first = asyncio.create_task(batcher.complete(long, "null"))
        await asyncio.sleep(0.05)  # on its way, bounded by its own 30 s lease
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await batcher.complete(short, "null")
        assert time.monotonic() - started < 2, "it waited for the hung call, not its own lease"
        first.cancel()
    finally:
        tcp_proxy.restore()
        await q.close()


async def test_leases_a_completion_call_brings_after_its_waiters_gave_up_still_run(make_queue, redis_url):
    # A completion waits no longer than its own lease, but the call it went in may still
    # be answered: the leases its reply carries (taken along for the freed slots) must be
    # run, or handed back, not dropped until they stall. Redis held by CLIENT PAUSE stands
    # for a slow reply (a starved worker process, a slow fsync): no fault, no lost reply.
    q = make_queue("late-along", lock_timeout=30)
    await q.offer_many([("x", i) for i in range(2)])
    (done,), _ = await q.acquire_many(1)
    done.confirmed_until = time.monotonic() + 0.3  # as if its last renewal was long ago

    class Along:
        lock_timeout, in_flight = None, 1

        def __init__(self):
            self.reserved, self.started = 0, []

        def wanted(self, completing):
            return completing

        def returned(self, reserved):
            self.reserved -= reserved

        def reserve(self, slots):
            self.reserved += slots

        def start(self, leases):
            raise AssertionError("the call was late: its leases go to start_late")

        def start_late(self, leases):
            self.started.extend(leases)
            return leases

    along = Along()
    batcher = effectmq.worker.acks.CompletionBatcher(q.engine, along)
    admin = redis.asyncio.Redis.from_url(redis_url)
    try:
        await admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        with pytest.raises(TimeoutError):
            await batcher.complete(done, "null")  # its lease ran out while Redis held the call
        assert along.reserved == 1, "the slot the call may fill stays reserved while it is out"
        async with asyncio.timeout(5):
            while not along.started:
                await asyncio.sleep(0.02)
        (late,) = along.started
        assert late.task_id != done.task_id and along.reserved == 0
        assert (await q.get(done.task_id)).state == "completed"  # the call did settle it
        await late.complete("null")  # the lease it brought is live, and this attempt's own
        assert (await q.get(late.task_id)).state == "completed"
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()


async def test_late_leases_start_only_in_free_slots_and_the_rest_go_back_waiting(make_queue):
    # The attempts of a batch that stopped waiting may send their completions again and be
    # given leases for the same slots; a late reply then finds them filled. Its leases
    # beyond the free slots are handed back (waiting again, no stall), never run over the
    # worker's concurrency.
    q = make_queue("late-room")
    await q.offer_many([("job", i) for i in range(3)])
    busy, *late = (await q.acquire_many(3))[0]
    running_now, release = [], asyncio.Event()

    async def job(payload):
        running_now.append(payload)
        await release.wait()

    worker = make_worker(q, {"job": job}, concurrency=2)
    worker._start(busy)  # one of its two slots runs an attempt
    worker._completions.along.start_late(late)  # a late reply brings two leases
    await asyncio.sleep(0.1)
    assert len(running_now) == 2 and worker.in_flight == 2
    (handed_back,) = [lease for lease in late if worker.slots.get(lease.token) is None]
    async with asyncio.timeout(5):
        while (info := await q.get(handed_back.task_id)).state != "waiting":
            await asyncio.sleep(0.02)
    assert info.stalled_attempt_count == 0
    release.set()
    await asyncio.gather(*(a.task for a in worker.slots.attempts()), return_exceptions=True)


# -- prefetch: leases held ahead ------------------------------------------------


async def test_prefetch_holds_leases_ahead_renews_them_and_runs_them_as_handlers_return(make_queue):
    # Held leases are renewed like running ones: held three lock timeouts, none stalls
    # (the worker's own maintenance would recover an expired one), and never more than
    # `concurrency` handlers run at once.
    q = make_queue("prefetch", lock_timeout=0.4)
    release = asyncio.Event()
    running_now, peak, order = 0, 0, []

    async def job(payload):
        nonlocal running_now, peak
        running_now += 1
        peak = max(peak, running_now)
        order.append(payload)
        await release.wait()
        running_now -= 1

    await q.offer_many([("job", i, {"task_id": f"p{i}"}) for i in range(6)])
    worker = make_worker(q, {"job": job}, concurrency=2, prefetch=2)
    async with running(worker):
        async with asyncio.timeout(5):
            while worker.in_flight < 4:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.2)  # three lock timeouts: the held leases live on renewals alone
        stats = await q.stats()
        assert (stats.active, stats.waiting) == (4, 2), "two run, two are held, two wait"
        assert (running_now, len(order)) == (2, 2)
        release.set()
        infos = [await settled(q, f"p{i}") for i in range(6)]
    assert peak == 2
    assert sorted(order) == list(range(6))
    assert [(i.state, i.attempt, i.stalled_attempt_count) for i in infos] == [("completed", 1, 0)] * 6


def hand_backs(caplog) -> list[tuple[str, str]]:
    """(level, reason) of each "not started ...; releasing it" line."""
    return [(r.levelname, r.getMessage().split(": ", 1)[1]) for r in caplog.records
            if "not started: " in r.getMessage()]


async def test_drain_hands_held_leases_back_without_a_stall(make_queue, caplog):
    caplog.set_level(logging.INFO, logger="effectmq")
    q = make_queue("prefetch-drain")
    entered = asyncio.Event()

    async def job(payload):
        entered.set()
        await asyncio.sleep(0.3)

    await q.offer_many([("job", i, {"task_id": t}) for i, t in enumerate(("run", "held1", "held2"))])
    worker = make_worker(q, {"job": job}, concurrency=1, prefetch=2)
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(entered.wait(), 5)
    async with asyncio.timeout(5):
        while worker.in_flight < 3:
            await asyncio.sleep(0.01)
    worker.stop()
    await asyncio.wait_for(task, 10)
    ran, *held = [await q.get(i) for i in ("run", "held1", "held2")]
    assert ran.state == "completed"
    assert [(h.state, h.stalled_attempt_count, h.handler_failure_count) for h in held] == [("waiting", 0, 0)] * 2
    # never started: not an attempt (no attempt number spent, no "released" entry in its history)
    assert [(h.attempt, h.attempts) for h in held] == [(0, [])] * 2
    # a drain is routine: no warning per held lease
    assert hand_backs(caplog) == [("INFO", "the worker is stopping; releasing it")] * 2


async def test_a_held_lease_that_cannot_be_renewed_is_dropped_never_started(tcp_proxy, make_queue):
    """Connection cut past the safety window: the running handler is interrupted and
    the held lease let go; neither runs again on this worker's spent leases, and both
    tasks are recovered later with one stall each."""
    through_proxy = make_queue("prefetch-cut", url=tcp_proxy.url, lock_timeout=1.0)
    direct = make_queue("prefetch-cut", lock_timeout=1.0)
    started, interrupted = [], asyncio.Event()

    async def hold(payload):
        started.append(payload)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            interrupted.set()
            raise

    await direct.offer_many([("hold", t, {"task_id": t}) for t in ("first", "second")])
    worker = make_worker(through_proxy, {"hold": hold}, concurrency=1, prefetch=1, maintenance_interval=60)
    async with running(worker):
        async with asyncio.timeout(5):
            while worker.in_flight < 2:
                await asyncio.sleep(0.01)
        tcp_proxy.cut()
        await asyncio.wait_for(interrupted.wait(), 5)
        await asyncio.sleep(0.2)
        assert worker.in_flight == 0 and started == ["first"], "the held lease was dropped, not started"
        await asyncio.sleep(1.0)  # both leases ran out
        report = await direct.maintain()
        assert report.recovered == 2
        tcp_proxy.restore()
    infos = [await direct.get(i) for i in ("first", "second")]
    assert [(i.stalled_attempt_count, i.handler_failure_count) for i in infos] == [(1, 0)] * 2


async def test_prefetch_must_be_a_non_negative_integer(queue):
    for bad in (-1, 1.5, True, "2", "auto"):
        with pytest.raises(effectmq.InvalidOption, match="prefetch"):
            effectmq.Worker(queue, {"x": print}, prefetch=bad)


async def test_auto_prefetch_holds_leases_only_while_handlers_are_short(make_queue, caplog):
    caplog.set_level(logging.INFO, logger="effectmq")
    # auto (the default): none held before a handler returned; as many as concurrency
    # once handlers are short; a lease held past HOLD_AT_MOST behind slow handlers goes
    # back (no stall) and holding stops, so it is not taken again at once.
    q = make_queue("prefetch-auto")
    gate = asyncio.Event()

    async def job(payload):
        if payload == "block":
            await gate.wait()

    async def active_settles_at(count, within):
        async with asyncio.timeout(within):
            while (await q.stats()).active != count:
                await asyncio.sleep(0.02)

    await q.offer_many([("job", "block")] * 3)
    worker = make_worker(q, {"job": job}, concurrency=2)
    assert worker.prefetch is None
    async with running(worker):
        await active_settles_at(2, 5)
        await asyncio.sleep(0.3)
        assert (await q.stats()).active == 2, "nothing is held before a handler returned"
        gate.set()
        await asyncio.wait_for(until_drained(q), 5)
        gate.clear()
        await q.offer_many([("job", "quick")] * 40)
        await asyncio.wait_for(until_drained(q), 5)
        await q.offer_many([("job", "block", {"task_id": f"b{i}"}) for i in range(6)])
        await active_settles_at(4, 5)  # two run, two are held
        await active_settles_at(2, 2 * prefetch.HOLD_AT_MOST + 2)  # handed back
        await asyncio.sleep(0.5)
        assert (await q.stats()).active == 2, "holding stopped while handlers are slow"
        gate.set()
        infos = [await settled(q, f"b{i}") for i in range(6)]
    # the two handed back were attempted once, like the rest: a lease held, never started, is no attempt
    assert [(i.state, i.stalled_attempt_count, i.attempt, i.attempts) for i in infos] == [("completed", 0, 1, [])] * 6
    backs = hand_backs(caplog)  # auto adapting to slow handlers is routine: INFO, not WARNING
    assert len(backs) == 2 and all(level == "INFO" and "without a free slot" in why for level, why in backs), backs


async def test_auto_prefetch_holds_nothing_under_max_active(make_queue):
    # Held leases count toward max_active: auto would let one worker take the budget
    # of attempts another could run, so under max_active it holds none.
    q = make_queue("prefetch-capped")
    await q.configure(max_active=10)
    gate = asyncio.Event()

    async def job(payload):
        if payload == "block":
            await gate.wait()

    await q.offer_many([("job", "quick")] * 40)
    async with running(make_worker(q, {"job": job}, concurrency=2)):
        await asyncio.wait_for(until_drained(q), 5)
        await q.offer_many([("job", "block")] * 6)
        seen = set()
        for _ in range(25):
            seen.add((await q.stats()).active)
            await asyncio.sleep(0.02)
        gate.set()
        await asyncio.wait_for(until_drained(q), 5)
    assert max(seen) == 2, f"active counts seen: {sorted(seen)}"


def gauge(name: str, queue: str) -> float | None:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(name, {"queue": queue})


async def test_the_in_flight_gauge_counts_running_attempts_and_falls_to_zero_when_idle(make_queue):
    # It was set only when leases arrived: an idle worker kept showing its last batch, and
    # held leases counted as running.
    q = make_queue("gauges")
    gate, entered = asyncio.Event(), asyncio.Event()

    async def job(payload):
        entered.set()
        await gate.wait()

    await q.offer_many([("job", i) for i in range(5)])
    worker = make_worker(q, {"job": job}, concurrency=2, prefetch=2)
    async with running(worker):
        await asyncio.wait_for(entered.wait(), 5)
        async with asyncio.timeout(5):
            while worker.in_flight < 4:
                await asyncio.sleep(0.01)
        assert (gauge("effectmq_in_flight", "gauges"), gauge("effectmq_prefetched", "gauges")) == (2, 2)
        gate.set()
        await asyncio.wait_for(until_drained(q), 5)
        async with asyncio.timeout(5):
            while worker.in_flight:
                await asyncio.sleep(0.01)
        assert (gauge("effectmq_in_flight", "gauges"), gauge("effectmq_prefetched", "gauges")) == (0, 0)


async def test_a_tasks_own_options_travel_with_its_offer(queue):
    """@app.task(max_retries=..., timeout=...) apply to `task.offer(...)` and `app.offer(...)`
    unless the call gives its own."""
    app = effectmq.App(queue.name)
    app.use_queue(queue)

    @app.task(max_retries=5, max_stalled_count=4, timeout=30)
    async def send(payload):
        return None

    await send.offer({"to": "a"}, task_id="by-task")
    await app.offer("send", {"to": "b"}, task_id="by-app")
    await send.offer({"to": "c"}, task_id="own", max_retries=1)
    for task_id in ("by-task", "by-app"):
        info = await queue.get(task_id)
        assert info.max_retries == 5 and info.options.get("timeout") == 30, (task_id, info)
    assert (await queue.get("own")).max_retries == 1
