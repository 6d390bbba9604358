"""The console behind TokenReview, in a real browser (Debian's chromium driven
by Playwright) against the local stack: the page asks for a bearer token in
its dialog, sends it on every API call and stream, keeps it for the tab only,
and a viewer allowed to list pods in one namespace sees that namespace's pods
and only the sum of the others'.

The stack's inventory is restarted with ``console_auth: tokenreview``; the
dev API server reviews the tokens its ``tokens`` minted and answers access
reviews from its ``access`` rules, as a cluster's API server does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, Request, async_playwright, expect

from gpuslice_cli.dev.stack import Stack
from tests.conftest import Native
from tests.console.workload import DESKTOP, WAIT_MS, Gate, card_of, chromium, gpu_pod, on_its_card
from tests.dev.conftest import stack_up

pytestmark = pytest.mark.asyncio(loop_scope="module")
expect.set_options(timeout=WAIT_MS)


@dataclass
class Guarded:
    url: str
    browser: Browser
    shared_card: str  # team-a/mine and team-b/theirs hold it together
    alice: str  # a token of a user who may list pods in team-a only


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guarded(
    native: Native, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Guarded]:
    work = tmp_path_factory.mktemp("tokens")
    done = Gate(work / "done")
    async with stack_up(Stack(work / "stack", heartbeat_s=1.0)) as (stack, driver, _, ledger):
        assert stack.console_url is not None
        inventory = stack.replicas("inventory")[0]
        stack.children[inventory].env["GPUSLICE_CONSOLE_AUTH"] = "tokenreview"
        await stack.restart(inventory)
        alice = stack.kube.tokens.mint_user("alice", ["developers"])
        stack.kube.access.grant(user="alice", verb="list", resource="pods", namespace="team-a")
        hold = on_its_card("alloc", "512m", "lock", str(done.path))
        running = [
            asyncio.create_task(
                driver.run_pod(gpu_pod("mine", hold, gpumem=2000), namespace="team-a")
            )
        ]
        try:
            mine = await card_of(stack, ledger, "team-a", "mine")
            on_mine = {"nvidia.com/use-gpuuuid": mine}
            theirs = gpu_pod("theirs", hold, annotations=on_mine, gpumem=2000)
            running.append(asyncio.create_task(driver.run_pod(theirs, namespace="team-b")))
            assert await card_of(stack, ledger, "team-b", "theirs") == mine
            async with async_playwright() as playwright:
                executable, args = chromium()
                browser = await playwright.chromium.launch(executable_path=executable, args=args)
                try:
                    yield Guarded(stack.console_url, browser, mine, alice)
                finally:
                    await browser.close()
        finally:
            done.open()
            outcomes = await asyncio.wait_for(asyncio.gather(*running), WAIT_MS / 1000)
            for outcome in outcomes:
                assert outcome.phase == "Succeeded", (outcome.ref, outcome.reason)


@pytest_asyncio.fixture(loop_scope="module")
async def page(guarded: Guarded) -> AsyncIterator[Page]:
    context = await guarded.browser.new_context(viewport=DESKTOP)
    page = await context.new_page()
    page.set_default_timeout(WAIT_MS)
    script_errors: list[str] = []
    page.on("pageerror", lambda e: script_errors.append(str(e)))
    try:
        yield page
    finally:
        await context.close()
    assert script_errors == []


async def give_token(page: Page, token: str) -> None:
    """Type the token into the page's dialog, as a person does, and press Enter."""
    await expect(page.get_by_role("dialog", name="Access token")).to_be_visible()
    await expect(page.get_by_label("Bearer token")).to_be_focused()
    await page.get_by_label("Bearer token").fill(token)
    await page.keyboard.press("Enter")


async def sign_in(page: Page, token: str) -> None:
    await give_token(page, token)
    await expect(page.get_by_role("dialog", name="Access token")).to_be_hidden()


async def test_a_refused_token_is_asked_again_and_says_why(guarded: Guarded, page: Page) -> None:
    await page.goto(f"{guarded.url}#/cluster")
    await give_token(page, "gsu.not-a-token-anyone-minted")
    # the API refused it: the dialog (back at once) says so, and nothing is shown
    await expect(page.locator("#token-error")).to_contain_text("The token was refused")
    await expect(page.get_by_role("dialog", name="Access token")).to_be_visible()
    await expect(page.locator('[data-testid^="card-"]')).to_have_count(0)
    await sign_in(page, guarded.alice)
    await expect(page.get_by_test_id(f"card-{guarded.shared_card}")).to_be_visible()


async def test_a_namespaced_viewer_sees_its_pods_and_only_the_sum_of_others(
    guarded: Guarded, page: Page
) -> None:
    sent: list[tuple[str, str | None]] = []

    def record(request: Request) -> None:
        if "/api/" in request.url:
            sent.append((request.url, request.headers.get("authorization")))

    page.on("request", record)
    await page.goto(f"{guarded.url}#/cluster")
    await sign_in(page, guarded.alice)
    await expect(page.get_by_test_id("viewer")).to_contain_text("alice")
    await expect(page.get_by_test_id("live")).to_have_attribute("data-state", "live")

    card = page.get_by_test_id(f"card-{guarded.shared_card}")
    await expect(card.get_by_test_id("pod-link-team-a-mine")).to_be_visible()
    await expect(card).to_contain_text("+ 1 pod in other namespaces")
    await expect(page.get_by_test_id("pod-link-team-b-theirs")).to_have_count(0)
    await expect(page.get_by_test_id("summary-pods").locator(".tile-value")).to_have_text("1")

    await page.get_by_test_id("nav-pods").click()
    await expect(page.get_by_test_id("pod-row-team-a-mine")).to_be_visible()
    await expect(page.locator('[data-testid^="pod-row-team-b-"]')).to_have_count(0)
    # another namespace's pod is as unknown as one that never existed
    await page.goto(f"{guarded.url}#/pods/team-b/theirs")
    await expect(page.get_by_test_id("pod-missing")).to_have_text("no pod team-b/theirs is known")

    # once given, the token went with every call, the streams' included; none
    # before it (the first answers asked for it); and it stays for the tab
    auths = [auth for _, auth in sent]
    given = auths.index(f"Bearer {guarded.alice}")
    assert set(auths[:given]) == {None}, sent
    assert set(auths[given:]) == {f"Bearer {guarded.alice}"}, sent
    assert any("/api/v1/stream?" in url for url, _ in sent[given:])
    await page.reload()
    await expect(page.get_by_test_id("pod-missing")).to_be_visible()
    await expect(page.get_by_role("dialog", name="Access token")).to_be_hidden()


async def test_another_tab_asks_for_its_own_token(guarded: Guarded, page: Page) -> None:
    """sessionStorage: a token given in one tab is not in another."""
    await page.goto(f"{guarded.url}#/cluster")
    await sign_in(page, guarded.alice)
    await expect(page.get_by_test_id(f"card-{guarded.shared_card}")).to_be_visible()
    other = await page.context.new_page()
    await other.goto(f"{guarded.url}#/cluster")
    await expect(other.get_by_role("dialog", name="Access token")).to_be_visible()
