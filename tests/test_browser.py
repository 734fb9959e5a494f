"""The demo page in a real browser: ``app.py`` (tiny pipelines, CPU) driven by headless Chromium through Playwright.

Skips when Playwright or ``/usr/bin/chromium`` is missing, saying how to run it (:data:`HOW_TO_RUN`), unless
``BCG_REQUIRE_BROWSER=1`` (CI), where that fails. Leaves a screenshot in ``test-artifacts/demo.png`` and the
server's log in ``test-artifacts/demo-server.log``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import screenshot_replay  # noqa: E402 - the screenshot script and this test share the browser set-up

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path(screenshot_replay.CHROMIUM)
CHROMIUM_ARGS = screenshot_replay.CHROMIUM_ARGS
SERVER_START_S = 120
GENERATE_S = 60
PROMPT = "a lighthouse on a cliff at night"
HOW_TO_RUN = (
    "to run it, install Debian's chromium package (`apt-get install chromium`, which gives /usr/bin/chromium) and "
    "`pip install playwright`; `BCG_REQUIRE_BROWSER=1` makes a missing browser fail instead of skip"
)


def _missing_browser() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed"
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"{CHROMIUM} is missing"
    if importlib.util.find_spec("gradio") is None:
        return "gradio is not installed (pip install -e '.[test]')"
    return None


def _need_browser() -> None:
    """Skip (or with ``BCG_REQUIRE_BROWSER=1`` fail) the test when the browser or its driver is missing."""
    missing = _missing_browser()
    if missing is None:
        return
    if os.environ.get("BCG_REQUIRE_BROWSER") == "1":
        pytest.fail(f"BCG_REQUIRE_BROWSER=1 but {missing}")
    pytest.skip(f"needs headless Chromium through Playwright ({missing}); {HOW_TO_RUN}")


def _log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _wait_until_serving(url: str, server: subprocess.Popen, log: Path) -> None:
    try:
        screenshot_replay.wait_until_serving(url, server, SERVER_START_S)
    except RuntimeError as exc:
        pytest.fail(f"{exc}:\n{_log_tail(log)}")


@pytest.fixture
def server_url():
    """``app.py`` on a free localhost port, tiny pipelines on the CPU; killed at the end whatever happens."""
    _need_browser()
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / "demo-server.log"
    port = screenshot_replay.free_port()
    command = [sys.executable, str(ROOT / "app.py"), "--weights", "tiny", "--device", "cpu", "--port", str(port)]
    command += ["--warmup", "64x64"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}/"
        _wait_until_serving(url, server, log)
        yield url
    finally:
        screenshot_replay.stop_server(server)


def test_generate_shows_both_images_the_timings_and_errors(server_url):
    from playwright.sync_api import sync_playwright

    external: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on(
                "request",
                lambda r: external.append(r.url) if urlsplit(r.url).hostname not in (None, "127.0.0.1") else None,
            )
            page.goto(server_url)
            page.locator("#prompt textarea").fill(PROMPT)
            page.locator("#resolution input").fill("128x96")
            page.locator("#resolution input").press("Enter")
            page.locator("#generate").click()

            report = page.locator("#report")
            report.get_by_text("byte-identical: yes").wait_for(timeout=GENERATE_S * 1000)
            images = [page.locator(f"#{name}-image img") for name in ("eager", "accelerated")]
            for image in images:
                image.wait_for(timeout=GENERATE_S * 1000)
                assert image.evaluate("img => img.complete && img.naturalWidth") == 128
                assert image.evaluate("img => img.naturalHeight") == 96
            text = report.inner_text()
            assert "latency" in text and "speed-up" in text.lower() and "not meaningful" in text
            assert "z-image, 128x96, 8 steps" in text and "; exact mode; " in text  # the mode that ran
            assert "captures" in text and "graph memory" in text
            assert " s" in text.split("latency", 1)[1].splitlines()[0]  # both latencies are printed in seconds
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)

            # a bad resolution: a short message on the page, no traceback, and the server goes on serving
            page.locator("#resolution input").fill("500x512")
            page.locator("#resolution input").press("Enter")
            page.locator("#generate").click()
            page.get_by_text("width 500 is not a multiple of 16").wait_for(timeout=GENERATE_S * 1000)
            assert "Traceback" not in page.content()

            # the mode selector, next to the pipeline choice: choosing fast mode renames the left image,
            # which is then fast mode's reference (its compiled blocks without graphs), not eager
            selector = page.locator("#acceleration")
            assert selector.get_by_label("exact").is_checked() and not selector.get_by_label("fast").is_checked()
            selector.get_by_label("fast").check()
            page.locator("#eager-image").get_by_text("Fast mode's reference").first.wait_for(timeout=10_000)
            selector.get_by_label("exact").check()
            page.locator("#eager-image").get_by_text("Eager").first.wait_for(timeout=10_000)
        finally:
            browser.close()
    assert not external, f"the page reached outside localhost: {external}"


def test_replay_page_screenshot(tmp_path):
    """Record a tiny generation, then screenshot the page replaying it (the H200 screenshot's path)."""
    _need_browser()
    recording = tmp_path / "recording"
    command = [sys.executable, str(ROOT / "app.py"), "--weights", "tiny", "--device", "cpu", "--pipeline", "z-image"]
    done = subprocess.run(
        [*command, "--record", str(recording)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = ARTIFACTS / "demo-replay.png"
    shot = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "screenshot_replay.py"), str(recording), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
