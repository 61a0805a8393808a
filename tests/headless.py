"""A headless Chromium for the page tests and the README screenshots, via selenium.

The network is closed and nothing may download: the browser and its driver must already be
installed (Debian: ``apt-get install chromium chromium-driver``); selenium is told their
paths, so its driver manager never looks online. :func:`missing` says why a browser cannot
start, for ``pytest.skip``.
"""

from __future__ import annotations

import shutil
import tempfile

BROWSERS = ("chromium", "chromium-browser", "google-chrome")

# Everything that would reach out at start-up (updates, sync, field trials) is off; a fresh
# profile keeps runs independent.
FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
    "--hide-scrollbars", "--force-device-scale-factor=1",
)  # fmt: skip


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def missing() -> str | None:
    """None when a headless Chromium can start here, else the reason it cannot."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if _browser() is None:
        return "no Chromium found (apt-get install chromium)"
    if shutil.which("chromedriver") is None:
        return "no chromedriver found (apt-get install chromium-driver)"
    return None


def start(width: int = 1200, height: int = 900):
    """A selenium Chrome driver on a fresh profile that records the page's console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _browser()
    profile = tempfile.mkdtemp(prefix="qkv-chromium-")
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.profile_dir = profile  # removed by stop()
    return driver


def stop(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)
