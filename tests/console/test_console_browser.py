"""The console in a real headless browser: Debian's chromium (``/usr/bin/chromium``, installed by
``scripts/test``; nothing is downloaded) driven by Playwright's Python client, against the
console served for real and turns run in this process."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from playwright.async_api import Browser, Page, async_playwright, expect

from actors.engine.models.scenario import parse_scenario
from actors.engine.models.scripted import scripted_turn
from actors.engine.turn_engine import TurnEngine
from store.keys import KeyLayout
from store.records import TurnSpec
from tests.console.test_console_http import engine_of
from tests.support.console_server import serving
from tests.support.polling import eventually
from tests.support.records import record

CHROMIUM = os.environ.get("PHASELINE_CHROMIUM", "/usr/bin/chromium")
#: What the machine's own Chromium needs headless and offline (its background services would
#: try to reach Google's hosts at every start).
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="module")
def chromium() -> str:
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"no browser at {CHROMIUM}: scripts/test installs Debian's chromium")
    return CHROMIUM


@pytest.fixture
async def browser(chromium: str) -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
def keys(namespace: str) -> KeyLayout:
    return KeyLayout(namespace)


@pytest.fixture
def base(redis_url: str, namespace: str) -> Iterator[str]:
    with serving(redis_url, namespace) as url:
        yield url


def scenario(**kw: Any) -> Any:
    return scripted_turn(parse_scenario({"name": "web", "rounds": 2, "tools_per_round": 1, **kw}))


async def start(engine: TurnEngine, turn_id: str, **kw: Any) -> asyncio.Task[Any]:
    agent, turn_input = scenario(**kw)
    rec = (await engine.submit_many(agent, turn_input, [turn_id]))[0][1]
    return asyncio.ensure_future(engine.start(rec, await engine.store.load_spec(turn_id)))


async def test_the_list_shows_a_runs_turns(
    real_client: aioredis.Redis, keys: KeyLayout, base: str, browser: Browser
) -> None:
    engine = engine_of(real_client, keys.namespace)
    await engine.run_new(*scenario(), ["web-a", "web-b", "web-c"])
    page = await browser.new_page()
    await page.goto(f"{base}/turns")
    rows = page.locator("#turns tbody tr")
    await expect(rows).to_have_count(3)
    await expect(page.locator("#indexed")).to_have_text("3")
    for turn_id in ("web-a", "web-b", "web-c"):
        await expect(page.get_by_role("link", name=turn_id)).to_be_visible()
    await page.set_viewport_size(
        {"width": 360, "height": 800}
    )  # a narrow window: 1,234 stays whole
    cells = page.locator("#turns td.num")
    for i in range(await cells.count()):
        assert await cells.nth(i).evaluate("e => getComputedStyle(e).whiteSpace") == "nowrap"
    await page.get_by_role("link", name="web-b").click()
    await expect(page.locator("h1")).to_contain_text("web-b")
    await expect(page.locator("#status")).to_have_text("answered")


async def test_a_running_turns_page_updates_live_without_a_reload(
    real_client: aioredis.Redis, keys: KeyLayout, base: str, browser: Browser
) -> None:
    engine = engine_of(real_client, keys.namespace)
    task = await start(engine, "web-live", rounds=4, llm_latency_ms=400)
    page: Page = await browser.new_page()
    await page.goto(f"{base}/turns/web-live")
    await expect(page.locator("#status")).to_contain_text("running")
    await page.evaluate("window.__sameDocument = true")  # gone if the page reloads
    first = await page.locator("#timeline tr").count()
    await expect(page.locator("#live")).to_be_visible()
    await task
    await expect(page.locator("#status")).to_have_text("answered", timeout=20_000)
    assert await page.locator("#timeline tr").count() > first
    await expect(page.locator("#timeline")).to_contain_text("finished: answered")
    await expect(page.locator("#part-transcript")).to_contain_text("echo")
    assert await page.evaluate("window.__sameDocument === true")


async def test_an_approval_made_on_the_page_lets_its_turn_go_on(
    real_client: aioredis.Redis, keys: KeyLayout, base: str, browser: Browser
) -> None:
    engine = engine_of(real_client, keys.namespace)
    task = await start(engine, "web-gate", rounds=1, require_approval=["echo"])

    async def asked() -> str | None:
        return engine.pending_approval("web-gate")

    key = await eventually(asked, timeout=10, what="the approval request")
    page = await browser.new_page()
    await page.goto(f"{base}/turns/web-gate")
    await expect(page.locator(f"#approvals tr[data-call='{key}']")).to_be_visible()
    await page.locator(f"#approvals tr[data-call='{key}'] input[name=reason]").fill("looks fine")
    await page.locator(f"#approvals tr[data-call='{key}'] button.approve").click()
    await expect(page.locator("#flash")).to_contain_text("approved")
    await asyncio.wait_for(task, 30)
    final = await engine.store.load("web-gate")
    (result,) = [m.tool_result for m in final.messages if m.tool_result]
    assert result.status == "ok"
    await expect(page.locator("#status")).to_have_text("answered", timeout=20_000)
    await expect(page.locator("#part-transcript")).to_contain_text("approved by console@")


async def test_a_sessions_turn_is_reached_from_the_list_and_approved_on_its_page(
    real_client: aioredis.Redis, keys: KeyLayout, base: str, browser: Browser
) -> None:
    """``web7/1`` holds a slash: its link, its page and its Approve all work (its page was a
    405 before: the POST route of a verb caught it)."""
    engine = engine_of(real_client, keys.namespace)
    agent, turn_input = scenario(rounds=1, require_approval=["echo"])
    spec, record = await engine.open_in_session(agent, turn_input, "web7")
    task = asyncio.ensure_future(engine.start(record, spec))

    async def asked() -> str | None:
        return engine.pending_approval("web7/1")

    key = await eventually(asked, timeout=10, what="the approval request")
    page = await browser.new_page()
    await page.goto(f"{base}/turns?session=web7")
    await page.get_by_role("link", name="web7/1").click()
    await expect(page.locator("h1")).to_contain_text("web7/1")
    await page.locator(f"#approvals tr[data-call='{key}'] button.approve").click()
    await expect(page.locator("#flash")).to_contain_text("approved")
    assert page.url.split("?")[0].endswith("/turns/web7/1")
    await asyncio.wait_for(task, 30)
    await expect(page.locator("#status")).to_have_text("answered", timeout=20_000)


async def test_pages_stay_whole_with_ten_thousand_turns_in_the_store(
    real_client: aioredis.Redis, keys: KeyLayout, base: str, browser: Browser
) -> None:
    """The list reads one page of the index, so 10,000 turns change nothing it does (the time
    it takes is a benchmark's: scripts/console_bench.py)."""
    store = engine_of(real_client, keys.namespace).store
    for start_at in range(0, 10_000, 500):
        await asyncio.gather(*(
            store.submit(
                TurnSpec(turn_id=f"bulk{i:05d}", session_id="", agent="a.b:c",
                         input={"message": "hi"}, created_at=1_000 + i),
                record(f"bulk{i:05d}").model_copy(update={"seq": 0, "updated_at": 1_000 + i}),
            )
            for i in range(start_at, start_at + 500)
        ))  # fmt: skip
    page = await browser.new_page()
    await page.goto(f"{base}/turns")
    await expect(page.locator("#indexed")).to_have_text("10,000")
    await expect(page.locator("#running")).to_have_text("10,000")
    await expect(page.locator("#turns tbody tr")).to_have_count(50)
    await expect(page.locator("#turns tbody tr").first).to_contain_text("bulk09999")
    await page.locator("#older").click()
    await expect(page.locator("#turns tbody tr").first).to_contain_text("bulk09949")
    await page.goto(f"{base}/turns/bulk04242")
    await expect(page.locator("h1")).to_contain_text("bulk04242")
