"""Capture time with measured products (``EncoderGraphManager(measure_products=True)``) against plain capture.

Usage: python benchmarks/products_startup.py [--plain] [--debug]   (run it twice: the second process recalls the first's
choices from the cache, ``hwgraph_cuda.products.cache_path()``)
One manager (TRITON_ATTN, budgets 64-1024, one sequence slot) on the real-size tower with random weights; prints the
capture seconds per budget, their sum, the wall time of ``capture()``, and ``stats()['products']`` (with the seconds
of each phase of measuring); the chooser's INFO log gives each shape's configurations and phases.
"""

from __future__ import annotations

import logging
import sys
import time

import torch

from hwgraph.bench import build_tower, warm_device
from hwgraph.manager import EncoderGraphManager


def main():
    measure = "--plain" not in sys.argv
    logging.basicConfig(format="%(message)s")
    # each shape's configurations and phases; with --debug also each chunk that the sweep had to sweep again
    logging.getLogger("hwgraph_cuda.products").setLevel(logging.DEBUG if "--debug" in sys.argv else logging.INFO)
    dev = torch.device("cuda")
    warm_device(dev)
    tower = build_tower("qwen3-omni-30b-a3b", dev, torch.bfloat16, 0)
    m = EncoderGraphManager(tower, budgets=[64, 128, 256, 512, 1024], max_images_per_graph=1, attention="TRITON_ATTN",
                            measure_products=measure)
    start = time.perf_counter()
    m.capture()
    wall = time.perf_counter() - start
    seconds = m.stats()["capture_seconds_per_budget"]
    print(f"measure_products={measure}: capture() {wall:.1f} s; per budget "
          f"{ {b: round(s, 2) for b, s in sorted(seconds.items())} } (sum {sum(seconds.values()):.1f} s)")
    print("products:", m.stats()["products"])
    m.close()


if __name__ == "__main__":
    main()
