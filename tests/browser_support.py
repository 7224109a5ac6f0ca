"""Test support for the playground page: Debian's Chromium driven headless by Playwright's Python package.

Playwright's own browser download needs the internet; these tests use the system Chromium instead
(`apt-get install chromium`, or `$MIRROR_RT_CHROMIUM`) and skip, saying why, where there is none.
Waits use Playwright's locators: the page's Content-Security-Policy forbids the `eval` behind
`wait_for_function`, and the tests run the page under its own policy.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

import pytest


def chromium_path() -> str | None:
    """The system Chromium, or None."""
    for name in (os.environ.get("MIRROR_RT_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def browser_or_skip():
    """(playwright, browser) on the system Chromium; skips the tests with the reason when it cannot."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser tests: Playwright's Python package is not installed (pip install -e '.[browser]')")
    path = chromium_path()
    if path is None:
        pytest.skip("browser tests: no Chromium here (apt-get install chromium, or set MIRROR_RT_CHROMIUM)")
    playwright = sync_playwright().start()
    try:  # root (CI) cannot use Chromium's sandbox; /dev/shm is small in containers
        browser = playwright.chromium.launch(executable_path=path, headless=True,
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
    except Exception as exc:  # noqa: BLE001 -- any launch failure is a reason to skip, said in one line
        playwright.stop()
        pytest.skip(f"browser tests: Chromium at {path} does not start headless ({str(exc).splitlines()[0]})")
    return playwright, browser


class Page:
    """A fresh browser context on the page, with the console errors it logs."""

    def __init__(self, browser, url: str, **context):
        self.context = browser.new_context(**context)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(url + "/")

    def close(self) -> None:
        self.context.close()

    def settings(self, **values) -> None:
        """Fill the settings: mode, gamma, temperature, max_tokens, system."""
        page = self.page
        if "mode" in values:
            page.select_option("#mode", values["mode"])
        for key, selector in (("gamma", "#gamma"), ("temperature", "#temperature"), ("max_tokens", "#max-tokens"),
                              ("system", "#system")):
            if key in values:
                page.fill(selector, str(values[key]))

    def ask(self, prompt: str, **settings) -> None:
        """Send `prompt` as a user would: type it and press Enter."""
        self.settings(**settings)
        self.page.fill("#prompt", prompt)
        self.page.press("#prompt", "Enter")

    def wait_done(self, timeout_s: float = 60) -> None:
        from playwright.sync_api import expect

        expect(self.page.locator("#status")).to_have_text(re.compile(r"^done"), timeout=timeout_s * 1000)

    def answer(self, index: int = -1):
        """The locator of an answer's tokens (the last one by default)."""
        answers = self.page.locator(".message.assistant .tokens")
        return answers.nth(index) if index >= 0 else answers.last

    def figure(self, name: str) -> str:
        return self.page.text_content(f"#fig-{name}")


@contextlib.contextmanager
def opened_page(browser, url: str):
    """The page at `url` in a fresh context of a desktop window's size, closed after."""
    page = Page(browser, url, viewport={"width": 1280, "height": 900})
    try:
        yield page
    finally:
        page.close()


def expect(locator):
    """Playwright's `expect` (imported on use: the package is optional)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)
