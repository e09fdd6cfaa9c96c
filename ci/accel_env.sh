#!/usr/bin/env bash
# Usage: ci/accel_env.sh cuda|rocm|npu WHEELDIR ENV_PYTHON   (tox's accelerator envs, before their tests)
# Makes the vendor's torch visible where it lives in a venv (ci/parent_venv.sh), names what the offline install
# would miss, installs hwgraph with its three backend plugins and the test tools offline (the suite's modules import
# all three plugins, whose vendor SDKs load lazily, to simulate each runtime), and refuses a machine where hwgraph
# does not find the env's accelerator.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# != 3 ] || [[ ! "$1" =~ ^(cuda|rocm|npu)$ ]]; then
  echo "ci/accel_env.sh: expected cuda|rocm|npu WHEELDIR ENV_PYTHON, got: $*" >&2; exit 2
fi
ACCEL="$1"; WHEELS="$2"; ENV_PYTHON="$3"
bash ci/parent_venv.sh "$ENV_PYTHON"
"$ENV_PYTHON" ci/accel_check.py deps "$ACCEL"
PATH="$(dirname "$ENV_PYTHON"):$PATH" bash ci/install_extra.sh "$WHEELS" cuda,rocm,npu,test --offline
"$ENV_PYTHON" ci/accel_check.py machine "$ACCEL"
