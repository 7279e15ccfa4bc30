#!/usr/bin/env bash
# Install Debian packages with apt-get unless a command they provide is present.
# Uses sudo only when not already root. Idempotent: a no-op once installed.
# Usage: scripts/apt_ensure.sh COMMAND PACKAGE...   e.g. scripts/apt_ensure.sh npm npm
set -euo pipefail
cmd=$1; shift
command -v "$cmd" >/dev/null 2>&1 && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup: '$cmd' is missing and this is not a Debian-like system; install: $*" >&2
    exit 1
fi
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
echo "setup: installing $* with apt-get (for '$cmd')"
"${sudo[@]}" apt-get update -q
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "$@"
