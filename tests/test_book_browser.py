# Run: .venv/bin/python -m pytest \
#   tests/test_book_browser.py -v   (about 30 s; needs /usr/bin/chromium: `make test` installs it)
"""The built book works offline: a real headless Chromium draws its figures,
widgets and math with the network cut off.

The book is built from the notebooks' stored outputs (execution off, through a
copy of _config.yml), so this stays fast; `make book` is the executing build.
Pages are served from 127.0.0.1; every other host is unreachable for the
browser (no DNS, dead proxy), and the off-host URLs it tried are reported.
"""
import functools
import http.server
import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
NOTEBOOK_PAGE = "notebooks/00_how_this_book_runs.html"
MATH_PAGE = "book/conventions.html"
FIGURE_LAYOUT_JS = (ROOT / "tests" / "figure_layout.js").read_text()
WAIT_S = 60  # generous: the machine may be busy with other tests
MAX_PAGE_BYTES = 1_000_000  # plotly.js is served once, never inlined
# A page may try these off-host and still work; anything else needed fails.
NEEDED_TYPES = {"Script", "Stylesheet"}
# Console errors that are not the book's: no favicon on a bare http.server,
# and the theme's notice on a first visit with empty localStorage.
CONSOLE_NOISE = ("favicon.ico", "Got invalid theme mode")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--window-size=1280,900",
    # No network but loopback: no name resolves, and an IP literal would go
    # to a proxy that is not there (loopback always bypasses the proxy).
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",
]

pytestmark = pytest.mark.slow


