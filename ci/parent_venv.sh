#!/usr/bin/env bash
# Usage: ci/parent_venv.sh ENV_PYTHON
# Where the vendor's torch lives in a venv (the H200 image's is /opt/torch/.venv), an environment made with the
# system's site-packages from that venv's python (ci/env.sh's .venv, or a tox env: virtualenv does the same) sees the
# base interpreter's site-packages, not that venv's, and finds no torch. This adds them to ENV_PYTHON's environment
# through a .pth file (after its own: nothing there is replaced). The parent is $PYTHON, or else the python3 found on
# PATH outside ENV_PYTHON's own bin folder (tox puts its env's first). Nothing is added where that python is no venv's.
set -euo pipefail
if [ $# != 1 ] || [ ! -x "$1" ]; then echo "ci/parent_venv.sh: expected an environment's python, got: $*" >&2; exit 2; fi
TARGET="$1"
if [ -z "${PYTHON:-}" ]; then
  OWN_BIN=$(cd "$(dirname "$TARGET")" && pwd)
  OUTSIDE=$(printf %s "$PATH" | tr : '\n' | while read -r dir; do
    [ -n "$dir" ] && [ "$(cd "$dir" 2>/dev/null && pwd)" != "$OWN_BIN" ] && printf '%s:' "$dir"; done)
  PYTHON=$(PATH="${OUTSIDE%:}" command -v python3) || {
    echo "ci/parent_venv.sh: no python3 on PATH outside $OWN_BIN (set PYTHON to the vendor's python)" >&2; exit 2; }
fi
PTH=$("$TARGET" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_hwgraph_parent_venv.pth
PARENT=$("$PYTHON" -c 'import site, sys
if sys.prefix != sys.base_prefix: print(*site.getsitepackages(), sep="\n")')
PREFIX='import sys; print(sys.prefix)'
if [ -n "$PARENT" ] && [ "$("$PYTHON" -c "$PREFIX")" != "$("$TARGET" -c "$PREFIX")" ]; then
  echo "$PARENT" > "$PTH"
  echo "ci: $TARGET also sees the site-packages of $PYTHON's venv ($PTH)" >&2
else
  rm -f "$PTH"  # an earlier run's parent (a reused tox env), no longer the one named
fi
