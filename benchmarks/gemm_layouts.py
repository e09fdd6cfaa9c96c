"""The block MLP's products in other layouts: is fc1 faster computed transposed (4304 x rows), where cuBLAS tiles
the 4304 features as rows instead of columns (fc1's 144x192 tiles leave 5.05 waves of the 132 SMs)?

Usage: CUBLASLT_WORKSPACE_SIZE=0 python benchmarks/gemm_layouts.py [--rows N ...]
(the CUDA plugin captures without a cuBLASLt workspace; set it for the whole process to time what graphs run).
µs per call (20 calls in one CUDA graph), bf16, cuBLAS through torch, relative error against float32:
- ``fc1 tower``: ``torch._addmm_activation(b1, x, w1.t(), use_gelu=True)``, what the tower runs;
- ``fc1 K+8``: the same with the bias as an input feature (x gets a ones column and 7 zero columns, w1 the bias and
  7 zero columns; K = 1160) and a zero bias through the epilogue;
- ``fc1^T K+8``: the transposed product, ``w1e @ xe.t()`` with GELU, ``[4304, rows]``: cuBLASLt's bias epilogue
  adds along the output's columns only, so the bias rides in K as above;
- ``fc1^T no bias``: the transposed product without the bias column (its rate at K = 1152);
- ``fc2 tower`` and ``fc2 from fc1^T``: ``F.linear(h, w2, b2)`` with h row-major, and with h the transpose of a
  ``[4304, rows]`` tensor (what fc2 would read after a transposed fc1).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hwgraph.timing import graphed_ms

HIDDEN, MLP, PAD = 1152, 4304, 8


def with_bias_column(x: torch.Tensor, bias_value: torch.Tensor | float) -> torch.Tensor:
    """``x`` ``[n, HIDDEN]`` -> ``[n, HIDDEN + PAD]``: column HIDDEN holds ``bias_value``, the rest zeros."""
    out = torch.zeros(x.shape[0], HIDDEN + PAD, device=x.device, dtype=x.dtype)
    out[:, :HIDDEN] = x
    out[:, HIDDEN] = bias_value
    return out


def main():
    rows_list = [int(sys.argv[i + 1]) for i, a in enumerate(sys.argv) if a == "--rows"] or [4096, 1024, 256]
    torch.manual_seed(0)
    w1 = torch.randn(MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    b1 = torch.randn(MLP, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(HIDDEN, MLP, device="cuda", dtype=torch.bfloat16) * MLP**-0.5
    b2 = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    w1e = with_bias_column(w1, b1)
    zero_mlp = torch.zeros(MLP, device="cuda", dtype=torch.bfloat16)
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        xe = with_bias_column(x, 1.0)
        zero_rows = torch.zeros(rows, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, MLP, device="cuda", dtype=torch.bfloat16)
        h_t = h.t().contiguous()
        flop = 2 * rows * HIDDEN * MLP
        ref1 = F.gelu(F.linear(x.float(), w1.float(), b1.float()), approximate="tanh")
        ref2 = F.linear(h.float(), w2.float(), b2.float())
        cases = {
            "fc1 tower": (lambda x=x: torch._addmm_activation(b1, x, w1.t(), use_gelu=True), ref1),
            "fc1 K+8": (lambda xe=xe: torch._addmm_activation(zero_mlp, xe, w1e.t(), use_gelu=True), ref1),
            "fc1^T K+8": (lambda xe=xe, z=zero_rows: torch._addmm_activation(z, w1e, xe.t(), use_gelu=True),
                          ref1.t()),
            "fc1^T no bias": (lambda x=x, z=zero_rows: torch._addmm_activation(z, w1, x.t(), use_gelu=True), None),
            "fc2 tower": (lambda h=h: F.linear(h, w2, b2), ref2),
            "fc2 from fc1^T": (lambda h_t=h_t: F.linear(h_t.t(), w2, b2), ref2),
        }
        for name, (fn, ref) in cases.items():
            us = graphed_ms(fn) * 1e3
            err = "" if ref is None else f" err {((fn().float() - ref).norm() / ref.norm()).item():.1e}"
            print(f"{rows} rows, {name}: {us:.1f} us {flop / us / 1e6:.0f} TFLOP/s{err}", flush=True)


if __name__ == "__main__":
    main()
