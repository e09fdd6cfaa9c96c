"""The fused rotary kernel (``hwgraph.models.qwen3_omni.fused.rotary_qk_launch``) at the tower's shapes: device time
per call and effective bandwidth, against the unfused torch computation.

Usage: python benchmarks/rotary.py [--warps]
``--warps``: the kernel with 1, 2, 4, 8 and 16 warps per program (bit-identical results).
Each cell: 20 calls captured in one CUDA graph, replayed, divided by 20 (``hwgraph.timing.graphed_ms``), for q and k
of 16 heads of 72 in bf16 out of the qkv matmul's ``[T, 3, H, D]`` view, ``cos``/``sin`` ``[T, 72]`` float32. Bytes:
q and k read and written once, ``cos`` and ``sin`` read once. ``max ulp``: the largest difference from the torch
computation in units of bf16's last place, over values of magnitude 1e-3 or more (the kernel may fuse a multiply and
an add, torch rounds each); ``max abs diff`` over all values.
Session 9 measured 1, 2, 4 and 8 tokens per program (``rotary-tokens-per-program.log``): one was best or within
4% at 256 to 16384 tokens, and the kernel takes one.
"""

from __future__ import annotations

import sys

import torch

from hwgraph.models.qwen3_omni import fused
from hwgraph.timing import graphed_ms

HEADS, DIM = 16, 72


def max_ulp(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest difference in bf16 ulps of the torch value, over values of magnitude 1e-3 or more; largest absolute
    difference over all values). Near zero an ulp is meaningless: cancellation leaves a rounding residue there."""
    got, want = got.float(), want.float()
    diff = (got - want).abs()
    big = want.abs() >= 1e-3
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-3)))) * torch.finfo(torch.bfloat16).eps
    return (diff[big] / ulp[big]).max().item(), diff.max().item()


def rotary_inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``qkv`` ``[T, 3, H, D]`` (a view of the qkv matmul's rows, bf16) and ``cos``, ``sin`` ``[T, D]``
    float32 with the rotation's sign in ``sin``, as the tower passes them."""
    qkv = torch.randn(tokens, 3 * HEADS * DIM, device="cuda", dtype=torch.bfloat16).view(tokens, 3, HEADS, DIM)
    angles = torch.randn(tokens, DIM // 2, device="cuda")
    return qkv, torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)


def warps_sweep():
    for tokens in (256, 1024, 4096):
        qkv, cos, sin = rotary_inputs(tokens)
        want = fused.rotary_qk_launch(qkv, cos, sin)
        cells = []
        for warps in (1, 2, 4, 8, 16):
            same = torch.equal(fused.rotary_qk_launch(qkv, cos, sin, num_warps=warps), want)
            ms = graphed_ms(lambda q=qkv, c=cos, s=sin, w=warps: fused.rotary_qk_launch(q, c, s, num_warps=w))
            cells.append(f"{warps} warps {ms * 1000:.1f} us{'' if same else ' (DIFFERS)'}")
        print(f"{tokens} tokens: " + " | ".join(cells), flush=True)


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if "--warps" in sys.argv:
        return warps_sweep()
    for tokens in (256, 1024, 4096, 16384):
        qkv, cos, sin = rotary_inputs(tokens)
        want = fused.rotary_qk_reference(qkv, cos, sin)
        got = fused.rotary_qk_launch(qkv, cos, sin)
        ulps, absolute = (max(x) for x in zip(*(max_ulp(g, w) for g, w in zip(got, want, strict=True)), strict=True))
        moved = 2 * 2 * tokens * HEADS * DIM * 2 + 2 * cos.numel() * 4
        torch_ms = graphed_ms(lambda q=qkv, c=cos, s=sin: fused.rotary_qk_reference(q, c, s))
        ms = graphed_ms(lambda q=qkv, c=cos, s=sin: fused.rotary_qk_launch(q, c, s))
        print(f"{tokens} tokens: torch {torch_ms * 1000:.1f} us | kernel {ms * 1000:.1f} us "
              f"{moved / ms / 1e9:.2f} TB/s, max ulp {ulps:.1f}, max abs diff {absolute:.1e}", flush=True)


if __name__ == "__main__":
    main()
