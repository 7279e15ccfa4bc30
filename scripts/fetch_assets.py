"""Put the book's third-party JavaScript into assets/vendor/, at pinned versions.

Readers on air-gapped clusters have no CDN, so the built book serves plotly.js,
the ipywidgets embedder, require.js and MathJax itself. None of it is committed:
it comes from package registries here (the plotly wheel, npm tarballs checked
against the integrity hashes below), and a stamp makes a second run a no-op.

Usage: .venv/bin/python scripts/fetch_assets.py        (called by `make assets`)
"""
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "assets" / "vendor"
NPM_CACHE = ROOT / ".cache" / "npm"
STAMP = VENDOR / ".stamp.json"

# The one place where versions live. Each npm package: its registry integrity
# (`npm view <spec> dist.integrity`) and which members of the tarball go where.
# A member ending in "/" is a folder, copied whole.
NPM_PINS = {
    "requirejs@2.3.8": {
        "integrity": ("sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0w"
                      "F421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw=="),
        "members": {"package/require.js": "require.js"},
    },
    "@jupyter-widgets/html-manager@1.0.15": {
        "integrity": ("sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVz"
                      "RhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA=="),
        # embed-amd.js looks for its icon fonts next to itself, so they come too.
        "members": {"package/dist/embed-amd.js": "embed-amd.js"},
        "font_dir": "package/dist/",
    },
    "mathjax@3.2.2": {
        "integrity": ("sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/"
                      "O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw=="),
        # tex-chtml.js loads its fonts, TeX extensions and menu from beside
        # itself; the other combined bundles (svg, mml, speech) are not used.
        "members": {
            "package/es5/tex-chtml.js": "mathjax/tex-chtml.js",
            "package/es5/input/tex/extensions/": "mathjax/input/tex/extensions/",
            "package/es5/output/chtml/": "mathjax/output/chtml/",
            "package/es5/a11y/": "mathjax/a11y/",
            "package/es5/ui/": "mathjax/ui/",
        },
    },
}
FONT_SUFFIXES = (".woff", ".woff2", ".ttf", ".eot", ".svg")
# Files the book refuses to build without (book/_ext/offline_assets.py checks them).
REQUIRED = ["plotly.min.js", "require.js", "embed-amd.js", "mathjax/tex-chtml.js"]


def plotly_source():
    """plotly.min.js inside the installed plotly wheel, and the wheel's version."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path, plotly.__version__


def wanted_stamp():
    """What the vendor folder must have been built from: pins plus plotly version."""
    _, plotly_version = plotly_source()
    pins = {spec: pin["integrity"] for spec, pin in NPM_PINS.items()}
    return {"plotly": plotly_version, "npm": pins}


def is_fresh():
    if not STAMP.exists():
        return False
    complete = all((VENDOR / name).is_file() for name in REQUIRED)
    return complete and json.loads(STAMP.read_text()) == wanted_stamp()


def sri_sha512(path):
    """The Subresource-Integrity form npm records: sha512-<base64 digest>."""
    digest = hashlib.sha512(path.read_bytes()).digest()
    return "sha512-" + base64.b64encode(digest).decode()


def tarball_name(spec):
    """npm pack's file name: @scope/name@1.2 -> scope-name-1.2.tgz."""
    name, version = spec.rsplit("@", 1)
    return f"{name.lstrip('@').replace('/', '-')}-{version}.tgz"


def npm_tarball(spec, integrity):
    """Path of the verified tarball for spec, running `npm pack` only on a miss."""
    NPM_CACHE.mkdir(parents=True, exist_ok=True)
    path = NPM_CACHE / tarball_name(spec)
    if not (path.exists() and sri_sha512(path) == integrity):
        if shutil.which("npm") is None:
            sys.exit("fetch_assets: npm is needed (apt-get install npm)")
        print(f"fetch_assets: npm pack {spec}")
        cmd = ["npm", "pack", spec, "--pack-destination", str(NPM_CACHE),
               "--loglevel=error"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    got = sri_sha512(path)
    if got != integrity:
        path.unlink()
        sys.exit(f"fetch_assets: {spec} integrity mismatch\n  want {integrity}\n  got  {got}")
    return path


def extract(tarball, pin, dest):
    """Copy the pinned members of one npm tarball into dest."""
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            target = target_for(member.name, pin)
            if target is None or not member.isfile():
                continue
            out = dest / target
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tar.extractfile(member).read())


def target_for(name, pin):
    """Where a tarball member goes inside vendor/, or None to skip it."""
    for src, dst in pin["members"].items():
        if name == src:
            return dst
        if src.endswith("/") and name.startswith(src):
            return dst + name[len(src):]
    font_dir = pin.get("font_dir")
    if font_dir and name.startswith(font_dir) and name.endswith(FONT_SUFFIXES):
        return name[len(font_dir):]
    return None


def build(dest):
    """Fill dest (an empty folder) with every vendored file."""
    plotly_js, _ = plotly_source()
    shutil.copyfile(plotly_js, dest / "plotly.min.js")
    for spec, pin in NPM_PINS.items():
        extract(npm_tarball(spec, pin["integrity"]), pin, dest)
    missing = [name for name in REQUIRED if not (dest / name).is_file()]
    if missing:
        sys.exit(f"fetch_assets: the tarballs lack {missing}")


def main():
    if is_fresh():
        return
    # Build beside the target and swap it in, so a failed run never leaves a
    # half-filled vendor folder that looks complete to the book build.
    tmp = VENDOR.with_name("vendor.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    (tmp / ".stamp.json").write_text(json.dumps(wanted_stamp(), indent=1) + "\n")
    shutil.rmtree(VENDOR, ignore_errors=True)
    tmp.rename(VENDOR)
    print(f"fetch_assets: {VENDOR.relative_to(ROOT)} ready")


if __name__ == "__main__":
    main()
