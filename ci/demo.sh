#!/usr/bin/env bash
# Usage: ci/demo.sh [extra args for hwgraph bench]
# Builds the environment (ci/env.sh) and shows the package doing its job on the detected device.
set -euo pipefail
source "$(dirname "$0")/detect.sh"
ACCEL="$DETECTED"
source "$(dirname "$0")/env.sh" "$ACCEL"
.venv/bin/hwgraph info
# The side-by-side benchmark (on CPU: the tiny preset and small groups, about a minute on 2 cores).
REPORT="${HWGRAPH_DEMO_OUT:-out/demo}"
mkdir -p "$REPORT"
.venv/bin/hwgraph bench --json "$REPORT/bench.json" "$@" | tee "$REPORT/bench.md"
echo "demo: benchmark report in $REPORT/bench.md (JSON: $REPORT/bench.json)"
