"""Latency samples: device events on CUDA/ROCm (torch.cuda.Event), wall clock elsewhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Latency:
    samples_ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p95(self) -> float:
        ordered = sorted(self.samples_ms)
        return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]

    def as_dict(self) -> dict:
        return {"median_ms": self.median, "p95_ms": self.p95, "samples": len(self.samples_ms)}


def measure(fn: Callable[[], object], device: torch.device, warmup: int = 10, samples: int = 30) -> Latency:
    """Time ``fn`` ``samples`` times after ``warmup`` calls; each sample is one call, synchronised."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    out = []
    if device.type == "cuda":  # CUDA and ROCm builds both answer here
        for _ in range(samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
    else:
        for _ in range(samples):
            start = time.perf_counter()
            fn()
            synchronize(device)
            out.append((time.perf_counter() - start) * 1e3)
    return Latency(tuple(out))


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (no-op on CPU); wall-clock timing needs it off CUDA (NPU, ...)."""
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if device.type != "cpu" and callable(sync):
        sync()


def median_ms(fn: Callable[[], object], device, warmup: int = 3, samples: int = 10) -> float:
    return measure(fn, device, warmup, samples).median
