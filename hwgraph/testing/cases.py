"""What the conformance suite runs: one case per (graph backend, attention kernel, dtype), gated on capabilities.

A case is skipped, with the gate's own reasons, when the backend or the kernel reports itself unavailable here; the
suite never looks at device names. The exceptions: a backend that refuses a machine of the kind it serves (the
cuda backend on a CUDA machine) errs in every check, at setup, with its reasons, since a vendor's CI on its own
hardware would otherwise pass with nothing checked. So does an attention kernel the settings select by name
(``HWGRAPH_ATTENTION``) whose gate refuses the devices of a kind it runs on, when the backend serving them is available
here (FLASH_ATTN on a GPU too old for it, TRITON_ATTN on a CPU without the Triton interpreter): its checks err with the
gate's reasons, as ``hwgraph validate --attention`` fails it, where they were all skipped. A selected kernel for
another accelerator than the backend's devices (FLASH_ATTN on a CPU machine) is still a skip: this machine lacks its
hardware. For the same reason a backend name that no installed plugin has (a typo, or a plugin that failed to load),
as ``HWGRAPH_BACKEND`` or in ``HWGRAPH_TEST_BACKENDS``, is a collection error naming it. Settings come from, in order:
the test class, the test module, the environment.

=========================  ==============================  =============================================
setting                    class/module attribute          environment
=========================  ==============================  =============================================
graph backend under test   ``HWGRAPH_BACKEND``             (none: the backend hwgraph would choose here)
its graph mode             ``HWGRAPH_GRAPH_MODE``          ``HWGRAPH_TEST_GRAPH_MODE`` (default: its first)
backends allowed to run    -                               ``HWGRAPH_TEST_BACKENDS=rocm,cuda``
attention kernels          ``HWGRAPH_ATTENTION`` (tuple)   ``HWGRAPH_TEST_ATTENTION=TRITON_ATTN,...``
tower preset               ``HWGRAPH_PRESET``              ``HWGRAPH_TEST_PRESET`` (default ``tiny``)
dtype                      ``HWGRAPH_DTYPE``               ``HWGRAPH_TEST_DTYPE`` (cpu: float32, else bfloat16)
=========================  ==============================  =============================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from hwgraph.dtypes import parse_dtype

BACKENDS_ENV = "HWGRAPH_TEST_BACKENDS"
ATTENTION_ENV = "HWGRAPH_TEST_ATTENTION"
PRESET_ENV = "HWGRAPH_TEST_PRESET"
DTYPE_ENV = "HWGRAPH_TEST_DTYPE"
GRAPH_MODE_ENV = "HWGRAPH_TEST_GRAPH_MODE"
SUITE_ENVIRONMENT = (BACKENDS_ENV, ATTENTION_ENV, PRESET_ENV, DTYPE_ENV, GRAPH_MODE_ENV)  # what the suite reads
DEFAULT_PRESET = "tiny"


@dataclass(frozen=True)
class ConformanceCase:
    """One combination the suite checks; ``device`` is a device type ("cpu", "cuda", "npu")."""

    backend: str
    kernel: str
    dtype: torch.dtype
    device: str
    preset: str
    mode: str | None = None  # the backend's graph mode; None: its first

    @property
    def id(self) -> str:
        backend = f"{self.backend}-{self.mode}" if self.mode else self.backend
        return f"{backend}-{self.kernel}-{str(self.dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class SuiteSettings:
    backend: str | None
    kernels: tuple[str, ...] | None
    preset: str
    dtype: str | None
    allowed_backends: tuple[str, ...] | None
    mode: str | None = None


def split_names(text: str | None) -> tuple[str, ...] | None:
    names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
    return names or None


def settings_for(cls, module) -> SuiteSettings:
    """Resolve the suite's settings for a test class in ``module`` (class, then module, then environment)."""

    def pick(attr, env=None):
        for owner in (cls, module):
            value = getattr(owner, attr, None)
            if value is not None:
                return value
        return os.environ.get(env) if env else None

    kernels = pick("HWGRAPH_ATTENTION", ATTENTION_ENV)
    if isinstance(kernels, str):
        kernels = split_names(kernels)
    return SuiteSettings(backend=pick("HWGRAPH_BACKEND"), kernels=tuple(k.upper() for k in kernels or ()) or None,
                         preset=pick("HWGRAPH_PRESET", PRESET_ENV) or DEFAULT_PRESET,
                         dtype=pick("HWGRAPH_DTYPE", DTYPE_ENV),
                         allowed_backends=split_names(os.environ.get(BACKENDS_ENV)),
                         mode=pick("HWGRAPH_GRAPH_MODE", GRAPH_MODE_ENV) or None)


@dataclass(frozen=True)
class UnservedCase:
    """The case of a backend that refuses to run on a machine of the kind it serves, or of a selected attention kernel
    that refuses the devices of a kind it runs on: every check errs with ``reason`` (``ConformanceSuite`` fails it
    before building anything)."""

    reason: str


def skipped(case_id: str, reason: str):
    return pytest.param(None, id=case_id, marks=pytest.mark.skip(reason=reason))


