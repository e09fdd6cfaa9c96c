"""FLASH_ATTN: flash attention for NVIDIA GPUs (compute capability >= 8.0).

It calls ``flash_attn.flash_attn_varlen_func`` when the flash-attn package imports, otherwise PyTorch's own varlen
flash kernel ``torch.nn.attention.varlen.varlen_attn``. Neither reads device memory on the host: ``max_seqlen`` is
a host int, so a captured graph keeps the value it was captured with. Neither writes rows past
``cu_seqlens[-1]``; the public function zeroes them on the device (``register_varlen_kernel``).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.nn.functional as F

from hwgraph.attention.base import KernelSpec
from hwgraph.attention.varlen_inputs import register_varlen_kernel, unit_stride_on_d
from hwgraph.capability import Capability, sm_tuple
from hwgraph.platform import PlatformInfo

MIN_COMPUTE_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=1)
def flash_provider() -> tuple[str | None, tuple[str, ...]]:
    """(``"flash_attn"`` | ``"aten"`` | ``"torch"`` | None, why each missing provider is missing).

    ``"aten"``: ATen's ``_flash_attention_forward``, the kernel torch's ``varlen_attn`` wraps, called directly;
    ``"torch"``: ``varlen_attn`` itself, where that ATen op is missing."""
    missing = []
    try:
        module = importlib.import_module("flash_attn")
        if callable(getattr(module, "flash_attn_varlen_func", None)):
            return "flash_attn", ()
        missing.append("flash_attn has no flash_attn_varlen_func")
    except Exception as exc:  # ImportError, or a wheel built for another torch/CUDA failing to load
        missing.append(f"flash_attn does not import ({type(exc).__name__}: {exc})")
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except Exception as exc:
        missing.append(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({exc})")
        return None, tuple(missing)
    # A CUDA build compiled without its flash kernel (some Windows and Jetson wheels) still has the op and varlen_attn,
    # which then fail at the first call. Read from the build, so it is False on CPU builds too: only a CUDA one counts.
    if torch.backends.cuda.is_built() and not torch.backends.cuda.is_flash_attention_available():
        missing.append(f"torch {torch.__version__} was built without its flash attention kernel "
                       f"(torch.backends.cuda.is_flash_attention_available() is False)")
        return None, tuple(missing)
    if hasattr(torch.ops.aten, "_flash_attention_forward"):
        return "aten", tuple(missing)
    return "torch", tuple(missing)


def flash_gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "cuda":
        return Capability.unavailable(f"FLASH_ATTN runs on NVIDIA CUDA, this platform is {platform.kind}")
    cc = sm_tuple(platform.arch)
    if cc is None:
        return Capability.unavailable(f"FLASH_ATTN needs compute capability >= 8.0, found an unknown "
                                      f"architecture {platform.arch!r}")
    if cc < MIN_COMPUTE_CAPABILITY:
        return Capability.unavailable(f"FLASH_ATTN needs compute capability >= 8.0, found {cc[0]}.{cc[1]}")
    provider, missing = flash_provider()
    if provider is None:
        return Capability.unavailable("FLASH_ATTN needs the flash_attn package or torch's varlen_attn: "
                                      + "; ".join(missing))
    return Capability.available()


@functools.lru_cache(maxsize=1)
def varlen_attn_takes_scale() -> bool:
    # torch 2.10's varlen_attn had no scale argument; later versions take it as a keyword.
    from torch.nn.attention.varlen import varlen_attn

    return "scale" in inspect.signature(varlen_attn).parameters


def aten_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               scale: float) -> torch.Tensor:
    """ATen's flash kernel, the one torch's ``varlen_attn`` wraps, called directly: ``varlen_attn`` adds a Python
    custom op (about 0.12 ms of host time per call on the H200's host) and a zeros kernel for an unused RNG state."""
    return torch.ops.aten._flash_attention_forward.default(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                           0.0, False, return_debug_mask=False, scale=scale)[0]


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int, scale: float) -> torch.Tensor:
    """The kernel body (unchecked): ``[T, H, D]`` in, ``[T, H, D]`` out, padding rows unwritten."""
    head_dim = q.shape[-1]
    q, k, v = unit_stride_on_d(q, k, v)  # flash kernels: "Input tensor must have contiguous last dimension"
    pad = 0
    if head_dim % 8:
        # Flash kernels take head dims in multiples of 8; zero lanes change neither q.k nor the kept slice of p.v.
        pad = 8 - head_dim % 8
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    max_seqlen = max(max_seqlen, 1)  # an all-padding batch still launches a valid (empty) grid
    provider, _ = flash_provider()
    if provider == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                     max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dropout_p=0.0,
                                     softmax_scale=scale, causal=False)
    elif provider == "aten":
        out = aten_flash(q, k, v, cu_seqlens, max_seqlen, scale)
    else:
        from torch.nn.attention.varlen import varlen_attn

        if varlen_attn_takes_scale():
            out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)
        else:
            # Its implied scale is head_dim ** -0.5 (of the padded dim); fold the difference into q.
            out = varlen_attn(q * (scale * q.shape[-1] ** 0.5), k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    if isinstance(out, tuple):
        out = out[0]
    return out[..., :head_dim] if pad else out


# Varlen attention: ``q, k, v`` ``[T, H, D]`` fp16/bf16 on CUDA, ``cu_seqlens`` int32 ``[n + 1]``.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIMS = (1, 256)
flash_varlen, flash_varlen_op = register_varlen_kernel("FLASH_ATTN", "flash_varlen", flash_attention,
                                                       dtypes=FLASH_DTYPES, head_dims=FLASH_HEAD_DIMS)


FLASH_ATTN = KernelSpec(
    name="FLASH_ATTN",
    impl_path="hwgraph_cuda.attention:flash_varlen",
    kinds=("cuda",),
    dtypes=FLASH_DTYPES,
    head_dims=FLASH_HEAD_DIMS,
    graph_safe=True,
    gate=flash_gate,
    priority=30,
    slot_bound=True,
    description="flash_attn.flash_attn_varlen_func if installed, else torch.nn.attention.varlen.varlen_attn",
)
