"""The web console in a real browser: Debian's chromium driven by Playwright,
against the local stack (real nats-server and redis-server, the four services
as processes, two simulated nodes whose containers run the probe under the
interposer on the fake CUDA driver).

One stack serves the whole module. While the tests run it holds a pod that
grows its device memory when the test lets it (the probe waits on a file the
test keeps locked), a pod with a 63-character name sharing a card, one taking
all of a card's cores and little of its memory, and a pod the webhook denied.
Every page must load without a console error (a CSP violation is one) and
without a script error.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, async_playwright, expect

from gpuslice_cli.dev.driver import ClusterDriver, PodOutcome
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import (
    ContainerAssignment,
    DeviceGrant,
    NodeInventory,
    Placement,
    PodRef,
)
from tests.conftest import Native, make_vendor_inventory
from tests.console.workload import (
    DESKTOP,
    PHONE,
    WAIT_MS,
    Gate,
    card_of,
    chromium,
    gpu_pod,
    on_its_card,
)
from tests.dev.conftest import stack_up

pytestmark = pytest.mark.asyncio(loop_scope="module")
expect.set_options(timeout=WAIT_MS)

SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"
LONG_NAME = "a-tenant-chose-a-very-long-pod-name-to-see-whether-it-wraps-ok"  # 63 characters
DENIED_REASON = "nvidia.com/gpucores must be between 0 and 100, got 150"


@dataclass
class Console:
    stack: Stack
    driver: ClusterDriver
    ledger: Ledger
    url: str
    browser: Browser
    grower_card: str  # the UUID of the card team-a/grower holds
    grow: Gate  # opened: the grower allocates 1 GiB more
    denied: PodOutcome


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(
    native: Native, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Console]:
    work = tmp_path_factory.mktemp("console")
    grow, done = Gate(work / "grow"), Gate(work / "done")
    async with stack_up(Stack(work / "stack", heartbeat_s=1.0)) as (stack, driver, _, ledger):
        assert stack.console_url is not None
        running = [
            asyncio.create_task(
                driver.run_pod(
                    gpu_pod(
                        "grower",
                        on_its_card("alloc", "256m", "lock", str(grow.path),
                                    "alloc", "1g", "lock", str(done.path)),
                        gpumem=4000,
                        gpucores=30,
                    ),
                    namespace="team-a",
                )
            ),
            asyncio.create_task(
                driver.run_pod(
                    gpu_pod(LONG_NAME, on_its_card("alloc", "1g", "lock", str(done.path)),
                            gpumem=8000),
                    namespace="team-b",
                )
            ),
            asyncio.create_task(
                driver.run_pod(
                    gpu_pod("all-cores", on_its_card("lock", str(done.path)),
                            gpumem=2000, gpucores=100),
                    namespace="team-b",
                )
            ),
        ]  # fmt: skip
        try:
            denied = await driver.run_pod(
                gpu_pod("bad-cores", ["probe", "init"], gpumem=1000, gpucores=150),
                namespace="team-c",
            )
            assert denied.phase == "Denied", denied
            grower_card = await card_of(stack, ledger, "team-a", "grower")
            await card_of(stack, ledger, "team-b", LONG_NAME)
            await card_of(stack, ledger, "team-b", "all-cores")
            async with async_playwright() as playwright:
                executable, args = chromium()
                browser = await playwright.chromium.launch(executable_path=executable, args=args)
                try:
                    yield Console(
                        stack, driver, ledger, stack.console_url, browser, grower_card, grow, denied
                    )
                finally:
                    await browser.close()
        finally:
            grow.open()
            done.open()
            outcomes = await asyncio.wait_for(asyncio.gather(*running), WAIT_MS / 1000)
            for outcome in outcomes:
                assert outcome.phase == "Succeeded", (outcome.ref, outcome.reason)


@pytest_asyncio.fixture(loop_scope="module")
async def page(console: Console) -> AsyncIterator[Page]:
    """A fresh browser context at desktop size; no console or script error may happen."""
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


async def value_now(page: Page, testid: str) -> float:
    value = await page.get_by_test_id(testid).get_attribute("aria-valuenow")
    assert value is not None
    return float(value)


async def wait_value_at_least(page: Page, testid: str, least: float) -> None:
    await page.wait_for_function(
        """([testid, least]) => {
            const bar = document.querySelector(`[data-testid="${testid}"]`);
            return bar !== null && Number(bar.getAttribute('aria-valuenow')) >= least;
        }""",
        arg=[testid, least],
        timeout=WAIT_MS,
    )


async def wait_chart_at_least(page: Page, table: str, field: str, least: float) -> float:
    """The newest value of ``field`` in the hidden table of chart ``table``, once
    it reaches ``least``."""
    found = await page.wait_for_function(
        """([table, field, least]) => {
            const cells = document.querySelectorAll(
                `[data-testid="${table}"] tbody tr td[data-field="${field}"][data-value]`);
            const value = cells.length ? Number(cells[cells.length - 1].dataset.value) : NaN;
            return value >= least ? value : null;
        }""",
        arg=[table, field, least],
        timeout=WAIT_MS,
    )
    return float(await found.json_value())


# ---------------------------------------------------------------- the views


async def test_the_grid_shows_every_card_and_the_running_pod_on_its_card(
    console: Console, page: Page
) -> None:
    await show(page, console, "#/cluster")
    for node in console.stack.nodes:
        section = page.get_by_test_id(f"node-{node.name}")
        await expect(section).to_be_visible()
        await expect(section.locator('[data-testid^="card-"]')).to_have_count(node.gpus)
        for card in await console.ledger.node_gpus(node.name):
            tile = section.get_by_test_id(f"card-{card.device.uuid}")
            await expect(tile).to_contain_text(card.device.model)
            await expect(tile).to_contain_text(f"#{card.device.index}")
            # its node agent's report of the layers that enforce there
            layers = tile.get_by_test_id(f"layers-{card.device.uuid}")
            await expect(layers).to_contain_text("Enforced by")
            await expect(layers).to_contain_text("interposer")
    assert await page.locator('[data-testid^="node-"]').count() == len(console.stack.nodes)
    await expect(page.get_by_test_id("summary-cards")).to_contain_text(
        str(sum(n.gpus for n in console.stack.nodes))
    )
    # the scheduler's report (written every ~2 s): its measure and what still fits
    await expect(page.get_by_test_id("cluster-fragmentation")).to_have_text(
        re.compile(r"^(\d+(\.\d)?|<1)%$")
    )
    await expect(page.get_by_test_id("fits").locator("li").first).to_contain_text(" \u00d7 ")

    # the running pod is on the card the ledger gave it, and nowhere else
    link = page.get_by_test_id("pod-link-team-a-grower")
    await expect(link).to_have_count(1)
    held = page.get_by_test_id(f"card-{console.grower_card}")
    await expect(held.get_by_test_id("pod-link-team-a-grower")).to_be_visible()
    await expect(held).to_contain_text("4000 MiB")  # its share, as asked (not "3.9 GiB")
    await link.click()
    await expect(page).to_have_url(f"{console.url}#/pods/team-a/grower")
    await expect(page.get_by_role("heading", level=1)).to_have_text("team-a/grower")


async def test_a_pods_memory_bar_and_chart_move_when_its_process_allocates(
    console: Console, page: Page
) -> None:
    bar = f"mem-bar-main-{console.grower_card}"
    await show(page, console, "#/pods/team-a/grower")
    located = page.get_by_test_id(bar)
    await expect(located).to_have_attribute("role", "progressbar")
    await expect(located).to_have_attribute("aria-valuemax", "4000")  # its limit, MiB
    await wait_value_at_least(page, bar, 256)  # the first 256 MiB, measured
    before = await value_now(page, bar)
    assert before < 4000
    # its last hour: allocated and limit its share, measured what the probe holds
    table = "history-pod-memory"
    charted = await wait_chart_at_least(page, table, "measured_mib", 256)
    assert charted < 1000
    assert await wait_chart_at_least(page, table, "allocated_mib", 4000) == 4000
    assert await wait_chart_at_least(page, table, "limit_mib", 4000) == 4000
    assert await wait_chart_at_least(page, "history-pod-compute", "cores", 30) == 30
    chart = page.get_by_test_id("chart-pod-memory")
    await expect(chart).to_have_attribute("role", "img")
    label = re.compile(r"^Memory, last hour: allocated now \S+ \w+, lowest .*; measured now ")
    await expect(chart).to_have_attribute("aria-label", label)

    console.grow.open()  # the probe goes on: 1 GiB more
    await wait_value_at_least(page, bar, before + 1000)
    after = await value_now(page, bar)
    assert before + 1000 <= after <= 4000
    # the chart follows without a reload, and says so in its label
    assert await wait_chart_at_least(page, table, "measured_mib", charted + 1000) <= 4000
    grown = re.compile(r"measured now (1(\.\d)? GiB|1\d{3} MiB)")
    await expect(chart).to_have_attribute("aria-label", grown)
    await expect(located).to_have_attribute(
        "aria-valuetext", re.compile(r"^\d(\.\d)? GiB of 4000 MiB used, peak \d(\.\d)? GiB$")
    )
    # the page was not reloaded: the stream brought it
    await expect(page.get_by_test_id(f"pod-card-main-{console.grower_card}")).to_contain_text("GiB")


async def test_a_cards_page_and_the_cluster_show_their_last_hour(
    console: Console, page: Page
) -> None:
    await show(page, console, "#/cluster")
    await page.get_by_test_id(f"history-link-{console.grower_card}").click()
    await expect(page).to_have_url(re.compile(rf"#/cards/[^/]+/{console.grower_card}$"))
    await expect(page.get_by_test_id(f"card-{console.grower_card}")).to_be_visible()
    # the grower's 4000 MiB at least are allocated on its card; its memory is the limit
    assert await wait_chart_at_least(page, "history-card-memory", "allocated_mib", 4000) >= 4000
    assert await wait_chart_at_least(page, "history-card-memory", "limit_mib", 4000) > 4000
    assert await wait_chart_at_least(page, "history-card-memory", "measured_mib", 256) >= 256
    await expect(page.get_by_test_id("chart-card-compute")).to_have_attribute("role", "img")
    assert await page.evaluate(ACCESSIBILITY) == []  # the card's page passes the checks too

    await show(page, console, "#/cluster")
    allocated = await wait_chart_at_least(page, "history-cluster-allocation", "memory", 0.1)
    assert allocated <= 100
    await expect(page.get_by_test_id("chart-cluster-fragmentation")).to_have_attribute(
        "aria-label", re.compile(r"^Fragmentation, last hour: fragmentation ")
    )


async def test_a_denied_pod_shows_its_reason(console: Console, page: Page) -> None:
    assert DENIED_REASON in console.denied.reason
    await show(page, console, "#/pods")
    row = page.get_by_test_id("pod-row-team-c-bad-cores")
    await expect(row).to_contain_text("denied")
    await expect(row).to_contain_text(DENIED_REASON)
    await row.get_by_role("link").click()
    await expect(page.get_by_test_id("pod-reason")).to_contain_text(DENIED_REASON)
    await expect(page.get_by_test_id("pod-state")).to_have_text("denied")
    await expect(page.get_by_test_id("story-event").first).to_have_attribute("data-type", "denied")


async def test_another_vendor_s_cards_show_their_vendor_model_memory_and_cores(
    console: Console, page: Page
) -> None:
    """Moore Threads' cards (16 cores a card) on a stack node, as the inventory
    registers them from the vendor's node object, one holding a pod: each tile
    names its vendor and shows its cores in its units; the cluster's figures
    per vendor. Withdrawn again at the end, for the other views' tests."""
    node = console.stack.nodes[0].name
    ledger = console.ledger
    vendor = make_vendor_inventory(node, "mthreads", "MTT S4000", memory_mib=49152, cores=16)
    await ledger.register_node(vendor)
    uuid = f"MTHREADS-{node}-1"
    grant = DeviceGrant(uuid=uuid, memory_mib=8192, cores=4)
    held = Placement(
        pod=PodRef(uid="mt-browser", namespace="team-v", name="mt-pod"),
        node=node,
        containers=(ContainerAssignment(name="main", vendor="mthreads", devices=(grant,)),),
    )
    await ledger.reserve(held)
    try:
        await show(page, console, "#/cluster")
        tile = page.get_by_test_id(f"card-{uuid}")
        await expect(tile).to_contain_text("MTT S4000")
        await expect(tile.get_by_test_id(f"vendor-{uuid}")).to_have_text("mthreads")
        await expect(tile.get_by_test_id(f"cores-{uuid}")).to_have_text("4 / 16")
        # its limits are its plugin's, not gpuslice's layers'
        await expect(tile.get_by_test_id(f"layers-{uuid}")).to_have_text(
            "Enforced by the vendor's device plugin"
        )
        await expect(tile).to_contain_text("8 GiB / 48 GiB")
        await expect(tile.get_by_test_id("pod-link-team-v-mt-pod")).to_be_visible()
        await expect(tile).to_contain_text("8192 MiB \u00b7 4/16 cores")  # the pod's share
        gpu = (await ledger.node_gpus(node))[0].device.uuid
        await expect(page.get_by_test_id(f"vendor-{gpu}")).to_have_text("nvidia")
        await expect(page.get_by_test_id(f"cores-{gpu}")).to_have_text(re.compile(r"^\d+ / 100$"))
        await expect(page.get_by_test_id("summary-vendor-mthreads")).to_have_text(
            "mthreads 2 cards \u00b7 8 GiB of 96 GiB \u00b7 4 of 32 cores"
        )
        # the pod's own page: its card's vendor and the cores granted of the card's
        await tile.get_by_test_id("pod-link-team-v-mt-pod").click()
        held_card = page.get_by_test_id(f"pod-card-main-{uuid}")
        await expect(held_card).to_contain_text("mthreads")
        await expect(held_card.get_by_test_id(f"pod-cores-main-{uuid}")).to_have_text("4/16 cores")
        await show(page, console, "#/cluster")
    finally:
        await ledger.release(held.pod.uid)
        await ledger.register_node(NodeInventory(node=node, devices=(), vendor="mthreads"))
    await expect(page.get_by_test_id(f"card-{uuid}")).to_have_count(0)
    await expect(page.get_by_test_id("summary-vendors")).to_have_count(0)


