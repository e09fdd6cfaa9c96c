"""The block's four products through cuBLASLt directly: every algorithm its heuristic offers, timed, against ATen.

Usage: python benchmarks/cublaslt_algos.py [--rows N ...] [--count C] [--workspace MIB ...]
       (default rows 256 1024 4096, 32 algorithms per shape, workspace limits 0 and 32 MiB)

ATen runs each product (``F.linear`` with its bias; fc1 as ``torch._addmm_activation(..., use_gelu=True)``, the tanh
GELU in cuBLASLt's epilogue, as the tower calls it) through ``cublasLtMatmul`` with the first algorithm that
``cublasLtMatmulAlgoGetHeuristic`` returns. The heuristic ranks its candidates by an estimate, not a measurement, and
PyTorch's TunableOp measures alternatives only on ROCm. This script asks the heuristic for up to C candidates for the
same descriptors (bf16 in and out, fp32 compute, the bias or GELU + bias epilogue, D = W x^T in cuBLAS's
column-major view), calls each through the CUDA plugin's ctypes binding (``hwgraph_cuda.cublaslt``) and times it.
``EncoderGraphManager(measure_products=True)`` chooses per shape among these candidates and the other tiles and cluster
shapes of their algorithms (``benchmarks/cublaslt_space.py``) while it captures.

µs per call: 20 calls in one CUDA graph (``hwgraph.timing.graphed_ms``). ``aten``: the tower's call; ``#0``: the
heuristic's first candidate (ATen's choice when the workspace limits match); ``best``: the fastest candidate whose
result is as close to the float64 product as ATen's (``relative_error``; within 1.5x + 1e-4). ATen, ``#0`` and the
three fastest are then timed again side by side (interleaved rounds, see ``report``). The CUDA plugin
captures without a cuBLASLt workspace, so run with ``CUBLASLT_WORKSPACE_SIZE=0`` for ``aten`` to time what the
graphs run. Kernel names come from ``torch.profiler``. The last lines weigh the interleaved gains by the calls in one
replay (27 blocks).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass

import torch
from hwgraph_cuda.cublaslt import Algo, LtProduct, check, cublaslt, describe_algo
from hwgraph_cuda.products import MeasuredProducts

from hwgraph.budget_capture import relative_error
from hwgraph.timing import graphed_calls, graphed_ms, measure_interleaved

HIDDEN, MLP, BLOCKS, CALLS = 1152, 4304, 27, 20
PRODUCTS = (("qkv", HIDDEN, 3 * HIDDEN, False), ("proj", HIDDEN, HIDDEN, False), ("fc1 + GELU", HIDDEN, MLP, True),
            ("fc2", MLP, HIDDEN, False))


@dataclass
class Candidate:
    algo: Algo
    workspace: torch.Tensor | None
    waves: float
    label: str

    @property
    def workspace_bytes(self) -> int:
        return 0 if self.workspace is None else self.workspace.numel()


class Operands:
    """One shape's ``LtProduct`` (the CUDA plugin's descriptors) with its operands and output."""

    def __init__(self, lib, handle, x, w, b, gelu: bool):
        self.lib, self.x, self.w, self.out = lib, x, w, x.new_empty(x.shape[0], w.shape[0])
        self.product = LtProduct(lib, handle, w, b, x.shape[0], gelu)

    def candidates(self, count: int, limit: int) -> list[Candidate]:
        return [Candidate(h.algo, torch.empty(h.workspace_size, dtype=torch.uint8, device=self.x.device)
                          if h.workspace_size else None, h.waves, describe_algo(self.lib, h.algo))
                for h in self.product.candidates(count, limit)]

    def run(self, candidate: Candidate) -> torch.Tensor:
        return self.product.run(candidate.algo, self.x, self.w, self.out, candidate.workspace)


def kernel_names(fn) -> str:
    """The device kernels one ``fn()`` launches, by name (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " + ".join(name[:70] for name in names) or "(none seen)"


def report(rows, name, k, n, aten, aten_us, aten_err, bound, product, timed) -> float | None:
    """Print one shape's candidates; time ATen, the heuristic's first and the three fastest accurate candidates again,
    interleaved (``measure_interleaved`` over their graphs, so drift in clock and power moves all alike); return the
    µs per call the fastest of those saves against ATen."""
    first = next((t for t in timed if t[2] == 0), None)
    good = sorted((t for t in timed if t[1] <= bound), key=lambda t: t[0])
    print(f"\n{rows} rows, {name} (K {k}, N {n}): aten {aten_us:.1f} µs (err {aten_err:.1e}); "
          f"{len(timed)} candidates, {len(timed) - len(good)} less accurate than aten", flush=True)
    for us, err, index, limit, cand in good[:6]:
        print(f"  {us:6.1f} µs  #{index:<2} limit {limit >> 20:>2} MiB, workspace {cand.workspace_bytes >> 10} KiB, "
              f"waves {cand.waves:.2f}, err {err:.1e}; {cand.label}")
    if not good:
        return None
    contenders = {"aten": aten}
    if first is not None:
        contenders["#0"] = lambda: product.run(first[4])
    for _us, _err, index, limit, cand in good[:3]:
        contenders.setdefault(f"#{index} ({limit >> 20} MiB)", lambda cand=cand: product.run(cand))
    per_call = interleaved(contenders)
    return per_call["aten"][0] - min(median for median, _ in per_call.values())


def interleaved(contenders: dict) -> dict[str, tuple[float, float]]:
    """Time each contender as ``CALLS`` calls in one CUDA graph, interleaved (``measure_interleaved``, so drift in
    clock and power moves all alike); print and return µs per call (median, p95), with each one's kernels."""
    graphs = {label: graphed_calls(fn, CALLS) for label, fn in contenders.items()}
    latency = measure_interleaved({label: g.replay for label, g in graphs.items()}, "cuda")
    per_call = {label: (lat.median * 1e3 / CALLS, lat.p95 * 1e3 / CALLS) for label, lat in latency.items()}
    print("  interleaved, µs per call (median / p95):")
    for label, (median, p95) in sorted(per_call.items(), key=lambda item: item[1][0]):
        print(f"    {label:<15} {median:6.1f} / {p95:6.1f}  {kernel_names(contenders[label])}", flush=True)
    return per_call


def arguments(flag: str, default: list[str]) -> list[str]:
    """The command-line values after ``flag`` up to the next ``--`` flag, or ``default``."""
    if flag not in sys.argv:
        return default
    values = []
    for arg in sys.argv[sys.argv.index(flag) + 1:]:
        if arg.startswith("--"):
            break
        values.append(arg)
    return values


def shape_operands(rows: int, k: int, n: int, gelu: bool, gen: torch.Generator):
    """Random bf16 operands of one product, its float64 result, the relative error a candidate may have, and ATen's
    call as the tower makes it (the CUDA plugin's ``MeasuredProducts.accuracy`` and ``MeasuredProducts.aten``)."""
    x = torch.randn(rows, k, device=gen.device, generator=gen).bfloat16()
    w = (torch.randn(n, k, device=gen.device, generator=gen) * k ** -0.5).bfloat16()
    b = torch.randn(n, device=gen.device, generator=gen).bfloat16()
    exact, bound = MeasuredProducts.accuracy(x, w, b, gelu)
    return x, w, b, exact, bound, functools.partial(MeasuredProducts.aten, x, w, b, gelu)


def session():
    """Print the device and settings; return torch's cuBLASLt, a handle of its own, and a seeded CUDA generator."""
    print(torch.cuda.get_device_name(), torch.__version__, "CUBLASLT_WORKSPACE_SIZE =",
          os.environ.get("CUBLASLT_WORKSPACE_SIZE", "(unset)"), flush=True)
    lib, reason = cublaslt()
    if lib is None:
        raise SystemExit(reason)
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return lib, handle, torch.Generator(device="cuda").manual_seed(0)


def main():
    rows_list = [int(r) for r in arguments("--rows", ["256", "1024", "4096"])]
    count = int(arguments("--count", ["32"])[0])
    limits = [int(mib) << 20 for mib in arguments("--workspace", ["0", "32"])]
    lib, handle, gen = session()
    totals: dict[int, list[float]] = {}
    for rows in rows_list:
        for name, k, n, gelu in PRODUCTS:
            x, w, b, exact, bound, aten = shape_operands(rows, k, n, gelu, gen)
            aten_err = relative_error(aten(), exact)
            aten_us = graphed_ms(aten) * 1e3
            product = Operands(lib, handle, x, w, b, gelu)
            timed = []
            for limit in limits:
                for index, cand in enumerate(product.candidates(count, limit)):
                    try:
                        err = relative_error(product.run(cand), exact)
                        us = graphed_ms(lambda cand=cand, product=product: product.run(cand)) * 1e3
                    except RuntimeError as error:  # a candidate that does not run or capture is reported, not timed
                        print(f"  {rows} rows, {name}: candidate #{index} (limit {limit >> 20} MiB) failed: {error}")
                        continue
                    timed.append((us, err, index, limit, cand))
            gain = report(rows, name, k, n, aten, aten_us, aten_err, bound, product, timed)
            if gain is not None:
                totals.setdefault(rows, []).append(gain * BLOCKS)
    for rows, gains in totals.items():
        print(f"\n{rows} rows: the best candidates would save {sum(gains) / 1e3:.3f} ms of a replay's 27 blocks "
              f"(qkv, proj, fc1, fc2: {', '.join(f'{g / 1e3:.3f}' for g in gains)})")


if __name__ == "__main__":
    main()
