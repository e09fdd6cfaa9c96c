"""The rocm plugin's probe and capability gate.

Cheap and side-effect free: importing this module imports torch and hwgraph only, and the probe runs at discovery
on every machine, so nothing here touches a device or imports aiter. The gate reads the torch build's gfx targets
(``build_archs``) only for a platform detected as ROCm, whose GPU detection has already initialised HIP.
"""

from __future__ import annotations

import torch

from hwgraph.capability import Capability, gfx_name
from hwgraph.graphs.torch_cuda import torch_build, torch_version_capability
from hwgraph.platform import PlatformInfo, cpu_torch_reason
from hwgraph.registry import BackendSpec, plugin_attention

#: Architectures that ROCm builds of torch target and HIP graph capture runs on (CDNA 1-4: MI100 to MI355; RDNA 2-4):
#: the gate's fallback where the torch build does not list the targets it was compiled for (``build_archs``).
SUPPORTED_ARCHS = frozenset({
    "gfx908", "gfx90a", "gfx942", "gfx950",
    "gfx1030", "gfx1100", "gfx1101", "gfx1102", "gfx1151", "gfx1200", "gfx1201",
})


def build_archs() -> tuple[str, ...]:
    """The gfx targets this torch build has kernels for, as bare names in the build's order.

    ``torch.cuda.get_arch_list()`` lists them on a ROCm build (``['gfx900', 'gfx906', 'gfx908', 'gfx90a', 'gfx942',
    ...]``); a build made with ``PYTORCH_ROCM_ARCH='gfx90a:xnack-'`` lists the features too, which are dropped here as
    the GPU's are. Empty where it lists none: a CPU build; a torch whose list depends on a visible GPU (older releases
    ask ``torch.cuda.is_available()`` first); a CUDA build, whose ``sm_*`` entries say nothing about AMD GPUs.

    Reading it initialises nothing new on a ROCm machine: the list is compiled in, and the availability check that
    older torch makes first is the one ``detect()`` has already made. A failure to read it is an empty list (the gate
    falls back to ``SUPPORTED_ARCHS``), not a crash.
    """
    try:
        listed = torch.cuda.get_arch_list()
    except Exception:
        return ()
    return tuple(dict.fromkeys(name for name in map(gfx_name, listed) if name is not None))


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


def arch_capability(arch: str | None, targets: tuple[str, ...] = ()) -> Capability:
    """Gate on the architecture named by ``gcnArchName`` (``'gfx942:sramecc+:xnack-'``: the part before ':').

    ``targets``: the gfx targets the torch build was compiled for (``build_archs``). Where it lists any, it decides:
    torch has kernels for those GPUs and no others, so a GPU outside it fails at its first kernel
    (``hipErrorNoBinaryForGpu``) whatever this plugin lists, and one inside it runs. Only where the build lists none
    does the fixed ``SUPPORTED_ARCHS`` decide.
    """
    name = gfx_name(arch)
    if name is None:
        return Capability.unavailable(f"could not read the AMD GPU architecture (gcnArchName {arch!r}); "
                                      f"update the ROCm driver and torch")
    if targets:
        if name not in targets:
            full = f" ({arch})" if arch.strip() != name else ""
            return Capability.unavailable(f"this GPU is {name}{full}, but torch {torch.__version__} was built for "
                                          f"{', '.join(targets)} only (torch.cuda.get_arch_list()); install a ROCm "
                                          f"build of torch that targets {name}")
        return Capability.available()
    if name not in SUPPORTED_ARCHS:
        return Capability.unavailable(f"the rocm graph backend supports {', '.join(sorted(SUPPORTED_ARCHS))}; "
                                      f"this GPU is {name}")
    return Capability.available()


def gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "rocm":
        return Capability.unavailable(not_rocm_reason(platform))
    return torch_version_capability("rocm", platform.torch_version) & arch_capability(platform.arch, build_archs())


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
