"""End to end in headless Chromium against a live run_web.py: form errors, save, join commands, live dashboard.

Uses Debian's /usr/bin/chromium through Playwright (never `playwright install`). Every request outside the app is
blocked and counted, so the page is proven to work offline.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import requests

from tests.web.live import WebServer, running_web_server

pytestmark = [pytest.mark.browser, pytest.mark.light]

CHROMIUM = Path("/usr/bin/chromium")
SCRIPT_NAME = "<script>alert(1)</script>"  # a volunteer's --public_name: shown as text, never run
ADMIN_TOKEN = "browser-test-admin-token"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture
def server(tmp_path):
    if not CHROMIUM.exists():
        reason = "no /usr/bin/chromium: apt-get install chromium (make browser)"
        pytest.fail(reason) if os.environ.get("CI") else pytest.skip(reason)
    with running_web_server(tmp_path, ADMIN_TOKEN) as server:
        yield server


@pytest.fixture
def page(server):
    playwright_api = pytest.importorskip("playwright.sync_api")
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900}, accept_downloads=True)
            page.set_default_timeout(20_000)
            page.outside = []
            page.console_errors = []

            def only_the_app(route):
                if route.request.url.startswith(server.url):
                    route.continue_()
                else:
                    page.outside.append(route.request.url)
                    route.abort()

            page.route("**/*", only_the_app)
            page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
            page.dialogs = []
            page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
            yield page
        finally:
            browser.close()


def post_metrics(server: WebServer, token: str, step: int) -> None:
    record = {
        "step": step,
        "loss": 6.0 - step * 0.5,
        "alive_peers": 2,
        "samples": 128 * step,
        "samples_per_second": 30.0 + step,
        "time": 1_700_000_000.0 + 10 * step,
    }
    if step == 4:
        record["eval_loss"] = 4.5
        record["contributors"] = [
            {"peer": "0123456789ab", "name": SCRIPT_NAME, "samples": 384, "rounds": 3, "seconds_online": 75.0,
             "last_seen": record["time"]},
            {"peer": "fedcba987654", "name": None, "samples": 128, "rounds": 1, "seconds_online": 0.0,
             "last_seen": record["time"]},
        ]  # fmt: skip
    response = requests.post(
        f"{server.url}/api/experiments/1/metrics",
        json=record,
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert response.status_code == 200, response.text


def test_configure_save_join_and_watch_the_dashboard(server, page, tmp_path):
    expect = pytest.importorskip("playwright.sync_api").expect
    page.goto(f"{server.url}/experiments/new")
    page.fill("#token", ADMIN_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(f"{server.url}/experiments/new")

    page.fill("#name", "browser <run>")
    page.fill("#target_batch_size", "-1")
    page.click("#save")
    error = page.locator("#field-target_batch_size .error")
    expect(error).to_have_text("--target_batch_size: must be a positive number (got -1)")
    expect(page.locator("#target_batch_size")).to_have_value("-1")
    expect(page.locator("#name")).to_have_value("browser <run>")
    page.locator("#field-target_batch_size").screenshot(path=str(tmp_path / "form-error.png"))

    page.fill("#target_batch_size", "128")
    page.fill("#max_steps", "10")
    page.click("#save")
    page.wait_for_url(f"{server.url}/experiments/1")
    expect(page.locator("#experiment-name")).to_have_text("browser <run>")
    peer_token = page.locator("#experiment-token").inner_text()
    token = page.locator("#monitor-token").inner_text()
    api = f"{server.url}/api/experiments/1"
    expect(page.locator("#command-trainer")).to_have_text(
        f"python run_trainer.py --config {api}/config --config_token {peer_token}"
    )
    expect(page.locator("#command-monitor")).to_contain_text(f"--config_token {token} --report_url {api}/metrics")

    for step in range(1, 5):
        post_metrics(server, token, step)
    expect(page.locator("#stat-step")).to_have_text("4")
    expect(page.locator("#stat-loss")).to_have_text("4.000")
    expect(page.locator("#stat-eta")).to_have_text("1 min 0 s")
    expect(page.locator("#stat-eval_loss")).to_have_text("4.500")
    expect(page.locator("#stat-sps")).to_have_text("34.0")
    assert page.locator("#chart-loss polyline.s1").get_attribute("points").count(",") == 4
    for drawn_by in ("dashboard.js", "the template"):
        rows = page.locator("#contributors tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.nth(0).locator("td")).to_have_text(
            [SCRIPT_NAME, "0123456789ab", "384", "3", "1 min 15 s", "2023-11-14 22:14:00 UTC"]
        )
        expect(rows.nth(1).locator("td").first).to_have_text("fedcba987654")  # no name: its short key
        assert page.locator("#contributors script").count() == 0, f"a name became a script ({drawn_by})"
        page.reload()
    assert page.dialogs == [], "a contributor's name ran as a script"
    post_metrics(server, token, 5)
    expect(page.locator("#stat-step")).to_have_text("5")

    archive = b"not really a tarball"
    response = requests.post(
        f"{api}/checkpoints",
        data={"step": "5", "loss": "3.5", "sha256": hashlib.sha256(archive).hexdigest()},
        files={"archive": ("checkpoint-5.tar.gz", archive)},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    link = page.locator("#checkpoints a", has_text="checkpoint-5.tar.gz")
    with page.expect_download() as download:
        link.click()
    assert Path(download.value.path()).read_bytes() == archive

    page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

    # Real same-origin form posts from the browser pass the origin check.
    page.click("#rotate-monitor-token")
    expect(page.locator("#monitor-token")).not_to_have_text(token)
    expect(page.locator("#experiment-token")).to_have_text(peer_token)
    page.click("button:has-text('Sign out')")
    page.wait_for_url(f"{server.url}/")
    page.goto(f"{server.url}/experiments/new")
    page.wait_for_url(f"{server.url}/login?next=/experiments/new")
    assert page.outside == [], "the page tried to reach the internet"
    # The one expected: the rejected form comes back with status 422.
    assert [e for e in page.console_errors if "status of 422" not in e] == []
