"""The dashboard in a real headless Chromium (Playwright driving the system's /usr/bin/chromium),
against a real llmd on the fake backend after a burst of real requests sent with the openai SDK:
the page loads with no console errors, its charts hold data and draw it, the request inspector
finds a request by the client's id and shows its stages, a tenant's key cannot open it (a
dashboard key can), and a phone-sized viewport gets one column with no sideways scrolling.

Screenshots: set LLMD_DASHBOARD_SCREENSHOTS=docs/img to (re)write the README's images."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LiveServer
from tests.unit.test_dashboard import KEY_A, TOML, VIEWER, advance, burst

CHROMIUM = os.environ.get("LLMD_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip("chromium not installed: .ci/run installs it with apt (package `chromium`)", allow_module_level=True)
async_api = pytest.importorskip("playwright.async_api", reason="playwright not installed: pip install -e '.[dev]'")

CHARTS = ("ttft", "itl", "throughput", "queue", "running", "kv", "events", "cost")
WAIT_MS = 60_000  # bounds a hang only; the page refreshes every 2 s


def _shots() -> Path | None:
    d = os.environ.get("LLMD_DASHBOARD_SCREENSHOTS")
    if not d:
        return None
    out = Path(d)
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
async def browser() -> Any:
    async with async_api.async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        await b.close()


async def _history(live: LiveServer) -> list[str]:
    """For the README's pictures only: a minute of uneven traffic, one closed interval per round."""
    ids = []
    for i in range(30):
        ids += await burst(live, 1 + (i * 7) % 5)
        advance(live, 2.0)
        live.node.dashboard.ring.tick()
    return ids


async def _open(browser: Any, live: LiveServer, key: str, **context: Any) -> tuple[Any, Any, list[str]]:
    """A fresh browser context on /dashboard, signed in through the page's form with `key`;
    returns (context, page, console errors and uncaught exceptions seen)."""
    ctx = await browser.new_context(**context)
    page = await ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"exception: {e}"))
    await page.goto(live.url + "/dashboard")
    await page.wait_for_selector("#login-form", state="visible", timeout=WAIT_MS)
    await page.fill("#login-key", key)
    await page.click("#login-form button")
    return ctx, page, errors


async def _pixels(page: Any, chart: str) -> int:
    """How many pixels of the chart's canvas are coloured (the series' strokes; axes, grid and
    labels are greys): drawn data, not an empty frame."""
    return int(await page.evaluate("""(sel) => {
        const c = document.querySelector(sel + ' canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) {
            const [r, g, b, a] = [d[i], d[i+1], d[i+2], d[i+3]];
            if (a > 100 && Math.abs(r - g) + Math.abs(g - b) + Math.abs(r - b) > 120) n++;
        }
        return n;
    }""", f"#c-{chart}"))


