"""Screenshot of the demo page replaying a recorded result (``app.py --record`` then ``--replay``).

    python scripts/screenshot_replay.py RECORDING_DIR OUT.png

Starts ``app.py --replay RECORDING_DIR`` on a free localhost port, opens it in headless Chromium
(Debian's ``/usr/bin/chromium`` through Playwright), presses Generate, waits for both images and the
report, and saves a full-page screenshot. Exits non-zero with a message on any failure.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def free_port() -> int:
    """A localhost TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_serving(url: str, server: subprocess.Popen, seconds: float = 120) -> None:
    """Return once ``url`` answers 200. Raises RuntimeError if ``server`` exits or ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"app.py exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise RuntimeError(f"app.py did not serve {url} within {seconds:.0f} s")


def screenshot(recording: Path, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    port = free_port()
    command = [sys.executable, str(ROOT / "app.py"), "--replay", str(recording), "--port", str(port)]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_until_serving(url, server)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url)
                page.locator("#generate").click()
                page.locator("#report h3").first.wait_for(timeout=60_000)  # the headline: speed-up, identity
                for name in ("eager", "accelerated"):
                    page.locator(f"#{name}-image img").wait_for(timeout=60_000)
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=True)
            finally:
                browser.close()
    finally:
        stop_server(server)


def stop_server(server: subprocess.Popen) -> None:
    """Terminate ``server``, and kill it if it has not exited 10 s later."""
    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=10)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        screenshot(Path(argv[0]), Path(argv[1]))
    except Exception as exc:  # a CLI: say what failed and exit non-zero
        print(f"screenshot_replay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
