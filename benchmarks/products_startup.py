"""Capture time with measured products (``EncoderGraphManager(measure_products=True)``) against plain capture.

Usage: python benchmarks/products_startup.py [--plain] [--debug] [--dump PATH]   (run it twice: the second process
recalls the first's choices from the cache, ``hwgraph_cuda.product_cache.cache_path()``)
One manager (TRITON_ATTN, budgets 64-1024, one sequence slot) on the real-size tower with random weights; prints the
capture seconds per budget, their sum, the wall time of ``capture()``, and ``stats()['products']`` (with the seconds
of each phase of measuring); the chooser's INFO log gives each shape's configurations and phases. ``--dump PATH``
writes every measured shape's configurations as JSON: algorithm, tile, stages, cluster shape, cuBLASLt's wave count,
the host µs of its first launch for that shape (slow where it is the process's first launch of the kernel), and its
ms in each round of the ranking that it reached (``hwgraph_cuda.products.RANKING``). Recording runs inside the
measuring (it times every launch and reads each configuration's attributes during the sweep), so a ``--dump`` run's
seconds are somewhat higher than a plain run's.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch

from hwgraph.bench import build_tower, warm_device
from hwgraph.manager import EncoderGraphManager


def record_measuring(shapes: list[dict]):
    """Patches the CUDA plugin's chooser so that each shape it measures appends its configurations to ``shapes``."""
    from hwgraph_cuda import cublaslt, products

    first_us, run = {}, cublaslt.LtProduct.run
    measure, sweep_times = products.MeasuredProducts.measure, products.MeasuredProducts.sweep_times

    def timed_run(self, algo, *args, **kwargs):
        start = time.perf_counter()
        try:
            return run(self, algo, *args, **kwargs)
        finally:
            first_us.setdefault((id(self), bytes(algo)), (time.perf_counter() - start) * 1e6)

    def recorded_measure(self, x, weight, bias, gelu):
        shapes.append({"label": self.label(x, weight, gelu), "configurations": {}, "sweeps": []})
        choice = measure(self, x, weight, bias, gelu)
        shapes[-1]["chosen"] = None if choice.algo is None else bytes(choice.algo).hex()
        shapes[-1] |= {"aten_us": choice.aten_us, "chosen_us": choice.chosen_us}
        return choice

    def recorded_sweep_times(descriptor, algos, x, weight, out, calls=products.RANKING[0][0], passes=1):
        ms = sweep_times(descriptor, algos, x, weight, out, calls, passes)
        configurations = shapes[-1]["configurations"]
        for algo in algos:
            key = bytes(algo).hex()
            if key not in configurations:
                checked = descriptor.checked(algo)
                configurations[key] = {
                    name: cublaslt.config_value(descriptor.lib, algo, attribute) for name, attribute in
                    (("algorithm", cublaslt.CFG_ID), ("tile", cublaslt.CFG_TILE), ("stages", cublaslt.CFG_STAGES),
                     ("cluster", cublaslt.CFG_CLUSTER))} | {
                    "waves": None if checked is None else checked.waves,
                    "first_launch_us": first_us.get((id(descriptor), bytes(algo)))}
        shapes[-1]["sweeps"].append({"calls": calls, "passes": passes,
                                     "ms": {bytes(a).hex(): t for a, t in zip(algos, ms, strict=True)}})
        return ms

    cublaslt.LtProduct.run = timed_run
    products.MeasuredProducts.measure = recorded_measure
    products.MeasuredProducts.sweep_times = staticmethod(recorded_sweep_times)


def main():
    measure = "--plain" not in sys.argv
    logging.basicConfig(format="%(message)s")
    # each shape's configurations and phases; with --debug also each chunk that the sweep had to sweep again
    logging.getLogger("hwgraph_cuda.products").setLevel(logging.DEBUG if "--debug" in sys.argv else logging.INFO)
    shapes, dump = [], sys.argv[sys.argv.index("--dump") + 1] if "--dump" in sys.argv else None
    if dump:
        record_measuring(shapes)
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
    if dump:
        with open(dump, "w") as f:
            json.dump(shapes, f)
        print(f"{len(shapes)} measured shapes written to {dump}")


if __name__ == "__main__":
    main()
