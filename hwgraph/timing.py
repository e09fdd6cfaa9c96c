"""Latency samples: device events on CUDA/ROCm (torch.cuda.Event), wall clock elsewhere."""

from __future__ import annotations

import contextlib
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hwgraph.budgets import is_int
from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.platform import device_runtime


@dataclass(frozen=True)
class Latency:
    samples_ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p95(self) -> float:
        """The nearest-rank 95th percentile: the smallest sample that at least 95% of the samples do not exceed
        (the rule it replaced, ``round(0.95 * (n - 1))``, rounded halves to even: 31 samples took the lower of two, 51
        the upper)."""
        ordered = sorted(self.samples_ms)
        return ordered[-(-95 * len(ordered) // 100) - 1]  # ceil(0.95 n) in integers: 0.95 * 60 is 56.99999999999999

    def as_dict(self) -> dict:
        return {"median_ms": self.median, "p95_ms": self.p95, "samples": len(self.samples_ms)}


def measure(fn: Callable[[], object], device: torch.device, warmup: int = 10, samples: int = 30) -> Latency:
    """Time ``fn`` ``samples`` times after ``warmup`` calls; each sample is one call, synchronised."""
    return measure_interleaved({"fn": fn}, device, warmup, samples)["fn"]


def measure_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int = 10,
                        samples: int = 30, seed: int | None = 0) -> dict[str, Latency]:
    """Time several callables side by side: ``warmup`` calls of each, then ``samples`` rounds of one timed call of
    each. A host that speeds up or slows down during the run (the H200's shared host swings the same eager forward
    by 2x between minutes) then moves every callable's samples alike, so ratios of their medians hold.

    Each round calls them in a new order (``round_orders``: a balanced design drawn with ``random.Random(seed)``;
    ``seed=None``: the given order every round). A call's time depends on the call before it: on the H200 a replay
    right after an eager forward took 1-7% longer than the same replay after another replay (a GPU that sat idle
    replays slower), so a fixed order biased whichever callable followed a slow one
    (``benchmarks/replay_gaps.py --order``)."""
    if not is_int(samples) or samples < 1:
        raise ValueError(f"samples must be an int >= 1 (timed rounds), got {samples!r}")
    if not is_int(warmup) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0 (untimed calls of each), got {warmup!r}")
    device = torch.device(device)
    with on_device(device):  # as the samples run (one_sample): a callable that reads the current device sees it
        for fn in fns.values():
            for _ in range(warmup):
                fn()
    synchronize(device)
    out = {name: [] for name in fns}
    for order in round_orders(list(fns), samples, seed):
        for name in order:
            out[name].append(one_sample(fns[name], device))
    return {name: Latency(tuple(values)) for name, values in out.items()}


def williams_orders(n: int) -> list[list[int]]:
    """Orders of ``range(n)`` in which each item directly follows each other one equally often, and takes each
    place equally often (a Williams design: n rows for an even n, 2n for an odd one)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first, low = first + [low], low + 1
        else:
            first, high = first + [high], high - 1
    rows = [[(x + shift) % n for x in first] for shift in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def round_orders(names: list[str], samples: int, seed: int | None) -> list[list[str]]:
    """The order of each of ``samples`` rounds: ``names`` as given every round (``seed=None``), else blocks of a
    Williams design (``williams_orders``), each with its own random naming of the places and order of its rows. A
    plain shuffle balances which callable follows which only on average: at the bench's one seed a compiled bench's
    plain replay followed an eager call in 19 of 30 rounds, its compiled replay in 8."""
    if seed is None or len(names) < 2:
        return [list(names) for _ in range(samples)]
    rng, orders = random.Random(seed), []
    while len(orders) < samples:
        labels = rng.sample(names, len(names))
        block = [[labels[i] for i in row] for row in williams_orders(len(names))]
        rng.shuffle(block)
        orders += block
    return orders[:samples]


def on_device(device: torch.device):
    """``device`` made current for the calls a measurement times and warms up (CUDA and ROCm); nothing elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def one_sample(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one synchronised call: device events on CUDA and ROCm, wall clock elsewhere. The events go
    on ``device``'s current stream, which ``fn``'s work joins, whichever device the caller has current."""
    if device.type == "cuda":  # CUDA and ROCm builds both answer here
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with on_device(device):
            start.record()
            fn()
            end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def graphed_ms(fn: Callable[[], object], calls: int = 20, warmup: int = 10, samples: int = 30) -> float:
    """Device milliseconds of one ``fn()`` on CUDA: ``calls`` calls captured in one CUDA graph and timed by replay
    (``measure``), divided by ``calls``, so host launch cost drops out. For component benchmarks."""
    return measure(graphed_calls(fn, calls).replay, "cuda", warmup, samples).median / calls


def graphed_calls(fn: Callable[[], object], calls: int = 20) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured in one CUDA graph, after three warm-up calls, both on the current device's
    ``side_stream``, into a pool of its own. A failed capture raises, after the backend's clean-up of one
    (``TorchCudaGraphBackend.abandon_capture``, which also gives the device's manager captures a new stream): the
    current stream, the allocator's routing and the device's generator are left as they were before it, which torch
    2.11 does not do itself."""
    if not is_int(calls) or calls < 1:  # 0 captured an empty graph, and graphed_ms divided by it
        raise ValueError(f"calls must be a positive int (calls of fn captured in one graph), got {calls!r}")
    stream = side_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph, pool, previous = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            for _ in range(calls):
                fn()
    except BaseException:
        device = torch.cuda.current_device()
        SideCaptures(torch.device("cuda", device)).abandon_capture(graph, pool, stream, previous)
        retire_side_stream(device)  # never capture on a stream a failed capture touched again
        raise
    return graph


class SideCaptures(TorchCudaGraphBackend):
    """The shared ``torch.cuda`` backend, for ``graphed_calls``' clean-up of a failed capture. It needs no gate of its
    own: ``graphed_calls`` runs where CUDA already has."""

    name = "cuda"

    @classmethod
    def capability(cls, device=None) -> Capability:
        return Capability.available()


SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> its side stream, made at first use
SIDE_STREAMS_LOCK = threading.Lock()


def side_stream(device: int) -> torch.cuda.Stream:
    """One stream per device for ``graphed_calls``' warm-ups and captures. cuBLAS keeps a workspace per stream for
    the process (32 MiB on Hopper). With a new warm-up stream per graph and a capture stream apart from it, measured
    products left about 100 MiB allocated per product shape they measured on the H200, as 32 MiB blocks with no
    tensor behind them (``docs/benchmarks.md``, session 27)."""
    with SIDE_STREAMS_LOCK:
        if device not in SIDE_STREAMS:
            SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
        return SIDE_STREAMS[device]


def retire_side_stream(device: int | None = None) -> None:
    """``side_stream(device)`` makes a new stream from now on (every device's, for None): after a failed capture on
    it. Only that device's: retiring them all (the cache cleared) gave every other device a new stream, and cuBLAS a
    new workspace there."""
    with SIDE_STREAMS_LOCK:
        if device is None:
            SIDE_STREAMS.clear()
        else:
            SIDE_STREAMS.pop(device, None)


def ready_side_stream(device: int, fn: Callable[[], object]) -> torch.cuda.Stream:
    """``side_stream(device)``, after running ``fn`` on it once and waiting for it: what the stream's first use makes
    for the process is made now, not in whatever runs there next. cuBLAS's workspaces for the stream (34 MiB on the
    H200) were made by the first product a chooser measured, inside a manager's capture and after its memory
    baseline, so the first budget measured in a process counted them (38.0 against 4.0 MiB)."""
    stream = side_stream(device)
    with torch.cuda.device(device):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
    return stream


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (no-op on CPU); wall-clock timing needs it off CUDA (NPU, ...)."""
    sync = getattr(device_runtime(device), "synchronize", None)
    if callable(sync):
        sync(device)
