"""Install JupyterHub's proxy, configurable-http-proxy, into deploy/proxy/node_modules/.

The version and every dependency's integrity hash are pinned by
deploy/proxy/package.json and package-lock.json (committed); `npm ci` installs
exactly that tree, and a stamp holding the lock file's hash makes a second run
a no-op. node_modules/ is never committed. deploy/jupyterhub_config.py uses
this copy when it is there, so neither the test nor an admin needs
`npm install -g`.

Usage: python3 scripts/fetch_proxy.py        (called by `make test`)
"""
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "deploy" / "proxy"
LOCK = PROXY / "package-lock.json"
STAMP = PROXY / "node_modules" / ".course-stamp"
BIN = PROXY / "node_modules" / ".bin" / "configurable-http-proxy"
NPM_CACHE = ROOT / ".cache" / "npm"


def wanted():
    return hashlib.sha256(LOCK.read_bytes()).hexdigest()


def main():
    if BIN.exists() and STAMP.exists() and STAMP.read_text().strip() == wanted():
        return
    if shutil.which("npm") is None:
        sys.exit("fetch_proxy: npm is needed (apt-get install npm)")
    print("fetch_proxy: npm ci configurable-http-proxy into deploy/proxy/node_modules")
    cmd = ["npm", "ci", "--prefix", str(PROXY), "--cache", str(NPM_CACHE),
           "--no-audit", "--no-fund", "--loglevel=error"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    version = subprocess.run([str(BIN), "--version"], check=True, capture_output=True,
                             text=True).stdout.strip()
    STAMP.write_text(wanted() + "\n")
    print(f"fetch_proxy: configurable-http-proxy {version} ready")


if __name__ == "__main__":
    main()
