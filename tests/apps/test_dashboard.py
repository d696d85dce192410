"""`serve`'s /dashboard in a real headless Chromium (Playwright): the page loads, shows what
/v1/stats says after real requests (and per-layer counts that add up to it), its numbers move
while a request runs, and a screenshot is kept (STRATA_MLX_ARTIFACTS, else the test's tmp).

Skips where Playwright or a Chromium is missing: Debian's chromium-headless-shell or chromium
(.ci/run installs one), STRATA_MLX_CHROMIUM, or a browser of Playwright's own."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from strata_mlx.apps.server import create_app

sync_api = pytest.importorskip("playwright.sync_api")

from test_server import (  # noqa: E402
    FAMILY,
    LONG,
    NAME,
    load_tiny,
    running,
    set_context,
    write_tokenizer,
)

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """Debian's Chromium (or the one named by STRATA_MLX_CHROMIUM); None: Playwright's own."""
    named = os.environ.get("STRATA_MLX_CHROMIUM")
    if named:
        return named
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        path = chromium_path()
        if path is None and not Path(p.chromium.executable_path).exists():
            pytest.skip("no Chromium: apt-get install chromium-headless-shell")
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


def tiny_model(store, d: Path):
    """test_server's tiny model, with its tokenizer and its context past LONG, from a copy of
    the store at `d`."""
    shutil.copytree(store(FAMILY), d)
    write_tokenizer(d)
    set_context(d, 2 * LONG)
    return load_tiny(d)


@pytest.fixture(scope="module")
def served(store, tmp_path_factory):
    model, tok = tiny_model(store, tmp_path_factory.mktemp("dashboard") / "tiny")
    app = create_app(model, tok, NAME, max_tokens_limit=LONG)
    try:
        with running(app) as base:
            yield base, model, tok
    finally:
        model.expert_cache.close()


def shown(page) -> dict:
    """Everything the page shows, read in one go (between two renders): data-key -> text of
    the tiles, the per-layer rows, and the poll count."""
    return page.evaluate(
        """() => ({
          seq: Number(document.body.dataset.seq),
          tiles: Object.fromEntries([...document.querySelectorAll('[data-key]')]
            .filter(e => !e.closest('#layers')).map(e => [e.dataset.key, e.textContent])),
          layers: [...document.querySelectorAll('#layers tbody tr')].map(tr =>
            Object.fromEntries([...tr.querySelectorAll('[data-key]')]
              .map(e => [e.dataset.key, e.textContent]))),
        })"""
    )


def next_polls(page, n: int = 2, timeout: float = 20.0) -> dict:
    """What the page shows once it has rendered `n` more polls."""
    start = shown(page)["seq"]
    deadline = time.monotonic() + timeout
    while True:
        s = shown(page)
        if s["seq"] >= start + n:
            return s
        assert time.monotonic() < deadline, "the page stopped polling"
        page.wait_for_timeout(50)


def lookup(body: dict, key: str):
    for part in key.split("."):
        body = body[part]
    return body


def agrees(text: str, value, fmt: str | None) -> bool:
    """The page's text of `value` as dashboard.html formats it (to its shown precision)."""
    if fmt is None:
        return text == str(value)
    if fmt == "pct":
        return text.endswith(" %") and abs(float(text[:-2]) - 100 * value) <= 0.05 + 1e-9
    decimals = int(fmt[1:])
    return abs(float(text) - value) <= 0.5 * 10**-decimals + 1e-9


