#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bcc for the block / NVMe probes: Debian's bcc 0.26, a kernel header tree bcc can find, tracefs
# mounted, and `import bcc` working from the project venv ($1) without exposing the rest of
# Debian's dist-packages. Idempotent; a no-op taking milliseconds once done. Run as root.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib/apt.sh"

venv="${1:?usage: bcc.sh VENV}"
release="$(uname -r)"
log() { printf '[setup bcc] %s\n' "$*" >&2; }

# bpftool: BTF struct offsets and the detach check; fio: the known workload of tests and bench
install_packages() { apt_install bpfcc-tools python3-bpfcc libbpfcc linux-headers-amd64 bpftool fio; }

mount_tracefs() {
  # bcc 0.26 reads tracepoint formats from /sys/kernel/debug/tracing, else /sys/kernel/tracing.
  if [ ! -e /sys/kernel/tracing/events ]; then
    log "mounting tracefs on /sys/kernel/tracing"
    mount -t tracefs nodev /sys/kernel/tracing
  fi
}

link_headers() {
  # Debian ships headers for its own kernel (6.1); tracepoint-only programs need only a tree
  # bcc can compile against (docs/probes.md, "Kernel headers"), so link the newest one.
  local modules="/lib/modules/$release" arch common
  arch="$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)"
  common="$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)"
  if [ -z "$arch" ] || [ -z "$common" ]; then
    log "no Debian header folders under /usr/src; is linux-headers-amd64 installed?"
    exit 1
  fi
  mkdir -p "$modules"
  [ -e "$modules/build" ] || { log "linking $modules/build -> $arch"; ln -sfn "$arch" "$modules/build"; }
  [ -e "$modules/source" ] || { log "linking $modules/source -> $common"; ln -sfn "$common" "$modules/source"; }
}

expose_bcc() {
  # A folder holding only a link to Debian's bcc package, named by a .pth file in the venv.
  local site shim="$venv/bcc-shim" debian_bcc=/usr/lib/python3/dist-packages/bcc
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$shim"
  [ -L "$shim/bcc" ] || ln -sfn "$debian_bcc" "$shim/bcc"
  [ -f "$site/kvscope-bcc.pth" ] || echo "$shim" >"$site/kvscope-bcc.pth"
}

install_packages
mount_tracefs
link_headers
expose_bcc
"$venv/bin/python" -c 'import bcc' || { log "import bcc fails in $venv"; exit 1; }
