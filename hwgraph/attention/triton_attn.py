"""TRITON_ATTN: our Triton varlen flash-attention kernel (CUDA, ROCm; CPU only under the Triton interpreter,
which it refuses on GPUs).

This module is cheap to import: triton and the ``@triton.jit`` kernel (``hwgraph.attention.triton_kernel``) load
on the first call. The grid is bounded by ``max_seqlen`` (a host int), so the kernel is graph-capturable.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from hwgraph.attention.base import KernelSpec
from hwgraph.attention.varlen_inputs import register_varlen_kernel
from hwgraph.capability import TRITON_MIN_COMPUTE_CAPABILITY, Capability, require_module, sm_tuple
from hwgraph.platform import PlatformInfo


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels under its interpreter here: ``TRITON_INTERPRET`` read as the installed Triton
    reads it (its ``knobs``; a Triton without them took only "1"), so the gate never disagrees with Triton.
    torch.compile can trace it (the fused tower kernels ask while it traces)."""
    if "TRITON_INTERPRET" not in os.environ:
        return False  # without importing triton
    if torch.compiler.is_compiling():
        # The knobs read the variable in C, which torch.compile cannot trace (fullgraph fails); their parsing:
        return os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on")
    try:
        from triton import knobs
    except ImportError:  # no triton (the gate says so), or one older than its knobs
        return os.environ["TRITON_INTERPRET"] == "1"
    return bool(knobs.runtime.interpret)


def interpreter_refusal(what: str, kind: str) -> Capability:
    """Why ``what`` (Triton kernels) cannot run on a ``kind`` GPU while Triton's interpreter is on: it runs them on
    the host (Triton copies GPU tensors there and back), so graph capture fails and every budget stayed eager."""
    return Capability.unavailable(
        f"TRITON_INTERPRET is set: Triton's interpreter runs {what} on the host, not the {kind} GPU, so graphs cannot "
        f"capture it; unset TRITON_INTERPRET to run it on the GPU")


def triton_gate(platform: PlatformInfo) -> Capability:
    if platform.kind not in ("cuda", "rocm", "cpu"):
        return Capability.unavailable(
            f"TRITON_ATTN runs on cuda/rocm (cpu only under the Triton interpreter), this platform is {platform.kind}")
    # On CPU the interpreter is asked about before triton is imported: importing it here, in every automatic choice,
    # made a TRITON_INTERPRET=1 set later in the process useless (triton reads it at import).
    if platform.kind == "cpu" and not interpreter_enabled():
        return Capability.unavailable(
            "on CPU TRITON_ATTN runs only under the Triton interpreter (TRITON_INTERPRET=1)")
    # Triton builds no kernels below Volta (torch's has_triton says so too): automatic choice took TRITON_ATTN on a
    # P100 or GTX 1080, where FLASH_ATTN is refused, and the first forward failed as the kernel compiled.
    cc = sm_tuple(platform.arch) if platform.kind == "cuda" else None
    if cc is not None and cc < TRITON_MIN_COMPUTE_CAPABILITY:
        major, minor = TRITON_MIN_COMPUTE_CAPABILITY
        return Capability.unavailable(f"TRITON_ATTN needs compute capability >= {major}.{minor} (the oldest NVIDIA "
                                      f"GPUs Triton compiles for), found {cc[0]}.{cc[1]}")
    found = require_module("triton", "TRITON_ATTN")
    if not found.ok:
        return found
    if platform.kind != "cpu" and interpreter_enabled():
        return interpreter_refusal("TRITON_ATTN", platform.kind)
    if platform.kind == "cpu" and not imported_interpreted():
        return Capability.unavailable(
            "TRITON_INTERPRET=1 was set after triton was imported in this process; triton decides at import "
            "whether it interprets, so TRITON_ATTN cannot run on CPU here")
    return Capability.available()


def triton_dtype_gate(platform: PlatformInfo, dtype: torch.dtype) -> Capability:
    """bf16 below compute capability 8.0 is refused: Triton builds no bf16 tensor-core products there (ptxas:
    "Feature '.bf16' requires .target sm_80"), so a T4 or V100 would fail at the first launch instead of choosing
    TORCH_SDPA. fp16 and float32 stay."""
    cc = sm_tuple(platform.arch) if platform.kind == "cuda" else None
    if dtype == torch.bfloat16 and cc is not None and cc < (8, 0):
        return Capability.unavailable(f"TRITON_ATTN runs bfloat16 on compute capability >= 8.0, found "
                                      f"{cc[0]}.{cc[1]} (float16 runs there)")
    return Capability.available()


def imported_interpreted() -> bool:
    """Whether what is already imported was built for the interpreter: triton's own ``@jit`` helpers (decorated
    when triton is imported) and, once imported, TRITON_ATTN's kernels. True for what is not imported yet."""
    import sys

    triton = sys.modules.get("triton")
    if triton is None:
        return True
    from triton.language import standard

    if isinstance(standard.sum, triton.runtime.JITFunction):
        return False
    kernel = sys.modules.get("hwgraph.attention.triton_kernel")
    return kernel is None or kernel.is_interpreted()


def triton_priority(platform: PlatformInfo) -> int:
    """35 on NVIDIA Hopper (sm_90) with a Triton that builds host TMA descriptors (3.4 or newer): there the TMA
    kernel runs (and the Gluon kernel, where Triton has Gluon: ``triton_kernel.uses_gluon``), and the Qwen3-Omni
    tower replays faster with them than with FLASH_ATTN (30) at every image size measured on the H200
    (``hwgraph.attention.registry``). 20 elsewhere: the pointer kernel is slower than FLASH_ATTN, and newer NVIDIA
    architectures were not measured."""
    cc = sm_tuple(platform.arch) if platform.kind == "cuda" else None
    if cc is None or cc[0] != 9:
        return 20
    try:
        has_descriptors = importlib.util.find_spec("triton.tools.tensor_descriptor") is not None
    except Exception:  # no triton, or one that fails to import (ImportError, or a broken build's RuntimeError):
        has_descriptors = False  # the gate says so; ranking must not crash automatic choice
    return 35 if has_descriptors else 20


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           scale: float) -> torch.Tensor:
    """The kernel body: imports triton (through the kernel module) only when it runs."""
    from hwgraph.attention.triton_kernel import launch_varlen_attention

    return launch_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)


# Varlen attention: ``q, k, v`` ``[T, H, D]``, ``cu_seqlens`` int32 ``[n + 1]`` -> ``[T, H, D]``. Every real sequence
# must be at most ``max_seqlen`` long: rows beyond it are not computed.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_HEAD_DIMS = (1, 256)
triton_varlen, triton_varlen_op = register_varlen_kernel("TRITON_ATTN", "triton_varlen", launch,
                                                         zeroes_padding=True, dtypes=TRITON_DTYPES,
                                                         head_dims=TRITON_HEAD_DIMS)


TRITON_ATTN = KernelSpec(
    name="TRITON_ATTN",
    impl_path="hwgraph.attention.triton_attn:triton_varlen",
    kinds=("cuda", "rocm", "cpu"),
    dtypes=TRITON_DTYPES,
    head_dims=TRITON_HEAD_DIMS,
    graph_safe=True,
    gate=triton_gate,
    priority=20,
    priority_on=triton_priority,
    dtype_gate=triton_dtype_gate,
    slot_bound=True,
    description="hwgraph's Triton varlen flash attention (online softmax; a Gluon kernel on Hopper); CPU only under "
                "TRITON_INTERPRET=1",
)
