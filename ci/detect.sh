# Sourced by ci/demo.sh and ci/test.sh: DETECTED is this machine's accelerator (cuda, rocm, npu), else cpu.
DETECTED=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DETECTED=cuda; fi
if command -v rocm-smi >/dev/null 2>&1; then DETECTED=rocm; fi
if command -v npu-smi >/dev/null 2>&1; then DETECTED=npu; fi
