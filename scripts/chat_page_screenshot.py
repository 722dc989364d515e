"""Take docs/chat-page.png: start `nanoserve serve` (default model: SmolLM2-135M-Instruct), hold
a short conversation on its chat page in headless Chromium, and screenshot it.

    python scripts/chat_page_screenshot.py [--model DIR] [--out docs/chat-page.png]

Needs Debian's chromium (apt-get install chromium) and playwright (pip install playwright).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Name three things to see there."]


def start_server(model: str | None) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "nanoserve", "serve", "--port", "0", "--log-level", "warning"]
    if model:
        command += ["--model", model]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    for line in process.stdout:
        if line.startswith("listening on "):
            return process, line.split()[-1]
    raise SystemExit(f"the server exited with {process.wait()} before listening")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=str(ROOT / "docs" / "chat-page.png"))
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print(
            "chat_page_screenshot: no chromium on PATH (apt-get install chromium)", file=sys.stderr
        )
        return 1
    from playwright.sync_api import sync_playwright

    process, url = start_server(args.model)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium)
            page = browser.new_page(viewport={"width": 1200, "height": 720}, color_scheme="light")
            page.set_default_timeout(120_000)
            page.goto(url + "/")
            page.fill("#temperature", "0.3")
            page.fill("#max-tokens", "96")
            page.fill("#system", "You are a concise assistant.")
            for index, question in enumerate(QUESTIONS):
                page.fill("#prompt", question)
                page.click("#send")
                page.locator(".msg.assistant").nth(index).and_(
                    page.locator("[data-done]")
                ).wait_for()
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out)
            browser.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
