"""A real browser (Debian's Chromium through Playwright)
against the real dashboard and a real redis-server."""

from __future__ import annotations

from urllib.parse import quote

import aiohttp
import pytest

from effectmq import TaskQueue

from .seed import two_queues

pytestmark = pytest.mark.timeout(120)


async def count(page, queue: str, state: str) -> str:
    return (await page.locator(f'[data-queue="{queue}"] [data-count="{state}"] .n').first.text_content()).strip()


async def sign_in(page, dash) -> None:
    await page.goto(dash.url("/login"))
    await page.fill('input[name="token"]', dash.token)
    await page.click('button[type="submit"]')
    await page.wait_for_url(dash.url("/"))


async def test_overview_lists_both_queues_with_their_counts(redis_url, start_dashboard, browser, screenshot_dir):
    await two_queues(redis_url)
    dash = await start_dashboard(redis_url)
    page = await browser.new_page()
    await page.goto(dash.url("/"))
    cards = page.locator("section.queue-card")
    assert await cards.count() == 2
    assert [await c.get_attribute("data-queue") for c in await cards.all()] == ["emails", "reports/daily"]
    expected = {"emails": {"waiting": "3", "active": "1", "completed": "2", "failed": "2", "delayed": "0"},
                "reports/daily": {"waiting": "2", "delayed": "1", "failed": "0"}}
    for queue, counts in expected.items():
        for state, n in counts.items():
            assert await count(page, queue, state) == n, (queue, state)
    emails = page.locator('[data-queue="emails"]')
    assert (await emails.locator('[data-field="worker_count"]').text_content()).strip() == "1"
    await page.wait_for_selector('[data-queue="emails"] .chart canvas')  # uPlot drew the throughput chart
    await page.screenshot(path=str(screenshot_dir / "overview.png"), full_page=True)

    # live: a new task shows up in the counts without a reload
    await page.evaluate("window.__notReloaded = true")
    async with TaskQueue("reports/daily", url=redis_url) as q:
        await q.offer("send_report", {"report": "new"})
    await page.wait_for_function(
        """() => document.querySelector('[data-queue="reports/daily"] [data-count="waiting"] .n')"""
        """.textContent.trim() === "3" """,
        timeout=10_000)
    assert await page.evaluate("window.__notReloaded") is True


async def test_failed_task_page_shows_error_tag_and_message(redis_url, start_dashboard, browser, screenshot_dir):
    seeded = await two_queues(redis_url)
    dash = await start_dashboard(redis_url)
    page = await browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(dash.url("/queues/emails?state=failed"))
    row = page.locator(f'tr[data-task="{seeded["typed"]}"]')
    assert "MailboxFull" in await row.text_content()
    await row.locator("a").click()
    await page.wait_for_url(f"**/queues/emails/tasks/{seeded['typed']}")
    assert (await page.text_content("#error-tag")).strip() == "MailboxFull"
    assert (await page.text_content("#error-message")).strip() == "mailbox of user2@example.com is full"
    assert "failed" in await page.text_content("#task-state")
    attempts = page.locator("#attempts tbody tr")
    assert await attempts.count() == 1
    assert "MailboxFull" in await attempts.first.text_content()
    assert "user2@example.com" in await page.text_content('pre[data-field="payload"]')
    events = [(await e.text_content()).split() for e in await page.locator("#events li").all()]
    assert [e[2] for e in events] == ["created", "active", "failed"], events  # time, time, event, fields
    assert events[1][3:] == ["attempt=1"] and events[2][3:] == ["kind=handler"], events
    await page.wait_for_timeout(2500)  # one poll: the live update keeps the page as it was
    assert (await page.text_content("#error-tag")).strip() == "MailboxFull"
    assert events == [(await e.text_content()).split() for e in await page.locator("#events li").all()]
    await page.screenshot(path=str(screenshot_dir / "failed-task.png"), full_page=True)
    assert errors == []


async def test_retry_of_a_dead_letter_moves_it_to_waiting_without_a_reload(redis_url, start_dashboard, browser):
    seeded = await two_queues(redis_url)
    dash = await start_dashboard(redis_url, actions=True)
    page = await browser.new_page()
    await sign_in(page, dash)
    await page.goto(dash.url("/queues/emails?state=failed"))
    await page.evaluate("window.__notReloaded = true")
    row = page.locator(f'tr[data-task="{seeded["defect"]}"]')
    await row.locator('button:has-text("Retry")').click()
    await page.wait_for_selector(f'tr[data-task="{seeded["defect"]}"]', state="detached", timeout=10_000)
    await page.wait_for_function(
        """() => document.querySelector('.tabs [data-count="waiting"] .n').textContent.trim() === "4" """)
    assert "now waiting" in await page.text_content("#toast")
    assert await page.evaluate("window.__notReloaded") is True
    async with TaskQueue("emails", url=redis_url) as q:
        info = await q.get(seeded["defect"])
    assert info is not None and info.state == "waiting" and info.handler_failure_count == 0

    # a running task: the engine refuses the retry, the page says why, the API answers 409
    await page.goto(dash.url(f"/queues/emails/tasks/{quote(seeded['running'], safe='')}"))
    await page.click("#retry")
    await page.wait_for_selector("#toast.error")
    assert "is running" in await page.text_content("#toast")
    api = dash.url(f"/api/queues/emails/tasks/{quote(seeded['running'], safe='')}/retry")
    async with aiohttp.ClientSession() as http:
        async with http.post(api, headers={"Authorization": f"Bearer {dash.token}"}) as r:
            assert r.status == 409
            assert "is running" in (await r.json())["message"]
        # the session cookie alone does not act (CSRF): the page's header is needed too
        cookie = {"effectmq_session": (await page.context.cookies())[0]["value"]}
        async with http.post(api, cookies=cookie) as r:
            assert r.status == 403
    async with TaskQueue("emails", url=redis_url) as q:
        assert (await q.get(seeded["running"])).state == "active"


async def test_read_only_dashboard_has_no_buttons_and_refuses_actions(redis_url, start_dashboard, browser):
    seeded = await two_queues(redis_url)
    dash = await start_dashboard(redis_url)  # no --actions
    page = await browser.new_page()
    for path in ("/", "/queues/emails?state=failed", f"/queues/emails/tasks/{seeded['defect']}", "/schedules"):
        await page.goto(dash.url(path))
        assert await page.locator("button[data-action]").count() == 0, path
        assert await page.locator("button").count() == 0, path
        assert "read-only" in await page.text_content("header")
    async with aiohttp.ClientSession() as http:
        for action in (f"tasks/{seeded['defect']}/retry", f"tasks/{seeded['ids'][0]}/cancel", "retry-all", "pause"):
            for headers in ({}, {"Authorization": "Bearer anything", "X-EffectMQ-Action": "1"}):
                async with http.post(dash.url(f"/api/queues/emails/{action}"), headers=headers) as r:
                    assert r.status == 403, action
                    assert "read-only" in (await r.json())["error"]
    async with TaskQueue("emails", url=redis_url) as q:
        assert (await q.get(seeded["defect"])).state == "failed"
        assert (await q.stats()).paused is False
