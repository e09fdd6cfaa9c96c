"""The block's four matrix products: cuBLAS as the tower calls it against inductor's max-autotune choice.

Usage: python benchmarks/gemm_autotune.py [--rows N ...]
µs per call (20 calls in one CUDA graph), bf16, at the 1024-token image's 4096 rows (and 1024 by default):
- ``tower``: what the tower runs (``F.linear``; fc1 as ``torch._addmm_activation`` with cuBLASLt's GELU epilogue);
- ``inductor``: ``torch.compile(dynamic=False)`` of the same function, inductor's defaults (cuBLAS products);
- ``max-autotune``: ``torch.compile(mode="max-autotune-no-cudagraphs")`` with Triton's persistent TMA templates
  enabled: inductor times its Triton GEMM templates (bias and GELU fused in their epilogue) against cuBLAS and keeps
  the fastest. The compile time of each is printed; the relative L2 error is against ``tower``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from mlp_epilogue import HIDDEN, MLP  # benchmarks/, the script's directory

from hwgraph.timing import graphed_ms

PRODUCTS = {"qkv": (HIDDEN, 3 * HIDDEN, False), "proj": (HIDDEN, HIDDEN, False), "fc1+gelu": (HIDDEN, MLP, True),
            "fc2": (MLP, HIDDEN, False)}


def tower_fn(w, b, gelu):
    if gelu:
        return lambda x: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return lambda x: F.linear(x, w, b)


def plain_fn(w, b, gelu):
    if gelu:
        return lambda x: F.gelu(F.linear(x, w, b), approximate="tanh")
    return lambda x: F.linear(x, w, b)


def compiled(fn, x, autotune):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    patch = {"triton.enable_persistent_tma_matmul": True, "max_autotune_gemm_backends": "ATEN,TRITON"} \
        if autotune else {}
    with inductor_config.patch(patch):
        c = torch.compile(fn, dynamic=False, mode="max-autotune-no-cudagraphs" if autotune else None)
        t0 = time.perf_counter()
        c(x)
        torch.cuda.synchronize()
    return c, time.perf_counter() - t0


def main():
    rows_list = [int(sys.argv[i + 1]) for i, a in enumerate(sys.argv) if a == "--rows"] or [4096, 1024]
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    torch.manual_seed(0)
    for rows in rows_list:
        for name, (k, n, gelu) in PRODUCTS.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            flop = 2 * rows * k * n
            tower = tower_fn(w, b, gelu)
            want = tower(x).float()
            line = f"{rows} rows {name}:"
            t = graphed_ms(lambda tower=tower, x=x: tower(x)) * 1e3
            line += f" tower {t:.1f} µs ({flop / t / 1e6:.0f} TFLOP/s)"
            for label, autotune in (("inductor", False), ("max-autotune", True)):
                try:
                    fn, secs = compiled(plain_fn(w, b, gelu), x, autotune)
                    got = fn(x).float()
                    err = ((got - want).norm() / want.norm()).item()
                    ms = graphed_ms(lambda fn=fn, x=x: fn(x)) * 1e3
                    line += f" | {label} {ms:.1f} µs ({ms / t:.3f}x, compile {secs:.0f} s, err {err:.1e})"
                except Exception as exc:  # a compile failure is reported, not fatal
                    line += f" | {label} failed {type(exc).__name__}: {str(exc)[:200]}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
