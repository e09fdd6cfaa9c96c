"""What a padded budget costs: a group replayed in a larger graph against the eager tower on the group alone.

Usage: python benchmarks/padding.py [--kernel FLASH_ATTN]
For each group: replay latency timed alone and interleaved with eager calls (CUDA events, median of 30), the summed
kernel time and the device span (first kernel start to last kernel end) of one replay and of one eager forward,
and per-kernel-class device time, eager vs replay. Then the block's GEMMs at the eager and the padded row counts,
each timed as 20 calls inside one CUDA graph.
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from hwgraph.bench import warm_device
from hwgraph.budgets import filling_grid
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.timing import graphed_ms, measure, measure_interleaved


def kernel_class(name: str) -> str:
    low = name.lower()
    for key, label in (("flash", "attention"), ("attn", "attention"), ("nvjet", "gemm"), ("gemm", "gemm"),
                       ("cutlass", "gemm"), ("sm90", "gemm"), ("rotary", "rotary"), ("layer_norm", "layernorm"),
                       ("add_ln", "layernorm"), ("ln", "layernorm"), ("copy", "copy"), ("memcpy", "copy"),
                       ("gelu", "gelu")):
        if key in low:
            return label
    return "other"


def profile_one(fn):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    per = collections.defaultdict(float)
    names = collections.defaultdict(float)
    for e in kernels:
        per[kernel_class(e.name)] += e.time_range.elapsed_us()
        names[e.name[:90]] += e.time_range.elapsed_us()
    total = sum(per.values()) / 1e3
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
    return total, span, len(kernels), per, names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="FLASH_ATTN")
    args = ap.parse_args()
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to("cuda", torch.bfloat16).eval()
    tower.set_attention(args.kernel)
    warm_device(torch.device("cuda"))
    manager = EncoderGraphManager(tower, budgets=[64, 128, 256], max_images_per_graph=4, attention=args.kernel)
    manager.capture()
    for label, grid in (("1x49", [filling_grid(49, 2)]), ("1x64", [filling_grid(64, 2)]),
                        ("2x49", [filling_grid(49, 2)] * 2), ("1x98", [filling_grid(98, 2)]),
                        ("1x128", [filling_grid(128, 2)]), ("1x256", [filling_grid(256, 2)])):
        tokens = sum(int(t * h * w) // 4 for t, h, w in grid)
        pixels = torch.randn(tokens * 4, 1536, device="cuda", dtype=torch.bfloat16)

        def eager(pixels=pixels, grid=grid):
            with torch.inference_mode():
                return tower.forward(pixels, grid)

        def replay(pixels=pixels, grid=grid):
            return manager.encode(pixels, grid)

        alone = measure(replay, "cuda")
        mixed = measure_interleaved({"eager": eager, "replay": replay}, torch.device("cuda"))
        e_total, e_span, e_n, e_per, e_names = profile_one(eager)
        r_total, r_span, r_n, r_per, r_names = profile_one(replay)
        print(f"{label}: replay alone {alone.median:.3f} (p95 {alone.p95:.3f}) | interleaved "
              f"{mixed['replay'].median:.3f} (eager {mixed['eager'].median:.3f}) | eager kernels {e_total:.3f} ms "
              f"in {e_n}, span {e_span:.3f} | replay kernels {r_total:.3f} ms in {r_n}, span {r_span:.3f} | "
              f"alone/eager kernels {alone.median / e_total:.2f}x")
        print("   class       eager ms  replay ms")
        for cls in sorted(set(e_per) | set(r_per), key=lambda c: -r_per.get(c, 0)):
            print(f"   {cls:10s} {e_per.get(cls, 0) / 1e3:9.3f} {r_per.get(cls, 0) / 1e3:9.3f}")
        if label == "1x98":
            print("   top kernels, replay vs eager (ms):")
            for name in sorted(r_names, key=lambda n: -r_names[n])[:12]:
                print(f"   {r_names[name] / 1e3:8.3f} {e_names.get(name, 0) / 1e3:8.3f}  {name}")
    print("GEMMs (one call, us, 20 calls in one CUDA graph):")
    for rows in (196, 256, 392, 448, 512):
        x = torch.randn(rows, 1152, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, 4304, device="cuda", dtype=torch.bfloat16)
        out = []
        for name, inp, n in (("qkv", x, 3456), ("proj", x, 1152), ("fc1", x, 4304), ("fc2", h, 1152)):
            w = torch.randn(n, inp.shape[1], device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            out.append(f"{name} {graphed_ms(lambda inp=inp, w=w, b=b: F.linear(inp, w, b)) * 1e3:6.1f}")
        print(f"  rows {rows:4d}: " + " ".join(out))


if __name__ == "__main__":
    main()
