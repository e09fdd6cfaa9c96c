"""The fused residual add + LayerNorm kernel (``fused.add_layer_norm``) against variants with several rows per
program and without masked lanes, at the tower's width (1152).

Usage: python benchmarks/layer_norm.py [ROWS ...]   (default 1024 4096)
µs per call (``graphed_ms``: 20 calls in one CUDA graph), two ways: ``hot``, the same x and delta every call (they
stay in L2, as delta does after the product that wrote it in a replay), and ``cold``, eight sets of inputs in turn
(more than the L2 holds). Variants (``add_layer_norm_rows``): ``R`` rows per program, the row loaded as a
power-of-two part and a tail (1152 = 1024 + 128) instead of 2048 masked lanes, ``W`` warps. Outputs are compared
with the shipped kernel's (bit-identical sums, normalised rows within 1 bf16 ulp: the sums' order may differ).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from hwgraph.models.qwen3_omni.fused import add_layer_norm_launch
from hwgraph.timing import graphed_ms

WIDTH = 1152
EPS = 1e-6


@triton.jit
def add_layer_norm_rows(x, delta, weight, bias, out, stride_x, stride_d, plane, eps, rows,
                        N: tl.constexpr, HEAD: tl.constexpr, TAIL: tl.constexpr, ROWS: tl.constexpr):
    """``ROWS`` rows per program; each row as lanes ``0 .. HEAD`` and ``HEAD .. HEAD + TAIL`` (no masked lanes
    when ``N == HEAD + TAIL``)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    ok = r < rows
    h = tl.arange(0, HEAD)[None, :]
    t = HEAD + tl.arange(0, TAIL)[None, :]
    tm = ok & (t < N)
    a_h = tl.load(x + r * stride_x + h, mask=ok, other=0.0).to(tl.float32)
    d_h = tl.load(delta + r * stride_d + h, mask=ok, other=0.0).to(tl.float32)
    a_t = tl.load(x + r * stride_x + t, mask=tm, other=0.0).to(tl.float32)
    d_t = tl.load(delta + r * stride_d + t, mask=tm, other=0.0).to(tl.float32)
    s_h = (a_h + d_h).to(out.dtype.element_ty)
    s_t = (a_t + d_t).to(out.dtype.element_ty)
    tl.store(out + r * N + h, s_h, mask=ok)
    tl.store(out + r * N + t, s_t, mask=tm)
    v_h = s_h.to(tl.float32)
    v_t = tl.where(tm, s_t.to(tl.float32), 0.0)
    mean = (tl.sum(v_h, axis=1) + tl.sum(v_t, axis=1)) / N
    e_h = v_h - mean[:, None]
    e_t = tl.where(tm, v_t - mean[:, None], 0.0)
    var = (tl.sum(e_h * e_h, axis=1) + tl.sum(e_t * e_t, axis=1)) / N
    rstd = (1.0 / tl.sqrt(var + eps))[:, None]
    w_h = tl.load(weight + h).to(tl.float32)
    b_h = tl.load(bias + h).to(tl.float32)
    w_t = tl.load(weight + t, mask=t < N, other=0.0).to(tl.float32)
    b_t = tl.load(bias + t, mask=t < N, other=0.0).to(tl.float32)
    tl.store(out + plane + r * N + h, (e_h * rstd * w_h + b_h).to(out.dtype.element_ty), mask=ok)
    tl.store(out + plane + r * N + t, (e_t * rstd * w_t + b_t).to(out.dtype.element_ty), mask=tm)


def variant(rows_per_program: int, warps: int):
    def launch(x, delta, weight, bias, out):
        rows = x.shape[0]
        add_layer_norm_rows[(triton.cdiv(rows, rows_per_program),)](
            x, delta, weight, bias, out, x.stride(0), delta.stride(0), out.stride(0), EPS, rows,
            N=WIDTH, HEAD=1024, TAIL=128, ROWS=rows_per_program, num_warps=warps)
        return out
    return launch


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    weight = torch.randn(WIDTH, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(WIDTH, device=dev, dtype=torch.bfloat16)
    shipped = lambda x, d, w, b, out: add_layer_norm_launch(x, d, w, b, EPS, out)  # noqa: E731
    variants = {"shipped (1 row, 2048 lanes, 4 warps)": shipped}
    for r, w in ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (8, 8), (4, 4)):
        variants[f"{r} rows, 1024 + 128 lanes, {w} warps"] = variant(r, w)
    for rows in [int(a) for a in sys.argv[1:]] or [1024, 4096]:
        sets = [(torch.randn(rows, WIDTH, device=dev, dtype=torch.bfloat16),
                 torch.randn(rows, WIDTH, device=dev, dtype=torch.bfloat16),
                 torch.empty(2, rows, WIDTH, device=dev, dtype=torch.bfloat16)) for _ in range(8)]
        want = shipped(*sets[0][:2], weight, bias, torch.empty_like(sets[0][2]))
        for name, fn in variants.items():
            got = fn(*sets[0][:2], weight, bias, torch.empty_like(sets[0][2]))
            same_sums = torch.equal(got[0], want[0])
            norm_diff = (got[1].float() - want[1].float()).abs().max().item()
            hot = graphed_ms(lambda fn=fn, first=sets[0]: fn(*first[:2], weight, bias, first[2])) * 1e3

            def cold(fn=fn, sets=sets, turn=iter(range(1 << 30))):  # 24 captured calls: each set three times
                x, d, out = sets[next(turn) % len(sets)]
                return fn(x, d, weight, bias, out)
            cold_us = graphed_ms(cold, calls=24) * 1e3
            print(f"{rows} rows, {name}: hot {hot:.2f} µs, cold {cold_us:.2f} µs; sums equal {same_sums}, "
                  f"normalised max diff {norm_diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
