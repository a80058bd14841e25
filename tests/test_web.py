"""The web page at / and the JSON it reads (/api/*): the live numbers against the metric objects,
the key policy, load/unload on the real engine, and the page itself in a real headless Chromium
(Debian's `chromium`, driven by Playwright) against the real gateway on the real model."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from playwright.async_api import Browser, ConsoleMessage, Page, Route, async_playwright
from prometheus_client.parser import text_string_to_metric_families

from engines.base import EngineHealth
from gateway.app import create_app
from gateway.metrics import SLO_TPOT_S, SLO_TTFT_S, Metrics
from gateway.models.registry import load_registry
from gateway.settings import Settings
from gateway.web.live import RATE_WINDOW_S, SAMPLE_S, WINDOW_S, LiveStats, quantile
from tests.conftest import MODEL, NO_CHECKS, ROOT, ServerThread

ARTIFACTS = ROOT / "tests" / "artifacts"
KEY = "sk-web-page-test-0123"
LABELS = (MODEL, "llamacpp/cpu", "cpu")


# --- the live numbers ---------------------------------------------------------------------------


def test_quantile_interpolates_like_prometheus_histogram_quantile() -> None:
    edges = (0.1, 0.5, 1.0, math.inf)
    assert quantile(0.5, edges, (2, 6, 10, 10)) == pytest.approx(0.1 + 0.4 * 3 / 4)  # rank 5 in (0.1, 0.5]
    assert quantile(0.95, edges, (2, 6, 10, 10)) == pytest.approx(0.5 + 0.5 * 3.5 / 4)
    assert quantile(0.5, edges, (4, 4, 4, 4)) == pytest.approx(0.05)  # the first bucket starts at 0
    assert quantile(0.95, edges, (0, 0, 1, 3)) == 1.0  # in +Inf: the highest finite edge
    assert quantile(0.5, edges, (0, 0, 0, 0)) is None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_live_stats_window_rate_and_history() -> None:
    metrics, clock = Metrics(), Clock()
    health = EngineHealth(ready=True, running=3, waiting=2)
    live = LiveStats(metrics, lambda: [(*LABELS, health)], clock)
    for _ in range(100):
        metrics.ttft.labels(*LABELS).observe(0.02)
    live.sample()
    first = live.points[-1]
    assert first.ttft_p50_s is not None and 0.01 < first.ttft_p50_s <= 0.025
    assert (first.running, first.waiting) == (3, 2)

    clock.t += SAMPLE_S / 2
    live.sample()
    assert len(live.points) == 1  # at most one sample per SAMPLE_S

    # WINDOW_S later only the new, slow observations count.
    clock.t += WINDOW_S + 10
    for _ in range(10):
        metrics.ttft.labels(*LABELS).observe(2.0)
    metrics.gen_tokens.labels(*LABELS).inc(50)
    metrics.requests.labels(*LABELS, "rejected", "429").inc(4)
    live.sample()
    p = live.points[-1]
    assert p.ttft_p50_s is not None and 1.0 < p.ttft_p50_s <= 2.5
    assert p.rejected_429 == 4
    assert p.window_s == pytest.approx(WINDOW_S + 10 + SAMPLE_S / 2)
    clock.t += RATE_WINDOW_S
    metrics.gen_tokens.labels(*LABELS).inc(100)
    live.sample()
    assert live.points[-1].tokens_per_s == pytest.approx(100 / RATE_WINDOW_S)
    assert live.points[-1].itl_p50_s is None  # nothing observed
    assert live.since(p.t) == [live.points[-1]]
    assert live.totals().generation_tokens == 150 and live.totals().rejected_429 == 4

    clock.t += 2000
    live.sample()
    assert len(live.points) == 1  # older than the 15-minute history


# --- the JSON endpoints on the session gateway ----------------------------------------------------


def _status(url: str, since: float | None = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = httpx.get(f"{url}/api/status", params={"since": since} if since is not None else None, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _row(status: dict[str, Any], model: str = MODEL) -> dict[str, Any]:
    return next(m for m in status["models"] if m["id"] == model)


def test_status_counts_requests_and_shows_the_serving_engine(gateway_url: str, client: openai.OpenAI) -> None:
    before = _status(gateway_url)
    for _ in range(3):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    time.sleep(SAMPLE_S)
    after = _status(gateway_url, since=before["live"]["points"][-1]["t"])
    assert after["live"]["totals"]["requests"] == before["live"]["totals"]["requests"] + 3
    assert after["live"]["totals"]["generation_tokens"] == before["live"]["totals"]["generation_tokens"] + 24
    [point] = after["live"]["points"]  # only the new one
    assert point["t"] > before["live"]["points"][-1]["t"]
    assert point["ttft_p50_s"] is not None and point["itl_p50_s"] is not None and point["tokens_per_s"] > 0
    assert after["live"]["slo"] == {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S, "e2e_s": 10.0}
    health = httpx.get(f"{gateway_url}/health").json()["models"][MODEL]
    row = _row(after)
    assert (row["state"], row["engine"], row["device"]) == ("loaded", health["engine"], health["device"])
    assert row["running"] == 0 and row["available"] and "chat.completions" in row["endpoints"]


def test_devices_are_what_gateway_devices_reports(gateway_url: str) -> None:
    d = httpx.get(f"{gateway_url}/api/devices", timeout=60).json()
    cli = subprocess.run([sys.executable, "-m", "gateway.cli", "devices", "--json", "--config", str(ROOT / "models.yaml")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)
    assert d["host"]["cpu"] == want["host"]["cpu"] and d["ep_matrix"] == want["ep_matrix"]
    assert [{k: v for k, v in c.items() if k not in ("serving", "build")} for c in d["plans"][MODEL]["candidates"]] == \
        want["plans"][MODEL]["candidates"]
    assert d["plans"][MODEL]["skipped"] == want["plans"][MODEL]["skipped"]
    serving = [c for c in d["plans"][MODEL]["candidates"] if c["serving"]]
    health = httpx.get(f"{gateway_url}/health").json()["models"][MODEL]
    assert [f"{c['runtime']}/{c['engine']}" for c in serving] == [health["engine"]]
    assert f"Plan for {MODEL}:" in d["text"] and "EXECUTION PROVIDER" in d["text"]


def test_page_and_files_are_served_with_a_strict_policy(gateway_url: str) -> None:
    r = httpx.get(f"{gateway_url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    js = httpx.get(f"{gateway_url}/web/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    missing = httpx.get(f"{gateway_url}/web/nope.js")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    paths = httpx.get(f"{gateway_url}/openapi.json").json()["paths"]
    assert "/" not in paths and {"/api/status", "/api/devices"} <= set(paths)


def test_load_and_unload_refuse_unknown_models(gateway_url: str) -> None:
    for action in ("load", "unload"):
        r = httpx.post(f"{gateway_url}/api/models/no-such-model/{action}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- a gateway with an API key --------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    """The real model, lazily loaded, behind an API key; `gateway.test` accepted as a Host name."""
    settings = Settings.from_env(env=NO_CHECKS, config=str(ROOT / "models.yaml"), api_key=KEY, preload=False,
                                 allowed_hosts=("gateway.test",), parallel=2)
    server = ServerThread(create_app(settings, load_registry(ROOT / "models.yaml"))).start()
    yield server.url
    server.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_routes_need_the_key_and_the_page_does_not(keyed_url: str) -> None:
    for method, path in (("GET", "/api/status"), ("GET", "/api/devices"), ("POST", f"/api/models/{MODEL}/load"),
                         ("POST", f"/api/models/{MODEL}/unload")):
        r = httpx.request(method, f"{keyed_url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{keyed_url}/").status_code == 200
    assert httpx.get(f"{keyed_url}/web/app.js").status_code == 200
    assert _row(_status(keyed_url, headers=AUTH))["state"] == "not_loaded"  # lazy: nothing loaded by the check


def test_the_page_origin_is_accepted_through_an_allowed_host_only(keyed_url: str) -> None:
    port = keyed_url.rsplit(":", 1)[1]
    own = {"Host": f"gateway.test:{port}", "Origin": f"http://gateway.test:{port}", **AUTH}
    assert httpx.get(f"{keyed_url}/api/status", headers=own).status_code == 200
    evil = {**own, "Origin": f"http://evil.test:{port}"}
    r = httpx.get(f"{keyed_url}/api/status", headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    rebound = {**own, "Host": f"evil.test:{port}", "Origin": f"http://evil.test:{port}"}
    assert httpx.get(f"{keyed_url}/api/status", headers=rebound).status_code == 403


def test_load_serve_and_unload_on_the_real_engine(keyed_url: str) -> None:
    r = httpx.post(f"{keyed_url}/api/models/{MODEL}/load", headers=AUTH, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "loaded" and r.json()["engine"].startswith("llamacpp/")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{keyed_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120) as s:
        assert s.status_code == 200
        busy = httpx.post(f"{keyed_url}/api/models/{MODEL}/unload", headers=AUTH)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
        frames = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert frames[-1] == "data: [DONE]"
    r = httpx.post(f"{keyed_url}/api/models/{MODEL}/unload", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "not_loaded" and r.json()["engine"] is None
    cards = httpx.get(f"{keyed_url}/v1/models", headers=AUTH).json()["data"]
    assert not next(c for c in cards if c["id"] == MODEL)["loaded"]
    # Unloaded, the default model is still servable (its next request loads it): not a reason to take
    # the gateway out of service.
    h = httpx.get(f"{keyed_url}/health")
    assert h.status_code == 200 and h.json()["models"][MODEL]["status"] == "not_loaded"


# --- the page in Chromium -------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    exe = shutil.which("chromium")
    if exe is None:
        why = "Debian's chromium is not installed (apt-get install --no-install-recommends chromium; scripts/test.sh does)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why)
        pytest.skip(why)
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        await b.close()


class Console:
    """Console errors and uncaught exceptions of one page."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)


