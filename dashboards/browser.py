# SPDX-License-Identifier: Apache-2.0
"""Headless Debian Chromium for the browser tests, the render benchmark and screenshots.

Imports selenium (a test dependency, from dash[testing]) inside the function, so the app
itself never needs it.
"""

from __future__ import annotations

from typing import Any

CHROMIUM = "/usr/bin/chromium"  # Debian's chromium; chromedriver is /usr/bin/chromedriver
# --no-sandbox: Chromium refuses to run as root without it; the networking flags keep it
# from calling home on an offline host.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run",
)


def chromium_options(width: int = 1400, height: int = 1000) -> Any:
    """selenium ChromeOptions for headless Chromium with a `width` x `height` window."""
    from selenium.webdriver.chrome.options import Options

    options = Options()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--window-size={width},{height}"):
        options.add_argument(flag)
    return options
