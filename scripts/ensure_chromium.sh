#!/usr/bin/env bash
# Make sure Debian's chromium and chromium-driver are installed: the browser
# test (tests/test_book_browser.py) drives /usr/bin/chromium through
# /usr/bin/chromedriver, so Selenium never downloads a driver.
# Usage: scripts/ensure_chromium.sh        (called by `make test`)
set -euo pipefail
cd "$(dirname "$0")"
./apt_ensure.sh chromium chromium chromium-driver
./apt_ensure.sh chromedriver chromium chromium-driver