async def _page(browser: Browser, url: str, scheme: Literal["light", "dark"] = "light") -> tuple[Page, Console]:
    page = await browser.new_page(viewport={"width": 1280, "height": 900}, color_scheme=scheme)
    console = Console(page)
    await page.goto(url)
    return page, console


async def _running(url: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{url}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "gateway_requests_running"
               for s in f.samples)


async def _cancelled(url: str) -> float:
    async with httpx.AsyncClient() as c:
        text = (await c.get(f"{url}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "gateway_requests"
               for s in f.samples if s.name.endswith("_total") and s.labels.get("outcome") == "cancelled")


async def _chat(page: Page, prompt: str, max_tokens: int, temperature: float = 0.0) -> None:
    await page.fill("#temperature", str(temperature))
    await page.fill("#max-tokens", str(max_tokens))
    await page.fill("#prompt", prompt)
    await page.press("#prompt", "Enter")  # the keyboard sends


async def test_page_shows_devices_models_and_the_serving_engine(browser: Browser, gateway_url: str) -> None:
    page, console = await _page(browser, gateway_url)
    engine = httpx.get(f"{gateway_url}/health").json()["models"][MODEL]["engine"]
    await page.wait_for_selector("#plans li.serving")
    assert engine in await page.inner_text("#plans li.serving")
    assert engine in await page.inner_text("#summary")
    rows = await page.locator("#devices tbody tr").all_inner_texts()
    assert any(r.startswith("CPU") for r in rows)
    assert await page.inner_text(f'#models tr[data-model="{MODEL}"] td.engine') == engine
    assert "Plan for" in await page.locator("#devices-text").text_content()  # type: ignore[operator]
    assert console.errors == []
    await page.close()


async def test_chat_streams_a_reply_with_its_engine_and_timings(browser: Browser, gateway_url: str,
                                                                client: openai.OpenAI) -> None:
    page, console = await _page(browser, gateway_url)
    await page.wait_for_selector(f'#model option[value="{MODEL}"]', state="attached")
    # Every text the reply shows while it streams, recorded in the page.
    await page.evaluate("""() => { window.seen = []; new MutationObserver(() => {
        const r = document.querySelector('.reply'); if (r) window.seen.push(r.textContent); })
        .observe(document.querySelector('#log'), {subtree: true, childList: true, characterData: true}); }""")
    question = "Name three colours."
    await _chat(page, question, max_tokens=24)
    await page.wait_for_selector(".stats[data-ending]", timeout=60_000)
    stats = await page.inner_text(".stats")
    reply = await page.inner_text(".reply")
    seen = [s for s in await page.evaluate("window.seen") if s]
    assert len(set(seen)) >= 3, f"the reply did not stream: {seen}"
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=24, temperature=0).choices[0].message.content
    assert reply.strip() == (whole or "").strip()
    health = httpx.get(f"{gateway_url}/health").json()["models"][MODEL]
    assert f"{health['engine']} on {health['device']}" in stats
    assert "TTFT " in stats and " tok/s" in stats and "TTFT –" not in stats
    # A poll after the reply, so the charts hold it, then the picture for docs/.
    await page.wait_for_timeout(2500)
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "web-page.png"), full_page=True)
    assert console.errors == []
    await page.close()