async def test_the_audit_view_filters_and_follows_without_a_reload(
    console: Console, page: Page
) -> None:
    await show(page, console, "#/audit")
    await page.get_by_label("Namespace").fill("team-a")
    await page.get_by_test_id("audit-type-pod.admitted").check()
    await page.get_by_test_id("audit-apply").click()
    await expect(page).to_have_url(f"{console.url}#/audit?namespace=team-a&type=pod.admitted")
    rows = page.get_by_test_id("audit-event")
    await expect(rows.first).to_be_visible()
    await expect(page.get_by_test_id("pod-link-team-a-grower").first).to_be_visible()
    for row in await rows.all():
        await expect(row).to_have_attribute("data-type", "pod.admitted")
        await expect(row.locator("td").nth(2)).to_contain_text("team-a/")
    await expect(page.get_by_test_id("export")).to_have_attribute(
        "href", "api/v1/audit/export?namespace=team-a&type=pod.admitted"
    )

    # following: a new pod's admission and release appear, its other events do not
    await page.get_by_label("Namespace").fill("team-e")
    await page.get_by_test_id("audit-type-alloc.released").check()
    await page.get_by_test_id("audit-apply").click()
    await expect(page.get_by_test_id("audit-status")).to_have_text(re.compile(r"^0 events"))
    await expect(page.get_by_test_id("follow")).to_be_checked()
    await page.evaluate("window.notReloaded = true")
    late = await console.driver.run_pod(
        gpu_pod("late", ["probe", "init"], gpumem=1000), namespace="team-e"
    )
    assert late.phase == "Succeeded", late.reason
    await expect(rows.and_(page.locator('[data-type="alloc.released"]'))).to_have_count(1)
    await expect(rows.and_(page.locator('[data-type="pod.admitted"]'))).to_have_count(1)
    await expect(rows).to_have_count(2)
    await expect(page.get_by_test_id("pod-link-team-e-late")).to_have_count(2)
    assert await page.evaluate("window.notReloaded") is True


