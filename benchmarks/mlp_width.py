"""The block's matmuls with cold and warm weights, and the MLP with its hidden width padded from 4304 to 4352.

Usage: python benchmarks/mlp_width.py [--rows 196 1024 4096]
Device time of one call (20 calls in one CUDA graph). "warm": the same weights every call, so they sit in the L2
cache after the first (what ``gemm_tiles.py`` times); "cold": each call reads another of 8 copies (8 x 10 MB is
more than the 50 MB L2), as a replayed tower reads every weight once. "4352": fc1 with 48 zero output features and
fc2 with 48 zero input features appended (17 x 256 wide): the block's output is unchanged (tanh-GELU(0) = 0).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from hwgraph.timing import graphed_ms

HIDDEN, MLP, COPIES = 1152, 4304, 8


def shapes(width):
    """name -> (in features, out features, gelu epilogue)"""
    return {"qkv": (HIDDEN, 3 * HIDDEN, False), "proj": (HIDDEN, HIDDEN, False), f"fc1 {width}": (HIDDEN, width, True),
            f"fc2 {width}": (width, HIDDEN, False)}


def call(x, w, b, gelu):
    return torch._addmm_activation(b, x, w.t(), use_gelu=True) if gelu else F.linear(x, w, b)


def cold_ms(fn, x, ws, b, gelu):
    """Ms of one ``fn(x, w, b, gelu)``, the 20 captured calls taking the weight copies ``ws`` in turn."""
    cycle = itertools.cycle(ws)
    return graphed_ms(lambda: fn(x, next(cycle), b, gelu))


def time_matmul(rows, k, n, gelu):
    """(warm, cold) ms of one call."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return graphed_ms(lambda: call(x, ws[0], b, gelu)), cold_ms(call, x, ws, b, gelu)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[196, 1024, 4096])
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for rows, width in itertools.product(args.rows, (MLP, 4352)):
        for name, (k, n, gelu) in shapes(width).items():
            if width != MLP and name in ("qkv", "proj"):
                continue
            warm, cold = time_matmul(rows, k, n, gelu)
            flop = 2 * rows * k * n
            print(f"rows {rows:5d} {name:9s} K={k} N={n}: warm {warm * 1e3:7.1f} us, cold {cold * 1e3:7.1f} us "
                  f"({flop / cold / 1e9:.0f} TFLOP/s, {n * k * 2 / cold / 1e9:.2f} TB/s of weights)", flush=True)


if __name__ == "__main__":
    main()