def offline_config(tmp_path):
    """_config.yml with execution off; the extension path made absolute."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    exts = config["sphinx"]["local_extensions"]
    config["sphinx"]["local_extensions"] = {k: str(ROOT / v) for k, v in exts.items()}
    path = tmp_path / "_config.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def html_dir(tmp_path_factory):
    """Build the book, warnings as errors, into a temporary folder."""
    out = tmp_path_factory.mktemp("book")
    jb = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(jb), "build", str(ROOT), "--path-output", str(out),
           "--config", str(offline_config(out)), "-W", "-n", "--keep-going", "-q"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, (f"book build failed:\n{proc.stdout[-4000:]}\n"
                                  f"{proc.stderr[-4000:]}")
    return out / "_build" / "html"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url(html_dir):
    handler = functools.partial(QuietHandler, directory=str(html_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.is_file():
            pytest.fail(f"{path} is missing: run `make test`, which installs "
                        "Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    # An explicit driver path: Selenium Manager (which downloads drivers) never runs.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def requests_seen(driver):
    """(url, resource type) of each request since the last call (CDP log)."""
    seen = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            params = message["params"]
            seen.append((params["request"]["url"], params.get("type", "Other")))
    return seen


def drain_logs(driver):
    """Forget what earlier pages logged, so each check sees its own page."""
    driver.get_log("performance")
    driver.get_log("browser")


def off_host(requests, base_url):
    host = urlsplit(base_url).netloc
    return sorted({(u, t) for u, t in requests
                   if urlsplit(u).scheme in ("http", "https", "ws", "wss")
                   and urlsplit(u).netloc != host})


def open_page(driver, base_url, page):
    driver.get(base_url + page)
    WebDriverWait(driver, WAIT_S).until(
        lambda d: d.execute_script("return document.readyState") == "complete")


def wait_for(driver, css, what):
    try:
        return WebDriverWait(driver, WAIT_S).until(
            EC.presence_of_element_located((By.CSS_SELECTOR, css)))
    except TimeoutException:
        errors = [e["message"] for e in driver.get_log("browser")]
        pytest.fail(f"{what}: no `{css}` after {WAIT_S} s; console: {errors}")


def test_pages_are_small(html_dir):
    pages = sorted(html_dir.rglob("*.html"))
    assert pages
    big = [(p.name, p.stat().st_size) for p in pages if p.stat().st_size > MAX_PAGE_BYTES]
    assert not big, f"pages over {MAX_PAGE_BYTES} bytes (inlined JS?): {big}"


def test_vendored_assets_were_copied(html_dir):
    vendor = html_dir / "_static" / "vendor"
    for name in ("plotly.min.js", "require.js", "embed-amd.js", "mathjax/tex-chtml.js"):
        assert (vendor / name).is_file(), name
    assert not (html_dir / "_static" / "_static").exists()


def test_notebook_page_draws_figure_widget_and_math(browser, base_url):
    drain_logs(browser)
    open_page(browser, base_url, NOTEBOOK_PAGE)
    wait_for(browser, "div.plotly-graph-div svg.main-svg", "plotly figure")
    assert browser.execute_script("return typeof window.Plotly") == "object"
    wait_for(browser, ".jupyter-widgets .widget-slider", "ipywidgets slider")
    box = wait_for(browser, ".jupyter-widgets .widget-text input", "ipywidgets text box")
    wait_for(browser, "mjx-container", "MathJax output")
    check_jslink(browser, box)
    check_offline(requests_seen(browser), base_url, NOTEBOOK_PAGE)
    check_console(browser, NOTEBOOK_PAGE)


def test_math_page_is_typeset(browser, base_url):
    drain_logs(browser)
    open_page(browser, base_url, MATH_PAGE)
    wait_for(browser, "mjx-container", "MathJax output")
    assert browser.find_elements(By.CSS_SELECTOR, "mjx-container[display='true']")
    check_offline(requests_seen(browser), base_url, MATH_PAGE)
    check_console(browser, MATH_PAGE)


def check_jslink(driver, box):
    """The saved widget state works without a kernel: the box drives the slider."""
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("6", Keys.ENTER)
    WebDriverWait(driver, WAIT_S).until(lambda d: [
        e.text for e in d.find_elements(By.CSS_SELECTOR, ".widget-readout")] == ["6"])


def check_console(driver, page):
    """No script error on the page (a widget or MathJax failing shows here)."""
    errors = [e["message"] for e in driver.get_log("browser")
              if e["level"] == "SEVERE"
              and not any(noise in e["message"] for noise in CONSOLE_NOISE)]
    assert not errors, f"{page}: console errors: {errors}"


def check_offline(requests, base_url, page):
    """Report every off-host URL the page tried; fail if a script/CSS was one."""
    tried = off_host(requests, base_url)
    if tried:
        warnings.warn(f"{page} tried off-host URLs (blocked): {tried}", stacklevel=2)
    print(f"{page}: {len(requests)} requests, off-host: {tried or 'none'}")
    needed = [(u, t) for u, t in tried if t in NEEDED_TYPES]
    assert not needed, f"{page} needs off-host scripts/CSS: {needed}"


def chapter_pages(html_dir):
    return sorted(str(p.relative_to(html_dir)) for p in (html_dir / "notebooks").glob("*.html"))


def figure_problems(driver, base_url, page):
    """Open a page, wait until plotly has drawn every figure, run figure_layout.js."""
    open_page(driver, base_url, page)
    WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script(
        "return [...document.querySelectorAll('div.plotly-graph-div')]"
        ".every(g => g._fullLayout && g.querySelector('.main-svg'))"))
    return driver.execute_script(FIGURE_LAYOUT_JS)


def test_every_figure_is_readable_at_the_page_width(browser, base_url, html_dir):
    """At the book's width (a 1280 px window: figures 676 px wide) no title is
    clipped or covered (mode bar, menu, subplot titles, legend), no legend
    covers a plot, and every timeline fills its time axis."""
    seen, bad = 0, []
    for page in chapter_pages(html_dir):
        figures = figure_problems(browser, base_url, page)
        seen += len(figures)
        bad += [f"{page}: {f['title'][:60]!r}: {'; '.join(f['problems'])}"
                for f in figures if f["problems"]]
    assert seen >= 30, f"only {seen} figures drawn in the chapters"
    assert not bad, "figures not readable at the page's width:\n" + "\n".join(bad)


BAD_FIGURES = [  # what the checks must catch: the look of the figures before the fix
    {"data": [{"type": "scatter", "x": [1, 2], "y": [1, 2]}],
     "layout": {"title": {"text": "a long title that runs under the mode bar at the top right "
                                   "of the figure", "y": 0.97, "yref": "container"}}},
    {"data": [{"type": "bar", "orientation": "h", "y": ["rank 0"], "base": [0], "x": [4]}],
     "layout": {"title": {"text": "a step of 4 ms", "y": 0.7, "yref": "container"},
                "xaxis": {"range": [0, 17]}}},
]


def test_figure_checks_catch_a_covered_title_and_an_empty_time_axis(browser, base_url, html_dir):
    page = html_dir / "figure_layout_selftest.html"
    divs = "".join(
        f'<div id="f{i}" class="plotly-graph-div" style="height:300px; width:676px"></div>'
        f'<script>Plotly.newPlot("f{i}", {json.dumps(fig)});</script>'
        for i, fig in enumerate(BAD_FIGURES))
    page.write_text('<html><head><script src="_static/vendor/plotly.min.js"></script></head>'
                    f"<body>{divs}</body></html>")
    problems = [f["problems"] for f in figure_problems(browser, base_url, page.name)]
    assert "title under mode bar" in problems[0], problems
    assert any(p.startswith("bars fill 24%") for p in problems[1]), problems
