"""The book's JupyterHub launch button (launch_buttons.jupyterhub_url in
_config.yml): off by default, and with it set a built chapter links to the hub's
nbgitpuller URL for that notebook.

A small copy of the book is built (execution off): the course's _config.yml with
the button set, and one chapter with its stored outputs.

Run: .venv/bin/python -m pytest tests/test_launch_buttons.py   (about 20 s)
"""
import html
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "notebooks/00_how_this_book_runs"
HUB = "https://hub.example.org"
REPO = "https://github.com/example-org/dist-course"


def test_the_button_is_off_by_default():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["launch_buttons"]["jupyterhub_url"] == ""
    assert config["launch_buttons"]["notebook_interface"] == "jupyterlab"


@pytest.mark.slow
def test_with_a_hub_set_a_chapter_links_to_nbgitpuller_on_it(tmp_path):
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"]["execute_notebooks"] = "off"
    config["launch_buttons"]["jupyterhub_url"] = HUB
    config["repository"]["url"] = REPO
    # The offline-assets extension serves the vendored JavaScript; the button
    # does not depend on it, and this copy does not need assets/vendor/.
    del config["sphinx"]["local_extensions"]
    (tmp_path / "_config.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "_toc.yml").write_text(yaml.safe_dump(
        {"format": "jb-book", "root": "index", "chapters": [{"file": CHAPTER}]}))
    (tmp_path / "index.md").write_text("# Launch button test\n")
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / f"{CHAPTER}.ipynb", tmp_path / f"{CHAPTER}.ipynb")
    jb = Path(sys.executable).with_name("jupyter-book")
    proc = subprocess.run([str(jb), "build", str(tmp_path), "-q"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    page = (tmp_path / "_build" / "html" / f"{CHAPTER}.html").read_text()
    links = [html.unescape(part.split('"', 1)[0])
             for part in page.split('href="')[1:] if part.startswith(HUB)]
    assert len(links) == 1, f"one JupyterHub button expected, found {links}"
    url = urlsplit(links[0])
    assert f"{url.scheme}://{url.netloc}{url.path}" == f"{HUB}/hub/user-redirect/git-pull"
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    assert query == {"repo": REPO, "branch": "main",
                     "urlpath": f"lab/tree/dist-course/{CHAPTER}.ipynb"}
