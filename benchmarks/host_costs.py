"""Host launch cost of the tower's operations, and device time of the varlen attention candidates (H200).

Usage: python benchmarks/host_costs.py
Part 1: microseconds of host time per call (200 calls enqueued back to back, no synchronisation inside) for each
operation of one block at 196 patch rows; the eager tower is bound by the sum of these.
Part 2: device time (CUDA events, median of 30 after 10 warm-ups) of the attention kernels ATen has for one
sequence, 16 heads of 72, bf16, at 196, 1024 and 4096 patches.
Part 3: host time of one eager forward and of one replay (enqueue only), against their latency.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from hwgraph.timing import measure


def host_us(fn, calls=200):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def part1():
    from hwgraph_cuda.attention import aten_flash, flash_varlen

    from hwgraph.attention.triton_attn import triton_varlen
    from hwgraph.attention.varlen_inputs import check_varlen_inputs, zero_padding_rows
    from hwgraph.hostmem import pinned_copy
    from hwgraph.models.qwen3_omni.fused import add_layer_norm_launch, rotary_qk_launch

    dev, dt = "cuda", torch.bfloat16
    rows, hidden, heads, hd = 196, 1152, 16, 72
    x = torch.randn(rows, hidden, device=dev, dtype=dt)
    lin = torch.nn.Linear(hidden, 3 * hidden, device=dev, dtype=dt)
    ln = torch.nn.LayerNorm(hidden, eps=1e-6, device=dev, dtype=dt)
    qkv = lin(x).view(rows, 3, heads, hd)
    cos = torch.randn(rows, hd, device=dev)
    sin = torch.randn(rows, hd, device=dev)
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    cu = torch.tensor([0, rows], device=dev, dtype=torch.int32)
    q4 = torch.randn(1024, heads, hd, device=dev, dtype=dt)
    cu4 = torch.tensor([0, 1024], device=dev, dtype=torch.int32)
    host_idx = torch.zeros(4, 784, dtype=torch.int64)
    w1 = torch.randn(4304, hidden, device=dev, dtype=dt)
    b1 = torch.randn(4304, device=dev, dtype=dt)
    cases = {
        "x + y": lambda: x + x,
        "F.linear (qkv)": lambda: F.linear(x, lin.weight, lin.bias),
        "nn.Linear module call (qkv)": lambda: lin(x),
        "torch._addmm_activation gelu (fc1)": lambda: torch._addmm_activation(b1, x, w1.t(), use_gelu=True),
        "F.layer_norm": lambda: F.layer_norm(x, (hidden,), ln.weight, ln.bias, 1e-6),
        "add + F.layer_norm": lambda: F.layer_norm(x + x, (hidden,), ln.weight, ln.bias, 1e-6),
        "add_layer_norm_launch (Triton)": lambda: add_layer_norm_launch(x, x, ln.weight, ln.bias, 1e-6),
        "rotary_qk_launch (Triton)": lambda: rotary_qk_launch(qkv, cos, sin),
        "aten_flash": lambda: aten_flash(q, k, v, cu, rows, hd**-0.5),
        "flash_varlen (checked, zeroed)": lambda: flash_varlen(q, k, v, cu, rows, hd**-0.5),
        "check_varlen_inputs": lambda: check_varlen_inputs("X", q, k, v, cu, rows, hd**-0.5),
        "zero_padding_rows": lambda: zero_padding_rows(q, cu),
        "triton_varlen (checked)": lambda: triton_varlen(q, k, v, cu, rows, hd**-0.5),
        "torch.empty": lambda: torch.empty((2, rows, hidden), device=dev, dtype=dt),
        "reshape non-contig": lambda: qkv[:, 2].reshape(rows, -1),
        "flash_varlen.padding_unspecified": lambda: flash_varlen.padding_unspecified(q, k, v, cu, rows, hd**-0.5),
        "aten_flash, 1024 rows": lambda: aten_flash(q4, q4, q4, cu4, 1024, hd**-0.5),
        "triton_varlen, 1024 rows": lambda: triton_varlen(q4, q4, q4, cu4, 1024, hd**-0.5),
        "host [4, 784] int64 .pin_memory()": lambda: host_idx.pin_memory(),
        "host [4, 784] int64 pinned_copy": lambda: pinned_copy(host_idx),
        "pinned_copy + .to(cuda, non_blocking)": lambda: pinned_copy(host_idx).to(dev, non_blocking=True),
    }
    print("host microseconds per call (196 rows, bf16):")
    for name, fn in cases.items():
        print(f"  {host_us(fn):7.1f}  {name}")


def attention_candidates(n: int, heads: int = 16, head_dim: int = 72):
    q, k, v = (torch.randn(n, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    scale = head_dim**-0.5
    dense = [t.transpose(0, 1)[None] for t in (q, k, v)]
    aten = torch.ops.aten
    cands = {
        "aten flash varlen": lambda: aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, False, return_debug_mask=False, scale=scale)[0],
        "aten efficient varlen": lambda: aten._efficient_attention_forward(
            q[None], k[None], v[None], None, cu, cu, n, n, 0.0, 0, False, scale=scale)[0][0],
        "aten cudnn varlen": lambda: aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, n, n, False, 0.0, False, False, scale=scale)[0],
        "aten cudnn dense [1,H,N,D]": lambda: aten._scaled_dot_product_cudnn_attention(
            *dense, None, False, 0.0, False, False, scale=scale)[0][0].transpose(0, 1),
    }
    ref = F.scaled_dot_product_attention(*(t.float().transpose(0, 1) for t in (q, k, v)), scale=scale).transpose(0, 1)
    return cands, ref


def part2():
    print("attention device ms (one sequence, 16 heads of 72, bf16):")
    for n in (196, 1024, 4096):
        cands, ref = attention_candidates(n)
        for name, fn in cands.items():
            try:
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                t = measure(fn, "cuda")
                print(f"  {n:5d} {name:28s} {t.median:7.3f} ms (p95 {t.p95:.3f}) rel err {err:.1e}")
            except Exception as exc:  # a candidate ATen lacks for this shape or build
                print(f"  {n:5d} {name:28s} failed: {type(exc).__name__}: {str(exc)[:200]}")


def part3():
    """Host time of one eager tower forward and of one manager replay (enqueue only), against device latency."""
    from hwgraph.budgets import filling_grid
    from hwgraph.manager import EncoderGraphManager
    from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to("cuda", torch.bfloat16).eval()
    manager = EncoderGraphManager(tower, budgets=[64, 128, 256], max_images_per_graph=4)
    manager.capture()
    print(f"host ms per call (enqueue) vs device latency ms, attention {tower.attention_kernel}:")
    for tokens in (49, 256):
        grid = [filling_grid(tokens, 2)]
        pixels = torch.randn(tokens * 4, 1536, device="cuda", dtype=torch.bfloat16)
        host = tower.prepare_metadata(grid)
        steps = {
            "prepare_metadata": lambda g=grid: tower.prepare_metadata(g),
            "metadata.to(cuda)": lambda h=host: h.to("cuda"),
            "eager forward": lambda p=pixels, g=grid: tower.forward(p, g),
            "manager.encode (replay)": lambda p=pixels, g=grid: manager.encode(p, g),
        }
        with torch.inference_mode():
            for name, fn in steps.items():
                ms = host_us(fn, calls=30) / 1e3
                lat = measure(fn, "cuda").median if name in ("eager forward", "manager.encode (replay)") else 0.0
                print(f"  {tokens:4d} tokens {name:26s} host {ms:7.3f} ms  latency {lat:7.3f} ms")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3])
    for part in ap.parse_args().parts:
        (part1, part2, part3)[part - 1]()