def chat(base: str, content: str, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    with httpx.Client(trust_env=False, timeout=60) as http:
        r = http.post(base + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def server_stats(base: str) -> dict:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return http.get(base + "/v1/stats").json()


def artifact(tmp_path: Path, name: str) -> Path:
    d = Path(os.environ.get("STRATA_MLX_ARTIFACTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d / name


def test_dashboard_shows_the_stats_endpoint_and_moves_while_a_request_runs(
    browser, served, tmp_path
):
    base, model, tok = served
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base + "/dashboard")
    first = next_polls(page, 1)
    assert first["tiles"]["stats.model"] == NAME
    assert len(first["layers"]) == len(model.expert_cache.layers)

    # Real requests, then the page against the stats endpoint: the same numbers.
    chat(base, "the cat sat on the mat", 4)
    chat(base, "tell me a story about a red fox", 6)
    seen = next_polls(page)
    stats = server_stats(base)
    assert stats["expert_cache"]["lookups"] > 0 and stats["expert_cache"]["misses"] > 0
    formats = dict(
        page.evaluate(
            """() => [...document.querySelectorAll('[data-key]')]
                 .filter(e => !e.closest('#layers')).map(e => [e.dataset.key,
                 e.dataset.format || null])"""
        )
    )
    compared = 0
    for key, text in seen["tiles"].items():
        if key.startswith("stats."):
            value = lookup(stats, key.removeprefix("stats."))
            assert agrees(text, value, formats[key]), (key, text, value)
            compared += 1
    assert compared >= 12
    ec = stats["expert_cache"]
    for counter in ("hits", "streamed_ahead", "misses"):
        assert sum(int(row[counter]) for row in seen["layers"]) == ec[counter], counter
    assert (
        sum(int(row["resident"].split(" / ")[0]) for row in seen["layers"])
        == (stats["arena"]["resident"])
    )
    with httpx.Client(trust_env=False, timeout=30) as http:
        data = http.get(base + "/dashboard/data").json()
    assert sum(l["lookups"] for l in data["layers"]) == ec["lookups"]

    # A long streaming request: the page's counters and rates move while it runs.
    stop = threading.Event()

    def long_request():
        body = {
            "messages": [{"role": "user", "content": "what is the capital of france"}],
            "max_tokens": LONG,
            "stream": True,
            "temperature": 0,
            # never the end of turn: it runs until the test leaves
            "logit_bias": {str(tok._tok.token_to_id("<|im_end|>")): -100},
        }
        with httpx.Client(trust_env=False, timeout=60) as http:
            with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break  # leaving the stream cancels the generation

    worker = threading.Thread(target=long_request, daemon=True)
    worker.start()
    try:
        tokens, rates, lookups = [], [], []
        deadline = time.monotonic() + 60
        while len(tokens) < 4 or not any(r > 0 for r in rates):
            assert time.monotonic() < deadline, (tokens, rates)
            s = next_polls(page, 1)
            tokens.append(int(s["tiles"]["stats.server.completion_tokens"]))
            rates.append(float(s["tiles"]["rates.tokens_per_s"]))
            lookups.append(int(s["tiles"]["stats.expert_cache.lookups"]))
        assert tokens[-1] > tokens[0] and lookups[-1] > lookups[0], (tokens, lookups)
        assert s["tiles"]["stats.server.active"] == "1"
        shot = artifact(tmp_path, "dashboard.png")
        page.screenshot(path=str(shot), full_page=True)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"dashboard screenshot: {shot}")
    deadline = time.monotonic() + 30
    while server_stats(base)["server"]["active"]:
        assert time.monotonic() < deadline, "the cancelled request did not stop"
        time.sleep(0.05)
    assert not errors, errors
    page.close()


def test_dashboard_data_without_an_expert_cache():
    """A model without an expert cache (a dense one): the page's feed still answers."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from strata_mlx.apps.dashboard import Dashboard, page

    class Engine:
        last = None

    async def stats():
        return {"model": "m", "server": {"completion_tokens": 0}, "expert_cache": None}

    board = Dashboard(None, Engine(), stats)
    # on a thread of its own: Playwright's sync API may hold an event loop on this one
    with ThreadPoolExecutor(1) as pool:
        data = pool.submit(asyncio.run, board.data()).result()
    assert data["layers"] == [] and data["rates"]["tokens_per_s"] == 0.0
    json.dumps(data)
    assert "/dashboard/data" in page()


def test_dashboard_behind_an_api_key_opens_in_a_browser_given_the_key(browser, store, tmp_path):
    """`serve --api-key`: the browser gets the Basic challenge (no page without the key), and
    with the key as its login's password the page loads and its polls keep succeeding."""
    from test_server import KEY

    model, tok = tiny_model(store, tmp_path / "tiny")
    app = create_app(model, tok, NAME, api_key=KEY)
    try:
        with running(app) as base:
            anonymous = browser.new_page()
            assert anonymous.goto(base + "/dashboard").status == 401
            anonymous.close()
            context = browser.new_context(http_credentials={"username": "me", "password": KEY})
            page = context.new_page()
            assert page.goto(base + "/dashboard").status == 200
            shown_now = next_polls(page, 2)
            assert shown_now["tiles"]["stats.model"] == NAME
            context.close()
    finally:
        model.expert_cache.close()
