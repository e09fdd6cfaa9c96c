"""The block's four products through cuBLASLt directly: every algorithm its heuristic offers, timed, against ATen.

Usage: python benchmarks/cublaslt_algos.py [--rows N ...] [--count C] [--workspace MIB ...]
       (default rows 256 1024 4096, 32 algorithms per shape, workspace limits 0 and 32 MiB)

ATen runs each product (``F.linear`` with its bias; fc1 as ``torch._addmm_activation(..., use_gelu=True)``, the tanh
GELU in cuBLASLt's epilogue, as the tower calls it) through ``cublasLtMatmul`` with the first algorithm that
``cublasLtMatmulAlgoGetHeuristic`` returns. The heuristic ranks its candidates by an estimate, not a measurement, and
PyTorch's TunableOp measures alternatives only on ROCm. This script asks the heuristic for up to C candidates for the
same descriptors (bf16 in and out, fp32 compute, the bias or GELU + bias epilogue, D = W x^T in cuBLAS's
column-major view), calls each through ctypes on the ``libcublasLt`` that torch loaded, and times it.

µs per call: 20 calls in one CUDA graph (``hwgraph.timing.graphed_ms``). ``aten``: the tower's call; ``#0``: the
heuristic's first candidate (ATen's choice when the workspace limits match); ``best``: the fastest candidate whose
result is as close to the float64 product as ATen's (``relative_error``; within 1.5x + 1e-4). ATen, ``#0`` and the
three fastest are then timed again side by side (interleaved rounds, see ``report``). The CUDA plugin
captures without a cuBLASLt workspace, so run with ``CUBLASLT_WORKSPACE_SIZE=0`` for ``aten`` to time what the
graphs run. Kernel names come from ``torch.profiler``. The last lines weigh the interleaved gains by the calls in one
replay (27 blocks).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hwgraph.manager import relative_error
from hwgraph.timing import graphed_calls, graphed_ms, measure_interleaved

HIDDEN, MLP, BLOCKS, CALLS = 1152, 4304, 27, 20
PRODUCTS = (("qkv", HIDDEN, 3 * HIDDEN, False), ("proj", HIDDEN, HIDDEN, False), ("fc1 + GELU", HIDDEN, MLP, True),
            ("fc2", MLP, HIDDEN, False))
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14  # cublasComputeType_t, cudaDataType_t
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDescAttributes_t
EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 4, 36
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
CONFIG = (("tile", 1), ("splitk", 2), ("reduction", 3), ("swizzle", 4), ("custom", 5), ("stages", 6), ("inner", 7),
          ("cluster", 8))  # cublasLtMatmulAlgoConfigAttributes_t


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The ``libcublasLt`` this process already uses (torch loads it with cuBLAS), with the argument types set."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.addmm(a[0], a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    if not paths:
        raise RuntimeError("no libcublasLt.so is mapped into this process after a bf16 addmm on CUDA")
    lib = ctypes.CDLL(paths[0])
    p, i, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(Heuristic), ctypes.POINTER(i)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(Algo), i, p, size, ctypes.POINTER(size)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(Algo), p, size, p],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = i
    return lib


def check(status: int, call: str):
    if status != 0:
        raise RuntimeError(f"{call} returned cublasStatus_t {status}, expected 0 (CUBLAS_STATUS_SUCCESS)")


@dataclass
class Candidate:
    algo: Algo
    workspace: int
    waves: float
    label: str


class LtProduct:
    """``out = epilogue(x w^T + b)`` for fixed tensors, as one ``cublasLtMatmul`` with a chosen algorithm."""

    def __init__(self, lib, handle, x, w, b, out, gelu: bool):
        self.lib, self.handle, self.x, self.w, self.b, self.out = lib, handle, x, w, b, out
        (m, k), n = x.shape, w.shape[0]
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "cublasLtMatmulDescCreate")
        self.set(DESC_TRANSA, ctypes.c_int32(OP_T))
        self.set(DESC_TRANSB, ctypes.c_int32(OP_N))
        self.set(DESC_EPILOGUE, ctypes.c_int32(EPILOGUE_GELU_BIAS if gelu else EPILOGUE_BIAS))
        self.set(DESC_BIAS_POINTER, ctypes.c_void_p(b.data_ptr()))
        # column-major: A = w as K x N (transposed), B = x as K x M, D = out as N x M
        self.layouts = [self.layout(rows, cols) for rows, cols in ((k, n), (k, m), (n, m))]
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.workspace = torch.empty(0, dtype=torch.uint8, device=x.device)

    def set(self, attribute: int, value):
        check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
              f"cublasLtMatmulDescSetAttribute({attribute})")

    def layout(self, rows: int, cols: int) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(handle), R_16BF, rows, cols, rows),
              "cublasLtMatrixLayoutCreate")
        return handle

    def candidates(self, count: int, workspace_bytes: int) -> list[Candidate]:
        pref = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        limit = ctypes.c_uint64(workspace_bytes)
        check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                            ctypes.sizeof(limit)), "set MAX_WORKSPACE_BYTES")
        results, returned = (Heuristic * count)(), ctypes.c_int(0)
        a, b, d = self.layouts
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, d, d, pref, count, results,
                                                      ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
        return [Candidate(r.algo, r.workspace_size, r.waves, self.describe(r.algo))
                for r in results[:returned.value] if r.state == 0]

    def describe(self, algo: Algo) -> str:
        parts = []
        for name, attribute in CONFIG:
            needed, value = ctypes.c_size_t(0), ctypes.c_uint64(0)
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, None, 0,
                                                             ctypes.byref(needed)) != 0 or needed.value > 8:
                continue
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attribute, ctypes.byref(value),
                                                             needed.value, ctypes.byref(needed)) == 0:
                parts.append(f"{name} {value.value}")
        return ", ".join(parts)

    def run(self, candidate: Candidate, x: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """The product with ``candidate``, of ``x`` (default: the constructor's) into ``out`` (same)."""
        x = self.x if x is None else x
        out = self.out if out is None else out
        if self.workspace.numel() < candidate.workspace:
            self.workspace = torch.empty(candidate.workspace, dtype=torch.uint8, device=self.x.device)
        a, b, d = self.layouts
        d_ptr = ctypes.c_void_p(out.data_ptr())
        check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(self.w.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), d_ptr, d, d_ptr, d,
            ctypes.byref(candidate.algo), ctypes.c_void_p(self.workspace.data_ptr()), candidate.workspace,
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cublasLtMatmul")
        return out


class MeasuredLinear:
    """The tower's products (``F.linear`` with a bias; fc1 + tanh GELU) through cuBLASLt with, per shape, the
    heuristic candidate (no workspace, as the graphs capture) that ran fastest, as accurate as ATen's, in interleaved
    graph replays. A shape is measured at its first call outside a capture (the manager's warm-up); a shape first
    seen while capturing takes the heuristic's first candidate, ATen's own choice. Anything else (no bias, not bf16,
    not contiguous, not 256-byte aligned) goes to ATen. ``notes`` keeps one line per measured shape."""

    def __init__(self):
        self.lib = load_cublaslt()
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.products: dict[tuple, LtProduct] = {}
        self.choices: dict[tuple, Candidate] = {}
        self.notes: list[str] = []

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if not self.takes(x, w, b):
            return torch._C._nn.linear(x, w, b)
        return self.product(x, w, b, gelu=False)

    def linear_gelu_tanh(self, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
        w, b = linear.weight, linear.bias
        if not self.takes(x, w, b):
            return F.gelu(torch._C._nn.linear(x, w, b), approximate="tanh")
        return self.product(x, w, b, gelu=True)

    @staticmethod
    def takes(x, w, b) -> bool:
        tensors = (x, w, b)
        return (b is not None and x.dim() == 2 and x.is_cuda and all(t.dtype == torch.bfloat16 for t in tensors)
                and all(t.is_contiguous() and t.data_ptr() % 256 == 0 for t in tensors))

    def product(self, x, w, b, gelu: bool) -> torch.Tensor:
        (rows, k), n = x.shape, w.shape[0]
        shape = (rows, k, n, gelu)
        key = shape + (w.data_ptr(), b.data_ptr())
        if key not in self.products:
            self.products[key] = LtProduct(self.lib, self.handle, x, w, b, x.new_empty(rows, n), gelu)
        product = self.products[key]
        if shape not in self.choices:
            capturing = torch.cuda.is_current_stream_capturing()
            self.choices[shape] = product.candidates(1, 0)[0] if capturing else self.measure(product, x, gelu)
        return product.run(self.choices[shape], x=x, out=x.new_empty(rows, n))

    def measure(self, product: LtProduct, x: torch.Tensor, gelu: bool) -> Candidate:
        w, b = product.w, product.b
        exact = x.double() @ w.double().t() + b.double()
        if gelu:
            exact = F.gelu(exact, approximate="tanh")

            def aten():
                return torch._addmm_activation(b, x, w.t(), use_gelu=True)
        else:
            def aten():
                return torch._C._nn.linear(x, w, b)
        bound = 1.5 * relative_error(aten(), exact) + 1e-4
        scratch = x.new_empty(x.shape[0], w.shape[0])
        candidates = [c for c in product.candidates(32, 0)
                      if relative_error(product.run(c, x=x, out=scratch), exact) <= bound]
        calls = {"aten": aten} | {i: (lambda c=c: product.run(c, x=x, out=scratch)) for i, c in enumerate(candidates)}
        graphs = {label: graphed_calls(fn, CALLS) for label, fn in calls.items()}
        latency = measure_interleaved({label: g.replay for label, g in graphs.items()}, "cuda")
        us = {label: lat.median * 1e3 / CALLS for label, lat in latency.items()}
        best = min((label for label in us if label != "aten"), key=us.get)
        self.notes.append(f"{x.shape[0]} x {w.shape[1]} -> {w.shape[0]}{' + GELU' if gelu else ''}: aten "
                          f"{us['aten']:.1f} µs, #0 {us.get(0, float('nan')):.1f}, #{best} {us[best]:.1f} "
                          f"({kernel_names(calls[best])})")
        return candidates[best]


@contextlib.contextmanager
def measured_products():
    """``F.linear`` and ``layers.linear_gelu_tanh`` through one ``MeasuredLinear`` while the context is open."""
    from hwgraph.models.qwen3_omni import layers

    global MEASURED
    if MEASURED is None:
        MEASURED = MeasuredLinear()
    saved = F.linear, layers.linear_gelu_tanh
    F.linear, layers.linear_gelu_tanh = MEASURED.linear, MEASURED.linear_gelu_tanh
    try:
        yield MEASURED
    finally:
        F.linear, layers.linear_gelu_tanh = saved


MEASURED: MeasuredLinear | None = None


def kernel_names(fn) -> str:
    """The device kernels one ``fn()`` launches, by name (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return " + ".join(name[:70] for name in names) or "(none seen)"


def report(rows, name, k, n, aten, aten_us, aten_err, product, timed) -> float | None:
    """Print one shape's candidates; time ATen, the heuristic's first and the three fastest accurate candidates again,
    interleaved (``measure_interleaved`` over their graphs, so drift in clock and power moves all alike); return the
    µs per call the fastest of those saves against ATen."""
    first = next((t for t in timed if t[2] == 0), None)
    good = sorted((t for t in timed if t[1] <= 1.5 * aten_err + 1e-4), key=lambda t: t[0])
    print(f"\n{rows} rows, {name} (K {k}, N {n}): aten {aten_us:.1f} µs (err {aten_err:.1e}); "
          f"{len(timed)} candidates, {len(timed) - len(good)} less accurate than aten", flush=True)
    for us, err, index, limit, cand in good[:6]:
        print(f"  {us:6.1f} µs  #{index:<2} limit {limit >> 20:>2} MiB, workspace {cand.workspace >> 10} KiB, "
              f"waves {cand.waves:.2f}, err {err:.1e}; {cand.label}")
    if not good:
        return None
    contenders = {"aten": aten}
    if first is not None:
        contenders["#0"] = lambda: product.run(first[4])
    for _us, _err, index, limit, cand in good[:3]:
        contenders.setdefault(f"#{index} ({limit >> 20} MiB)", lambda cand=cand: product.run(cand))
    graphs = {label: graphed_calls(fn, CALLS) for label, fn in contenders.items()}
    latency = measure_interleaved({label: g.replay for label, g in graphs.items()}, "cuda")
    per_call = {label: (lat.median * 1e3 / CALLS, lat.p95 * 1e3 / CALLS) for label, lat in latency.items()}
    print("  interleaved, µs per call (median / p95):")
    for label, (median, p95) in sorted(per_call.items(), key=lambda item: item[1][0]):
        print(f"    {label:<14} {median:6.1f} / {p95:6.1f}  {kernel_names(contenders[label])}")
    return per_call["aten"][0] - min(median for median, _ in per_call.values())


def main():
    def listed(flag: str, default: list[int]) -> list[int]:
        if flag not in sys.argv:
            return default
        values = []
        for arg in sys.argv[sys.argv.index(flag) + 1:]:
            if arg.startswith("--"):
                break
            values.append(int(arg))
        return values

    rows_list = listed("--rows", [256, 1024, 4096])
    count = listed("--count", [32])[0]
    limits = [mib << 20 for mib in listed("--workspace", [0, 32])]
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, "CUBLASLT_WORKSPACE_SIZE =",
          os.environ.get("CUBLASLT_WORKSPACE_SIZE", "(unset)"), flush=True)
    lib = load_cublaslt()
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    gen = torch.Generator(device=dev).manual_seed(0)
    totals: dict[int, list[float]] = {}
    for rows in rows_list:
        for name, k, n, gelu in PRODUCTS:
            x = torch.randn(rows, k, device=dev, generator=gen).bfloat16()
            w = (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).bfloat16()
            b = torch.randn(n, device=dev, generator=gen).bfloat16()
            exact = x.double() @ w.double().t() + b.double()
            if gelu:
                exact = F.gelu(exact, approximate="tanh")

                def aten(x=x, w=w, b=b):
                    return torch._addmm_activation(b, x, w.t(), use_gelu=True)
            else:
                def aten(x=x, w=w, b=b):
                    return F.linear(x, w, b)
            aten_err = relative_error(aten(), exact)
            aten_us = graphed_ms(aten) * 1e3
            product = LtProduct(lib, handle, x, w, b, torch.empty(rows, n, device=dev, dtype=torch.bfloat16), gelu)
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
            gain = report(rows, name, k, n, aten, aten_us, aten_err, product, timed)
            if gain is not None:
                totals.setdefault(rows, []).append(gain * BLOCKS)
    for rows, gains in totals.items():
        print(f"\n{rows} rows: the best candidates would save {sum(gains) / 1e3:.3f} ms of a replay's 27 blocks "
              f"(qkv, proj, fc1, fc2: {', '.join(f'{g / 1e3:.3f}' for g in gains)})")


if __name__ == "__main__":
    main()
