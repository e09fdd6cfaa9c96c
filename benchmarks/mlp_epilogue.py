"""The tower's fc1 (1152 -> 4304, bias, tanh-GELU) at the 1024-token image's 4096 rows: what its GELU epilogue costs.

Usage: python benchmarks/mlp_epilogue.py [--rows N ...]
µs per call (20 calls in one CUDA graph), bf16, cuBLAS through torch:
- ``gelu epilogue``: ``torch._addmm_activation(..., use_gelu=True)``, what the tower runs (cuBLASLt's GELU+bias
  epilogue);
- ``bias only``: ``F.linear`` (bias epilogue), the same product without GELU;
- ``bias, then GELU``: ``F.linear`` and ``F.gelu(approximate="tanh")`` as two kernels;
- ``fc2``: the block's other MLP product (4304 -> 1152), for its rate.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hwgraph.timing import graphed_ms

HIDDEN, MLP = 1152, 4304


def main():
    rows_list = [int(sys.argv[i + 1]) for i, a in enumerate(sys.argv) if a == "--rows"] or [4096, 1024]
    torch.manual_seed(0)
    w1 = torch.randn(MLP, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5
    b1 = torch.randn(MLP, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(HIDDEN, MLP, device="cuda", dtype=torch.bfloat16) * MLP**-0.5
    b2 = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    for rows in rows_list:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, MLP, device="cuda", dtype=torch.bfloat16)
        flop = 2 * rows * HIDDEN * MLP
        ref = F.gelu(F.linear(x.float(), w1.float(), b1.float()), approximate="tanh")
        cases = {
            "gelu epilogue": lambda x=x: torch._addmm_activation(b1, x, w1.t(), use_gelu=True),
            "bias only": lambda x=x: F.linear(x, w1, b1),
            "bias, then GELU": lambda x=x: F.gelu(F.linear(x, w1, b1), approximate="tanh"),
            "fc2": lambda h=h: F.linear(h, w2, b2),
        }
        for name, fn in cases.items():
            us = graphed_ms(fn) * 1e3
            err = ""
            if name != "bias only" and name != "fc2":
                err = f" err {((fn().float() - ref).norm() / ref.norm()).item():.1e}"
            print(f"{rows} rows, {name}: {us:.1f} us {flop / us / 1e6:.0f} TFLOP/s{err}", flush=True)


if __name__ == "__main__":
    main()
