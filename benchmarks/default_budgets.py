"""What ``EncoderGraphManager(tower)`` does with its defaults on this device: inferred budgets, calibrated cap.

Usage: python benchmarks/default_budgets.py [--tokens 49 256 1024 3000] [--preset P] [--device D]
Builds the real-size tower (random weights, bf16) and one manager with every default (budgets doubling from 64 to
2048, calibrated on an accelerating backend; automatic attention kernel), captures, and prints the wall time of
``capture()``, the calibration's eager and replay milliseconds per budget, the budgets kept, and the graph memory.
Then it encodes one image of each ``--tokens`` size through the manager and reports whether it replayed and the
output's relative L2 error against the tower's eager forward (bf16 rounding only: a few 1e-3).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from hwgraph.bench import build_tower, default_device, group_inputs, parse_groups, warm_device
from hwgraph.budget_capture import relative_error
from hwgraph.manager import EncoderGraphManager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[49, 256, 1024, 3000])
    parser.add_argument("--preset", default="qwen3-omni-30b-a3b")
    parser.add_argument("--device", help="torch device (default: the detected accelerator, else cpu)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device) if args.device else default_device()
    tower = build_tower(args.preset, device, torch.bfloat16 if device.type != "cpu" else torch.float32, 0)
    warm_device(device)
    start = time.perf_counter()
    manager = EncoderGraphManager(tower)
    manager.capture()
    seconds = time.perf_counter() - start
    s = manager.stats()
    print(f"EncoderGraphManager(tower) on {s['graph_backend']}/{s['attention']}: calibrate="
          f"{manager.calibrate_on_capture}, slot counts {s['slot_counts']}, capture() {seconds:.1f} s")
    print("budget  eager ms  replay ms  kept  capture s  graph MiB")
    for budget, f in sorted(s["calibration"].items()):
        mib = s["capture_bytes_per_budget"].get(budget)
        secs = s["capture_seconds_per_budget"].get(budget)
        print(f"{budget:6d}  {f['eager_ms']:8.3f}  {f['replay_ms']:9.3f}  {'yes' if f['kept'] else 'no':4s}  "
              f"{'-' if secs is None else f'{secs:9.2f}'}  {'-' if mib is None else f'{mib / 2**20:9.1f}'}")
    print(f"budgets kept: {s['budgets']}")
    groups = parse_groups(",".join(f"1x{t}" for t in args.tokens))
    inputs = group_inputs(tower, groups, 1000)
    for group in groups:
        pixels, grid = inputs[group.label]
        before = manager.stats()["replays"]
        got = manager.encode(pixels, grid)[0]
        replayed = manager.stats()["replays"] > before
        with torch.inference_mode():
            want = tower.forward(pixels, grid)
        error = max(relative_error(g, w) for g, w in zip(got.tensors(), want.tensors(), strict=True))
        print(f"{group.label}: {'replayed' if replayed else 'eager'}, relative L2 error against eager {error:.2e}")
    manager.close()


if __name__ == "__main__":
    main()
