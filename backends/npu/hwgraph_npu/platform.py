"""The npu plugin's probe and capability gate.

The probe runs at discovery on every machine, so it imports neither torch_npu nor torchair; the gate imports
torch_npu (through ``hwgraph.platform``) only when selection asks for it, and an ImportError becomes a reason.
"""

from __future__ import annotations

import torch

from hwgraph.capability import Capability, require_module
from hwgraph.graphs.torch_cuda import torch_version_capability
from hwgraph.platform import PlatformInfo, npu_import, torch_npu_unavailable
from hwgraph.registry import BackendSpec, plugin_attention

MODES = ("aclgraph", "torchair")


def torch_npu_refusal(what: str) -> str | None:
    """Why ``what`` cannot use torch_npu, with what to do (install it; or, where an installed one does not import,
    set the CANN toolkit's environment); None where it imports."""
    module, failure = npu_import()
    if module is not None:
        return None
    if failure is not None:
        return f"{what} needs torch_npu, and {torch_npu_unavailable(failure)}"
    missing = require_module("torch_npu", what).describe()
    return f"{missing}; install torch_npu built for torch {torch.__version__} with the CANN toolkit"


def not_npu_reason(platform: PlatformInfo) -> str:
    """Why the detected platform is not a usable Ascend NPU, in words that say what to do."""
    if platform.kind in ("cuda", "rocm"):
        return f"this machine's accelerator is {platform.kind}, not an Ascend NPU: use the {platform.kind} backend"
    refusal = torch_npu_refusal("the npu graph backend")
    if refusal:
        return refusal
    notes = f" ({'; '.join(platform.notes)})" if platform.notes else ""
    return f"torch_npu imports but no Ascend NPU is usable{notes}; check npu-smi info and ASCEND_RT_VISIBLE_DEVICES"


def gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "npu":
        return Capability.unavailable(not_npu_reason(platform))
    return torch_version_capability("npu", platform.torch_version)


def attention_kernels() -> tuple:
    """The plugin's attention kernels; empty while ``hwgraph_npu.attention`` is absent or fails to import."""
    return plugin_attention("hwgraph_npu.attention", "NPU")


def probe() -> BackendSpec:
    return BackendSpec(
        name="npu",
        class_path="hwgraph_npu.graphs:NpuGraphBackend",
        kinds=("npu",),
        gate=gate,
        modes=MODES,
        priority=100,
        attention=attention_kernels(),
        description="Ascend NPU graphs: aclgraph (torch.npu.NPUGraph) or torchair (compiled, reduce-overhead)",
        distribution="hwgraph-backend-npu",
    )
