"""The cuda plugin's probe and capability gate.

Cheap and side-effect free: importing this module imports torch and hwgraph only, and the probe runs at discovery
(``hwgraph.registry``) on every machine, so nothing here touches a device or imports flash_attn.
"""

from __future__ import annotations

import torch

from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import torch_build, torch_version_capability
from hwgraph.platform import PlatformInfo, cpu_torch_reason
from hwgraph.registry import BackendSpec, plugin_attention


def not_cuda_reason(platform: PlatformInfo) -> str:
    """Why the detected platform is not a usable NVIDIA GPU, in words that say what to do."""
    if platform.kind not in ("cpu", "cuda", "rocm"):  # an Ascend NPU: a CUDA build of torch would break torch_npu
        return (f"this machine's accelerator is {platform.kind}: the cuda backend serves NVIDIA GPUs; "
                f"use the {platform.kind} backend")
    build, version = torch_build()
    if build == "rocm":
        if platform.kind == "rocm":
            return f"torch is a ROCm (HIP {version}) build: use the rocm backend"
        # no AMD GPU in use: on an NVIDIA GPU "use the rocm backend" alone left nothing to do (rocm's reason says why)
        return f"torch is a ROCm (HIP {version}) build: use the rocm backend (NVIDIA GPUs need a CUDA build)"
    if build == "cpu":
        return cpu_torch_reason("cuda", "NVIDIA GPUs", "CUDA")
    notes = f" ({'; '.join(platform.notes)})" if platform.notes else ""
    return (f"torch {torch.__version__} is a CUDA {version} build but no NVIDIA GPU is visible{notes}; "
            f"check nvidia-smi and CUDA_VISIBLE_DEVICES")


def gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "cuda":
        return Capability.unavailable(not_cuda_reason(platform))
    return torch_version_capability("cuda", platform.torch_version)


def attention_kernels() -> tuple:
    """The plugin's attention kernels; empty while ``hwgraph_cuda.attention`` is absent or fails to import."""
    return plugin_attention("hwgraph_cuda.attention", "FLASH_ATTN")


def probe() -> BackendSpec:
    return BackendSpec(
        name="cuda",
        class_path="hwgraph_cuda.graphs:CudaGraphBackend",
        kinds=("cuda",),
        gate=gate,
        modes=("full",),
        priority=100,
        attention=attention_kernels(),
        description="CUDA graphs through torch.cuda (CUDAGraph, private memory pools)",
        distribution="hwgraph-backend-cuda",
    )