async def test_dashboard_in_chromium(make_server: Any, browser: Any) -> None:
    live = await make_server(TOML)
    ids = await burst(live)
    advance(live, 2.0)  # the burst's interval closes now, the next one's at the first poll after it
    live.node.dashboard.ring.tick()
    ids += await burst(live, 2)  # so every chart has two points with data: a line, not a dot
    advance(live, 2.0)
    if _shots() is not None:
        ids += await _history(live)
    ctx, page, errors = await _open(browser, live, VIEWER, viewport={"width": 1360, "height": 900})
    await page.wait_for_selector("#board", state="visible", timeout=WAIT_MS)
    # Two points at least (a line needs two): the burst's interval and the next one.
    await page.wait_for_function("() => window.llmdDashboard.points.length >= 2", timeout=WAIT_MS)
    charts = await page.evaluate("""() => Object.fromEntries(Object.entries(window.llmdDashboard.charts).map(
        ([k, c]) => [k, {series: c.series.length - 1, points: c.data[0].length,
                          values: c.data.slice(1).flat().filter(v => v !== null && v > 0).length}]))""")
    assert set(charts) == set(CHARTS), charts
    for name in ("ttft", "itl", "throughput"):  # the burst's latencies and rates are in them
        assert charts[name]["points"] >= 2 and charts[name]["values"] > 0, (name, charts[name])
    assert charts["running"]["values"] > 0  # the seat limit, at every point
    assert charts["cost"]["points"] >= 1 and charts["cost"]["values"] > 0  # this hour's cost per M tokens
    for name in ("throughput", "running", "ttft"):
        assert await _pixels(page, name) > 50, f"{name}: the series is not drawn"
    # The tables: both tenants' latency, their spend today, the model's version and split.
    assert await page.locator("#tbl-latency tbody tr").count() == 2
    spend = await page.inner_text("#tbl-spend")
    assert "a" in spend and "b" in spend and "none" not in spend
    assert "fake-fake 100%" in await page.inner_text("#tbl-models")
    # GPU-hour cost ([cost.models.fake]): the model's row and the window's, with a price per M tokens
    assert await page.is_visible("#cost-panel")
    cost_rows = await page.eval_on_selector_all("#tbl-cost tbody tr",
                                                "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert [r[0] for r in cost_rows] == ["fake@fake-fake", "all priced"], cost_rows
    assert all(r[2].endswith("USD") and r[5].endswith("USD") for r in cost_rows), cost_rows
    # The inspector: a request found by the client's X-Request-ID, its stages shown.
    await page.fill("#inspect-id", ids[0])
    await page.click("#inspect-form button")
    await page.wait_for_selector(".stage[data-stage=first_token]", timeout=WAIT_MS)
    stages = await page.eval_on_selector_all(".stage[data-stage]", "els => els.map(e => e.dataset.stage)")
    assert stages == ["arrived", "dispatched", "first_token", "last_token", "ended"]
    assert await page.inner_text("[data-fact=tenant]") == "a"
    assert (await page.inner_text("[data-fact='node / replica']")).startswith(live.node.config.server.node + "/fake@")
    # A click on a recent request (the newest: another one) inspects it too.
    newest = await page.inner_text("#tbl-recent a.rid >> nth=0")
    assert newest == ids[-1] != ids[0]
    await page.click("#tbl-recent a.rid >> nth=0")
    await page.wait_for_function("(id) => document.querySelector('[data-fact=\"client id\"]')?.textContent === id",
                                 arg=newest, timeout=WAIT_MS)
    assert (await page.inner_text("#status")).startswith("updated")
    assert not errors, errors
    if (shots := _shots()) is not None:
        await page.screenshot(path=str(shots / "dashboard-desktop.png"), full_page=True)
    await ctx.close()


async def test_dashboard_on_a_phone(make_server: Any, browser: Any) -> None:
    live = await make_server(TOML)
    ids = await burst(live, 3)
    advance(live, 2.0)
    if _shots() is not None:
        ids += await _history(live)
    ctx, page, errors = await _open(browser, live, VIEWER, viewport={"width": 390, "height": 844},
                                    device_scale_factor=2, is_mobile=True, has_touch=True)
    await page.wait_for_function("() => window.llmdDashboard.points.length >= 2", timeout=WAIT_MS)
    assert await page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth + 1"), "sideways scroll"
    boxes = [await page.locator(f"#c-{c}").bounding_box() for c in ("ttft", "itl")]
    assert boxes[0] and boxes[1] and boxes[1]["y"] > boxes[0]["y"] and boxes[0]["width"] <= 390  # one column
    assert await _pixels(page, "throughput") > 50
    await page.fill("#inspect-id", ids[-1])
    await page.click("#inspect-form button")
    await page.wait_for_selector(".stage[data-stage=ended]", timeout=WAIT_MS)
    assert not errors, errors
    if (shots := _shots()) is not None:
        await page.evaluate("() => window.scrollTo(0, 0)")
        await page.screenshot(path=str(shots / "dashboard-phone.png"), full_page=False)
    await ctx.close()


async def test_a_tenant_key_cannot_open_it(make_server: Any, browser: Any) -> None:
    live = await make_server(TOML)
    ctx, page, _ = await _open(browser, live, KEY_A)
    await page.wait_for_function("() => document.querySelector('#login-error').textContent.length > 0", timeout=WAIT_MS)
    assert "dashboard key" in await page.inner_text("#login-error")
    assert await page.is_hidden("#board")
    status = await page.evaluate("() => fetch('/dashboard/api/overview').then(r => r.status)")
    assert status == 401  # no session was made
    await ctx.close()
