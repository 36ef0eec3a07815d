"""The tenant's web page (`/ui`) in a real headless browser: Debian's chromium, driven by Playwright with its
executable path (no browser download). It logs in with the tenant's key, shows that tenant's models and nobody
else's, plots live figures, and refuses a wrong key."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from conftest import KEYS, load

SCREENSHOT = Path(__file__).parents[3] / "docs" / "images" / "ui.png"


def test_the_page_shows_the_tenants_own_models_and_live_plots(server, browser):
    for tenant, name, path in (("alice", "poet", "alice/poet"), ("bob", "writer", "bob/writer")):
        response = load(server, tenant, name, path)
        assert response.status_code in (200, 400), response.text  # 400: loaded by an earlier test of this module
    for _ in range(3):
        server.client("alice").completions.create(model="poet", prompt="roses are", max_tokens=6, temperature=0)
    server.client("alice").completions.create(model="tiny-llama", prompt="the cat", max_tokens=4, temperature=0)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    response = page.goto(server.url + "/ui")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.fill("#key", KEYS["alice"])
    page.click("button[type=submit]")
    page.wait_for_selector("#models .fill[data-model='poet']")
    assert page.inner_text("#who") == "tenant alice"
    models = page.eval_on_selector_all("#models .fill", "bars => bars.map(b => b.dataset.model)")
    assert models == ["tiny-llama (base)", "poet"]  # bob's adapter is not shown to alice
    assert "3 requests" in page.inner_text("#models")
    # the rate and latency plots have points; the executor's plot fills in from the second reading on
    page.wait_for_function("document.querySelectorAll('#executor polyline').length === 3")
    points = page.eval_on_selector("#rate polyline", "line => line.getAttribute('points').split(' ').length")
    assert points >= 1
    assert page.eval_on_selector("#latency polyline[data-series='whole request']", "l => l.getAttribute('points')")
    if os.environ.get("SYMBIOSIS_UI_SCREENSHOT"):  # docs/images/ui.png is made this way, under some load
        SCREENSHOT.parent.mkdir(exist_ok=True)
        client, stop = server.client("alice"), threading.Event()

        def load_it():
            while not stop.is_set():
                client.completions.create(model="poet", prompt=["roses are"] * 8, max_tokens=24, temperature=1)
        workers = [threading.Thread(target=load_it) for _ in range(4)]
        for worker in workers:
            worker.start()
        page.wait_for_timeout(12000)
        stop.set()
        for worker in workers:
            worker.join()
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    page.click("#logout")
    assert page.is_visible("#login") and not page.is_visible("#board")
    assert not errors
    page.close()


def test_a_wrong_key_is_refused_and_nothing_is_shown(server, browser):
    page = browser.new_page()
    page.goto(server.url + "/ui")
    page.fill("#key", "not-a-key-0123456789")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-error:has-text('not valid')")
    assert not page.is_visible("#board")
    assert page.evaluate("sessionStorage.getItem('symbiosis-key')") is None
    page.close()
