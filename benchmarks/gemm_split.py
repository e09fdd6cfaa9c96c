"""The block's products split in two cuBLAS calls that write one output: do the parts fill the 132 SMs' waves better
than the whole? (fc1 at 4096 rows runs 144x192 tiles, 667 of them: 5.05 waves, so its last wave keeps 7 SMs busy.)

Usage: CUBLASLT_WORKSPACE_SIZE=0 python benchmarks/gemm_split.py [--rows N ...]
(the CUDA plugin captures without a cuBLASLt workspace; set it for the whole process to time what graphs run).
µs per call (20 calls in one CUDA graph), bf16, cuBLAS through torch, each product as the tower calls it (fc1 through
``torch._addmm_activation``'s GELU epilogue, the others through ``F.linear``):
- ``whole``: one call;
- ``cols N``: output features ``[:N]`` and ``[N:]`` in two calls, each writing its column slice of one output through
  ``out=`` (leading dimension the full width);
- ``rows M``: rows ``[:M]`` and ``[M:]`` in two calls;
- ``... side``: the second call on a second stream, forked and joined inside the graph, so it can fill SMs that the
  first call's last wave leaves idle.
``same`` says whether the output equals the whole call's bit for bit.
"""

from __future__ import annotations

import sys

import torch

from hwgraph.timing import graphed_ms

HIDDEN, MLP, QKV = 1152, 4304, 3 * 1152


def product(x, w, b, gelu, out):
    if gelu:
        return torch._addmm_activation(b, x, w.t(), use_gelu=True, out=out)
    return torch.addmm(b, x, w.t(), out=out)


def split_call(x, w, b, gelu, out, cols=None, rows=None, side=None):
    """``out`` = the product, computed in two calls split at ``cols`` output features or ``rows`` rows; with ``side``
    the second call runs on that stream."""
    if cols is not None:
        parts = [(x, w[:cols], b[:cols], out[:, :cols]), (x, w[cols:], b[cols:], out[:, cols:])]
    else:
        parts = [(x[:rows], w, b, out[:rows]), (x[rows:], w, b, out[rows:])]
    if side is not None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            product(*parts[1][:3], gelu, parts[1][3])
        product(*parts[0][:3], gelu, parts[0][3])
        main.wait_stream(side)
    else:
        for p in parts:
            product(*p[:3], gelu, p[3])
    return out


def main():
    rows_list = [int(sys.argv[i + 1]) for i, a in enumerate(sys.argv) if a == "--rows"] or [4096, 1024]
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    shapes = {"qkv": (HIDDEN, QKV, False), "fc1": (HIDDEN, MLP, True), "fc2": (MLP, HIDDEN, False),
              "proj": (HIDDEN, HIDDEN, False)}
    col_splits = {"qkv": [3072, 3328, 3392], "fc1": [4096, 4160, 4224, 4288], "fc2": [1024, 1088], "proj": [1024]}
    for rows in rows_list:
        row_splits = [rows - 256, rows - 128, rows - 64] if rows > 512 else [rows // 2]
        for name, (k, n, gelu) in shapes.items():
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            whole = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(whole)
            flop = 2 * rows * k * n
            args = (x, w, b, gelu, out)
            cases = {"whole": lambda a=(x, w, b, gelu, whole): product(*a)}
            for c in col_splits[name]:
                cases[f"cols {c}"] = lambda c=c, a=args: split_call(*a, cols=c)
                cases[f"cols {c} side"] = lambda c=c, a=args: split_call(*a, cols=c, side=side)
            for r in row_splits:
                cases[f"rows {r}"] = lambda r=r, a=args: split_call(*a, rows=r)
                cases[f"rows {r} side"] = lambda r=r, a=args: split_call(*a, rows=r, side=side)
            for case, fn in cases.items():
                us = graphed_ms(fn) * 1e3
                fn()
                torch.cuda.synchronize()
                same = "" if case == "whole" else f" same={torch.equal(out, whole)}"
                print(f"{rows} rows, {name} {case}: {us:.1f} us {flop / us / 1e6:.0f} TFLOP/s{same}", flush=True)


if __name__ == "__main__":
    main()