async def _add_ignore_eos(route: Route) -> None:
    body = json.loads(route.request.post_data or "{}")
    await route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


async def test_stop_ends_the_generation_on_the_server(browser: Browser, gateway_url: str) -> None:
    page, console = await _page(browser, gateway_url)
    # A reply that cannot end by itself within the test: no end-of-sequence, 1500 tokens.
    await page.route("**/v1/chat/completions", _add_ignore_eos)
    await page.wait_for_selector(f'#model option[value="{MODEL}"]', state="attached")
    cancelled = await _cancelled(gateway_url)
    await _chat(page, "Tell a long story about a lighthouse keeper.", max_tokens=1500)
    await page.wait_for_function("() => document.querySelector('.reply')?.textContent.length > 20", timeout=60_000)
    assert await _running(gateway_url) >= 1
    assert await page.is_enabled("#stop") and not await page.is_enabled("#send")
    await page.click("#stop")
    t0 = time.monotonic()
    while await _running(gateway_url) > 0 and time.monotonic() - t0 < 5:
        await page.wait_for_timeout(100)
    assert await _running(gateway_url) == 0, "the engine is still generating after Stop"
    assert await _cancelled(gateway_url) == cancelled + 1
    await page.wait_for_selector('.stats[data-ending="stopped"]')
    tokens = int((await page.inner_text(".stats")).split(" tokens")[0].rsplit(" ", 1)[-1])
    assert 0 < tokens < 1500
    assert await page.is_enabled("#send")
    assert console.errors == []
    await page.close()


