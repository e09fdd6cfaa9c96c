"""How fast the host launches cuBLASLt products through ``hwgraph_cuda.products``, and how many launches the device's
queue holds behind a sleeping kernel before the next one blocks: the two figures that bound
``MeasuredProducts.sweep`` (its chunks must fit the queue, and its sleeps must outlast launching a chunk).

Usage: python benchmarks/launch_queue.py [--rows N] [--threads T]   (default 1024; fc1 + GELU, 1152 -> 4304, bf16;
       --threads: first launch every configuration from T threads before anything else)
Prints the host time of every configuration's first launch and of its second (a first launch may load the kernel),
the host µs per ``LtProduct.run`` with the device idle (one configuration repeated, and every configuration once),
per ``torch.cuda._sleep`` and per ``F.linear``; then, behind a 300 ms sleep, after how many launches of each
kind a launch first takes more than 5 ms (it waited for the queue).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from cublaslt_algos import shape_operands
from hwgraph_cuda.products import measured_products

SLEEP_CYCLES = 600_000_000  # about 300 ms


def host_us(launch, count: int) -> float:
    """Host µs per ``launch()`` over ``count`` launches, starting with the device idle."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    for i in range(count):
        launch(i)
    spent = time.perf_counter() - began
    torch.cuda.synchronize()
    return spent * 1e6 / count


def queue_depth(launch, limit: int = 4096) -> tuple[int, float]:
    """Launches accepted behind a long sleep before one takes more than 5 ms, and the host µs of that one."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for i in range(limit):
        began = time.perf_counter()
        launch(i)
        spent = time.perf_counter() - began
        if spent > 5e-3:
            torch.cuda.synchronize()
            return i, spent * 1e6
    torch.cuda.synchronize()
    return limit, 0.0


def main():
    rows = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 1024
    chooser = measured_products(0)
    x, w, b, *_ = shape_operands(rows, 1152, 4304, True, torch.Generator(device="cuda").manual_seed(0))
    out = x.new_empty(rows, 4304)
    descriptor = chooser.descriptor(w, b, rows, gelu=True)
    candidates = descriptor.candidates()
    algos = [c.algo for c in candidates] + descriptor.configurations(candidates)
    if "--threads" in sys.argv:  # every configuration's first launch from a pool of threads
        threads = int(sys.argv[sys.argv.index("--threads") + 1])

        def first_launch(algo):
            try:
                descriptor.run(algo, x, w, x.new_empty(rows, 4304))
            except RuntimeError:
                pass

        began = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(first_launch, algos))
        torch.cuda.synchronize()
        print(f"first launches of the {len(algos)} configurations on {threads} threads: "
              f"{time.perf_counter() - began:.2f} s")
    runnable, first_us = [], []
    for algo in algos:  # every kernel loaded before anything else is timed
        torch.cuda.synchronize()
        began = time.perf_counter()
        try:
            descriptor.run(algo, x, w, out)
        except RuntimeError:
            continue
        first_us.append((time.perf_counter() - began) * 1e6)
        runnable.append(algo)
    again_us = []
    for algo in runnable:
        torch.cuda.synchronize()
        began = time.perf_counter()
        descriptor.run(algo, x, w, out)
        again_us.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    print(f"{rows} x 1152 -> 4304 + GELU: {len(runnable)} of {len(algos)} configurations run "
          f"(CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'unset')}); host time of each one's launch, "
          f"device idle: first launches {sum(first_us) / 1e6:.2f} s in all, median {statistics.median(first_us):.1f} "
          f"µs; second launches {sum(again_us) / 1e6:.2f} s in all, median {statistics.median(again_us):.1f} µs")
    first = runnable[0]
    kinds = {
        "LtProduct.run, one configuration": lambda i: descriptor.run(first, x, w, out),
        "LtProduct.run, each configuration": lambda i: descriptor.run(runnable[i % len(runnable)], x, w, out),
        "torch.cuda._sleep(1)": lambda i: torch.cuda._sleep(1),
        "F.linear (ATen)": lambda i: F.linear(x, w, b),
        "event record": lambda i: torch.cuda.Event(enable_timing=True).record(),
    }
    for name, launch in kinds.items():
        us = sorted(host_us(launch, 200) for _ in range(5))[2]
        depth, blocked_us = queue_depth(launch)
        print(f"{name}: {us:.1f} µs a launch (device idle, median of 5 x 200); behind a sleep, launch {depth} "
              f"was the first to wait ({blocked_us / 1e3:.1f} ms)" if blocked_us else
              f"{name}: {us:.1f} µs a launch (device idle, median of 5 x 200); behind a sleep, none of {depth} waited")


if __name__ == "__main__":
    main()
