"""A split-K, weight-streaming Triton GEMM for the tower's matmuls at few rows, against cuBLAS.

Usage: python benchmarks/gemm_smallm.py [--rows 196] [--quick]
At 49 tokens (196 patch rows) a replay is GEMM-bound at about a quarter of the HBM bandwidth: cuBLAS's kernels
tile the 196 rows and the output features, which leaves most of the 132 SMs idle for the 1152-wide outputs (proj,
fc2). This kernel swaps the operands (out^T = W x^T: the weight's rows fill the tensor cores' M side, all the rows
of x their N side) and splits K across programs so that every SM streams its own slice of the weight through TMA;
a second kernel (``gemm_tiles.py``'s ``split_k_reduce_kernel``) sums the float32 partials in order and adds the
bias (and the tanh-GELU for fc1). Each cell is the device time of one call (20 calls in one CUDA graph) with cold
weights (``mlp_width.cold_ms``: each call reads another of 8 copies, as a replay reads every weight once), and the
error against a float32 matmul.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemm_tiles import split_k_reduce_kernel
from mlp_width import COPIES, HIDDEN, MLP, call, cold_ms
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qkv": (HIDDEN, 3 * HIDDEN, False), "proj": (HIDDEN, HIDDEN, False), "fc1": (HIDDEN, MLP, True),
          "fc2": (MLP, HIDDEN, False)}


@triton.jit
def partial_kernel(w_desc, x_desc, ws, M, N, k_per_split,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """ws[split, m, n] = sum over this split's K slice of x[m, k] w[n, k]; TMA zero-fills past M, N and K."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_lo = split * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(k_lo, k_lo + k_per_split, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k])
        x = x_desc.load([0, k])
        acc = tl.dot(w, tl.trans(x), acc)
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    ptrs = ws + split * M * N + rm[None, :] * N + rn[:, None]
    tl.store(ptrs, acc, mask=(rn < N)[:, None] & (rm < M)[None, :])


def splitk_linear(x, w, b, gelu, cfg):
    block_n, block_k, splits, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    ws = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k])
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k])
    partial_kernel[(triton.cdiv(n, block_n), splits)](w_desc, x_desc, ws, m, n, k_per_split, BLOCK_N=block_n,
                                                       BLOCK_M=block_m, BLOCK_K=block_k, STAGES=stages,
                                                       num_warps=warps)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    split_k_reduce_kernel[(triton.cdiv(m * n, 1024),)](ws, b, out, m, n, m * n, out.stride(0), SPLIT_K=splits,
                                                       BLOCK=1024, HAS_BIAS=True, GELU=gelu, num_warps=4)
    return out


def reference(x, w, b, gelu):
    y = F.linear(x.float(), w.float(), b.float())
    return F.gelu(y, approximate="tanh") if gelu else y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[196])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    # (BLOCK_N, BLOCK_K, splits, stages, warps)
    configs = [(64, 64, s, st, 4) for s in (2, 4, 6, 8) for st in (3, 4)] + \
              [(128, 64, s, 3, 8) for s in (2, 4, 8)] + [(64, 128, s, 2, 4) for s in (2, 4, 8)]
    if args.quick:
        configs = [(64, 64, s, 4, 4) for s in (2, 4, 8)]
    for rows in args.rows:
        for name, (k, n, gelu) in SHAPES.items():
            torch.manual_seed(0)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(COPIES)]
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            want = reference(x, ws[0], b, gelu)

            def cold(fn, x=x, ws=ws, b=b, gelu=gelu):
                return cold_ms(fn, x, ws, b, gelu) * 1e3

            base = cold(call)
            results = []
            for cfg in configs:
                try:
                    got = splitk_linear(x, ws[0], b, gelu, cfg).float()
                    err = ((got - want).norm() / want.norm()).item()
                    results.append((cold(lambda x_, w_, b_, g_, c=cfg: splitk_linear(x_, w_, b_, g_, c)), cfg, err))
                except Exception as exc:  # a config that fails to build is reported, not fatal
                    print(f"  {name} {cfg}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            results.sort()
            best = ", ".join(f"{t:.1f} {c} err {e:.1e}" for t, c, e in results[:4])
            print(f"M={rows} {name:4s} K={k} N={n}: cuBLAS {base:.1f} us | split-K best {best}", flush=True)


if __name__ == "__main__":
    main()
