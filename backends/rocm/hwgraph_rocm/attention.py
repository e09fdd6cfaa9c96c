"""ROCM_AITER_FA: AMD aiter's varlen flash attention on MI300-class (gfx942) and MI350-class (gfx950) GPUs.

aiter's argument order has changed between versions, so every argument is passed by keyword. ``max_seqlen`` is a
host int (fixed at capture); rows past ``cu_seqlens[-1]`` are zeroed on the device.
"""

from __future__ import annotations

import torch

from hwgraph.attention.base import KernelSpec
from hwgraph.attention.varlen_inputs import register_varlen_kernel
from hwgraph.capability import Capability, gfx_name, require_module
from hwgraph.platform import PlatformInfo

SUPPORTED_GFX = ("gfx942", "gfx950")


def aiter_gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "rocm":
        return Capability.unavailable(f"ROCM_AITER_FA runs on AMD ROCm, this platform is {platform.kind}")
    reasons = []
    gfx = gfx_name(platform.arch)
    if gfx not in SUPPORTED_GFX:
        found = gfx or (repr(platform.arch) if platform.arch else "no architecture (torch reported no gcnArchName)")
        reasons.append(f"ROCM_AITER_FA needs {' or '.join(SUPPORTED_GFX)}, found {found}")
    found = require_module("aiter", "ROCM_AITER_FA")
    if found.ok:
        import aiter

        if not callable(getattr(aiter, "flash_attn_varlen_func", None)):
            found = Capability.unavailable(
                f"ROCM_AITER_FA needs aiter.flash_attn_varlen_func, which aiter "
                f"{getattr(aiter, '__version__', '(unknown version)')} lacks; install an aiter release that has it")
    return Capability(tuple(reasons) + found.reasons)


def aiter_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int, scale: float) -> torch.Tensor:
    """The kernel body (unchecked): ``[T, H, D]`` in, ``[T, H, D]`` out, padding rows unwritten."""
    import aiter

    max_seqlen = max(max_seqlen, 1)  # an all-padding batch still launches a valid (empty) grid
    out = aiter.flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                       max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dropout_p=0.0,
                                       softmax_scale=scale, causal=False)
    if isinstance(out, (tuple, list)):  # versions and flags that also return the log-sum-exp
        out = out[0]
    return out


# Varlen attention: ``q, k, v`` ``[T, H, D]`` fp16/bf16 on ROCm, ``cu_seqlens`` int32 ``[n + 1]``.
AITER_DTYPES = (torch.float16, torch.bfloat16)
AITER_HEAD_DIMS = (1, 256)
aiter_varlen, aiter_varlen_op = register_varlen_kernel("ROCM_AITER_FA", "aiter_varlen", aiter_attention,
                                                       dtypes=AITER_DTYPES, head_dims=AITER_HEAD_DIMS)


ROCM_AITER_FA = KernelSpec(
    name="ROCM_AITER_FA",
    impl_path="hwgraph_rocm.attention:aiter_varlen",
    kinds=("rocm",),
    dtypes=AITER_DTYPES,
    head_dims=AITER_HEAD_DIMS,
    graph_safe=True,
    gate=aiter_gate,
    priority=30,
    slot_bound=True,  # a batch dimension in its grid like ATen's flash (assumed: not measured on ROCm here)
    description="aiter.flash_attn_varlen_func (CK/ASM flash attention) on gfx942/gfx950",
)
