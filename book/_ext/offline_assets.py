"""Serve the book's JavaScript from assets/vendor/ instead of CDNs.

Readers on air-gapped clusters and CI have no network, so every script a page
needs (plotly.js, MathJax, require.js and the ipywidgets embedder) is copied
from assets/vendor/, which scripts/fetch_assets.py fills at pinned versions.
It also drops inline scripts that reach a page twice (see dedupe_scripts).
Registered in _config.yml under `sphinx: local_extensions:`.
"""
from pathlib import Path

from sphinx.errors import ExtensionError

# assets/ is copied into _build/html/_static/; it must not itself be named
# _static, because Jupyter Book adds every file of a _static folder to each
# page on its own, so they would load twice.
ASSETS = "assets"
PLOTLY_JS = "vendor/plotly.min.js"
MATHJAX_JS = "vendor/mathjax/tex-chtml.js"
# myst-nb adds these (in this order) to pages whose notebook holds widget
# state. widgets_offline.js is ours (committed): see its comments.
WIDGETS_JS = ["vendor/require.js", "widgets_offline.js", "vendor/embed-amd.js"]
# Before Sphinx's default 500: if require.js came first, plotly.min.js would
# register itself as an anonymous AMD module and never set window.Plotly.
PLOTLY_PRIORITY = 100


def assets_dir(app):
    return Path(app.confdir) / ASSETS


def configure(app, config):
    """Point html_static_path, MathJax and myst-nb's widget scripts at vendor/."""
    config.html_static_path.append(str(assets_dir(app)))
    config.mathjax_path = MATHJAX_JS
    # The default is a dict of CDN URLs with integrity/crossorigin attributes;
    # local files need none. They get Sphinx's default priority (500), so
    # they load after plotly.min.js.
    config.nb_ipywidgets_js = {path: {} for path in WIDGETS_JS}


def check_vendor(app):
    """Fail early, with the fix, when the vendored files were never fetched."""
    needed = [PLOTLY_JS, MATHJAX_JS, *WIDGETS_JS]
    missing = [p for p in needed if not (assets_dir(app) / p).is_file()]
    if missing:
        raise ExtensionError(
            f"offline assets missing from {assets_dir(app)}: {', '.join(missing)}; "
            "run `make assets` (or `make book`, which fetches them)")


def dedupe_scripts(app, pagename, templatename, context, doctree):
    """Drop repeated inline scripts from a page.

    Some extensions' inline scripts reach the page twice, once registered
    with filename None and once with "" (Sphinx does not see them as equal);
    sphinx-thebe's `const THEBE_JS_URL` then throws a SyntaxError on every page.
    """
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen, unique = set(), []
    for js in scripts:
        key = (js.filename or "", js.priority, tuple(sorted(js.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique  # the builder's own list; Sphinx resets it for each page


def setup(app):
    app.connect("config-inited", configure)
    app.connect("builder-inited", check_vendor)
    app.connect("html-page-context", dedupe_scripts, priority=900)
    # On every page: figures are inline <script>s that call Plotly right away.
    app.add_js_file(PLOTLY_JS, priority=PLOTLY_PRIORITY)
    return {"version": "1.0", "parallel_read_safe": True,
            "parallel_write_safe": True}
