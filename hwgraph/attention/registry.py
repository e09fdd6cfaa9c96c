"""The attention-kernel registry: built-in kernels plus those each backend plugin brings; automatic choice.

Automatic choice takes, among the kernels that serve the detected platform and pass their gate for the dtype and
head dim, the one with the highest priority on that platform (``KernelSpec.rank``). The documented order:

- cuda, Hopper (sm_90): TRITON_ATTN (35) > FLASH_ATTN (30) > TORCH_SDPA (0)
- cuda, other GPUs: FLASH_ATTN (30) > TRITON_ATTN (20) > TORCH_SDPA (0)
- rocm: ROCM_AITER_FA (30) > TRITON_ATTN (20) > TORCH_SDPA (0)
- npu:  NPU (30) > TORCH_SDPA (0)
- cpu:  TORCH_SDPA (TRITON_ATTN under TRITON_INTERPRET=1)

On Hopper, TRITON_ATTN runs its TMA kernel, and the Qwen3-Omni tower replays faster with it than with FLASH_ATTN
(ATen's flash kernel) for every image group measured on the H200, in the same rounds: 3.5% at one 49-token image,
2-7% at 98 tokens, 9% at 256, 17% at 1024 (``benchmarks/replay_gaps.py --ab``, ``docs/benchmarks.md``, session 6).
Elsewhere it runs its pointer kernel, which is slower than FLASH_ATTN (``benchmarks/attention_hd72.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hwgraph.attention.base import KernelSpec, VarlenAttention
from hwgraph.capability import Capability
from hwgraph.platform import PlatformInfo, detect
from hwgraph.registry import (
    ATTENTION_LOAD_FAILURES,
    SelectionError,
    backend_specs,
    discovered,
    failed_plugins,
    variable_setting,
)

log = logging.getLogger(__name__)

ATTENTION_ENV = "HWGRAPH_ATTENTION"


def builtin_kernels() -> tuple[KernelSpec, ...]:
    from hwgraph.attention.sdpa import TORCH_SDPA
    from hwgraph.attention.triton_attn import TRITON_ATTN

    return (TORCH_SDPA, TRITON_ATTN)


def kernel_specs() -> tuple[KernelSpec, ...]:
    """Every known kernel: built-in first, then each plugin's, each name once, case ignored (a plugin's kernel that
    repeats a name is ignored, with a warning the first time it is seen)."""
    specs = list(builtin_kernels())
    for backend in backend_specs():
        for kernel in backend.attention:
            # Names are matched case-insensitively (kernel_named): "flash_attn" would repeat FLASH_ATTN.
            kept = next((k for k in specs if k.name.upper() == kernel.name.upper()), None)
            if kept is None:
                specs.append(kernel)
            elif kept is not kernel and (backend.name, kernel.name) not in _REPEATS_WARNED:
                _REPEATS_WARNED.add((backend.name, kernel.name))
                log.warning("graph backend %r brings an attention kernel named %s, which %s already has; ignored",
                            backend.name, kernel.name, kept.impl_path)
    return tuple(specs)


_REPEATS_WARNED: set[tuple[str, str]] = set()


def kernel_named(name: str) -> KernelSpec:
    """The kernel called ``name`` (case and surrounding blanks ignored, as for ``"auto"``); ``SelectionError``
    listing the known ones when there is none, ``TypeError`` naming ``name`` when it is not a string."""
    check_kernel_name(name)
    # Both sides folded: a plugin's kernel may be named in lower or mixed case ("Toy_Attn"), and was then unknown
    # even by its exact name.
    for spec in kernel_specs():
        if spec.name.upper() == name.strip().upper():
            return spec
    known = ", ".join(k.name for k in kernel_specs())
    # A plugin's kernels are unknown while the plugin, or its attention module, fails to load: say which failed.
    failed = failed_plugins((*discovered()[1], *ATTENTION_LOAD_FAILURES.values()))
    raise SelectionError(f"unknown attention kernel {name!r}; known: {known}{failed}")


def check_kernel_name(name) -> None:
    # Anything else failed with AttributeError ("'torch.dtype' object has no attribute 'strip'"), naming nothing.
    if not isinstance(name, str):
        raise TypeError(f"an attention kernel name must be a string (or 'auto'), got {name!r} "
                        f"({type(name).__name__})")


def list_kernels(platform: PlatformInfo | None = None, dtype=None,
                 head_dim=None) -> list[tuple[KernelSpec, Capability]]:
    platform = platform or detect()
    return [(spec, spec.capability(platform, dtype, head_dim)) for spec in kernel_specs()]


@dataclass(frozen=True)
class SelectedKernel:
    spec: KernelSpec
    fn: VarlenAttention
    reason: str


def choose_attention(name: str | None = None, platform: PlatformInfo | None = None,
                     dtype: torch.dtype | None = None, head_dim: int | None = None,
                     graph_safe: bool = False) -> SelectedKernel:
    """``name``, else (None) ``$HWGRAPH_ATTENTION``, else the kernel of highest priority on this platform available
    here (``"auto"`` from either: automatic choice).

    An explicit choice that is unavailable raises ``SelectionError`` naming its reasons, and ``$HWGRAPH_ATTENTION``
    where it came from there (one that does not import, ``ImportError``); with nothing explicit, TORCH_SDPA is always
    available, and a kernel that does not import is passed over with the reason. ``graph_safe=True`` chooses
    automatically only among kernels that may be captured in a graph (the reason names those passed over); an
    explicit kernel is honoured either way.
    """
    if name is not None:
        check_kernel_name(name)
    platform = platform or detect()
    # A kernel named by the environment says so when it fails: the caller may never have named one.
    origin = "" if name is not None else f"${ATTENTION_ENV}: "
    # Only None defers to the variable: an empty name (a script's unset variable) is an unknown kernel, as a blank
    # one is, and as graph_backend="" is refused. The variable set blank (a shell's HWGRAPH_ATTENTION=" ", a
    # template's empty field) is unset, as set empty is.
    if name is None:
        name = variable_setting(ATTENTION_ENV)
    if name is not None and name.strip().lower() == "auto":  # as a tower takes it: $HWGRAPH_ATTENTION=auto too
        name = None
    if name is not None:
        try:
            spec = kernel_named(name)
        except SelectionError as exc:
            raise SelectionError(f"{origin}{exc}") from None
        cap = spec.capability(platform, dtype, head_dim)
        if not cap.ok:
            raise SelectionError(f"{origin}attention kernel {spec.name!r} is unavailable: " + "; ".join(cap.reasons))
        try:
            fn = spec.load()
        except ImportError as exc:  # from the variable: say so, as its SelectionErrors do
            if not origin:
                raise
            raise ImportError(f"{origin}{exc}") from exc
        return SelectedKernel(spec, fn, "explicit")
    refused = []
    for spec in sorted(kernel_specs(), key=lambda k: -k.rank(platform)):
        if platform.kind not in spec.kinds:
            continue
        if graph_safe and not spec.graph_safe:
            refused.append(f"{spec.name}: not graph-safe")
            continue
        cap = spec.capability(platform, dtype, head_dim)
        if cap.ok:
            try:
                fn = spec.load()
            except ImportError as exc:  # a plugin's kernel that does not import: the next one, with the reason
                log.debug("attention kernel %s does not load", spec.name, exc_info=True)
                refused.append(f"{spec.name}: {exc}")
                continue
            why = f"best available for {platform.kind}" + (f" (refused: {'; '.join(refused)})" if refused else "")
            return SelectedKernel(spec, fn, why)
        refused.append(f"{spec.name}: {cap.describe()}")
    raise SelectionError("no attention kernel is available: " + "; ".join(refused))
