"""Fused device kernels for the tower's hot path: fewer, larger kernels on GPUs.

Profiling the eager tower on the H200 (``benchmarks/explore.py``) showed rotary embedding costing six small kernels
per block (float copy, roll, two multiplies, an add, a cast back) and every residual add followed by a separate
LayerNorm. Here:

- ``rotary_qk``: one Triton kernel rotates q and k straight out of the qkv matmul's ``[T, 3, H, D]`` view and
  writes them contiguous (float32 math, as transformers does);
- ``add_layer_norm``: one Triton kernel adds the residual and normalises the sum (LayerNorm of the rounded sum,
  as the unfused pair computes it);
- ``linear_gelu_tanh``: fc1 with its tanh-GELU as the cuBLASLt epilogue (``torch._addmm_activation``, or a
  measured cuBLASLt algorithm while a graph is captured: ``hwgraph.products``);
- ``add_position_embedding``: one Triton kernel blends the four learned position rows of each patch and adds them
  to the patch embedding (five kernels unfused, one of them writing ``[4, rows, hidden]`` float32 products).

Each has a plain torch fallback, used on CPU, without Triton, on GPUs under Triton's interpreter, and when
``HWGRAPH_FUSED=0``; the fallbacks are the exact unfused computations, so the CPU tower stays equal to transformers.
The Triton kernels are ``torch.library`` custom ops (one opaque op for capture and ``torch.compile``); eager calls go
straight to the launcher, skipping the dispatcher's overhead.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.nn.functional as F

from hwgraph import products
from hwgraph.attention.triton_attn import interpreter_enabled
from hwgraph.attention.varlen_inputs import eager_or_op, launches_on_tensor_device, records_grad
from hwgraph.capability import TRITON_MIN_COMPUTE_CAPABILITY

FUSED_ENV = "HWGRAPH_FUSED"


# Looked up once (finds the package without importing it); a plain constant also keeps torch.compile from tracing
# a cached function call on every forward.
TRITON_FOUND = importlib.util.find_spec("triton") is not None
# What the add + LayerNorm and position-embedding kernels compute in (float32 inside); float64 takes the exact
# fallbacks instead of being rounded to float32.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels on CUDA/ROCm tensors of a GPU Triton compiles for, unless Triton's interpreter is on (or CPU
    tensors under the interpreter, for tests)."""
    if os.environ.get(FUSED_ENV, "1") == "0" or not TRITON_FOUND:
        return False
    if t.is_cuda:
        # While torch.compile traces, inductor itself needs such a GPU (it generates Triton), and the cached call
        # is left out of the traced forward. The interpreter would run the kernels on the host (Triton copies the
        # tensors there and back), which graph capture cannot record.
        return (torch.compiler.is_compiling() or triton_compiles_for(t.device)) and not interpreter_enabled()
    # As TRITON_ATTN's gate reads the interpreter (Triton's knobs): "true" and "on" count too.
    return t.device.type == "cpu" and interpreter_enabled()


@functools.cache
def triton_compiles_for(device: torch.device) -> bool:
    """Whether Triton builds kernels for ``device``'s GPU: every ROCm GPU torch runs on, NVIDIA from compute
    capability 7.0 (below it, on a P100 or GTX 10xx, the fused kernels' first launch failed; the unfused path runs)."""
    return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= TRITON_MIN_COMPUTE_CAPABILITY


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------- rotary on q and k
def rotary_qk_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``qkv`` ``[T, 3, H, D]``; ``cos``/``sin`` ``[T, D]`` float32 with the rotation's sign folded into ``sin``
    (``-sin`` on the first half). Returns rotated ``q``, ``k`` ``[T, H, D]`` in qkv's dtype."""
    x = qkv[:, :2].float()
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1): with the signed sin, x*cos + swapped*sin rotates
    out = (x * cos[:, None, None, :] + swapped * sin[:, None, None, :]).to(qkv.dtype)
    return out[:, 0], out[:, 1]


