#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# libfuse 3 for the device twin's FUSE daemon (capture/device_twin_fuse.py, through mfusepy's
# ctypes binding: the shared library libfuse3.so.3 and fusermount3), and the loop module it
# stacks on. Idempotent; a no-op taking milliseconds once done. Run as root. ($1, the venv, is
# unused: mfusepy comes from scripts/requirements.lock.)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib/apt.sh"

log() { printf '[setup fuse] %s\n' "$*" >&2; }

install_packages() { apt_install fuse3 libfuse3-3; }

check_kernel() {
  # loop may be built in (no modprobe then); FUSE needs /dev/fuse.
  [ -e /sys/module/loop ] || modprobe loop 2>/dev/null || log "no loop driver: no device twin here"
  [ -e /dev/fuse ] || modprobe fuse 2>/dev/null || log "no /dev/fuse: no device twin here"
}

install_packages
check_kernel
