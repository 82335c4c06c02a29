#!/bin/sh
# Headless Chromium for the dashboard tests (Playwright drives Debian's build;
# its own browser download is not used). Idempotent.
set -eu
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q chromium
