#!/usr/bin/env bash
# Usage: ci/pkg_check.sh WORKDIR
# Builds wheels of the core and the three backend plugins, installs hwgraph[rocm] from them into a fresh venv
# with --find-links, and checks that the rocm backend is discovered through its entry point (and cuda/npu are not,
# since only the rocm extra was asked for).
set -euo pipefail
if [ $# != 1 ] || [ -z "$1" ]; then echo "ci/pkg_check.sh: expected WORKDIR (emptied first), got: $*" >&2; exit 2; fi
# Absolute, from where it is called: the script moves into the checkout, and later into WORKDIR itself.
WORK="$1"; [[ "$WORK" = /* ]] || WORK="$PWD/$WORK"
cd "$(dirname "$0")/.."
rm -rf "$WORK"; mkdir -p "$WORK/wheels"
PIP="python -m pip --disable-pip-version-check -q"
for dist in . backends/cuda backends/rocm backends/npu; do
  # setuptools packs build/lib as an earlier build left it, which would hide a module the wheel lacks.
  rm -rf "$dist/build"
  $PIP wheel --no-deps --no-build-isolation -w "$WORK/wheels" "$dist"
done
ls "$WORK/wheels"
python -m venv "$WORK/venv"
vpip() { "$WORK/venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }  # WORK may hold a space
vpip install torch==2.13.0
vpip install --find-links "$WORK/wheels" "hwgraph[rocm]"
cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
from hwgraph.registry import list_backends
names = {spec.name: cap for spec, cap in list_backends()}
assert "rocm" in names, f"rocm backend not discovered: {sorted(names)}"
assert "cuda" not in names and "npu" not in names, f"only the rocm extra was installed: {sorted(names)}"
assert not names["rocm"].ok and names["rocm"].reasons, "rocm must be unavailable here, with reasons"
print("pkg: hwgraph[rocm] installed from wheels; rocm backend discovered:", names["rocm"].describe())
PY
"$WORK/venv/bin/hwgraph" info
