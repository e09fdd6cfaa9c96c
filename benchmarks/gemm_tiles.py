"""The tower's matmuls at small row counts: cuBLAS (what F.linear runs) against our Triton linear kernel.

Usage: python benchmarks/gemm_tiles.py [--rows 196 1024 4096]
For each of the block's four matmuls (qkv, proj, fc1 + tanh-GELU, fc2) and the mergers' two, device time (20
calls in one CUDA graph, CUDA events, median of 10 replays) of cuBLAS and of each Triton tile configuration, with
its error against a float32 matmul.

Measured on the H200 (docs/reports/h200/gemm_tiles.log): cuBLAS won every shape but one (the merger's second
matmul at 49 rows, 7.8 against 8.5 us), so the tower keeps F.linear and this kernel lives only here.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hwgraph.timing import graphed_ms


@triton.jit
def gelu_tanh(x):
    """GELU, tanh approximation, in float32: tanh(y) written as 1 - 2 / (exp(2y) + 1)."""
    y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    y = tl.minimum(tl.maximum(y, -20.0), 20.0)  # tanh is +-1 in float32 there; keeps exp finite
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def linear_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, stride_split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """``out = x @ w.T (+ bias) (then tanh-GELU)`` for ``x`` ``[M, K]``, ``w`` ``[N, K]``, accumulated in float32.

    Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``. With ``SPLIT_K > 1`` each program sums one slice of K
    and writes float32 partials to ``out`` laid out ``[SPLIT_K, M, N]`` (``stride_split`` apart);
    ``split_k_reduce_kernel`` adds them in a fixed order, so results are deterministic."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_span
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_span, K), BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(x_rows + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = gelu_tanh(acc)
        tl.store(out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=mask)
    else:
        dst = out + pid_k * stride_split + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(dst, acc, mask=mask)


@triton.jit
def split_k_reduce_kernel(partials, bias, out, M, N, stride_split, stride_om,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """``out[m, n] = sum_s partials[s, m, n] (+ bias[n]) (then tanh-GELU)``, summed in order s = 0, 1, ..."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partials + s * stride_split + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        acc = gelu_tanh(acc)
    tl.store(out + (offs // N).to(tl.int64) * stride_om + n, acc.to(out.dtype.element_ty), mask=mask)


def linear_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool,
                  tiles: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """``x @ weight.T + bias`` (then tanh-GELU when ``gelu``) with our Triton kernel; ``tiles`` is
    ``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)``."""
    rows, inner = x.shape
    cols = weight.shape[0]
    block_m, block_n, block_k, split_k, warps, stages = tiles
    out = torch.empty((rows, cols), device=x.device, dtype=x.dtype)
    if rows == 0:
        return out
    grid = (triton_cdiv(cols, block_n), triton_cdiv(rows, block_m), split_k)
    has_bias = bias is not None
    if split_k == 1:
        linear_kernel[grid](x, weight, bias if has_bias else x, out, rows, cols, inner, x.stride(0), weight.stride(0),
                            out.stride(0), 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1,
                            HAS_BIAS=has_bias, GELU=gelu, num_warps=warps, num_stages=stages)
        return out
    partials = torch.empty((split_k, rows, cols), device=x.device, dtype=torch.float32)
    linear_kernel[grid](x, weight, x, partials, rows, cols, inner, x.stride(0), weight.stride(0), cols, rows * cols,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, HAS_BIAS=False,
                        GELU=False, num_warps=warps, num_stages=stages)
    block = 1024
    split_k_reduce_kernel[(triton_cdiv(rows * cols, block),)](
        partials, bias if has_bias else x, out, rows, cols, rows * cols, out.stride(0), SPLIT_K=split_k, BLOCK=block,
        HAS_BIAS=has_bias, GELU=gelu, num_warps=4)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


SHAPES = {"qkv": (1152, 3456), "proj": (1152, 1152), "fc1": (1152, 4304), "fc2": (4304, 1152),
          "merger fc1": (4608, 4608), "merger fc2": (4608, 2048)}


def configs():
    yield from itertools.product((16, 64, 128), (32, 64, 128), (64, 128), (1, 2, 4), (4,), (3,))
    yield from ((128, 128, 64, 1, 8, 3), (64, 128, 64, 1, 4, 4), (128, 256, 64, 1, 8, 3), (256, 128, 64, 1, 8, 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[196, 1024, 4096])
    args = ap.parse_args()
    torch.manual_seed(0)
    for rows in args.rows:
        for name, (inner, cols) in SHAPES.items():
            if rows > 1024 and name.startswith("merger"):
                continue
            m = rows // 4 if name.startswith("merger") else rows
            x = torch.randn(m, inner, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(cols, inner, device="cuda", dtype=torch.bfloat16) * inner**-0.5
            b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
            gelu = name == "fc1"
            want = x.float() @ w.float().T + b.float()
            if gelu:
                want = F.gelu(want, approximate="tanh")
            if gelu:
                cublas = lambda x=x, w=w, b=b: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
            else:
                cublas = lambda x=x, w=w, b=b: F.linear(x, w, b)  # noqa: E731
            base = graphed_ms(cublas, warmup=3, samples=10) * 1e3  # µs
            results = []
            for tiles in configs():
                if tiles[3] > 1 and inner // tiles[3] < tiles[2]:
                    continue
                try:
                    got = linear_launch(x, w, b, gelu, tiles)
                    err = ((got.float() - want).norm() / want.norm()).item()
                    call = functools.partial(linear_launch, x, w, b, gelu, tiles)
                    results.append((graphed_ms(call, warmup=3, samples=10) * 1e3, tiles, err))
                except Exception as exc:  # out of shared memory for big tiles
                    results.append((float("inf"), tiles, repr(exc)[:60]))
            results.sort(key=lambda r: r[0])
            best = results[0]
            print(f"M={m:5d} {name:10s} K={inner} N={cols}: cuBLAS {base:7.1f} us | best Triton "
                  f"{best[0]:7.1f} us {best[1]} err {best[2]:.1e} | next "
                  + ", ".join(f"{r[0]:.1f} {r[1]}" for r in results[1:4]), flush=True)


if __name__ == "__main__":
    main()
