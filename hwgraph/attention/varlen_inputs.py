"""Checks and helpers shared by every varlen attention kernel (and, for launching, by the tower's other Triton
kernels); none of them reads device memory.

Validation looks only at tensor metadata (shape, dtype, device, strides) and host values, so it is safe on the
replay path and under capture. Zeroing the padding rows is a device-side masked fill, in place.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers

import torch

from hwgraph.budgets import is_int

log = logging.getLogger(__name__)
_RECORDING_LOGGED: set[str] = set()  # kernels whose differentiable stand-in was logged (differentiable_attention)


def check_varlen_inputs(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                        dtypes: tuple[torch.dtype, ...] | None = None,
                        head_dims: tuple[int, int] | None = None) -> None:
    """Raise ``ValueError`` naming the offending value when the inputs break the common kernel signature, or when
    q, k, v are not of one of the kernel's ``dtypes`` (its ``KernelSpec.dtypes``; None: any floating dtype) or their
    head dim is outside its ``head_dims`` (None: any).
    ``max_seqlen`` and ``scale`` are host numbers of any kind (Python's, numpy's), but not bools."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{kernel}: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"{kernel}: q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{kernel}: q, k, v must have one shape, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{kernel}: q, k, v must have one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if dtypes is not None and q.dtype not in dtypes:
        raise ValueError(f"{kernel}: q, k, v must be {', '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                         f"got {q.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"{kernel}: q, k, v must be floating point, got {q.dtype}")
    if head_dims is not None and not head_dims[0] <= q.shape[2] <= head_dims[1]:
        # automatic choice checks it; a direct call failed as the kernel compiled (Triton: out of shared memory)
        raise ValueError(f"{kernel}: head_dim must be {head_dims[0]}..{head_dims[1]}, got {q.shape[2]} "
                         f"(q {tuple(q.shape)})")
    if k.device != q.device or v.device != q.device or cu_seqlens.device != q.device:
        raise ValueError(f"{kernel}: q, k, v and cu_seqlens must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}, cu_seqlens {cu_seqlens.device}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{kernel}: cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{kernel}: cu_seqlens must be 1-D with at least 2 entries [0, ...], "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if not cu_seqlens.is_contiguous():  # the Triton kernels read it by pointer, as ATen's flash kernel requires
        raise ValueError(f"{kernel}: cu_seqlens must be contiguous, got stride {cu_seqlens.stride()}; pass "
                         f"cu_seqlens.contiguous()")
    if not is_int(max_seqlen) or max_seqlen < 0:
        raise ValueError(f"{kernel}: max_seqlen must be a non-negative host int (fixed at capture), "
                         f"got {max_seqlen!r} ({type(max_seqlen).__name__})")
    # compared, not math.isfinite: torch.compile cannot trace that on a symbolic scale (q.shape[-1] ** -0.5 with
    # dynamic shapes), which made every kernel break the graph there (fullgraph: fail)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not -math.inf < scale < math.inf:
        raise ValueError(f"{kernel}: scale must be a finite host float, got {scale!r} ({type(scale).__name__})")


def valid_rows(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Bool ``[tokens]`` on device: True for rows before ``cu_seqlens[-1]`` (rows that belong to a sequence)."""
    rows = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return rows < cu_seqlens[-1]


def zero_padding_rows(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``out`` with rows at or past ``cu_seqlens[-1]`` set to zero (kernels leave them unwritten or garbage).
    In place: three small kernels (arange, compare, masked fill) instead of a where that materialises its zero."""
    padding = ~valid_rows(cu_seqlens, out.shape[0])
    return out.masked_fill_(padding[:, None, None], 0)


def unit_stride_on_d(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor as it is where its last dimension has unit stride (kernels read a head's lanes contiguously; other
    strides pass, as the tower's v, a strided view of its qkv rows), else a contiguous copy."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def register_varlen_kernel(kernel: str, op_name: str, body, zeroes_padding: bool = False,
                           dtypes: tuple[torch.dtype, ...] | None = None, differentiable: bool = False,
                           head_dims: tuple[int, int] | None = None):
    """Register ``body`` (the common signature, inputs unchecked) as the custom op ``hwgraph::<op_name>``, whose
    output is a new contiguous ``[tokens, heads, head_dim]`` tensor, as its fake says. Returns ``(public, op)``:
    ``public`` checks its inputs (``ValueError`` naming ``kernel``; q, k, v of one of ``dtypes``, a head dim in
    ``head_dims``, as its ``KernelSpec`` says), runs the op while
    torch.compile traces and the op's function itself in eager (``eager_or_op``; its output is contiguous either
    way), and returns padding rows (rows at or past
    ``cu_seqlens[-1]``) as zeros: ``body`` zeroes them itself when ``zeroes_padding``, otherwise ``public`` does
    (three small device kernels, about 50 µs of host time per call on the H200's host).

    ``public.padding_unspecified`` is the same checked kernel without that zeroing: its padding rows hold whatever
    the kernel left there. The tower uses it, because no later step mixes rows across sequences: its padding rows
    stay in padding rows, which the manager never hands out.

    While autograd records through q, k or v (``records_grad``) the op, which has no autograd formula, is not used:
    a ``differentiable`` body (plain torch ops) runs itself, any other kernel ``differentiable_attention``.
    """

    def impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
             scale: float) -> torch.Tensor:
        # torch.compile takes the output's strides from the fake and Inductor asserts them, so the op returns the
        # layout the fake gives whatever its body returns: TORCH_SDPA a contiguous copy of a permuted q's layout, a
        # padded head sliced back (FLASH_ATTN, a head_dim not a multiple of 8), a q copied to unit stride on D
        # (TRITON_ATTN), rows padded to 16 bytes (the Gluon kernel). A no-op for the tower's contiguous outputs.
        return body(q, k, v, cu_seqlens, max_seqlen, scale).contiguous()

    op = torch.library.custom_op(f"hwgraph::{op_name}", impl, mutates_args=())
    op.register_fake(lambda q, k, v, cu_seqlens, max_seqlen, scale: q.new_empty(q.shape))

    def padding_unspecified(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
        check_varlen_inputs(kernel, q, k, v, cu_seqlens, max_seqlen, scale, dtypes, head_dims)
        if records_grad(q, k, v):  # the op has no autograd formula: the body itself, or a differentiable stand-in
            if differentiable:
                return body(q, k, v, cu_seqlens, int(max_seqlen), float(scale))
            return differentiable_attention(kernel, q, k, v, cu_seqlens, scale)
        # impl, not body: eager calls hand back the op's contiguous layout too (a padded head's slice, a transposed
        # q's layout were handed back as they came, so out.view(tokens, -1) raised only in eager)
        return eager_or_op(op, impl)(q, k, v, cu_seqlens, int(max_seqlen), float(scale))

    if zeroes_padding:
        def public(q, k, v, cu_seqlens, max_seqlen, scale):
            return padding_unspecified(q, k, v, cu_seqlens, max_seqlen, scale)
    else:
        def public(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                   scale: float) -> torch.Tensor:
            return zero_padding_rows(padding_unspecified(q, k, v, cu_seqlens, max_seqlen, scale), cu_seqlens)

    public.__name__ = public.__qualname__ = op_name
    padding_unspecified.__name__ = padding_unspecified.__qualname__ = f"{op_name}_padding_unspecified"
    public.padding_unspecified = padding_unspecified
    return public, op


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd records through one of ``tensors``. The varlen kernels and the tower's fused kernels have no
    backward: their outputs came without a history (gradients silently missing) and torch.compile refused to trace
    them ("no autograd formula"), so differentiable torch computations run instead while this is True. The manager,
    the bench and the vLLM integration run under ``no_grad``/``inference_mode``, where it is False."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def differentiable_attention(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """What every varlen kernel runs while autograd records (``records_grad``): TORCH_SDPA's body, plain torch ops
    (the same attention; ``tokens**2`` bytes of mask), called directly rather than as its custom op, so it has a
    backward in eager and under torch.compile. Padding rows come back zero. Logged once per ``kernel``: a caller
    who only forgot ``torch.inference_mode()`` learns why the forward is slow."""
    from hwgraph.attention.sdpa import masked_sdpa  # sdpa registers its kernel through this module

    if kernel not in _RECORDING_LOGGED and not torch.compiler.is_compiling():
        _RECORDING_LOGGED.add(kernel)
        log.warning("autograd records through %s attention, which has no backward: the differentiable TORCH_SDPA "
                    "computation runs instead (and the tower's fused kernels run unfused); call under "
                    "torch.inference_mode() or torch.no_grad() for the kernels", kernel)
    out = masked_sdpa(q, k, v, cu_seqlens, scale)
    return out.masked_fill(~valid_rows(cu_seqlens, out.shape[0])[:, None, None], 0)


def eager_or_op(op, body):
    """``op`` (the registered custom op) while torch.compile traces, so the kernel stays one opaque node; ``body``
    in eager, skipping the dispatcher's Python round trip (about 0.12 ms of host time per call on the H200's host,
    measured with torch.profiler: 3.3 ms of a 29 ms eager forward)."""
    return op if torch.compiler.is_compiling() else body


def launches_on_tensor_device(launch):
    """Decorate a Triton launcher whose first argument is a tensor so that its kernels run on that tensor's GPU.

    Triton launches on the current device and its current stream, whatever device the arguments are on: with
    tensors on ``cuda:1`` while ``cuda:0`` is current, a launch fails ("cannot be accessed from Triton") or, where
    the GPUs are peers, runs on the wrong one. ATen's ops guard their device themselves. The guard is entered only
    when the tensor's GPU is not the current one (capture, and the usual one-GPU-per-process setup, skip it)."""

    @functools.wraps(launch)
    def on_tensor_device(tensor: torch.Tensor, *args, **kwargs):
        if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
            with torch.cuda.device(tensor.device):
                return launch(tensor, *args, **kwargs)
        return launch(tensor, *args, **kwargs)

    return on_tensor_device
