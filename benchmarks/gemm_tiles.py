"""The tower's matmuls at small row counts: cuBLAS (what F.linear runs) against our Triton linear kernel.

Usage: python benchmarks/gemm_tiles.py [--rows 196 1024 4096]
For each of the block's four matmuls (qkv, proj, fc1 + tanh-GELU, fc2) and the mergers' two, device time (20
calls in one CUDA graph, CUDA events, median of 10 replays) of cuBLAS and of each Triton tile configuration, with
its error against a float32 matmul. The best configuration per shape goes into ``fused.LINEAR_TILES``.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F

from hwgraph.models.qwen3_omni.fused import linear_launch
from hwgraph.timing import measure

SHAPES = {"qkv": (1152, 3456), "proj": (1152, 1152), "fc1": (1152, 4304), "fc2": (4304, 1152),
          "merger fc1": (4608, 4608), "merger fc2": (4608, 2048)}


def configs():
    yield from itertools.product((16, 64, 128), (32, 64, 128), (64, 128), (1, 2, 4), (4,), (3,))
    yield from ((128, 128, 64, 1, 8, 3), (64, 128, 64, 1, 4, 4), (128, 256, 64, 1, 8, 3), (256, 128, 64, 1, 8, 3))


def graphed_us(fn, calls: int = 20) -> float:
    """Device microseconds per call: ``calls`` calls captured in one CUDA graph, so host launch cost drops out."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return measure(graph.replay, "cuda", warmup=3, samples=10).median * 1e3 / calls


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
            base = graphed_us(cublas)
            results = []
            for tiles in configs():
                if tiles[3] > 1 and inner // tiles[3] < tiles[2]:
                    continue
                try:
                    got = linear_launch(x, w, b, gelu, tiles)
                    err = ((got.float() - want).norm() / want.norm()).item()
                    call = functools.partial(linear_launch, x, w, b, gelu, tiles)
                    results.append((graphed_us(call), tiles, err))
                except Exception as exc:  # out of shared memory for big tiles
                    results.append((float("inf"), tiles, repr(exc)[:60]))
            results.sort(key=lambda r: r[0])
            best = results[0]
            print(f"M={m:5d} {name:10s} K={inner} N={cols}: cuBLAS {base:7.1f} us | best Triton "
                  f"{best[0]:7.1f} us {best[1]} err {best[2]:.1e} | next "
                  + ", ".join(f"{r[0]:.1f} {r[1]}" for r in results[1:4]), flush=True)


if __name__ == "__main__":
    main()