async def test_keyboard_reaches_the_nav_and_the_filters(console: Console, page: Page) -> None:
    await show(page, console, "#/cluster")
    await expect(page.get_by_test_id(f"node-{console.stack.nodes[0].name}")).to_be_visible()
    reached: list[str] = []
    for _ in range(10):
        await page.keyboard.press("Tab")
        focused = await page.evaluate("document.activeElement.dataset.testid || ''")
        reached.append(focused)
        if focused == "nav-audit":
            break
    assert reached[-3:] == ["nav-cluster", "nav-pods", "nav-audit"], reached
    outline = await page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"  # focus is visible
    await page.keyboard.press("Enter")
    await expect(page).to_have_url(f"{console.url}#/audit")
    await expect(page.get_by_role("heading", level=1)).to_be_focused()

    fields: list[str] = []
    for _ in range(10):
        await page.keyboard.press("Tab")
        fields.append(await page.evaluate("document.activeElement.id"))
        if fields[-1] == "audit-namespace":
            break
    assert fields == ["audit-since", "audit-node", "audit-namespace"], fields
    await page.keyboard.type("team-c")
    await page.keyboard.press("Enter")
    await expect(page).to_have_url(f"{console.url}#/audit?namespace=team-c")
    await expect(page.get_by_test_id("pod-link-team-c-bad-cores").first).to_be_visible()


