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
exec .venv/bin/python -m pytest -n auto -m "not vllm" tests backends "$@"
