"""The dashboard against real Redis, below the browser: which queues it shows, that it
keeps lifecycle events written, and that user data is escaped in pages and links."""

from __future__ import annotations

import asyncio
import shutil
from urllib.parse import quote

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis

from effectmq import TaskQueue
from effectmq.client.discovery import discover_queues
from tests.fixtures.redis import free_port

pytestmark = pytest.mark.timeout(60)

NASTY_ID = '"><img src=x onerror=alert(1)>/../?a=1&b=<script>'


async def test_discovery_finds_used_queues_only(redis_url):
    async with TaskQueue("offered.to", url=redis_url) as a, TaskQueue("only/configured", url=redis_url) as b:
        await a.offer("job", {})
        await a.offer("job", {}, task_id="x}:seq")  # a task key that ends like a marker
        await b.configure(max_active=3)
    async with TaskQueue("never-used", url=redis_url):
        pass
    async with aioredis.Redis.from_url(redis_url, decode_responses=True) as client:
        assert await discover_queues(client) == ["offered.to", "only/configured"]
        assert await discover_queues(client, prefix="other") == []


async def test_queues_given_limit_what_is_shown(redis_url, start_dashboard):
    for name in ("shown", "hidden"):
        async with TaskQueue(name, url=redis_url) as q:
            await q.offer("job", {}, task_id="t1")
    dash = await start_dashboard(redis_url, queues=("shown",))
    async with aiohttp.ClientSession() as http:
        async with http.get(dash.url("/api/queues")) as r:
            assert [q["name"] for q in (await r.json())["queues"]] == ["shown"]
        for path in ("/queues/hidden", "/api/queues/hidden/tasks/t1", "/queues/hidden/tasks/t1"):
            async with http.get(dash.url(path)) as r:
                assert r.status == 404, path
    # without --queue, a queue created after the dashboard started shows up at once
    dash_all = await start_dashboard(redis_url)
    async with aiohttp.ClientSession() as http:
        async with http.get(dash_all.url("/api/queues")) as r:
            assert [q["name"] for q in (await r.json())["queues"]] == ["hidden", "shown"]
        async with TaskQueue("newer", url=redis_url) as q:
            await q.offer("job", {}, task_id="n1")
        async with http.get(dash_all.url("/queues/newer/tasks/n1")) as r:
            assert r.status == 200


async def test_the_dashboard_keeps_lifecycle_events_written(redis_url, start_dashboard):
    """With actions, or told to (--want-events): it writes to every queue, so a read-only
    dashboard does not by default (test_redis_load: it writes nothing)."""
    async with TaskQueue("watched", url=redis_url) as q:
        await q.offer("job", {}, task_id="before")
        dash = await start_dashboard(redis_url, want_events=True)
        for _ in range(50):  # its background loop registers interest for every queue it shows
            if await q.redis.hget(q.keys.key("meta"), "events_until"):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the dashboard never called want_events()")
        await q.offer("job", {}, task_id="after")
    async with aiohttp.ClientSession() as http:
        async with http.get(dash.url("/api/queues/watched/tasks/after")) as r:
            assert [e["event"] for e in (await r.json())["events"]] == ["created"]


async def test_names_and_ids_are_escaped_and_encoded(redis_url, start_dashboard, browser):
    async with TaskQueue("q.a-b", url=redis_url) as q:
        await q.offer("<b>name</b>", {"html": "<script>alert(2)</script>"}, task_id=NASTY_ID)
        lease = await q.acquire()
        await lease.fail(RuntimeError("<i>boom</i>"), retryable=False)
    dash = await start_dashboard(redis_url)
    page = await browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), asyncio.ensure_future(d.dismiss())))
    await page.goto(dash.url("/queues/q.a-b?state=failed"))
    link = page.locator("#tasks td.id a")
    assert await link.text_content() == NASTY_ID
    assert await link.get_attribute("href") == f"/queues/q.a-b/tasks/{quote(NASTY_ID, safe='')}"
    await page.wait_for_timeout(2300)  # after a poll re-rendered the rows
    assert await page.locator("#tasks td.id a").text_content() == NASTY_ID
    await page.locator("#tasks td.id a").click()
    await page.wait_for_selector("#error-message")
    assert (await page.text_content("h1 .id")) == NASTY_ID
    assert (await page.text_content("#error-message")).strip() == "RuntimeError: <i>boom</i>"
    assert "<script>alert(2)</script>" in await page.text_content('pre[data-field="payload"]')
    await page.wait_for_timeout(2300)
    assert await page.locator("img, i, b, main script:not([type=\"application/json\"])").count() == 0
    assert dialogs == []


