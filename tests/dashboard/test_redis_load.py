"""What a visitor's requests cost the workers' Redis, and records that made
pages fail, each against a running dashboard over HTTP and a private redis-server
whose own counters (INFO commandstats, INFO stats) say what the dashboard sent
(discovery SCANs on demand; whole records read for a list; a non-UTF-8 key, a
nested-JSON record, 60 concurrent requests, offsets beyond int64, `--queue` and
schedules, and the writes of a read-only dashboard)."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from effectmq import TaskQueue
from effectmq.scheduler import Scheduler, ScheduleSpec

pytestmark = pytest.mark.timeout(180)


def calls(server, command: str) -> int:
    return server.client().info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def sent_bytes(server) -> int:
    return server.client().info("stats")["total_net_output_bytes"]


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url) as r:
        return r.status, await r.text()


# -- discovery -----------------------------------------------------------------------------------

async def test_discovery_is_single_flight_and_never_asked_for_by_a_visitor(make_redis, start_dashboard):
    server = make_redis()
    for name in ("emails", "reports"):
        async with TaskQueue(name, url=server.url) as q:
            await q.offer("job", {}, task_id="t1")
    dash = await start_dashboard(server.url)
    async with aiohttp.ClientSession() as http:
        before = calls(server, "scan")
        statuses = await asyncio.gather(*(get(http, dash.url("/api/queues")) for _ in range(30)))
        assert [s for s, _ in statuses] == [200] * 30
        assert calls(server, "scan") - before == 2  # one discovery: one SCAN per marker (seq, meta)

        before = calls(server, "scan")
        for i in range(20):  # each used to clear the cache and SCAN the whole keyspace
            status, _ = await get(http, dash.url(f"/queues/nope-{i}"))
            assert status == 404
            status, _ = await get(http, dash.url(f"/api/queues/nope-{i}/tasks/t1"))
            assert status == 404
        assert calls(server, "scan") == before

        async with TaskQueue("newer", url=server.url) as q:  # created since: its pages answer at once
            await q.offer("job", {}, task_id="n1")
        status, _ = await get(http, dash.url("/api/queues/newer/tasks/n1"))
        assert status == 200
        status, body = await get(http, dash.url("/api/queues"))
        assert status == 200 and "newer" in body  # and the overview lists it from then on
        assert calls(server, "scan") == before


# -- a list reads the fields it shows ----------------------------------------------------------

async def test_a_list_page_reads_only_the_fields_it_shows(make_redis, start_dashboard):
    server = make_redis()
    big = "x" * (256 * 1024)
    async with TaskQueue("big", url=server.url) as q:
        await q.offer_many([("job", {"blob": big, "n": i}, {"task_id": f"t{i}"}) for i in range(40)])
    dash = await start_dashboard(server.url)
    async with aiohttp.ClientSession() as http:
        await get(http, dash.url("/api/queues"))  # discovery, scripts loaded
        for path in ("/api/queues/big?state=waiting&limit=40", "/queues/big?state=waiting&limit=40",
                     "/api/queues/big/tasks?state=waiting&limit=40", "/queues/big?search=t7"):
            before = sent_bytes(server)
            status, body = await get(http, dash.url(path))
            spent = sent_bytes(server) - before
            assert status == 200 and "t7" in body, path
            assert big not in body
            assert spent < 200_000, f"{path}: Redis sent {spent:,} bytes for a list (payloads: 10 MB)"
        before = sent_bytes(server)
        status, body = await get(http, dash.url("/api/queues/big/tasks/t7"))
        assert status == 200 and big in body  # the task's own page shows its payload
        assert sent_bytes(server) - before > len(big)


async def test_the_groups_section_reads_one_page_of_groups_and_parked_rows_read_no_payload(make_redis,
                                                                                          start_dashboard):
    from effectmq.dashboard.views import DEFAULT_GROUPS_PAGE

    server = make_redis()
    big = "x" * (256 * 1024)
    async with TaskQueue("many", url=server.url) as q:
        await q.pause_group("held")
        await q.offer_many([("job", {"blob": big}, {"group": "held", "task_id": f"h{i}"}) for i in range(30)])
        assert (await q.acquire_many(30))[0] == []  # all 30 parked
        await q.offer_many([("job", {}, {"group": f"g{i:03}", "task_id": f"t{i}"}) for i in range(300)])
    dash = await start_dashboard(server.url)
    async with aiohttp.ClientSession() as http:
        await get(http, dash.url("/api/queues"))  # discovery, scripts loaded
        for path, groups_read in (("/api/queues/many", DEFAULT_GROUPS_PAGE), ("/queues/many?groups_limit=5", 5),
                                  # the group named: its row and the parked list's total
                                  ("/api/queues/many?state=parked&limit=30&group=held", DEFAULT_GROUPS_PAGE + 2),
                                  ("/queues/many?state=parked&limit=30&groups_offset=290", 10)):
            before, sent = calls(server, "zlexcount"), sent_bytes(server)
            status, body = await get(http, dash.url(path))
            assert status == 200, (path, body[:300])
            assert calls(server, "zlexcount") - before == groups_read, path  # one per group shown: 300 exist
            assert big not in body and sent_bytes(server) - sent < 200_000, path  # parked rows: no payload (7.5 MB)
        status, body = await get(http, dash.url("/api/queues/many?state=parked&limit=30"))
        assert status == 200 and body.count('"group": "held"') == 30
        raw = server.client()  # an id another client wrote, not UTF-8: the list still answers
        raw.hset(b"{emq:many}:t:x\xff", mapping={"name": "job", "state": "waiting", "group": "held"})
        raw.zadd(b"{emq:many}:backlog", {b"held\0" + b"0" * 16 + b"x\xff": 0})
        status, body = await get(http, dash.url("/api/queues/many?state=parked&group=held&limit=2"))
        assert status == 200 and '"tasks": [{"task_id": "x\\\\udcff", "name": "job", "state": "waiting"' in body, body


# -- Low: one bad record or key fails one thing at most ------------------------------------------

async def test_a_non_utf8_key_fails_no_page(make_redis, start_dashboard):
    server = make_redis()
    async with TaskQueue("emails", url=server.url) as q:
        await q.offer("job", {}, task_id="t1")
    raw = server.client()
    raw.set(b"{emq:\xff\xfe}:seq", b"1")  # a key no queue of ours has: not UTF-8
    raw.set(b"{emq:\xc3}:meta", b"1")
    raw.set(b"other:\xff", b"1")
    dash = await start_dashboard(server.url)
    async with aiohttp.ClientSession() as http:
        for path in ("/", "/api/queues", "/queues/emails", "/api/queues/emails", "/queues/emails/tasks/t1",
                     "/schedules"):
            status, body = await get(http, dash.url(path))
            assert status == 200, (path, body[:300])
        status, body = await get(http, dash.url("/api/queues"))
        assert '"emails"' in body


DEEP = "[" * 100_000 + "]" * 100_000


async def test_a_deeply_nested_record_fails_no_page(make_redis, start_dashboard):
    server = make_redis()
    async with TaskQueue("emails", url=server.url) as q:
        await q.offer("job", {"ok": 1}, task_id="deep")
        await q.offer("job", {"ok": 2}, task_id="fine")
        await q.offer("job", {"ok": 3}, task_id="deep-error")
        await q.offer("job", {"ok": 4}, task_id="just-nested")
        await q.redis.hset(q.keys.task("deep"), mapping={"payload": DEEP, "result": DEEP})
        await q.redis.hset(q.keys.task("deep-error"), "error", '{"tag": "X", "message": "m", "data": ' + DEEP + "}")
        nested = "[" * 900 + "]" * 900  # decodes, but would not encode again inside a page
        await q.redis.hset(q.keys.task("just-nested"), "payload", nested)
    dash = await start_dashboard(server.url)
    async with aiohttp.ClientSession() as http:
        for path in ("/queues/emails", "/api/queues/emails", "/api/queues/emails/tasks", "/queues/emails?search=deep",
                     "/queues/emails/tasks/deep", "/api/queues/emails/tasks/deep", "/queues/emails/tasks/deep-error",
                     "/api/queues/emails/tasks/deep-error", "/queues/emails/tasks/just-nested",
                     "/api/queues/emails/tasks/just-nested", "/queues/emails/tasks/fine"):
            status, body = await get(http, dash.url(path))
            assert status == 200, (path, body[:300])
        status, body = await get(http, dash.url("/api/queues/emails/tasks/deep"))
        assert "nested" in body  # says why the value is not shown
        status, body = await get(http, dash.url("/api/queues/emails?state=waiting"))
        assert all(f'"{t}"' in body for t in ("deep", "fine", "deep-error", "just-nested"))


async def test_sixty_concurrent_requests_are_all_answered(make_redis, start_dashboard):
    """Was: 59 of 60 answered 503 "Too many connections" (redis-py's pool of 100 ran out)."""
    server = make_redis()
    for name in ("emails", "reports", "billing"):
        async with TaskQueue(name, url=server.url) as q:
            await q.offer_many([("job", {"n": i}) for i in range(20)])
    dash = await start_dashboard(server.url)
    paths = ["/", "/api/queues", "/queues/emails", "/api/queues/reports?state=waiting", "/schedules"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        for n in (60, 150):
            answers = await asyncio.gather(*(get(http, dash.url(paths[i % len(paths)])) for i in range(n)))
            assert Counter(status for status, _ in answers) == {200: n}, [b[:200] for s, b in answers if s != 200][:2]
    assert server.client().info("clients")["connected_clients"] < 60


@pytest.mark.parametrize("offset", ["9223372036854775808", "99999999999999999999999", "2147483648", "-1", "1e3"])
async def test_an_offset_out_of_bounds_is_a_bad_request(redis_url, start_dashboard, offset):
    async with TaskQueue("emails", url=redis_url) as q:
        await q.offer("job", {}, task_id="t1")
    dash = await start_dashboard(redis_url)
    async with aiohttp.ClientSession() as http:
        for path in (f"/queues/emails?offset={offset}", f"/api/queues/emails?offset={offset}",
                     f"/api/queues/emails/tasks?offset={offset}"):
            status, body = await get(http, dash.url(path))
            assert status == 400, (path, status, body[:200])
            assert "offset" in body


# -- Low: --queue restricts schedules; a read-only dashboard writes nothing -----------------------

async def test_the_queues_given_restrict_the_schedules_too(redis_url, start_dashboard):
    async with Scheduler(redis_url, namespace="default") as scheduler:
        for queue in ("shown", "hidden"):
            await scheduler.put(ScheduleSpec(id=f"{queue}/nightly", queue=queue, cron="0 2 * * *", task="job",
                                             payload={"secret-of": queue}))
    dash = await start_dashboard(redis_url, actions=True, queues=("shown",))
    auth = {"Authorization": f"Bearer {dash.token}"}
    async with aiohttp.ClientSession() as http:
        async with http.get(dash.url("/api/schedules")) as r:
            assert [s["id"] for s in (await r.json())["schedules"]] == ["shown/nightly"]
        status, page = await get(http, dash.url("/schedules"))
        assert status == 200 and "shown/nightly" in page and "hidden/nightly" not in page
        async with http.post(dash.url("/api/schedules/hidden%2Fnightly/suspend"), headers=auth) as r:
            assert r.status == 404, await r.text()
        async with http.post(dash.url("/api/schedules/shown%2Fnightly/suspend"), headers=auth) as r:
            assert r.status == 200, await r.text()
    async with Scheduler(redis_url, namespace="default") as scheduler:
        assert (await scheduler.status("hidden/nightly")).suspended is False
        assert (await scheduler.status("shown/nightly")).suspended is True


def snapshot(server) -> dict:
    """Every key with its type and contents (not DUMP: reads may rehash a hash table, which
    reorders its serialization), and the loaded function libraries."""
    raw = server.client().__class__(port=server.port, password=server.password)  # bytes in and out
    read = {b"string": raw.get, b"hash": raw.hgetall, b"list": lambda k: raw.lrange(k, 0, -1),
            b"set": lambda k: sorted(raw.smembers(k)), b"zset": lambda k: raw.zrange(k, 0, -1, withscores=True),
            b"stream": raw.xrange}
    keys = sorted(raw.scan_iter(count=1000))
    return {"keys": {k: (raw.type(k), read[raw.type(k)](k), raw.pttl(k) > 0) for k in keys},
            "functions": repr(raw.execute_command("FUNCTION", "LIST"))}


def write_calls(server) -> dict[str, int]:
    client = server.client()
    flags = {name: set(info.get("flags", ())) for name, info in client.command().items()}
    stats = client.info("commandstats")
    return {name: s["calls"] for name, s in ((k[len("cmdstat_"):], v) for k, v in stats.items())
            if "write" in flags.get(name.split("|")[0], set())}


async def test_a_read_only_dashboard_writes_nothing(make_redis, start_dashboard, monkeypatch):
    from effectmq.dashboard import service

    monkeypatch.setattr(service, "EVENTS_EVERY", 0.05)  # its background loop, sped up
    server = make_redis()
    async with TaskQueue("emails", url=server.url) as q:
        await q.offer_many([("job", {"n": i}, {"task_id": f"t{i}"}) for i in range(5)])
        lease = await q.acquire()
        await lease.fail(RuntimeError("boom"), retryable=False)
    async with Scheduler(server.url, namespace="default") as scheduler:
        await scheduler.put(ScheduleSpec(id="nightly", queue="emails", cron="0 2 * * *", task="job"))
    before, writes = snapshot(server), write_calls(server)
    dash = await start_dashboard(server.url)
    async with aiohttp.ClientSession() as http:
        for path in ("/", "/api/queues", "/queues/emails", "/queues/emails?state=failed", "/api/queues/emails/tasks",
                     "/queues/emails/tasks/t0", "/api/queues/emails/tasks/t1", "/schedules", "/queues/emails?search=t2",
                     "/queues/nope", "/readyz"):
            status, _ = await get(http, dash.url(path))
            assert status in (200, 404), path
        await asyncio.sleep(1.0)  # about 20 rounds of its background loop
    assert write_calls(server) == writes
    after = snapshot(server)
    assert after["functions"] == before["functions"]
    changed = {k for k in before["keys"].keys() | after["keys"].keys() if before["keys"].get(k) != after["keys"].get(k)}
    assert changed == set(), {k: (before["keys"].get(k), after["keys"].get(k)) for k in changed}
