"""Leases nobody will run go back to the queue at once, without a stall.

A lease an acquire call took is someone's to run, or is handed back: the leases of the
earlier rounds of `acquire_many` when a later round fails, those of a call whose reply
was lost (each call has its own token prefix, and the `reclaim` script hands back what
is still active under it), a held lease the heartbeat drops, and the leases of a
combined call still out when the drain ends. None of these may count a stall: the
handler never ran. And callers of one process that acquire at once share a call (one
cancelled meanwhile loses no lease).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import REGISTRY

import effectmq
from effectmq.client import engine
from effectmq import errors
from effectmq.protocol import protocol
from tests.support.inprocess import make_worker, running, settled


def on_acquire(queue, before):
    """Run `before(args, n)` ahead of the n-th acquire call (n from 1) the engine sends."""
    real = queue.engine.scripts.run
    count = 0

    async def run(args):
        nonlocal count
        if isinstance(args, protocol.AcquireArgs):
            count += 1
            await before(args, count)
        return await real(args)

    queue.engine.scripts.run = run


async def states(queue, ids):
    """(state, attempt, stalled_attempt_count) of each task."""
    return [(i.state, i.attempt, i.stalled_attempt_count) for i in [await queue.get(t) for t in ids]]


# -- the rounds of acquire_many -----------------------------------------------


async def test_acquire_many_returns_the_leases_of_earlier_rounds_when_a_later_round_fails(tcp_proxy, make_queue):
    # Round one leases the two ids this process offered, round two the ids its reply named;
    # the reply of round two is lost. Round one's leases were dropped (each stalled a whole
    # lease later); round two's were minted for nobody.
    q = make_queue("rounds-lost", url=tcp_proxy.url, lock_timeout=30)
    await q.offer_many([("x", i, {"task_id": f"a{i}"}) for i in range(2)])  # learnt by q's engine
    await make_queue("rounds-lost").offer_many([("x", i, {"task_id": f"b{i}"}) for i in range(3)])

    async def lose_round_two(args, n):
        if n == 2:
            tcp_proxy.drop_next_reply()

    on_acquire(q, lose_round_two)
    leases, next_due = await q.acquire_many(5)
    assert tcp_proxy.replies_dropped == 1
    assert sorted(lease.task_id for lease in leases) == ["a0", "a1"]
    assert next_due == 0.0, "tasks are known ready: look again now"
    # Round two's leases: nobody holds them, so they are waiting again, not counted.
    assert await states(q, ["b0", "b1", "b2"]) == [("waiting", 0, 0)] * 3
    more, _ = await q.acquire_many(3)
    assert sorted(lease.task_id for lease in more) == ["b0", "b1", "b2"]
    await q.complete_many([(lease, "null") for lease in leases + more])
    assert await states(q, ["a0", "a1", "b0", "b1", "b2"]) == [("completed", 1, 0)] * 5


async def test_acquire_many_cancelled_in_a_later_round_hands_back_the_earlier_rounds(make_queue):
    q = make_queue("rounds-cancelled", lock_timeout=30)
    await q.offer_many([("x", i, {"task_id": f"a{i}"}) for i in range(2)])
    await make_queue("rounds-cancelled").offer_many([("x", i, {"task_id": f"b{i}"}) for i in range(3)])
    hang = asyncio.Event()

    async def hang_round_two(args, n):
        if n == 2:
            hang.set()
            await asyncio.sleep(60)

    on_acquire(q, hang_round_two)
    call = asyncio.create_task(q.acquire_many(5))
    await asyncio.wait_for(hang.wait(), 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The next call hands round one's leases back first (nobody got them), then leases all.
    leases, _ = await q.acquire_many(5)
    assert sorted(lease.task_id for lease in leases) == ["a0", "a1", "b0", "b1", "b2"]
    assert [lease.attempt for lease in leases] == [1] * 5
    await q.complete_many([(lease, "null") for lease in leases])
    assert await states(q, ["a0", "a1", "b0", "b1", "b2"]) == [("completed", 1, 0)] * 5


# -- lost replies ---------------------------------------------------------------


async def test_each_acquire_call_mints_tokens_of_its_own_prefix(make_queue):
    q = make_queue("call-prefix")
    await q.offer_many([("x", i) for i in range(3)])
    first, _ = await q.acquire_many(2)
    second, _ = await q.acquire_many(1)
    prefix_of = {lease.token.rsplit(":", 1)[0] for lease in first}
    assert len(prefix_of) == 1
    (call_prefix,) = prefix_of
    assert call_prefix.startswith(q.engine.token_prefix + ".")
    assert second[0].token.rsplit(":", 1)[0] not in (call_prefix, q.engine.token_prefix)


async def test_two_lost_acquire_replies_neither_stall_nor_fail_a_task_that_never_ran(tcp_proxy, make_queue):
    # Each lost reply minted a lease nobody got: a stall each, and the second failed the
    # task ~effectmq/Error/Stalled although no handler ever saw it.
    q = make_queue("acquire-lost", url=tcp_proxy.url, lock_timeout=0.3)
    direct = make_queue("acquire-lost", lock_timeout=0.3)
    await q.offer("x", "payload", task_id="t")
    lose = True

    async def lose_the_reply(args, n):
        if lose:
            tcp_proxy.drop_next_reply()

    on_acquire(q, lose_the_reply)
    for n in range(2):
        with pytest.raises(effectmq.RedisUnavailable):
            await q.acquire_many(1)
        assert tcp_proxy.replies_dropped == n + 1
        await asyncio.sleep(0.4)  # a lease minted then has run out by now
        await direct.maintain()
        info = await direct.get("t")
        assert (info.state, info.attempt, info.stalled_attempt_count) == ("waiting", 0, 0), info.error
    lose = False
    (lease,), _ = await q.acquire_many(1)
    assert lease.attempt == 1
    await lease.complete("done")
    assert await states(direct, ["t"]) == [("completed", 1, 0)]


async def test_a_task_whose_lease_never_arrives_is_handed_back_a_bounded_number_of_times(tcp_proxy, make_queue):
    # A reply that never makes it (too large to arrive in time, say) must not hand the same
    # task back and lease it again for ever: after RECLAIMS_PER_TASK it stalls, and
    # max_stalled_count ends it, as before.
    q = make_queue("acquire-lost-often", url=tcp_proxy.url, lock_timeout=0.3)
    direct = make_queue("acquire-lost-often", lock_timeout=0.3)
    await q.offer("x", "payload", task_id="t")

    async def lose_the_reply(args, n):
        tcp_proxy.drop_next_reply()

    on_acquire(q, lose_the_reply)
    seen = []
    for _ in range(engine.RECLAIMS_PER_TASK + 1):
        with pytest.raises(effectmq.RedisUnavailable):
            await q.acquire_many(1)
        await asyncio.sleep(0.4)
        await direct.maintain()
        seen += await states(direct, ["t"])
    assert seen == [("waiting", 0, 0)] * engine.RECLAIMS_PER_TASK + [("waiting", 1, 1)]


async def test_a_lost_complete_and_acquire_reply_settles_by_receipt_and_hands_its_leases_back(tcp_proxy, make_queue):
    q = make_queue("combined-lost", url=tcp_proxy.url, lock_timeout=30, retention_completed=60)
    await q.offer_many([("x", i, {"task_id": f"t{i}"}) for i in range(3)])
    (done,), _ = await q.acquire_many(1)
    tcp_proxy.drop_next_reply()
    with pytest.raises(effectmq.RedisUnavailable):
        await q.engine.complete_and_acquire([(done, "null")], 2)
    assert tcp_proxy.replies_dropped == 1
    # The completion landed (a resend finds it in the call's receipt) ...
    assert await q.complete_many([(done, "null")]) == [protocol.Outcome.COMPLETED]
    # ... and the two leases the call took are waiting again, as if never taken.
    assert await states(q, ["t1", "t2"]) == [("waiting", 0, 0)] * 2
    leases, _ = await q.acquire_many(2)
    assert sorted((lease.task_id, lease.attempt) for lease in leases) == [("t1", 1), ("t2", 1)]


async def test_a_reclaim_that_fails_too_is_sent_before_the_next_acquire(tcp_proxy, make_queue):
    q = make_queue("reclaim-later", url=tcp_proxy.url, lock_timeout=30)
    await q.offer_many([("x", i, {"task_id": f"t{i}"}) for i in range(2)])
    real = q.engine.scripts.run
    sent: list[str] = []

    async def run(args):
        sent.append(args.operation)
        if args.operation == "acquire" and sent.count("acquire") == 1:
            tcp_proxy.drop_next_reply()
        if args.operation == "reclaim" and sent.count("reclaim") == 1:
            raise errors.RedisUnavailable("Redis unavailable: no route", "CONNECTION")
        return await real(args)

    q.engine.scripts.run = run
    with pytest.raises(effectmq.RedisUnavailable):
        await q.acquire_many(2)
    assert await states(q, ["t0", "t1"]) == [("active", 1, 0)] * 2  # its reclaim failed too
    leases, _ = await q.acquire_many(2)
    assert sent == ["acquire", "reclaim", "reclaim", "acquire"]
    assert sorted((lease.task_id, lease.attempt) for lease in leases) == [("t0", 1), ("t1", 1)]


async def test_a_refused_acquire_hands_back_nothing(make_queue):
    # An error reply: the script wrote nothing (runtime rule 7), so no reclaim is sent.
    q = make_queue("acquire-refused")
    await q.offer_many([("x", i) for i in range(2)])
    real = q.engine.scripts.run
    sent: list[str] = []

    async def run(args):
        sent.append(args.operation)
        if args.operation == "acquire" and sent.count("acquire") == 1:
            raise errors.RedisUnavailable("Redis refused for now: OOM command not allowed", "OOM")
        return await real(args)

    q.engine.scripts.run = run
    with pytest.raises(effectmq.RedisUnavailable):
        await q.acquire_many(2)
    leases, _ = await q.acquire_many(2)
    assert len(leases) == 2 and sent == ["acquire", "acquire"]


# -- the worker: held leases, renewals, the drain --------------------------------------


async def test_a_held_lease_the_heartbeat_drops_is_released_not_stalled(make_queue):
    # Renewals fail until the safety window closes: the running attempt is interrupted (its
    # handler ran: the stall is its own), the held one is dropped. Nothing ever ran the held
    # one, so it goes back released, not left to stall a whole lease later.
    q = make_queue("held-dropped", lock_timeout=1.0)
    blocked, interrupted = asyncio.Event(), asyncio.Event()
    ran = []

    async def job(payload):
        ran.append(payload)
        if payload == "first" and not blocked.is_set():  # its first attempt only
            blocked.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                interrupted.set()
                raise

    await q.offer_many([("job", t, {"task_id": t}) for t in ("first", "second")])
    worker = make_worker(q, {"job": job}, concurrency=1, prefetch=1, maintenance_interval=0.1)
    real_renew = q.engine.renew

    async def failing_renew(leases):
        if not interrupted.is_set():
            raise effectmq.RedisUnavailable("Redis unavailable: no route", "CONNECTION")
        return await real_renew(leases)

    q.engine.renew = failing_renew
    async with running(worker):
        await asyncio.wait_for(blocked.wait(), 5)
        async with asyncio.timeout(5):
            while worker.in_flight < 2:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(interrupted.wait(), 5)
        second = await settled(q, "second")
    assert (second.state, second.stalled_attempt_count, second.handler_failure_count) == ("completed", 0, 0)
    assert ran.count("second") == 1


async def test_a_renewal_out_while_the_drain_hands_back_a_held_lease_does_not_stop_the_worker(make_queue):
    # Was: the drain handed the held lease back without marking it; the renewal that was
    # out meanwhile answered "not owned", the heartbeat took that for a lost lease and
    # `self._held.remove` raised ValueError: the worker stopped with it (run() raised).
    q = make_queue("drain-renewal", lock_timeout=3)
    entered, finish = asyncio.Event(), asyncio.Event()
    renewing, proceed = asyncio.Event(), asyncio.Event()

    async def job(payload):
        if payload == "run":
            entered.set()
            await finish.wait()

    await q.offer_many([("job", t, {"task_id": t}) for t in ("run", "held")])
    worker = make_worker(q, {"job": job}, concurrency=1, prefetch=1, lock_refresh=0.2)
    real_renew = q.engine.renew

    async def slow_renew(leases):
        if any(lease.task_id == "held" for lease in leases) and not proceed.is_set():
            renewing.set()
            await proceed.wait()
        return await real_renew(leases)

    q.engine.renew = slow_renew
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(entered.wait(), 5)
        await asyncio.wait_for(renewing.wait(), 5)  # a renewal of both is out
        worker.stop()  # the drain hands the held lease back
        async with asyncio.timeout(5):
            while (await q.get("held")).state != "waiting":
                await asyncio.sleep(0.01)
        proceed.set()  # the renewal answers: the held lease is no longer owned
        await asyncio.sleep(0.3)
        finish.set()
        await asyncio.wait_for(task, 10)  # raised ValueError
    finally:
        finish.set()
        proceed.set()
        if not task.done():
            worker.stop()
            await asyncio.wait_for(task, 10)
    assert await states(q, ["run", "held"]) == [("completed", 1, 0), ("waiting", 0, 0)]  # held: no attempt


async def test_the_drain_waits_for_a_combined_call_still_out_and_hands_its_leases_back(make_queue):
    # Confirmed: the drain ended while a completion call that took a lease along was still
    # out (its waiters had given up at their own lease's end); the late reply came to a
    # stopped worker (or to no process at all), and the lease it brought was left to stall.
    q = make_queue("drain-late", lock_timeout=3)
    await q.offer_many([("job", t, {"task_id": t}) for t in ("a", "b")])
    replied = asyncio.Event()

    async def job(payload, ctx):
        ctx.lease.confirmed_until = time.monotonic() + 0.3  # as if its last renewal was long ago
        asyncio.get_running_loop().call_later(0.05, worker.stop)  # while its completion is out

    real = q.engine.scripts.run

    async def slow_reply(args):
        reply = await real(args)
        if isinstance(args, protocol.AcquireArgs) and args.completions:
            await asyncio.sleep(1.0)  # the reply comes after the lease of "a", within that of "b"
            replied.set()
        return reply

    q.engine.scripts.run = slow_reply
    worker = make_worker(q, {"job": job}, concurrency=1, prefetch=0, drain_timeout=10)
    await asyncio.wait_for(worker.run(), 15)
    # As the process would exit now: nothing of this worker's is left active.
    assert replied.is_set(), "the drain ended before the call it started came back"
    a, b = await q.get("a"), await q.get("b")
    assert a.state == "completed"
    assert (b.state, b.attempt, b.stalled_attempt_count) == ("waiting", 0, 0)  # never started: no attempt


async def test_a_renewal_racing_a_batched_completion_is_not_a_lease_loss(make_queue, caplog):
    # Confirmed: a renewal sent while the completion was on its way answered "not owned"
    # (the completion landed first); the heartbeat interrupted the attempt, which was only
    # waiting for its completion's reply: logged "lease lost", counted a lease loss, for a
    # task that completed.
    caplog.set_level(logging.INFO, logger="effectmq")
    q = make_queue("renew-race", lock_timeout=3)
    go, renewing, landed, proceed, reply = (asyncio.Event() for _ in range(5))

    async def job(payload):
        await go.wait()

    real_renew = q.engine.renew

    async def racing_renew(leases):
        if go.is_set() and not proceed.is_set():
            renewing.set()
            await proceed.wait()  # sent after the completion landed
        return await real_renew(leases)

    real_combined = q.engine.complete_and_acquire

    async def slow_completion(settled_, count, **kw):
        result = await real_combined(settled_, count, **kw)
        landed.set()
        await reply.wait()  # its reply comes after the renewal's
        return result

    q.engine.renew = racing_renew
    q.engine.complete_and_acquire = slow_completion
    await q.offer("job", None, task_id="r")
    worker = make_worker(q, {"job": job}, concurrency=1, prefetch=0, lock_refresh=0.1)
    losses = REGISTRY.get_sample_value("effectmq_lease_losses_total", {"queue": "renew-race", "task": "job"}) or 0
    async with running(worker):
        async with asyncio.timeout(5):
            while worker.running < 1:
                await asyncio.sleep(0.01)
        go.set()
        await asyncio.wait_for(landed.wait(), 5)
        await asyncio.wait_for(renewing.wait(), 5)
        proceed.set()
        await asyncio.sleep(0.2)  # the renewal's answer: not owned
        reply.set()
        info = await settled(q, "r")
        async with asyncio.timeout(5):
            while worker.in_flight:
                await asyncio.sleep(0.01)
    assert info.state == "completed"
    assert not [r for r in caplog.records if "interrupting task r" in r.getMessage()]
    after = REGISTRY.get_sample_value("effectmq_lease_losses_total", {"queue": "renew-race", "task": "job"}) or 0
    assert after == losses, "a completed task counted as a lease loss"
    completed = REGISTRY.get_sample_value("effectmq_outcomes_total",
                                          {"queue": "renew-race", "task": "job", "outcome": "completed"})
    assert completed == 1


# -- callers of one process share a call ----------------------------------------


def count_calls(queue) -> dict[str, int]:
    real = queue.engine.scripts.run
    calls: dict[str, int] = {}

    async def run(args):
        calls[args.operation] = calls.get(args.operation, 0) + 1
        return await real(args)

    queue.engine.scripts.run = run
    return calls


async def test_concurrent_acquire_callers_share_calls_and_each_gets_its_own_lease(make_queue):
    # They took turns, one script call each: 32 coroutines of one process ran at 0.57 of
    # the client's limit. Those who come while a call is out now share the next one.
    q = make_queue("coalesced", lock_timeout=30)
    await q.offer_many([("x", i, {"task_id": f"t{i}"}) for i in range(32)])
    calls = count_calls(q)
    leases = await asyncio.gather(*(q.acquire() for _ in range(32)))
    assert sorted(lease.task_id for lease in leases) == sorted(f"t{i}" for i in range(32))
    assert len({lease.token for lease in leases}) == 32
    assert calls["acquire"] <= 4, calls
    # Asking for more than there is: each gets what the call got, in order, and the rest None.
    await q.offer_many([("x", i, {"task_id": f"u{i}"}) for i in range(3)])
    more = await asyncio.gather(*(q.acquire() for _ in range(8)))
    assert sorted(lease.task_id for lease in more if lease) == ["u0", "u1", "u2"]
    await q.complete_many([(lease, "null") for lease in leases + [m for m in more if m]])
    assert (await q.stats()).active == 0


@pytest.mark.parametrize("cancelled", [0, 1], ids=["the caller making the call", "a caller sharing it"])
async def test_a_caller_cancelled_while_the_call_is_out_loses_no_lease(make_queue, cancelled):
    q = make_queue(f"coalesced-cancel-{cancelled}", lock_timeout=30)
    await q.offer_many([("x", i, {"task_id": f"t{i}"}) for i in range(5)])
    gates = {2: asyncio.Event(), 3: asyncio.Event()}
    out = {2: asyncio.Event(), 3: asyncio.Event()}

    real = q.engine.scripts.run
    n = 0

    async def hold(args):  # call 2 before it is sent, call 3 after it ran (its reply held)
        nonlocal n
        n += 1 if isinstance(args, protocol.AcquireArgs) else 0
        if n == 2 and isinstance(args, protocol.AcquireArgs):
            out[2].set()
            await gates[2].wait()
        reply = await real(args)
        if n == 3 and isinstance(args, protocol.AcquireArgs):
            out[3].set()
            await gates[3].wait()
        return reply

    q.engine.scripts.run = hold
    first = await q.acquire()  # call 1
    second = asyncio.create_task(q.acquire())  # call 2, held
    await asyncio.wait_for(out[2].wait(), 5)
    waiters = [asyncio.create_task(q.acquire()) for _ in range(3)]  # they share call 3
    await asyncio.sleep(0.05)
    gates[2].set()
    await asyncio.wait_for(out[3].wait(), 5)  # call 3 is out, for all three
    waiters[cancelled].cancel()
    gates[3].set()
    with pytest.raises(asyncio.CancelledError):
        await waiters[cancelled]
    got = [first, await second] + [await w for i, w in enumerate(waiters) if i != cancelled]
    held = [lease for lease in got if lease]
    # What the cancelled caller's call took for it went back, without a stall; the next
    # call hands it back first and may lease it again, as a first attempt.
    again, _ = await q.acquire_many(5)
    everything = held + again
    assert sorted(lease.task_id for lease in everything) == [f"t{i}" for i in range(5)]
    assert [lease.attempt for lease in everything] == [1] * 5