async def test_charts_update_after_requests(browser: Browser, gateway_url: str) -> None:
    page, console = await _page(browser, gateway_url)
    tps = page.locator("#chart-tps")
    # Quiet first (no tokens in the rate window), so the points that follow are these requests'.
    await page.wait_for_function("() => document.querySelector('#chart-tps')?.getAttribute('aria-label') === 'tokens/s 0.0'",
                                 timeout=30_000)
    before = int(await tps.get_attribute("data-nonzero") or 0)
    ttft_before = int(await page.locator("#chart-ttft").get_attribute("data-points") or 0)
    total = int((await page.inner_text("#cards")).split("Requests / tokens (total)")[1].split("/")[0])
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as c:
        for _ in range(3):
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 16, "ignore_eos": True,
                                                           "messages": [{"role": "user", "content": "Hello"}]})
            assert r.status_code == 200
    # Functions, not expressions: the page's CSP forbids eval, which Playwright uses for expressions.
    await page.wait_for_function("n => document.querySelector('#cards').innerText.includes(`${n} /`)", arg=total + 3,
                                 timeout=10_000)
    await page.wait_for_function("n => Number(document.querySelector('#chart-tps').dataset.nonzero) > n", arg=before,
                                 timeout=10_000)
    await page.wait_for_function("n => Number(document.querySelector('#chart-ttft').dataset.points) > n",
                                 arg=ttft_before, timeout=10_000)
    # The SLO lines, at the thresholds of gateway/metrics.py.
    assert float(await page.locator("#chart-ttft line.slo").get_attribute("data-value") or 0) == SLO_TTFT_S
    assert float(await page.locator("#chart-itl line.slo").get_attribute("data-value") or 0) == SLO_TPOT_S
    assert console.errors == []
    await page.close()


async def test_light_and_dark(browser: Browser, gateway_url: str) -> None:
    backgrounds = []
    scheme: Literal["light", "dark"]
    for scheme in ("light", "dark"):
        page, console = await _page(browser, gateway_url, scheme)
        await page.wait_for_selector("#models tbody tr")
        backgrounds.append(await page.evaluate("getComputedStyle(document.body).backgroundColor"))
        await page.screenshot(path=str(ARTIFACTS / f"web-page-{scheme}.png"))
        assert console.errors == []
        await page.close()
    assert backgrounds[0] != backgrounds[1]


async def test_page_asks_for_the_key_and_loads_and_unloads(browser: Browser, keyed_url: str) -> None:
    page, console = await _page(browser, keyed_url)
    await page.wait_for_selector("#key-form:not([hidden])")
    await page.fill("#key", "wrong-key")
    await page.press("#key", "Enter")
    await page.wait_for_function("() => document.querySelector('#key-msg').textContent.includes('refused')")
    await page.fill("#key", KEY)
    await page.press("#key", "Enter")
    row = f'#models tr[data-model="{MODEL}"]'
    await page.wait_for_selector(f'{row}[data-state="not_loaded"]')
    assert await page.evaluate("sessionStorage.getItem('llm-gateway-api-key')") == KEY
    await page.click(f"{row} button")
    await page.wait_for_selector(f'{row}[data-state="loaded"]', timeout=120_000)
    assert (await page.inner_text(f"{row} td.engine")).startswith("llamacpp/")
    await page.wait_for_selector("#plans li.serving")
    await page.click(f"{row} button")
    await page.wait_for_selector(f'{row}[data-state="not_loaded"]', timeout=30_000)
    # Only the refusals before the key was given, which the browser logs as failed loads.
    assert all("401" in e for e in console.errors), console.errors
    await page.close()
