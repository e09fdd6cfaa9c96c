"""The rocm plugin's probe and capability gate.

Cheap and side-effect free: importing this module imports torch and hwgraph only, and the probe runs at discovery
on every machine, so nothing here touches a device or imports aiter. The gate reads the torch build's gfx targets
(``build_archs``) only for a platform detected as ROCm, whose GPU detection has already initialised HIP.
"""

from __future__ import annotations

from dataclasses import dataclass

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


#: LLVM's generic targets and the processors each runs on (AMDGPUUsage, "AMDGPU Generic Processors"): a build made
#: for ``gfx11-generic`` has one code object for all of RDNA 3 and 3.5. Generic code objects carry a version, and a
#: processor added to a family later needs a code object of that version or newer; get_arch_list() does not say which
#: version a build has, so every listed member is taken to run.
GENERIC_TARGETS = {
    "gfx9-generic": frozenset({"gfx900", "gfx902", "gfx904", "gfx906", "gfx909", "gfx90c"}),
    "gfx9-4-generic": frozenset({"gfx940", "gfx941", "gfx942", "gfx950"}),
    "gfx10-1-generic": frozenset({"gfx1010", "gfx1011", "gfx1012", "gfx1013"}),
    "gfx10-3-generic": frozenset({"gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"}),
    "gfx11-generic": frozenset({"gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152",
                                "gfx1153"}),
    "gfx12-generic": frozenset({"gfx1200", "gfx1201"}),
    "gfx12-5-generic": frozenset({"gfx1250", "gfx1251"}),
}


@dataclass(frozen=True)
class TargetId:
    """An AMDGPU target ID, a GPU's ``gcnArchName`` or a build's target: ``'gfx90a:sramecc+:xnack-'`` is processor
    gfx90a with sramecc on and xnack off. A feature it does not name is "any" (LLVM's target-ID rules)."""

    processor: str
    features: tuple[tuple[str, bool], ...] = ()  # (name, on) in the order named

    @classmethod
    def parse(cls, text: str | None) -> TargetId | None:
        """None where ``text`` names no gfx processor (empty, ``sm_90``); a part that is not ``name+`` or ``name-``
        is dropped."""
        processor = gfx_name(text)
        if processor is None:
            return None
        parts = (part.strip() for part in text.split(":")[1:])
        return cls(processor, tuple((part[:-1], part[-1] == "+") for part in parts
                                    if len(part) > 1 and part[-1] in "+-"))

    def __str__(self) -> str:
        return ":".join([self.processor, *(f"{name}{'+' if on else '-'}" for name, on in self.features)])

    def covers(self, processor: str) -> bool:
        """This target's code is for ``processor``: the same processor, or a member of this generic target."""
        return processor == self.processor or processor in GENERIC_TARGETS.get(self.processor, ())

    def conflicts(self, device: TargetId) -> tuple[str, ...]:
        """The device's settings (``'xnack+'``) of the features this target sets otherwise; a feature either side does
        not name matches any setting."""
        wanted = dict(self.features)
        return tuple(f"{name}{'+' if on else '-'}" for name, on in device.features
                     if name in wanted and wanted[name] != on)

    def runs_on(self, device: TargetId) -> bool:
        return self.covers(device.processor) and not self.conflicts(device)


def build_archs() -> tuple[str, ...]:
    """The gfx targets this torch build has kernels for, as target IDs in the build's order.

    ``torch.cuda.get_arch_list()`` lists them on a ROCm build (``['gfx900', 'gfx906', 'gfx908', 'gfx90a', 'gfx942',
    ...]``); a build made with ``PYTORCH_ROCM_ARCH='gfx90a:xnack-'`` lists the features too, which are kept (that code
    runs only with XNACK off), as are LLVM's generic targets (``gfx11-generic``). Empty where it lists none: a CPU
    build; a torch whose list depends on a visible GPU (older releases ask ``torch.cuda.is_available()`` first); a
    CUDA build, whose ``sm_*`` entries say nothing about AMD GPUs.

    Reading it initialises nothing new on a ROCm machine: the list is compiled in, and the availability check that
    older torch makes first is the one ``detect()`` has already made. A failure to read it is an empty list (the gate
    falls back to ``SUPPORTED_ARCHS``), not a crash.
    """
    try:
        listed = torch.cuda.get_arch_list()
    except Exception:
        return ()
    return tuple(dict.fromkeys(str(target) for target in map(TargetId.parse, listed) if target is not None))


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
    """Gate on the GPU's ``gcnArchName`` (``'gfx942:sramecc+:xnack-'``: its processor, then its features' settings).

    ``targets``: the gfx target IDs the torch build was compiled for (``build_archs``). Where it lists any, it decides:
    torch has kernels for those GPUs and no others, so a GPU none of them runs on fails at its first kernel
    (``hipErrorNoBinaryForGpu``) whatever this plugin lists, and one that some target runs on runs. A target runs on the
    GPU when it is for the GPU's processor, or a generic target of its family (``GENERIC_TARGETS``), and each feature
    it sets (``gfx90a:xnack-``) has that setting on the GPU. Only where the build lists none does the fixed
    ``SUPPORTED_ARCHS`` decide, by processor.
    """
    device = TargetId.parse(arch)
    if device is None:
        return Capability.unavailable(f"could not read the AMD GPU architecture (gcnArchName {arch!r}); "
                                      f"update the ROCm driver and torch")
    name = device.processor
    if targets:
        built = [target for target in map(TargetId.parse, targets) if target is not None]
        if any(target.runs_on(device) for target in built):
            return Capability.available()
        full = f" ({arch.strip()})" if arch.strip() != name else ""
        refused = (f"this GPU is {name}{full}, but torch {torch.__version__} was built for {', '.join(targets)} only "
                   f"(torch.cuda.get_arch_list())")
        covering = [target for target in built if target.covers(name)]
        if not covering:
            unknown = [str(t) for t in built if t.processor.endswith("-generic") and t.processor not in GENERIC_TARGETS]
            if unknown:  # a family newer than the table: whether it serves this GPU is not known here
                return Capability.unavailable(
                    f"{refused}; this plugin does not know which processors the generic target(s) "
                    f"{', '.join(unknown)} serve (it knows {', '.join(GENERIC_TARGETS)}), so it cannot tell whether "
                    f"they serve {name}; update hwgraph-backend-rocm, or install a ROCm build of torch that targets "
                    f"{name}")
            return Capability.unavailable(f"{refused}; install a ROCm build of torch that targets {name}")
        settings = tuple(dict.fromkeys(setting for target in covering for setting in target.conflicts(device)))
        # HSA_XNACK only helps where the xnack setting is a target's one conflict
        xnack = [conflict[0] for conflict in (target.conflicts(device) for target in covering)
                 if len(conflict) == 1 and conflict[0][:-1] == "xnack"]
        return Capability.unavailable(
            f"{refused}: its {name} code ({', '.join(map(str, covering))}) does not run with this GPU's "
            f"{', '.join(settings)}; install a ROCm build of torch that targets {name} or {device}"
            + (f", or run with HSA_XNACK={'0' if xnack[0] == 'xnack+' else '1'}" if xnack else ""))
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
