#!/usr/bin/env bash
# Usage: ci/vllm.sh [pytest args]      (also: ci/test.sh vllm, tox -e vllm)
# The vLLM integration tests, in their own venv .venv-vllm: vllm==0.33.0 pulls a CUDA build of torch (2.14) and
# transformers 5.20, which must not replace the CPU torch pinned in .venv. The first run installs about 9.4 GB
# (measured here: 3 to 6 minutes, depending on the package mirror); later runs reuse the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="${HWGRAPH_VLLM_VENV:-.venv-vllm}"  # another path, e.g. to time a fresh install
VLLM_PIN=0.33.0
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP="$VPY -m pip --disable-pip-version-check -q"
installed() { $VPY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || true; }
if [ "$(installed vllm)" != "$VLLM_PIN" ]; then
  start=$SECONDS
  # One retry: a download can arrive damaged (session 49 saw pip refuse a 46 MB nvidia-nvjitlink wheel whose
  # sha256 did not match PyPI's; the same file downloaded again matched), and pip keeps what it already installed.
  attempt=1
  until $PIP install "vllm==$VLLM_PIN"; do
    if [ "$attempt" -ge 2 ]; then
      # pip's own error is above; a full disk ("[Errno 28] No space left on device") is the other usual cause on a
      # CI machine, so say how much the venv needs and what is free where it is being built.
      echo "ci/vllm.sh: installing vllm==$VLLM_PIN into $VENV failed twice (pip's error is above); it needs" \
        "about 9.4 GB there, and its disk has $(df -Ph "$VENV" | awk 'NR == 2 {print $4}') free" >&2
      exit 1
    fi
    echo "ci/vllm.sh: installing vllm==$VLLM_PIN failed (pip's error is above); trying once more" >&2
    attempt=$((attempt + 1))
  done
  echo "ci/vllm.sh: installed vllm==$VLLM_PIN in $((SECONDS - start)) s" >&2
fi
# hwgraph's own dependencies (torch, transformers, numpy, packaging, safetensors) come with vllm; --no-deps keeps
# pip from swapping vllm's torch for another build. Only what vllm does not bring is added, when missing.
for req in "numpy>=1.24" "packaging>=23" "safetensors>=0.8" "pytest>=8"; do
  name="${req%%[<>=]*}"
  [ -n "$(installed "$name")" ] || $PIP install "$req"
done
# The backend plugins too, so that on a GPU machine the cuda-marked test captures real device graphs.
$PIP install --no-deps --no-build-isolation -e . -e backends/cuda -e backends/rocm -e backends/npu
# The vllm-marked modules skip where vllm does not import (pytest.importorskip): here it is installed, so a failing
# import (a dependency missing from a reused venv) must fail the run, not pass it with every vllm test skipped.
"$VPY" -c "import vllm" || { echo "ci/vllm.sh: vllm==$VLLM_PIN is installed in $VENV but does not import (the error is" \
  "above), so every vllm test would be skipped: remove $VENV and run again" >&2; exit 1; }
exec "$VPY" -m pytest -m vllm tests/integrations "$@"
