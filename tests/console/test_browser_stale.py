"""The console says when its data is not live, in a real browser (Debian's
chromium driven by Playwright) against the local stack: with Redis stopped the
cluster view shows a banner saying the ledger cannot be read and keeps the
last snapshot marked stale; with NATS stopped the audit view says its feed may
miss newer events; both banners go once the server reads again.

The stack is this module's own: stopping Redis or NATS under the stack the
other browser tests share would disturb their pods.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, async_playwright, expect

from gpuslice_cli.dev.stack import Stack
from gpuslice_common.ledger import Ledger
from tests.conftest import Native
from tests.console.workload import DESKTOP, WAIT_MS, chromium
from tests.dev.conftest import stack_up

pytestmark = pytest.mark.asyncio(loop_scope="module")
expect.set_options(timeout=WAIT_MS)

SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"


@dataclass
class Console:
    stack: Stack
    ledger: Ledger
    url: str
    browser: Browser


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(
    native: Native, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Console]:
    work = tmp_path_factory.mktemp("stale")
    async with stack_up(Stack(work / "stack", heartbeat_s=1.0)) as (stack, _, _, ledger):
        assert stack.console_url is not None
        async with async_playwright() as playwright:
            executable, args = chromium()
            browser = await playwright.chromium.launch(executable_path=executable, args=args)
            try:
                yield Console(stack, ledger, stack.console_url, browser)
            finally:
                await browser.close()


@pytest_asyncio.fixture(loop_scope="module")
async def page(console: Console) -> AsyncIterator[Page]:
    """A fresh browser context at desktop size; no console or script error may
    happen, not even while Redis or NATS is away (the page's stream and its
    requests go to the inventory, which still answers)."""
    context = await console.browser.new_context(viewport=DESKTOP)
    page = await context.new_page()
    page.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"script error: {e}"))
    try:
        yield page
    finally:
        await context.close()
    assert errors == []


async def show(page: Page, console: Console, route: str) -> None:
    await page.goto(f"{console.url}{route}")
    await expect(page.get_by_test_id("live")).to_have_attribute("data-state", "live")


async def test_the_cluster_view_says_the_ledger_cannot_be_read_and_keeps_the_last_data(
    console: Console, page: Page
) -> None:
    node = console.stack.nodes[0]
    card = (await console.ledger.node_gpus(node.name))[0].device.uuid
    await show(page, console, "#/cluster")
    content = page.get_by_test_id("cluster-content")
    banner = page.get_by_test_id("data-problem")
    await expect(page.get_by_test_id(f"card-{card}")).to_be_visible()
    await expect(banner).to_have_count(0)
    await expect(content).to_have_attribute("data-stale", "false")
    await expect(page.locator(".stamp")).not_to_contain_text("not live")

    redis = console.stack.server("redis")
    redis.stop()
    try:
        await expect(banner).to_be_visible()
        await expect(banner).to_contain_text("The cluster view is not live")
        await expect(banner).to_contain_text("the ledger cannot be read")
        await expect(banner).to_contain_text("what is shown was read at 20")
        # the live region the banner appears in: announced to a screen reader
        await expect(page.get_by_role("alert").filter(has=banner)).to_have_count(1)
        # the last snapshot is still shown, marked stale
        await expect(content).to_have_attribute("data-stale", "true")
        await expect(page.get_by_test_id(f"card-{card}")).to_be_visible()
        await expect(page.get_by_test_id(f"node-{node.name}")).to_be_visible()
        await expect(page.locator(".stamp")).to_contain_text("not live")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)  # for the documentation
        await page.screenshot(path=SCREENSHOTS / "cluster-stale.png", full_page=True)
    finally:
        redis.start()
    await expect(banner).to_have_count(0)
    await expect(content).to_have_attribute("data-stale", "false")
    await expect(page.locator(".stamp")).not_to_contain_text("not live")
    await expect(page.get_by_test_id(f"card-{card}")).to_be_visible()
    await expect(page.get_by_test_id("live")).to_have_attribute("data-state", "live")


async def test_the_audit_view_says_its_feed_may_miss_newer_events(
    console: Console, page: Page
) -> None:
    await show(page, console, "#/audit")
    banner = page.get_by_test_id("data-problem")
    await expect(page.get_by_test_id("audit-status")).to_contain_text("newest first")
    await expect(banner).to_have_count(0)
    events = page.locator(".table-wrap")
    await expect(events).to_have_attribute("data-stale", "false")

    nats = console.stack.server("nats")
    nats.stop()
    try:
        await expect(banner).to_be_visible()
        await expect(banner).to_contain_text("The audit view is not live")
        await expect(banner).to_contain_text("newer events may be missing")
        await expect(events).to_have_attribute("data-stale", "true")
        await expect(page.get_by_test_id("audit-table")).to_be_visible()
    finally:
        nats.start()
    await expect(banner).to_have_count(0)
    await expect(events).to_have_attribute("data-stale", "false")