async def test_a_redis_that_refuses_new_tasks_is_named_on_every_refresh(make_redis, start_dashboard):
    """Was: with Redis full (maxmemory, noeviction) every offer failed with OOM while the
    dashboard showed the queues as if all were well."""
    server = make_redis()
    admin = server.client()
    async with TaskQueue("shop/orders", url=server.url) as q:
        await q.offer("job", {}, task_id="t1")
    dash = await start_dashboard(server.url)

    async def notes(path: str = "/api/queues") -> list[str]:
        async with aiohttp.ClientSession() as http:
            async with http.get(dash.url(path)) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["redis"]["notes"]

    assert await notes() == []
    admin.config_set("maxmemory", "1")
    try:
        (full,) = await notes()
        assert "refuses new tasks" in full and "maxmemory" in full and "noeviction" in full, full
        (on_queue_page,) = await notes("/api/queues/shop%2Forders")  # the queue's page says so too
        assert on_queue_page.startswith("Redis is full (")
        async with aiohttp.ClientSession() as http:
            async with http.get(dash.url("/")) as r:
                assert "refuses new tasks" in await r.text()  # the first paint, before any refresh
    finally:
        admin.config_set("maxmemory", "0")
    assert await notes() == []
    admin.config_set("maxmemory-policy", "allkeys-lru")
    (evicts,) = await notes()
    assert "evicts keys" in evicts and "allkeys-lru" in evicts
    admin.config_set("maxmemory-policy", "noeviction")
    admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # never reachable: the data stays
    try:
        (replica,) = await notes()
        assert "read-only replica" in replica, replica
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")
    assert await notes() == []
    # An RDB save that fails (its folder is gone) refuses writes only with save points set.
    shutil.rmtree(server.workdir)
    admin.config_set("save", "3600 1")
    admin.bgsave()
    for _ in range(100):
        if admin.info("persistence")["rdb_last_bgsave_status"] == "err":
            break
        await asyncio.sleep(0.05)
    (misconf,) = await notes()
    assert "refuses new tasks (MISCONF)" in misconf, misconf
    with pytest.raises(redis.exceptions.ResponseError, match="MISCONF"):
        admin.set("probe", "1")  # as Redis itself says
    admin.config_set("save", "")
    (unsaved,) = await notes()
    assert "still takes new tasks" in unsaved, unsaved
    admin.set("probe", "1")


async def test_on_a_cluster_the_primary_that_refuses_new_tasks_is_named(redis_cluster, start_dashboard):
    url = redis_cluster.url()
    async with TaskQueue("shop/orders", url=url) as q:
        await q.offer("job", {}, task_id="t1")
    dash = await start_dashboard(url)
    full = redis_cluster.masters()[1]
    full.client().config_set("maxmemory", "1")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(dash.url("/api/queues")) as r:
                body = await r.json()
        (note,) = body["redis"]["notes"]
        assert note.startswith(f"127.0.0.1:{full.port}: Redis is full ("), note
        assert [q["name"] for q in body["queues"]] == ["shop/orders"]
    finally:
        full.client().config_set("maxmemory", "0")


