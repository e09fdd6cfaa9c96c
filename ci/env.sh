# Sourced by ci/*.sh: make .venv (if missing) and install hwgraph, its three backend plugins and the test tools.
# On a machine without an accelerator torch==2.13.0 (CPU build) is installed into the venv; on an accelerator
# machine the vendor's torch (CUDA, ROCm, torch_npu) comes from the system site-packages, or from the venv of the
# python that runs this ($PYTHON, default python3) where that is a venv's, and is never replaced.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ACCEL="${1:-cpu}"
PYTHON="${PYTHON:-python3}"
SYSTEM=true  # whether the venv sees the system's site-packages, where an accelerator's torch is
if [ "$ACCEL" = cpu ] || [ "$ACCEL" = vllm ]; then SYSTEM=false; fi
if [ ! -x .venv/bin/python ]; then
  if [ "$SYSTEM" = false ]; then
    "$PYTHON" -m venv .venv
  else
    "$PYTHON" -m venv --system-site-packages .venv
    # Where $PYTHON is itself a venv's (the vendor's torch installed there), the new venv sees the base
    # interpreter's site-packages, not that venv's: ci/parent_venv.sh adds them.
    PYTHON="$PYTHON" bash ci/parent_venv.sh .venv/bin/python
  fi
fi
# A .venv made for another kind of machine is refused, not reused: a CPU one has its own CPU torch, under which the
# accelerator's tests would all be skipped; an accelerator's one runs the CPU suite under the vendor's torch.
MADE=$(sed -n 's/^include-system-site-packages *= *//p' .venv/pyvenv.cfg 2>/dev/null | tr -d '[:space:]')
if [ "${MADE:-false}" != "$SYSTEM" ]; then
  if [ "$SYSTEM" = true ]; then
    echo "ci: .venv was made for a CPU machine (its own torch), but $ACCEL needs the vendor's torch from the system" \
      "site-packages: remove it (rm -rf .venv) and run again" >&2
  else
    echo "ci: .venv was made for an accelerator (the system's torch), but $ACCEL installs its own CPU torch:" \
      "remove it (rm -rf .venv) and run again, or name this machine's accelerator (ci/test.sh cuda|rocm|npu)" >&2
  fi
  exit 2
fi
VPY=.venv/bin/python
PIP="$VPY -m pip --disable-pip-version-check -q"
if ! $VPY -c "import torch" 2>/dev/null; then
  if [ "$ACCEL" = cpu ]; then
    $PIP install torch==2.13.0
  elif [ "$ACCEL" != vllm ]; then
    echo "ci: no torch for $ACCEL in this environment: install the vendor's torch build first" >&2; exit 2
  fi
fi
if [ "$ACCEL" = cpu ]; then
  # The Triton interpreter runs TRITON_ATTN's correctness tests on CPU; matplotlib draws `hwgraph validate`'s plot.
  $PIP install -e ".[test,triton,plot]" -e backends/cuda -e backends/rocm -e backends/npu
else
  # Accelerator machines may be offline: no build isolation, no dependency resolution beyond what is there.
  $PIP install --no-build-isolation --no-deps -e . -e backends/cuda -e backends/rocm -e backends/npu
fi
