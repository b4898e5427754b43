#!/usr/bin/env bash
# Headless Chromium + chromedriver for the dashboard's browser tests (dash[testing] drives them).
# Debian's packages put /usr/bin/chromium and /usr/bin/chromedriver on PATH, so Selenium never
# tries to download a driver. Idempotent: a no-op when both are installed.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
printf '[setup] installing chromium and chromium-driver (dashboard browser tests)\n' >&2
export DEBIAN_FRONTEND=noninteractive
# apt-get can be busy with another set-up script: wait for its lock rather than fail.
apt_get() { apt-get -o DPkg::Lock::Timeout=300 "$@"; }
apt_get update -qq
apt_get install -y -qq chromium chromium-driver >/dev/null