async def test_on_a_replica_the_events_it_cannot_ask_for_are_logged_once(make_redis, start_dashboard,
                                                                          monkeypatch, caplog):
    """Was: a warning every 20 s for as long as the dashboard read a replica."""
    import logging

    from effectmq.dashboard import service

    monkeypatch.setattr(service, "EVENTS_EVERY", 0.05)
    server = make_redis()
    admin = server.client()
    async with TaskQueue("shop/orders", url=server.url) as q:
        await q.offer("job", {}, task_id="t1")
    admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
    try:
        with caplog.at_level(logging.INFO, logger="effectmq.dashboard"):
            await start_dashboard(server.url, actions=True)  # with actions it asks for events
            await asyncio.sleep(1.0)  # about 20 rounds of the loop
            warned = [r for r in caplog.records if "could not register interest" in r.getMessage()]
            assert len(warned) == 1 and "READONLY" in warned[0].getMessage()
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")
    with caplog.at_level(logging.INFO, logger="effectmq.dashboard"):
        for _ in range(40):
            if any("registered again" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the recovery was not logged")


async def test_the_poison_filter_lists_tasks_that_killed_their_workers_pod_twice(redis_url, start_dashboard):
    from effectmq import PodIdentity, WorkerEnding
    from effectmq.transport.clock import server_time_ms

    pod = PodIdentity("emails-worker-7d9f-x2", "uid-1", "n1")
    async with TaskQueue("emails", url=redis_url, lock_timeout=0.05) as q:
        await q.offer("job", {}, task_id="bomb", max_stalled_count=5)
        for _ in range(2):  # each attempt's pod is OOMKilled
            await q.worker_beat("w", 1, 1, 60, pod=pod)
            lease = await q.acquire()
            assert lease.task_id == "bomb"
            await q.record_worker_ending(WorkerEnding(pod.name, pod.uid, pod.node, "oom_killed", 137,
                                                      finished_at_ms=await server_time_ms(q.redis, q.keys.base)))
            await asyncio.sleep(0.1)
            assert (await q.maintain()).stall_causes == {"oom_killed": 1}
        await q.offer("job", {}, task_id="fine")
    dash = await start_dashboard(redis_url)
    async with aiohttp.ClientSession() as http:
        async with http.get(dash.url("/api/queues/emails?state=poison")) as r:
            listing = await r.json()
        assert [t["task_id"] for t in listing["tasks"]] == ["bomb"]
        assert listing["queue"]["poison"] == 1 and listing["page"]["total"] == 1
        async with http.get(dash.url("/queues/emails?state=poison")) as r:
            page = await r.text()
        assert 'href="/queues/emails?state=poison"' in page and "bomb" in page and "fine" not in page
        async with http.get(dash.url("/api/queues/emails/tasks/bomb")) as r:
            task = (await r.json())["task"]
        assert task["poison"] is True and [a["cause_text"] for a in task["attempt_rows"][:2]] == [
            "pod emails-worker-7d9f-x2 OOMKilled (exit 137) on node n1"] * 2
        async with http.get(dash.url("/queues/emails/tasks/bomb")) as r:
            page = await r.text()
        assert "stalled: pod emails-worker-7d9f-x2 OOMKilled (exit 137) on node n1" in page
        assert '<span class="badge poison">poison</span>' in page


NASTY_GROUP = '"><img src=x onerror=alert(1)>&<script>'


async def tenants(url: str) -> None:
    """Group NASTY_GROUP paused, "capped" at 1 (capped-0 running): 5 tasks parked; then
    "busy" offers 5 and "few" 1, left waiting."""
    async with TaskQueue("tenants", url=url) as q:
        await q.pause_group(NASTY_GROUP)
        await q.configure_group("capped", max_active=1)
        await q.offer_many([("job", {}, {"group": g, "task_id": f"{g[:1]}-{i}"}) for g in (NASTY_GROUP, "capped")
                            for i in range(3)])
        leases, _ = await q.acquire_many(10)
        assert [lease.task_id for lease in leases] == ["c-0"]
        await q.offer_many([("job", {}, {"group": g, "task_id": f"{g}-{i}"}) for g, n in (("busy", 5), ("few", 1))
                            for i in range(n)])
        assert ((await q.stats()).parked, (await q.stats()).waiting) == (5, 6)


async def test_the_groups_section_and_the_parked_list(redis_url, start_dashboard):
    await tenants(redis_url)
    dash = await start_dashboard(redis_url)
    async with aiohttp.ClientSession() as http:
        async def api(query: str) -> dict:
            async with http.get(dash.url(f"/api/queues/tenants?{query}")) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        shown = await api("")
        assert (shown["queue"]["parked"], shown["queue"]["group_caps"]) == (5, True)
        groups = shown["groups"]
        assert [(g["group"], g["waiting"]) for g in groups["rows"]] == [("busy", 5), ("few", 1)]  # busiest first
        assert groups["page"]["total"] == 2 and groups["group"] is None
        assert groups["columns"] == ["waiting", "active", "parked", "max_active", "paused", "rate_limit"]

        parked = await api("state=parked")
        assert [(t["task_id"], t["group"], t["state"]) for t in parked["tasks"]] == [
            (f"\"-{i}", NASTY_GROUP, "waiting") for i in range(3)] + [(f"c-{i}", "capped", "waiting") for i in (1, 2)]
        assert parked["page"]["total"] == 5
        assert [t["task_id"] for t in (await api("state=parked&offset=1&limit=2"))["tasks"]] == ['"-1', '"-2']

        one = await api("state=parked&group=capped")
        assert [t["task_id"] for t in one["tasks"]] == ["c-1", "c-2"] and one["page"]["total"] == 2
        assert one["group"] == "capped"
        looked_up = one["groups"]["group"]
        assert {k: looked_up[k] for k in one["groups"]["columns"]} == {
            "waiting": 0, "active": 1, "parked": 2, "max_active": 1, "paused": False, "rate_limit": None}
        nasty = await api(f"state=parked&group={quote(NASTY_GROUP, safe='')}")
        assert nasty["groups"]["group"]["shown"]["paused"] == "yes" and nasty["page"]["total"] == 3
        assert [g["group"] for g in (await api("groups_limit=1"))["groups"]["rows"]] == ["busy"]
        later = (await api("groups_offset=1&groups_limit=1"))["groups"]
        assert [g["group"] for g in later["rows"]] == ["few"] and later["page"]["previous"] == 0

        for query, says in (("groups_offset=-1", "groups_offset must be between"),
                            ("groups_limit=100000", "groups_limit between 1 and"),
                            ("groups_offset=abc", "groups_offset and groups_limit must be integers"),
                            ("groups_offset=99999999999999999999", "groups_offset must be between"),
                            ("state=parked&group=a%09b", "control characters"),
                            (f"state=parked&group={'x' * 200}", "at most MAX_GROUP_BYTES")):
            for path in (f"/queues/tenants?{query}", f"/api/queues/tenants?{query}",
                         f"/api/queues/tenants/tasks?{query}"):
                async with http.get(dash.url(path)) as r:
                    body = await r.text()
                    if "groups_" in query and "/tasks?" in path:  # the task list takes no groups page
                        assert r.status == 200, (path, body[:300])
                        continue
                    assert r.status == 400 and says in body, (path, r.status, body[:300])

        async with http.get(dash.url(f"/queues/tenants?state=parked&group={quote(NASTY_GROUP, safe='')}")) as r:
            page = await r.text()
        assert r.status == 200
        assert NASTY_GROUP not in page and "<img" not in page  # escaped in the heading, the rows, the form
        assert page.count("&#34;&gt;&lt;img src=x onerror=alert(1)&gt;&amp;&lt;script&gt;") >= 5
        assert f'href="/queues/tenants?state=parked&amp;group={quote(NASTY_GROUP, safe="")}"' in page


async def test_a_groups_name_shows_as_text_in_a_real_browser(redis_url, start_dashboard, browser, screenshot_dir):
    await tenants(redis_url)
    dash = await start_dashboard(redis_url)
    page = await browser.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), asyncio.ensure_future(d.dismiss())))
    await page.goto(dash.url("/queues/tenants?state=parked"))
    assert await page.locator("#tasks td.group").all_text_contents() == [NASTY_GROUP] * 3 + ["capped"] * 2
    await page.fill('input[name="group"]', NASTY_GROUP)  # the lookup form
    await page.press('input[name="group"]', "Enter")
    await page.wait_for_selector("#parked-group")
    assert await page.text_content("#parked-group") == NASTY_GROUP
    looked_up = page.locator("#group-table tr.looked-up")
    assert await looked_up.locator("td.id a").text_content() == NASTY_GROUP
    assert await looked_up.locator('td[data-field="parked"]').text_content() == "3"
    assert await page.locator("#tasks td.id a").all_text_contents() == ['"-0', '"-1', '"-2']
    await page.wait_for_timeout(2300)  # after a poll re-rendered the rows and the groups
    assert await page.locator("#group-table tr.looked-up td.id a").text_content() == NASTY_GROUP
    assert await page.locator("#group-table tbody tr:not(.looked-up) td.id a").all_text_contents() == ["busy", "few"]
    assert await page.locator("#tasks td.group").all_text_contents() == [NASTY_GROUP] * 3
    await page.screenshot(path=str(screenshot_dir / "queue-groups.png"), full_page=True)
    assert await page.locator("img, main script:not([type=\"application/json\"])").count() == 0
    assert dialogs == []
