"""proj and fc2 at small row counts as one batched cuBLAS call over K slices (split-K), fp32 partials, against F.linear.

Usage: [CUBLASLT_WORKSPACE_SIZE=0] python benchmarks/splitk_bmm.py [--rows N ...]   (default 256 and 1024 rows)
At 256 rows (the 49-token graph's budget of 64 tokens) proj and fc2 have 1152 output features: few output tiles for
132 SMs, and fc2's K is 4304 long. Split-K runs S slices of K as one ``torch.bmm`` (``out_dtype=torch.float32``, so
the partials are not rounded), whose sum plus the bias the add + LayerNorm kernel that follows both products could
read instead of the product's bf16 output. A slice's first element must stay 16-byte aligned, so S divides K into
multiples of 8 (fc2's 4304 only into 2; its 4 slices of 1076 are timed too, marked ``unaligned``).

µs per call (20 calls in one CUDA graph; ``hwgraph.timing.graphed_ms``), bf16:
- ``linear``: ``F.linear`` with its bias, as the tower calls it;
- ``bmm S``: the S partials only (the sum and bias would be the LayerNorm kernel's);
- ``bmm S + sum``: with ``partials.sum(0) + bias`` rounded to bf16 in torch, an upper bound of a separate reduction.
``err``: relative L2 against the product in float64 (``relative_error``, in float32), of ``F.linear`` and of the
S-split sum rounded to bf16.
The CUDA plugin captures without a cuBLASLt workspace; run once with ``CUBLASLT_WORKSPACE_SIZE=0`` to time what graphs
run, and once without to see whether cuBLAS would choose differently with one.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from hwgraph.budget_capture import relative_error
from hwgraph.timing import graphed_ms

HIDDEN, MLP = 1152, 4304


def splits(k: int) -> list[int]:
    """Slice counts that divide K into slices of whole 8-byte groups (16-byte aligned where ``(K / S) % 8 == 0``)."""
    return [s for s in (2, 3, 4, 6, 8, 9, 12, 16) if k % s == 0 and (k // s) % 4 == 0]


def sliced(x: torch.Tensor, w: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` and w ``[N, K]`` as ``[S, M, K/S]`` and ``[S, K/S, N]`` views (no copies)."""
    m, k = x.shape
    n = w.shape[0]
    return x.view(m, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0)


def main():
    rows_list = [int(a) for a in sys.argv[sys.argv.index("--rows") + 1:]] if "--rows" in sys.argv else [256, 1024]
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, "CUBLASLT_WORKSPACE_SIZE =",
          os.environ.get("CUBLASLT_WORKSPACE_SIZE", "(unset)"), flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    for rows in rows_list:
        for name, k in (("proj", HIDDEN), ("fc2", MLP)):
            x = torch.randn(rows, k, device=dev, generator=gen).bfloat16()
            w = (torch.randn(HIDDEN, k, device=dev, generator=gen) * k ** -0.5).bfloat16()
            b = torch.randn(HIDDEN, device=dev, generator=gen).bfloat16()
            exact = x.double() @ w.double().t() + b.double()
            cells = [f"linear {graphed_ms(lambda x=x, w=w, b=b: F.linear(x, w, b)) * 1e3:.1f} "
                     f"(err {relative_error(F.linear(x, w, b), exact):.1e})"]
            for s in splits(k):
                xs, ws = sliced(x, w, s)
                partials = torch.bmm(xs, ws, out_dtype=torch.float32)
                got = (partials.sum(0) + b.float()).bfloat16()
                only = graphed_ms(lambda xs=xs, ws=ws: torch.bmm(xs, ws, out_dtype=torch.float32)) * 1e3
                both = graphed_ms(lambda xs=xs, ws=ws, b=b: (torch.bmm(xs, ws, out_dtype=torch.float32).sum(0)
                                                        + b.float()).bfloat16()) * 1e3
                aligned = "" if (k // s) % 8 == 0 else " unaligned"
                cells.append(f"bmm {s}{aligned} {only:.1f}, + sum {both:.1f} (err {relative_error(got, exact):.1e})")
            print(f"{rows} rows {name} (K {k}): " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
