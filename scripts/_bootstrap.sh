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
# What the calling script needs: SHARDLAB_NEEDS (set by it before sourcing this) names extras of pyproject.toml:
# `dev` for the tests and the doc generator (pytest, ruff, TensorBoard, libtpu for cross-compiling), `profile` for
# the demo (TensorBoard to open its trace, no test tools). SHARDLAB_EXTRAS adds the user's: cuda on a GPU machine
# (jax[cuda12]), tpu on a TPU VM. A comma-separated list: SHARDLAB_EXTRAS=cuda
NEEDS="${SHARDLAB_NEEDS:-dev}"
EXTRAS="$NEEDS${SHARDLAB_EXTRAS:+,$SHARDLAB_EXTRAS}"
case "$EXTRAS" in *[!a-z0-9,-]*)
  echo "shardlab: error: SHARDLAB_EXTRAS=$SHARDLAB_EXTRAS: give extras from pyproject.toml separated by commas, e.g. cuda" >&2
  exit 2;;
esac
_want() { (cat "$ROOT/pyproject.toml"; echo "$ROOT"; echo "$1") | sha256sum | cut -d' ' -f1; }
_stamp() { echo "$VENV/.shardlab-install-stamp-$(echo "$1" | tr ',' '+')"; }
WANT="$(_want "$EXTRAS")"
# The dev install holds everything the demo's needs (profile) do: a venv the tests set up serves the demo as it is.
DEV="dev${EXTRAS#"$NEEDS"}"
if [ -f "$(_stamp "$EXTRAS")" ] && [ "$(cat "$(_stamp "$EXTRAS")")" = "$WANT" ]; then
  :
elif [ "$NEEDS" = profile ] && [ -f "$(_stamp "$DEV")" ] && [ "$(cat "$(_stamp "$DEV")")" = "$(_want "$DEV")" ]; then
  :
else
  echo "[bootstrap] installing shardlab[$EXTRAS] into .venv (first run takes a minute or two)" >&2
  LOG="$VENV/install.log"
  if ! { "$VENV/bin/python" -m pip install --disable-pip-version-check --upgrade pip \
         && "$VENV/bin/python" -m pip install --disable-pip-version-check -e "$ROOT[$EXTRAS]"; } >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "shardlab: error: installing into .venv failed; the full log is $LOG" >&2
    exit 1
  fi
  echo "$WANT" > "$(_stamp "$EXTRAS")"
  echo "[bootstrap] .venv now holds $(du -sh "$VENV" 2>/dev/null | cut -f1) (shardlab[$EXTRAS])" >&2
fi
# The caller's own PATH, before ours: a command the lab prints (tensorboard --logdir ...) is run in that shell.
export SHARDLAB_CALLER_PATH="${SHARDLAB_CALLER_PATH:-$PATH}"
export PATH="$VENV/bin:$PATH"