@launches_on_tensor_device
def rotary_qk_launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_warps: int | None = None) -> torch.Tensor:
    """The Triton path: returns ``[2, T, H, D]`` (rotated q, then k), contiguous. One program per token (more tokens
    per program measured slower or equal), with ``num_warps`` warps (default ``rotary_warps``). On the H200
    (``benchmarks/rotary.py``), 16 heads of 72: 13.1 us for 4096 tokens with 4 warps (3.1 TB/s), 10.9-11.0 us with
    8."""
    from hwgraph.models.qwen3_omni.fused_kernels import rotary_qk_kernel

    tokens, _, heads, head_dim = qkv.shape
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    out = torch.empty((2, tokens, heads, head_dim), device=qkv.device, dtype=qkv.dtype)
    if tokens:
        rotary_qk_kernel[(tokens,)](
            qkv, cos, sin, out, qkv.stride(0), qkv.stride(1), cos.stride(0), tokens * heads * head_dim,
            H=heads, D=head_dim, STRIDE_H=qkv.stride(2), BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(head_dim // 2),
            num_warps=rotary_warps(heads, head_dim) if num_warps is None else num_warps)
    return out


def rotary_warps(heads: int, head_dim: int) -> int:
    """Warps per program of ``rotary_qk_kernel``: one per 128 elements of its ``[heads, head_dim / 2]`` tile (padded
    to powers of two), 1 to 8. For 16 heads of 72 that is 8, which measured 17-18% faster than Triton's default 4 on
    the H200 at 1024 and 4096 tokens, with identical results (``benchmarks/rotary.py --warps``)."""
    return max(1, min(8, next_pow2(heads) * next_pow2(head_dim // 2) // 128))


@torch.library.custom_op("hwgraph::rotary_qk", mutates_args=())
def rotary_qk_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rotary_qk_launch(qkv, cos, sin)


@rotary_qk_op.register_fake
def _(qkv, cos, sin):
    return qkv.new_empty((2, qkv.shape[0], qkv.shape[2], qkv.shape[3]))


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``q``, ``k`` ``[T, H, D]`` from the ``[T, 3, H, D]`` qkv view (see ``rotary_qk_reference``)."""
    # The kernel reads cos and sin as contiguous [T, D] rows: a table the reference broadcasts ([1, D]) takes it.
    if not use_triton(qkv) or qkv.dim() != 4 or qkv.stride(-1) != 1 or cos.shape != (qkv.shape[0], qkv.shape[-1]) \
            or sin.shape != cos.shape or not cos.is_contiguous() or not sin.is_contiguous() \
            or records_grad(qkv, cos, sin):
        return rotary_qk_reference(qkv, cos, sin)
    out = eager_or_op(rotary_qk_op, rotary_qk_launch)(qkv, cos, sin)
    return out[0], out[1]


# ---------------------------------------------------------------- residual add + LayerNorm
def add_layer_norm_reference(x: torch.Tensor, delta: torch.Tensor, norm: torch.nn.LayerNorm
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, F.layer_norm(total, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


@launches_on_tensor_device
def add_layer_norm_launch(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                          eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton path: returns ``[2, rows, N]``: the sum, then its LayerNorm. ``out``: where to write them (a new
    tensor by default), rows contiguous; its two planes may lie anywhere, e.g. rows of a larger ``[2, R, N]``."""
    from hwgraph.models.qwen3_omni.fused_kernels import add_layer_norm_kernel

    rows, width = x.shape
    if out is None:
        out = torch.empty((2, rows, width), device=x.device, dtype=x.dtype)
    elif out.shape != (2, rows, width) or out.stride(1) != width or out.stride(2) != 1:
        raise ValueError(f"out must be [2, {rows}, {width}] with contiguous rows, got shape {tuple(out.shape)} and "
                         f"strides {out.stride()}")
    if rows:
        block = next_pow2(width)
        add_layer_norm_kernel[(rows,)](x, delta, weight, bias, out, x.stride(0), delta.stride(0), out.stride(0), eps,
                                       N=width, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return out


@torch.library.custom_op("hwgraph::add_layer_norm", mutates_args=())
def add_layer_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    return add_layer_norm_launch(x, delta, weight, bias, eps)


@add_layer_norm_op.register_fake
def _(x, delta, weight, bias, eps):
    return x.new_empty((2, *x.shape))


def add_layer_norm(x: torch.Tensor, delta: torch.Tensor, norm: torch.nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))`` for ``[rows, N]`` activations, in one kernel on GPUs."""
    # The kernel reads weight and bias as contiguous [N] rows: other layouts (a parameter assigned a strided view)
    # take the reference, which gave other values than the kernel's.
    # The kernel's sum is rounded to x's dtype: a delta of another dtype (x + delta promotes) takes the reference.
    fusable = (use_triton(x) and x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.stride(-1) == 1
               and delta.stride(-1) == 1 and delta.shape == x.shape and delta.dtype == x.dtype
               and norm.weight is not None and norm.bias is not None
               and norm.weight.shape == norm.bias.shape == x.shape[1:] and norm.weight.is_contiguous()
               and norm.bias.is_contiguous() and not records_grad(x, delta, norm.weight, norm.bias))
    if not fusable:
        return add_layer_norm_reference(x, delta, norm)
    args = (x, delta, norm.weight, norm.bias, float(norm.eps))
    out = eager_or_op(add_layer_norm_op, add_layer_norm_launch)(*args)
    return out[0], out[1]


# ---------------------------------------------------------------- position embedding
def add_position_embedding_reference(x: torch.Tensor, table: torch.Tensor, indices: torch.Tensor,
                                     weights: torch.Tensor) -> torch.Tensor:
    """``x`` ``[R, hidden]`` plus the bilinear blend of ``table``'s rows: ``indices``/``weights`` ``[4, R]`` (int64,
    float32). The products and their sum are float32 (the weights are, as in transformers); the blend is rounded to
    ``x``'s dtype before the add."""
    pos = (F.embedding(indices, table) * weights[:, :, None]).sum(0)
    return x + pos.to(x.dtype)


@launches_on_tensor_device
def add_position_embedding_launch(x: torch.Tensor, table: torch.Tensor, indices: torch.Tensor,
                                  weights: torch.Tensor) -> torch.Tensor:
    """The Triton path: one program per row; returns a new ``[R, hidden]``. Floating-point contraction is off, so
    each product is rounded before it is added, as in the unfused multiply and sum."""
    from hwgraph.models.qwen3_omni.fused_kernels import add_position_embedding_kernel

    rows, width = x.shape
    out = torch.empty((rows, width), device=x.device, dtype=x.dtype)
    if rows:
        add_position_embedding_kernel[(rows,)](x, table, indices, weights, out, x.stride(0), table.stride(0),
                                               indices.stride(0), weights.stride(0), N=width,
                                               CORNERS=indices.shape[0], BLOCK=next_pow2(width),
                                               enable_fp_fusion=False)
    return out


@torch.library.custom_op("hwgraph::add_position_embedding", mutates_args=())
def add_position_embedding_op(x: torch.Tensor, table: torch.Tensor, indices: torch.Tensor,
                              weights: torch.Tensor) -> torch.Tensor:
    return add_position_embedding_launch(x, table, indices, weights)


@add_position_embedding_op.register_fake
def _(x, table, indices, weights):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def add_position_embedding(x: torch.Tensor, table: torch.Tensor, indices: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:
    """``add_position_embedding_reference``, in one kernel on GPUs."""
    fusable = (use_triton(x) and x.dtype in KERNEL_DTYPES and table.dtype in KERNEL_DTYPES and x.dim() == 2
               and table.dim() == 2 and x.stride(-1) == 1 and table.stride(-1) == 1
               and table.shape[1] == x.shape[1] and indices.dtype == torch.int64 and weights.dtype == torch.float32
               and indices.dim() == 2 and indices.shape == weights.shape and indices.shape[1] == x.shape[0]
               and indices.stride(-1) == 1 and weights.stride(-1) == 1 and not records_grad(x, table, weights))
    if not fusable:
        return add_position_embedding_reference(x, table, indices, weights)
    return eager_or_op(add_position_embedding_op, add_position_embedding_launch)(x, table, indices, weights)


# ---------------------------------------------------------------- fc1 + tanh-GELU
def linear_gelu_tanh(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """``gelu(linear(x), approximate="tanh")``; on CUDA the GELU runs as the matmul's epilogue
    (``products.aten_linear_gelu_tanh``), or as the active product chooser runs it (``hwgraph.products``); the
    unfused pair while autograd records (``records_grad``)."""
    if records_grad(x, linear.weight, linear.bias):
        return F.gelu(F.linear(x, linear.weight, linear.bias), approximate="tanh")
    return products.linear_gelu_tanh(x, linear.weight, linear.bias)