@pytest.mark.parametrize(
    "route",
    ["#/cluster", "#/pods", f"#/pods/team-b/{LONG_NAME}", "#/audit"],
)
async def test_a_phone_never_scrolls_sideways(console: Console, route: str) -> None:
    """Every view holding the 63-character pod name, at 390x844."""
    context = await console.browser.new_context(viewport=PHONE, is_mobile=True)
    try:
        page = await context.new_page()
        page.set_default_timeout(WAIT_MS)
        await show(page, console, route)
        await expect(page.get_by_role("heading", level=1)).to_be_visible()
        await expect(page.locator(".view").get_by_text(LONG_NAME).first).to_be_visible()
        width = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], width
    finally:
        await context.close()


# the basic accessibility checks, run in the page (returns the problems found)
ACCESSIBILITY = (Path(__file__).parent / "accessibility.js").read_text()


@pytest.mark.parametrize(
    ("route", "ready"),
    [
        ("#/cluster", '[data-testid^="card-"]'),
        ("#/pods", '[data-testid^="pod-row-"]'),
        ("#/pods/team-a/grower", '[data-testid^="mem-bar-"]'),
        ("#/pods/team-c/bad-cores", '[data-testid="pod-reason"]'),
        ("#/audit", '[data-testid="audit-event"]'),
        ("#/cluster", '[data-testid="chart-cluster-allocation"]'),
        ("#/pods/team-a/grower", '[data-testid="chart-pod-memory"]'),
    ],
)
async def test_every_view_passes_the_basic_accessibility_checks(
    console: Console, page: Page, route: str, ready: str
) -> None:
    await show(page, console, route)
    await expect(page.locator(ready).first).to_be_visible()
    assert await page.evaluate(ACCESSIBILITY) == []


