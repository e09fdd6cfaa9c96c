#!/usr/bin/env bash
# Usage: ci/install_extra.sh WHEELDIR EXTRAS [--offline]
# Installs hwgraph (editable) with the given extras, e.g. "cuda,test", into the current Python environment.
# The backend distributions are not on an index: their wheels are built into WHEELDIR first and found there.
# --offline (accelerator machines): no index; torch, transformers and pytest come from the system site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || [ $# -gt 3 ] || { [ $# = 3 ] && [ "$3" != --offline ]; }; then
  echo "ci/install_extra.sh: expected WHEELDIR EXTRAS [--offline], got: $*" >&2; exit 2
fi
WHEELS="$1"; EXTRAS="$2"; OFFLINE="${3:-}"
PIP="python -m pip --disable-pip-version-check -q"
mkdir -p "$WHEELS"
for vendor in cuda rocm npu; do
  # setuptools packs build/lib as an earlier build left it: a module since removed or renamed would still ship.
  rm -rf "backends/$vendor/build"
  $PIP wheel --no-deps --no-build-isolation -w "$WHEELS" "backends/$vendor"
done
if [ "$OFFLINE" = --offline ]; then
  $PIP install --no-build-isolation --no-index --find-links "$WHEELS" -e ".[$EXTRAS]"
else
  $PIP install --no-build-isolation --find-links "$WHEELS" -e ".[$EXTRAS]"
fi
# Every plugin is version 0.1.0, so in a reused environment (tox's, on its second run) pip keeps the plugin an earlier
# run installed and the tests import stale code: reinstall the wheels just built for the extras asked for.
for vendor in cuda rocm npu; do
  case ",$EXTRAS," in
    *",$vendor,"*) $PIP install --no-deps --no-index --force-reinstall "$WHEELS"/hwgraph_backend_"$vendor"-*.whl ;;
  esac
done
