#!/usr/bin/env bash
# Usage: ci/test.sh [cpu|cuda|rocm|npu|vllm] [pytest args]   (default: this machine's accelerator, as ci/demo.sh)
# Builds the environment (ci/env.sh) and runs the suite for that accelerator with pytest-xdist. Tests marked for
# another accelerator are skipped with the reason; vllm tests run only in the vllm mode (their own venv).
set -euo pipefail
source "$(dirname "$0")/detect.sh"
ACCEL="${1:-$DETECTED}"
case "$ACCEL" in
  cpu|cuda|rocm|npu|vllm) ;;
  *) echo "ci/test.sh: unknown accelerator '$ACCEL': expected cpu, cuda, rocm, npu or vllm" \
       "(usage: ci/test.sh [cpu|cuda|rocm|npu|vllm] [pytest args])" >&2; exit 2;;
esac
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/.."
if [ "$ACCEL" = vllm ]; then
  exec bash ci/vllm.sh "$@"
fi
source ci/env.sh "$ACCEL"
.venv/bin/hwgraph info
# Where hwgraph does not find the accelerator asked for, every test of its marker would be skipped and the run pass
# with none of them run (tox's accelerator envs refuse the same, ci/accel_check.py).
if [ "$ACCEL" != cpu ]; then
  FOUND=$(.venv/bin/python -c 'from hwgraph.platform import detect; print(detect().kind)')
  if [ "$FOUND" != "$ACCEL" ]; then
    echo "ci/test.sh $ACCEL: hwgraph finds a $FOUND machine here, so every $ACCEL test would be skipped (hwgraph" \
      "info above says what it found): run it on a machine with the $ACCEL accelerator, or ci/test.sh cpu here" >&2
    exit 2
  fi
fi
exec .venv/bin/python -m pytest -n auto -m "not vllm" tests backends "$@"