async def test_screenshots_of_every_view(console: Console, page: Page) -> None:
    """For the documentation: each view at 1280x800 and the cluster on a phone."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shots = {
        "cluster": ("#/cluster", f"card-{console.grower_card}"),
        "pods": ("#/pods", "pod-row-team-a-grower"),
        "pod": ("#/pods/team-a/grower", f"mem-bar-main-{console.grower_card}"),
        "pod-denied": ("#/pods/team-c/bad-cores", "pod-reason"),
        "audit": ("#/audit", "audit-event"),
    }
    for name, (route, ready) in shots.items():
        await show(page, console, route)
        await expect(page.get_by_test_id(ready).first).to_be_visible()
        await page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)
    await page.set_viewport_size(PHONE)
    await show(page, console, "#/cluster")
    await expect(page.get_by_test_id(f"card-{console.grower_card}")).to_be_visible()
    await page.screenshot(path=SCREENSHOTS / "cluster-phone.png", full_page=True)
    for name in [*shots, "cluster-phone"]:
        assert (SCREENSHOTS / f"{name}.png").stat().st_size > 10_000, name


async def test_a_dropped_stream_reconnects_and_says_so(console: Console) -> None:
    """The inventory restarted under the page: the indicator says so, then the
    page is live again with fresh data. (Last in the module: the failed requests
    while the inventory is away are console errors, so this page is its own.)"""
    context = await console.browser.new_context(viewport=DESKTOP)
    try:
        page = await context.new_page()
        page.set_default_timeout(WAIT_MS)
        script_errors: list[str] = []
        page.on("pageerror", lambda e: script_errors.append(str(e)))
        await show(page, console, "#/cluster")
        before = await page.get_by_test_id("live").get_attribute("data-state")
        assert before == "live"
        restart = asyncio.create_task(console.stack.restart(console.stack.replicas("inventory")[0]))
        await expect(page.get_by_test_id("live")).to_have_attribute("data-state", "reconnecting")
        await expect(page.get_by_test_id("live")).to_contain_text("Reconnecting")
        await restart
        await expect(page.get_by_test_id("live")).to_have_attribute("data-state", "live")
        await expect(page.get_by_test_id(f"card-{console.grower_card}")).to_be_visible()
        assert script_errors == []
    finally:
        await context.close()
