"""The tower's position embedding: one fused Triton kernel against the unfused torch computation.

Usage: python benchmarks/position_embedding.py
1. Per call (20 calls in one CUDA graph, µs), bf16, the checkpoint's table (2304 x 1152):
   ``fused.add_position_embedding`` against ``add_position_embedding_reference`` (embedding gather, float32
   products, sum over the four corners, cast, add: five kernels), at the patch rows of budgets 64, 256 and 1024,
   with whether the two are bit-identical.
2. Whole replays (TRITON_ATTN, one sequence slot, budgets 64 and 1024): a manager capturing the fused kernel against
   one capturing the unfused computation (the tower module's ``add_position_embedding`` swapped during capture),
   interleaved, two rounds, median ms, and the relative difference of their outputs.
"""

from __future__ import annotations

import torch

from hwgraph.bench import group_inputs, parse_groups, warm_device
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, fused
from hwgraph.models.qwen3_omni import tower as tower_module
from hwgraph.timing import graphed_ms, measure_interleaved


def per_call():
    torch.manual_seed(0)
    table = torch.randn(2304, 1152, device="cuda", dtype=torch.bfloat16)
    for rows in (256, 1024, 4096):
        x = torch.randn(rows, 1152, device="cuda", dtype=torch.bfloat16)
        indices = torch.randint(0, 2304, (4, rows), device="cuda")
        weights = torch.rand(4, rows, device="cuda")
        args = (x, table, indices, weights)
        same = torch.equal(fused.add_position_embedding(*args), fused.add_position_embedding_reference(*args))
        ours = graphed_ms(lambda a=args: fused.add_position_embedding(*a)) * 1e3
        torch_us = graphed_ms(lambda a=args: fused.add_position_embedding_reference(*a)) * 1e3
        print(f"{rows} rows: fused {ours:.1f} us, unfused {torch_us:.1f} us, bit-identical {same}", flush=True)


def replays():
    device = torch.device("cuda")
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", attention="TRITON_ATTN").to(device, torch.bfloat16)
    tower.eval()
    groups = parse_groups("1x49,1x1024")
    inputs = group_inputs(tower, groups, seed=0)
    managers = {}
    for label, function in (("fused", fused.add_position_embedding),
                            ("unfused", fused.add_position_embedding_reference)):
        tower_module.add_position_embedding = function  # read by forward_with_metadata at each call
        try:
            managers[label] = EncoderGraphManager(tower, budgets=[64, 1024], max_images_per_graph=1)
            managers[label].capture()
        finally:
            tower_module.add_position_embedding = fused.add_position_embedding
    for round_ in ("a", "b"):
        for group in groups:
            pixels, grid = inputs[group.label]
            lat = measure_interleaved({k: (lambda m=m, p=pixels, g=grid: m.encode(p, g)) for k, m in managers.items()},
                                      "cuda")
            print(f"round {round_} {group.label}: fused {lat['fused'].median:.3f} / {lat['fused'].p95:.3f} | "
                  f"unfused {lat['unfused'].median:.3f} / {lat['unfused'].p95:.3f} | "
                  f"{lat['fused'].median / lat['unfused'].median:.3f}x", flush=True)
    for group in groups:
        pixels, grid = inputs[group.label]
        a, b = (managers[k].encode(pixels, grid)[0].embeds.float() for k in ("fused", "unfused"))
        print(f"{group.label}: relative difference {((a - b).norm() / a.norm()).item():.1e}")


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    warm_device(torch.device("cuda"))
    per_call()
    replays()


if __name__ == "__main__":
    main()
