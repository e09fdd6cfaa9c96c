#!/usr/bin/env bash
# Usage (on the H200 device machine): ci/h200.sh [tests|bench|compile|validate|all]   (default all)
# Installs hwgraph and the plugins offline over the machine's torch, prints `hwgraph info`, runs the cuda-marked
# tests and/or the benchmarks, and leaves logs and reports under $OUT (or out/ when $OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
case "$WHAT" in
  tests|bench|compile|validate|all) ;;
  *) echo "ci/h200.sh: unknown step '$WHAT': expected tests, bench, compile, validate or all" >&2; exit 2;;
esac
OUTDIR="${OUT:-out}"; mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e backends/cuda -e backends/rocm -e backends/npu \
  > /tmp/hwgraph-install.log 2>&1 || { cat /tmp/hwgraph-install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# The command line of the python3 that holds torch: a bare `hwgraph` is whichever script PATH finds first, and a
# machine whose `pip` belongs to another Python has one there that cannot import torch (session 64).
hwgraph() { python3 -m hwgraph.cli "$@"; }
hwgraph info | tee "$OUTDIR/info.txt"
status=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -m cuda tests backends -rs --durations=10 2>&1 | tee "$OUTDIR/cuda-tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  hwgraph bench --preset qwen3-omni-30b-a3b --profile --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.md"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1  # tee's status would hide a crashed benchmark
fi
if [ "$WHAT" = compile ] || [ "$WHAT" = all ]; then
  # Compiled replay (issue 5): first process compiles and captures; a second process reuses inductor's caches.
  python3 benchmarks/explore.py --compile --tokens 49 256 1024 2>&1 | grep -v Warn | tee "$OUTDIR/compile.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 benchmarks/explore.py --compile --no-plain --capture-only --tokens 49 256 1024 2>&1 | grep -v Warn \
    | tee -a "$OUTDIR/compile.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$WHAT" = validate ] || [ "$WHAT" = all ]; then
  hwgraph validate --preset qwen3-omni-30b-a3b --report "$OUTDIR/validate" 2>&1 | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  mv "$OUTDIR/validate/conformance.log" /tmp/ 2>/dev/null  # the device returns at most 8 files
fi
exit $status
