# Sourced by ci/demo.sh and ci/test.sh: DETECTED is this machine's accelerator (cuda, rocm, npu), else cpu.
# A vendor tool counts only when it runs and succeeds: a leftover rocm-smi that finds no AMD GPU must not turn a
# machine whose `nvidia-smi -L` lists its GPUs into a ROCm one.
DETECTED=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DETECTED=cuda
elif command -v rocm-smi >/dev/null 2>&1 && rocm-smi >/dev/null 2>&1; then DETECTED=rocm
elif command -v npu-smi >/dev/null 2>&1 && npu-smi info >/dev/null 2>&1; then DETECTED=npu
fi
