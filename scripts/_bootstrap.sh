# Sourced by scripts/demo and scripts/test: make .venv exist and hold this checkout's install.
# Idempotent: a stamp keyed on pyproject.toml skips the install when nothing changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${SHARDLAB_PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.12 python3.11 python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      PY="$cand"; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "shardlab: error: no Python >= 3.11 found on PATH (set SHARDLAB_PYTHON=/path/to/python3.11)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV with $("$PY" --version 2>&1)" >&2
  "$PY" -m venv "$VENV"
fi
# SHARDLAB_EXTRAS adds extras to the install: cuda on a GPU machine (jax[cuda12]), tpu on a TPU VM (libtpu; the dev
# extra already brings it on Linux x86-64), profile for TensorBoard. A comma-separated list: SHARDLAB_EXTRAS=cuda
EXTRAS="dev${SHARDLAB_EXTRAS:+,$SHARDLAB_EXTRAS}"
case "$EXTRAS" in *[!a-z0-9,-]*)
  echo "shardlab: error: SHARDLAB_EXTRAS=$SHARDLAB_EXTRAS: give extras from pyproject.toml separated by commas, e.g. cuda" >&2
  exit 2;;
esac
STAMP="$VENV/.shardlab-install-stamp"
WANT="$( (cat "$ROOT/pyproject.toml"; echo "$ROOT"; echo "$EXTRAS") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[bootstrap] installing shardlab[$EXTRAS] into .venv (first run takes a minute or two)" >&2
  LOG="$VENV/install.log"
  if ! { "$VENV/bin/python" -m pip install --disable-pip-version-check --upgrade pip \
         && "$VENV/bin/python" -m pip install --disable-pip-version-check -e "$ROOT[$EXTRAS]"; } >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "shardlab: error: installing into .venv failed; the full log is $LOG" >&2
    exit 1
  fi
  echo "$WANT" > "$STAMP"
fi
# The caller's own PATH, before ours: a command the lab prints (tensorboard --logdir ...) is run in that shell.
export SHARDLAB_CALLER_PATH="${SHARDLAB_CALLER_PATH:-$PATH}"
export PATH="$VENV/bin:$PATH"
