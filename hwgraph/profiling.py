"""Device kernel time of one call, from ``torch.profiler``: the floor a replay is compared against. Kernels that
overlap (the DeepStack mergers on their own stream) count once: the time in which any ran.

The manager issue asks for every replay within 1.3x of the tower's summed kernel time and the tower issue for the
eager tower at 1024 tokens within 1.2x of it; both ratios come out of ``hwgraph bench --profile``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from hwgraph.timing import synchronize

log = logging.getLogger(__name__)

DEVICE_EVENT_TYPES = (DeviceType.CUDA, DeviceType.PrivateUse1, DeviceType.XPU)  # ROCm reports as CUDA, NPU as PU1


@dataclass(frozen=True)
class KernelTime:
    """``ms``: the time in which any device activity (kernels, copies, memsets) of one call ran, overlaps counted
    once (``busy_us``).

    On CPU there are no device kernels; ``ms`` is then the summed self time of the CPU operators and ``source``
    says so.
    """

    ms: float | None
    events: int
    source: str  # "device kernels" | "cpu operators" | "unavailable: <why>"

    def as_dict(self) -> dict:
        return {"kernel_ms": self.ms, "events": self.events, "source": self.source}


def activities_for(device: torch.device) -> list:
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    elif device.type not in ("cpu", "meta") and hasattr(ProfilerActivity, "PrivateUse1"):
        acts.append(ProfilerActivity.PrivateUse1)
    return acts


def kernel_time(fn: Callable[[], object], device, warmup: int = 1) -> KernelTime:
    """Profile one call of ``fn`` (after ``warmup`` unprofiled calls) and sum its device time."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    failure = None  # fn's own exception: raised as it is, never reported as the profiler's
    try:
        with profile(activities=activities_for(device)) as prof:
            try:
                fn()
                synchronize(device)
            except Exception as exc:
                failure = exc
        events = list(prof.events())
    except Exception as exc:  # a profiler that cannot start here is a reported gap, not a crashed benchmark
        if failure is not None:
            raise failure from None
        log.warning("torch.profiler failed on %s: %s", device, exc)
        return KernelTime(None, 0, f"unavailable: {type(exc).__name__}: {exc}")
    if failure is not None:
        raise failure
    if device.type == "cpu":
        ops = [e for e in events if e.device_type == DeviceType.CPU]
        return KernelTime(sum(e.self_cpu_time_total for e in ops) / 1e3, len(ops), "cpu operators")
    kernels = [e for e in events if e.device_type in DEVICE_EVENT_TYPES]
    if not kernels:
        return KernelTime(None, 0, "unavailable: the profiler recorded no device activity")
    return KernelTime(busy_us(kernels) / 1e3, len(kernels), "device kernels")


def busy_us(events) -> float:
    """Microseconds in which at least one of ``events`` ran: the union of their time ranges, so that kernels on two
    streams at once count once (a plain sum of durations would exceed the call's device time)."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in events):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def replay_activities(graph) -> list:
    """The device activities (kernels, copies, memsets) of one profiled replay of a captured CUDA graph (anything
    with ``replay()``; one unprofiled replay first), in start order."""
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
