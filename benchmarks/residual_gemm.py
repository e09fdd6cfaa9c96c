"""The residual adds inside the matrix products (cuBLAS beta = 1), the biases deferred into the LayerNorm kernels.

Usage: python benchmarks/residual_gemm.py [--rows N ...]   (default 4096 and 1024)
A block now writes each residual sum twice over: proj (or fc2) writes ``delta = a W + b``, then the add + LayerNorm
kernel reads ``x`` and ``delta`` and writes ``x + delta`` and its LayerNorm (two planes read, two written). With the
product accumulating into the residual in place (``x.addmm_(a, W.t())``: cuBLAS's ``C = A B + C``), the bias left
for the LayerNorm kernel to add as a vector:
- after proj, ``LN(x + b_proj)`` is written and the sum is not (one plane read, one written; the sum stays in ``x``
  without its bias);
- after fc2, ``x + b_proj + b_fc2`` is written back into ``x`` with the next block's LayerNorm (one read, two
  written).
Rounding moves: ``x + a W`` is rounded before the bias is added, where the tower rounds ``a W + b`` and then the sum.

Prints µs per call (20 calls in one CUDA graph) of the block's products and LayerNorm kernels both ways, per row
count: ``shipped`` (``F.linear`` with its bias epilogue, ``fused.add_layer_norm_launch``) against ``in place``
(``addmm_``, ``offset_layer_norm``), and their sums per block. ``block_forward_in_place`` is the same block for
whole replays (``replay_toggle.py residual-in-gemm``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hwgraph.models.qwen3_omni.fused import linear_gelu_tanh, next_pow2, rotary_qk
from hwgraph.models.qwen3_omni.fused_kernels import layer_norm_row
from hwgraph.timing import graphed_ms

HIDDEN, MLP, HEADS = 1152, 4304, 16


@triton.jit
def offset_layer_norm_kernel(x, offset, weight, bias, out, stride_x, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                             WRITE_SUM: tl.constexpr):
    """One program per row: ``total = x + offset`` (``offset`` one vector for every row), rounded to the activation
    dtype; with ``WRITE_SUM`` written back over ``x``; its LayerNorm written to ``out``."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(x + r * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    o = tl.load(offset + offs, mask=m, other=0.0).to(tl.float32)
    total = (a + o).to(out.dtype.element_ty)
    if WRITE_SUM:
        tl.store(x + r * stride_x + offs, total, mask=m)
    normed = layer_norm_row(total.to(tl.float32), m, offs, weight, bias, eps, N)
    tl.store(out + r * N + offs, normed.to(out.dtype.element_ty), mask=m)


def offset_layer_norm(x: torch.Tensor, offset: torch.Tensor, norm: torch.nn.LayerNorm, write_sum: bool) -> torch.Tensor:
    """LayerNorm of ``x + offset``; with ``write_sum`` the sum also replaces ``x``."""
    rows, width = x.shape
    out = torch.empty_like(x)
    offset_layer_norm_kernel[(rows,)](x, offset, norm.weight, norm.bias, out, x.stride(0), norm.eps, N=width,
                                      BLOCK=next_pow2(width), WRITE_SUM=write_sum, num_warps=4)
    return out


def block_forward_in_place(self, x, normed, next_norm, cos, sin, cu_seqlens, max_seqlen, attend):
    """``VisionBlock.forward_fused`` with both residual adds in the products (``x`` is updated in place). The block's
    two biases are summed once, at its first call, and kept on the block: its weights must not change after."""
    attn, mlp = self.attn, self.mlp
    offset = getattr(self, "_residual_offset", None)
    if offset is None:
        offset = self._residual_offset = attn.proj.bias + mlp.linear_fc2.bias
    tokens = x.shape[0]
    qkv = F.linear(normed, attn.qkv.weight, attn.qkv.bias).view(tokens, 3, attn.num_heads, attn.head_dim)
    q, k = rotary_qk(qkv, cos, sin)
    out = attend(q, k, qkv[:, 2], cu_seqlens, max_seqlen, attn.scale)
    x.addmm_(out.reshape(tokens, -1), attn.proj.weight.t())
    normed = offset_layer_norm(x, attn.proj.bias, self.norm2, write_sum=False)
    x.addmm_(linear_gelu_tanh(normed, mlp.linear_fc1), mlp.linear_fc2.weight.t())
    if next_norm is None:
        return x.add_(offset), None
    return x, offset_layer_norm(x, offset, next_norm, write_sum=True)


def time_rows(rows: int, wp, bp, w2, b2, norm) -> None:
    from hwgraph.models.qwen3_omni.fused import add_layer_norm_launch

    dev, dt = wp.device, wp.dtype
    a = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
    h = torch.randn(rows, MLP, device=dev, dtype=dt)
    x = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
    delta = torch.randn(rows, HIDDEN, device=dev, dtype=dt)
    # Errors of one residual update against float32: x + a W + b.
    want = x.float() + a.float() @ wp.float().t() + bp.float()
    got = {"shipped": x + F.linear(a, wp, bp), "in place": x.clone().addmm_(a, wp.t()).float() + bp.float()}
    err = {k: ((v.float() - want).norm() / want.norm()).item() for k, v in got.items()}
    cases = {
        "proj, bias epilogue": lambda: F.linear(a, wp, bp),
        "proj, addmm_ into x": lambda: x.addmm_(a, wp.t()),
        "fc2, bias epilogue": lambda: F.linear(h, w2, b2),
        "fc2, addmm_ into x": lambda: x.addmm_(h, w2.t()),
        "add + LayerNorm (2 read, 2 written)": lambda: add_layer_norm_launch(x, delta, norm.weight, norm.bias,
                                                                             norm.eps),
        "LayerNorm of x + bias (1 read, 1 written)": lambda: offset_layer_norm(x, bp, norm, write_sum=False),
        "x += bias, LayerNorm (1 read, 2 written)": lambda: offset_layer_norm(x, bp, norm, write_sum=True),
    }
    us = {}
    for name, fn in cases.items():
        x.normal_()  # addmm_ accumulates into x across calls; start each case from unit values
        us[name] = graphed_ms(fn) * 1e3
        print(f"{rows} rows, {name}: {us[name]:.1f} us", flush=True)
    t = list(us.values())
    print(f"{rows} rows, per block: shipped {t[0] + t[2] + 2 * t[4]:.1f} us, in place {t[1] + t[3] + t[5] + t[6]:.1f} "
          f"us; relative error of one update against float32: shipped {err['shipped']:.2e}, in place "
          f"{err['in place']:.2e}", flush=True)


def main():
    rows_list = [int(sys.argv[i + 1]) for i, a in enumerate(sys.argv) if a == "--rows"] or [4096, 1024]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    wp = torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dt) * HIDDEN**-0.5
    bp = torch.randn(HIDDEN, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(HIDDEN, MLP, device=dev, dtype=dt) * MLP**-0.5
    b2 = torch.randn(HIDDEN, device=dev, dtype=dt) * 0.02
    norm = torch.nn.LayerNorm(HIDDEN, eps=1e-6, device=dev, dtype=dt)
    for rows in rows_list:
        time_rows(rows, wp, bp, w2, b2, norm)


if __name__ == "__main__":
    main()
