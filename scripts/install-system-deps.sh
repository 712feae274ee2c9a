#!/bin/sh
# System packages the test suite drives for real: Debian chromium (browser tests), redis-server (Redis store tests).
# Installs only what is missing, and only where apt-get is usable (root on Debian/Ubuntu).
set -e
need=""
command -v chromium >/dev/null 2>&1 || need="$need chromium"
command -v redis-server >/dev/null 2>&1 || need="$need redis-server"
[ -z "$need" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    echo "install-system-deps: please install:$need (the tests that need them will be skipped)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends $need || { apt-get update && apt-get install -y --no-install-recommends $need; }
