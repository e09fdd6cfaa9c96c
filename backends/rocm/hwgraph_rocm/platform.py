"""The rocm plugin's probe and capability gate.

Cheap and side-effect free: importing this module imports torch and hwgraph only, and the probe runs at discovery
on every machine, so nothing here touches a device or imports aiter.
"""

from __future__ import annotations

import torch

from hwgraph.capability import Capability, gfx_name
from hwgraph.graphs.torch_cuda import torch_build, torch_version_capability
from hwgraph.platform import PlatformInfo, cpu_torch_reason
from hwgraph.registry import BackendSpec, plugin_attention

#: Architectures that ROCm builds of torch target and HIP graph capture runs on (CDNA 1-4: MI100 to MI355; RDNA 2-4).
SUPPORTED_ARCHS = frozenset({
    "gfx908", "gfx90a", "gfx942", "gfx950",
    "gfx1030", "gfx1100", "gfx1101", "gfx1102", "gfx1151", "gfx1200", "gfx1201",
})


def not_rocm_reason(platform: PlatformInfo) -> str:
    """Why the detected platform is not a usable AMD GPU, in words that say what to do."""
    if platform.kind not in ("cpu", "cuda", "rocm"):  # an Ascend NPU: a ROCm build of torch would break torch_npu
        return (f"this machine's accelerator is {platform.kind}: the rocm backend serves AMD GPUs; "
                f"use the {platform.kind} backend")
    build, version = torch_build()
    if build == "cuda":
        return f"torch {torch.__version__} is a CUDA {version} build: use the cuda backend (AMD GPUs need a ROCm build)"
    if build == "cpu":
        return cpu_torch_reason("rocm", "AMD GPUs", "ROCm")
    notes = f" ({'; '.join(platform.notes)})" if platform.notes else ""
    return (f"torch is a ROCm (HIP {version}) build but no AMD GPU is visible{notes}; "
            f"check rocm-smi and HIP_VISIBLE_DEVICES")


def arch_capability(arch: str | None) -> Capability:
    """Gate on the architecture named by ``gcnArchName`` (``'gfx942:sramecc+:xnack-'``: the part before ':')."""
    name = gfx_name(arch)
    if name is None:
        return Capability.unavailable(f"could not read the AMD GPU architecture (gcnArchName {arch!r}); "
                                      f"update the ROCm driver and torch")
    if name not in SUPPORTED_ARCHS:
        return Capability.unavailable(f"the rocm graph backend supports {', '.join(sorted(SUPPORTED_ARCHS))}; "
                                      f"this GPU is {name}")
    return Capability.available()


def gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "rocm":
        return Capability.unavailable(not_rocm_reason(platform))
    return torch_version_capability("rocm", platform.torch_version) & arch_capability(platform.arch)


def attention_kernels() -> tuple:
    """The plugin's attention kernels; empty while ``hwgraph_rocm.attention`` is absent or fails to import."""
    return plugin_attention("hwgraph_rocm.attention", "ROCM_AITER_FA")


def probe() -> BackendSpec:
    return BackendSpec(
        name="rocm",
        class_path="hwgraph_rocm.graphs:RocmGraphBackend",
        kinds=("rocm",),
        gate=gate,
        modes=("full",),
        priority=100,
        attention=attention_kernels(),
        description="HIP graphs through torch.cuda on ROCm builds of torch (replay checked after capture)",
        distribution="hwgraph-backend-rocm",
    )
