"""Headless Chromium for the viewer's browser tests and bench/viewer.py (Debian's chromium + chromium-driver).

`chromium_or_skip()` gives a selenium Chrome driver, or skips the test with the reason (selenium
not installed, no chromium or chromedriver on PATH: `scripts/install.sh` installs them).
`open_page(driver, url)` loads a viewer route and waits until the page says it is ready
(`document.body.dataset.ready`, set by viewer.js once the route has rendered), so no test
races the page's own requests.
"""

from __future__ import annotations

import shutil
import time

import pytest

WINDOW = "1400,1000"


def missing() -> str | None:
    """Why Chromium cannot be driven here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (the dev extra)"
    for binary, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(binary) is None:
            return f"{binary} is not on PATH (Debian package {package}; scripts/install.sh installs it)"
    return None


def chromium():
    """A headless Chromium driven through Debian's chromedriver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={WINDOW}", "--disable-extensions", "--no-first-run"):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def chromium_or_skip():
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    return chromium()


def wait_for(driver, script: str, *, timeout_s: float = 20.0, what: str = "the page"):
    """Poll a JavaScript expression until it is truthy; return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = driver.execute_script(f"return ({script});")
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: `{script}` still false after {timeout_s:g} s")
        time.sleep(0.05)


def open_page(driver, url: str, *, timeout_s: float = 20.0) -> None:
    """Load a viewer URL (base + '#/...') and wait until that route has rendered."""
    route = url.split("#", 1)[1] if "#" in url else "/"
    driver.get(url)
    ready = wait_for(driver, "document.body.dataset.ready", timeout_s=timeout_s, what=url)
    if ready == "error":
        raise AssertionError(f"{url}: {driver.find_element('id', 'error').text}")
    assert ready == "#" + route or (route == "/" and ready in ("#/", "#")), (ready, route)


def browser_errors(driver) -> list[str]:
    """The console's error messages so far."""
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def count(driver, selector: str) -> int:
    """How many elements match a CSS selector."""
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length", selector)


# The run page's charts, in order (sdk/viewer/static/viewer.js CHARTS): each is drawn from the first metrics row on.
CHART_TITLES = ["Reward", "Held-out evaluation", "Mismatch KL", "Staleness", "Tokens/s", "Step time split (s)",
                "Rollout time split (s, mean per rollout)", "Tool calls", "Dropped groups"]


def chart_titles(driver) -> list[str]:
    """The titles of the charts drawn on the page, in order."""
    return driver.execute_script(
        "return [...document.querySelectorAll('svg.chart')].map(svg => svg.dataset.chart)")


def texts(driver, selector: str, attribute: str = "textContent") -> list[str]:
    """`attribute` of each element matching a CSS selector (textContent by default)."""
    script = "return [...document.querySelectorAll(arguments[0])].map(e => e[arguments[1]])"
    return driver.execute_script(script, selector, attribute)
