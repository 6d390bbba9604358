"""The console shows what a user asked in the user's terms, in a real browser
(Debian's chromium driven by Playwright) against the local stack: an idle
cluster has no fragmentation figure, a failed pod says why (its container's
exit code), and a pod's memory and cores read as asked (MiB as asked, a
percentage as asked, "no core limit" for a pod that asked no cores).

The stack is this module's own: the idle cluster must be idle.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, async_playwright, expect

from gpuslice_cli.dev.driver import ClusterDriver
from gpuslice_cli.dev.stack import Stack
from gpuslice_common.bus import Bus
from gpuslice_common.events import AllocationEvent, EventType, make_event
from gpuslice_common.ledger import Ledger
from gpuslice_common.models import ContainerAssignment, DeviceGrant, PodRef
from tests.conftest import Native
from tests.console.workload import DESKTOP, WAIT_MS, Gate, card_of, chromium, gpu_pod, on_its_card
from tests.dev.conftest import stack_up

pytestmark = pytest.mark.asyncio(loop_scope="module")
expect.set_options(timeout=WAIT_MS)


@dataclass
class Console:
    stack: Stack
    driver: ClusterDriver
    ledger: Ledger
    url: str
    browser: Browser
    gate: Gate  # opened: the running pods end


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def console(
    native: Native, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Console]:
    work = tmp_path_factory.mktemp("units")
    gate = Gate(work / "gate")
    try:
        async with stack_up(Stack(work / "stack", heartbeat_s=1.0)) as (stack, driver, _, ledger):
            assert stack.console_url is not None
            async with async_playwright() as playwright:
                executable, args = chromium()
                browser = await playwright.chromium.launch(executable_path=executable, args=args)
                try:
                    yield Console(stack, driver, ledger, stack.console_url, browser, gate)
                finally:
                    await browser.close()
    finally:
        gate.open()


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


async def test_an_idle_cluster_shows_no_fragmentation_figure(console: Console, page: Page) -> None:
    """Nothing allocated: the scheduler's report is there (its learned kinds
    shown), but nothing is fragmented, on the cluster or on a node."""
    await show(page, console, "#/cluster")
    await expect(page.get_by_test_id("cluster-fragmentation-detail")).to_have_text(
        "nothing allocated: nothing to fragment"
    )
    await expect(page.get_by_test_id("cluster-fragmentation")).to_have_text("\u2014")
    for node in console.stack.nodes:
        await expect(page.get_by_test_id(f"fragmentation-{node.name}")).to_have_text(
            "nothing allocated"
        )


async def test_a_failed_pod_says_which_container_exited_with_what(
    console: Console, page: Page
) -> None:
    failed = await console.driver.run_pod(
        gpu_pod("crash", ["sh", "-c", "exit 3"], gpumem=1000), namespace="team-f"
    )
    assert failed.phase == "Failed", failed
    why = "pod failed: container main exited 3 (Error)"
    await show(page, console, "#/pods")
    row = page.get_by_test_id("pod-row-team-f-crash")
    await expect(row).to_contain_text(why)
    await row.get_by_role("link").click()
    await expect(page.get_by_test_id("pod-reason")).to_have_text(why)


async def test_memory_and_cores_read_as_the_pod_asked(console: Console, page: Page) -> None:
    """1536 MiB and no cores asked: "1536 MiB" (not "1.5 GiB") and "no core
    limit" (not "0/100 cores"); a quarter of the card's memory: "25%"."""
    held = on_its_card("lock", str(console.gate.path))
    pods = [gpu_pod("in-mib", held, gpumem=1536), gpu_pod("in-percent", held)]
    pods[1]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem-percentage"] = 25
    running = [asyncio.create_task(console.driver.run_pod(pod, "team-g")) for pod in pods]
    try:
        card = await card_of(console.stack, console.ledger, "team-g", "in-mib")
        await card_of(console.stack, console.ledger, "team-g", "in-percent")
        await show(page, console, "#/cluster")
        tile = page.get_by_test_id(f"card-{card}")
        await expect(tile.get_by_test_id("pod-link-team-g-in-mib")).to_be_visible()
        await expect(tile).to_contain_text("in-mib 1536 MiB \u00b7 no core limit")
        # now something is allocated: the scheduler's figure
        await expect(page.get_by_test_id("cluster-fragmentation")).to_have_text(
            re.compile(r"^(\d+(\.\d)?|<1)%$")
        )

        await show(page, console, "#/pods/team-g/in-mib")
        await expect(page.get_by_test_id(f"pod-memory-main-{card}")).to_have_text("limit 1536 MiB")
        await expect(page.get_by_test_id(f"pod-cores-main-{card}")).to_have_text("no core limit")
        await expect(page.get_by_test_id(f"mem-bar-main-{card}")).to_have_attribute(
            "aria-valuetext", re.compile(r" of 1536 MiB used")
        )

        await show(page, console, "#/pods/team-g/in-percent")
        await expect(page.locator('[data-testid^="pod-memory-main-"]')).to_have_text(
            re.compile(r"^limit 25% of the card \(\d+ MiB\)$")
        )

        await show(page, console, "#/audit?namespace=team-g&type=pod.admitted")
        admitted = page.get_by_test_id("audit-event").filter(has_text="in-mib")
        await expect(admitted).to_contain_text("main asks 1 \u00d7 1536 MiB, no core limit")
    finally:
        console.gate.open()
        outcomes = await asyncio.wait_for(asyncio.gather(*running), WAIT_MS / 1000)
    for outcome in outcomes:
        assert outcome.phase == "Succeeded", (outcome.ref, outcome.reason)


async def test_an_audit_line_gives_each_vendors_cores_in_its_own_units(
    console: Console, page: Page
) -> None:
    """A reservation of 4 of a Moore Threads card's 16 cores is "4 cores", not
    "4% cores"; an NVIDIA grant of no cores is "no core limit", not "0%"."""
    pod = PodRef(uid="uid-vendors", namespace="team-h", name="two-vendors")
    containers = (
        ContainerAssignment(
            name="mt",
            vendor="mthreads",
            devices=(DeviceGrant(uuid="MTHREADS-n-0", memory_mib=8192, cores=4),),
        ),
        ContainerAssignment(
            name="nv", devices=(DeviceGrant(uuid="GPU-n-0", memory_mib=1536, cores=0),)
        ),
    )
    reserved = AllocationEvent(pod=pod, node="n", containers=containers, policy="binpack")
    bus = await Bus.connect(console.stack.bus_settings("scheduler"), "units")
    try:
        await bus.publish_acked(make_event(EventType.ALLOC_RESERVED, reserved, source="/test"))
    finally:
        await bus.close()
    await show(page, console, "#/audit?namespace=team-h")
    row = page.get_by_test_id("audit-event").filter(has_text="two-vendors")
    await expect(row).to_contain_text("mt → card …EADS-n-0 (8192 MiB, 4 cores)")
    await expect(row).to_contain_text("nv → card …GPU-n-0 (1536 MiB, no core limit)")
