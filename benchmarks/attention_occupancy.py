"""TRITON_ATTN's TMA kernel with tiles small enough for several programs per SM, at head_dim 72.

Usage: python benchmarks/attention_occupancy.py
The shipped 128x128 tiles (8 warps, 255 registers a thread, about 160 KB of shared memory with 3 stages) leave one
program per SM, whose two warpgroups run softmax and the tensor-core dots in the same phases, so neither overlaps
the other. Programs of one warpgroup with fewer stages (and a register cap, ``maxnreg``) fit two or three per SM,
whose phases the warp schedulers can interleave. Each row: ms per call (20 calls in one CUDA graph) for one
4096-patch image and for 1024 patches, registers, spills, shared memory, and the programs per SM those allow.
"""

from __future__ import annotations

import functools

import torch
import triton

from hwgraph.attention.triton_kernel import (
    LOG2_E,
    dot_dtype_for,
    head_descriptor,
    head_split,
    head_width,
    varlen_attention_tma_kernel,
)
from hwgraph.timing import graphed_ms

H, D = 16, 72
SM_REGISTERS, SM_SHARED = 65536, 232448


def launch(q, k, v, cu, max_seqlen, tiles, maxnreg, info):
    block_m, block_n, warps, stages = tiles
    d_a, d_b = head_split(D)
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_seqlen, block_m), H, cu.shape[0])
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    compiled = varlen_attention_tma_kernel[grid](
        q, head_descriptor(k, block_n, d_a), head_descriptor(k, block_n, max(d_b, 16)),
        head_descriptor(v, block_n, head_width(D)), out, cu, q.shape[0], cu.shape[0] - 1, D**-0.5 * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        D_A=d_a, D_B=max(d_b, 16), D_V=head_width(D), HAS_B=d_b > 0, DOT_DTYPE=dot_dtype_for(q.dtype),
        num_warps=warps, num_stages=stages, **extra)
    info.setdefault("kernel", compiled)
    return out


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    configs = [((128, 128, 8, 3), None), ((128, 128, 8, 2), None), ((64, 128, 4, 2), None), ((64, 128, 4, 3), None),
               ((64, 64, 4, 2), None), ((64, 64, 4, 3), None), ((64, 128, 4, 2), 168), ((64, 64, 4, 2), 168),
               ((64, 64, 4, 3), 128), ((64, 32, 4, 3), 128), ((128, 64, 8, 2), 128)]
    for n in (4096, 1024):
        torch.manual_seed(0)
        qkv = torch.randn(n, 3, H, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        gflop = 4 * n * n * H * D / 1e9
        want = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, False, False,
                                                       scale=D**-0.5)[0].float()
        print(f"1x{n} ({gflop:.1f} GFLOP)", flush=True)
        for tiles, maxnreg in configs:
            info = {}
            try:
                err = ((launch(q, k, v, cu, n, tiles, maxnreg, info).float() - want).norm() / want.norm()).item()
                ms = graphed_ms(functools.partial(launch, q, k, v, cu, n, tiles, maxnreg, info))
                kern = info["kernel"]
                regs, shared = kern.n_regs, kern.metadata.shared
                per_sm = min(SM_REGISTERS // (max(regs, 1) * 32 * tiles[2]), SM_SHARED // max(shared, 1))
                print(f"  {tiles} maxnreg {maxnreg}: {ms:.4f} ms {gflop / ms:.0f} TFLOP/s err {err:.1e} | {regs} "
                      f"registers, {kern.n_spills} spills, {shared} B shared, {per_sm} programs/SM", flush=True)
            except Exception as exc:  # a config that fails to build is reported, not fatal
                print(f"  {tiles} maxnreg {maxnreg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