def conformance_params(settings: SuiteSettings, graph_safe_only: bool = True) -> list:
    """``pytest.param`` per case: runnable ones carry a ``ConformanceCase``; the others are skips with reasons, or an
    ``UnservedCase`` where the backend or a selected kernel refuses hardware of its own kind (see the module's
    docstring). A kernel that is not graph-safe is a skip only for checks that capture it (``graph_safe_only``): the
    manager still runs it eagerly, so a check of the kernel itself runs it.

    Raises ValueError for a graph backend (``HWGRAPH_BACKEND``, or a name in ``$HWGRAPH_TEST_BACKENDS``) that is not
    installed or failed to load, for a selected kernel name no installed kernel has (case ignored), for an unknown
    preset or dtype, and for a graph mode the backend does not have: a typo would otherwise skip, or fail, every
    case."""
    from hwgraph.attention.registry import kernel_specs
    from hwgraph.models.qwen3_omni import preset_config
    from hwgraph.platform import detect, device_type, platform_for
    from hwgraph.registry import SelectionError, choose_backend, spec_named

    platform = detect()
    for allowed in settings.allowed_backends or ():
        try:  # a misspelt name would exclude the backend under test, and every check skip
            spec_named(allowed)
        except SelectionError as exc:
            raise ValueError(f"{BACKENDS_ENV}={','.join(settings.allowed_backends)}: {exc}") from None
    # Names are checked before the backend is excluded or found unavailable: a typo must fail that run too, not hide
    # behind its one skip until the run on the hardware.
    try:
        config = preset_config(settings.preset)
    except ValueError as exc:
        raise ValueError(f"HWGRAPH_PRESET or {PRESET_ENV}: {exc}") from None
    try:
        chosen_dtype = parse_dtype(settings.dtype) if settings.dtype else None
    except ValueError as exc:
        raise ValueError(f"HWGRAPH_DTYPE or {DTYPE_ENV}: {exc}") from None
    kernels = kernel_specs()
    known = [kernel.name for kernel in kernels]
    # Matched with case folded, as kernel_named does: a plugin's kernel may be named "Toy_Attn", and the selection is
    # upper-cased (settings_for, and validate's module), so it was unknown even by its exact name.
    by_folded = {kernel.name.upper(): kernel.name for kernel in kernels}
    unknown = [name for name in settings.kernels or () if name.strip().upper() not in by_folded]
    if unknown:
        raise ValueError(f"unknown attention kernel {', '.join(map(repr, unknown))} in HWGRAPH_ATTENTION or "
                         f"{ATTENTION_ENV}; known: {', '.join(known)}")
    selected = tuple(by_folded[name.strip().upper()] for name in settings.kernels or ())
    name = settings.backend or choose_backend(platform=platform).spec.name
    try:
        spec = spec_named(name)
    except SelectionError as exc:  # a typo, or a plugin that failed to load: skipping would pass with nothing checked
        raise ValueError(f"the conformance suite's graph backend: {exc}") from None
    if settings.allowed_backends and name not in settings.allowed_backends:
        return [skipped(f"{name}-excluded", f"{BACKENDS_ENV}={','.join(settings.allowed_backends)} "
                                            f"excludes the {name} graph backend")]
    refusal = spec.mode_refusal(settings.mode)
    if refusal:
        raise ValueError(f"unknown graph mode {settings.mode!r} in HWGRAPH_GRAPH_MODE or {GRAPH_MODE_ENV}: {refusal}")
    cap = spec.capability(platform)
    if not cap.ok:
        reason = f"graph backend {name!r} is unavailable: {cap.describe()}"
        if platform.kind in spec.kinds:
            # on a machine of the kind it serves, a refusing gate is a broken install, not a reason to skip: a
            # vendor's CI would otherwise pass with nothing checked
            return [pytest.param(UnservedCase(f"{reason} (on this {platform.kind} machine, which it serves)"),
                                 id=f"{name}-unavailable")]
        return [skipped(f"{name}-unavailable", reason)]
    kind = platform.kind if platform.kind in spec.kinds else "cpu"
    device = device_type(kind)  # ROCm builds answer to "cuda"
    dtype = chosen_dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    head_dim = config.hidden_size // config.num_heads
    kernel_platform = platform_for(torch.device(device))
    params = []
    for kernel in kernels:
        case = ConformanceCase(name, kernel.name, dtype, device, settings.preset, settings.mode)
        if kernel_platform.kind not in kernel.kinds:
            if kernel.name in selected:  # selected: say why it has no case, not vanish
                params.append(skipped(case.id, f"attention kernel {kernel.name} runs on {', '.join(kernel.kinds)}, "
                                               f"not on the {name} graph backend's {kernel_platform.kind} devices"))
            continue  # a kernel for another accelerator is no concern of this backend's conformance
        if selected and kernel.name not in selected:
            params.append(skipped(case.id, f"attention kernel {kernel.name} not selected "
                                           f"(selected: {', '.join(selected)})"))
            continue
        kcap = kernel.capability(kernel_platform, dtype, head_dim)
        if not kcap.ok and kernel.name in selected:
            # named by the vendor's settings, for devices of a kind this machine has and the backend runs on: a
            # refusing gate is a broken install or a machine unfit for it, and a skip passed the run with nothing
            # checked while `hwgraph validate --attention` failed it
            reason = f"attention kernel {kernel.name} is unavailable: {kcap.describe()}"
            params.append(pytest.param(UnservedCase(f"{reason} (selected by HWGRAPH_ATTENTION or {ATTENTION_ENV}, "
                                                    f"on the {name} graph backend's {kernel_platform.kind} devices)"),
                                       id=case.id))
        elif not kcap.ok:
            params.append(skipped(case.id, f"attention kernel {kernel.name} is unavailable: {kcap.describe()}"))
        elif graph_safe_only and not kernel.graph_safe:
            params.append(skipped(case.id, f"attention kernel {kernel.name} is not graph-safe: "
                                           f"the manager runs it eagerly"))
        else:
            params.append(pytest.param(case, id=case.id))
    if not params:
        params.append(skipped(f"{name}-no-kernel", f"no attention kernel serves {kernel_platform.kind}"))
    return params
