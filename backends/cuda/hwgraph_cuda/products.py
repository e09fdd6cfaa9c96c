"""Measured cuBLASLt algorithms for the tower's matrix products in captured graphs (``hwgraph.products``).

ATen runs a product with a bias (``F.linear``; fc1's ``torch._addmm_activation`` with the tanh GELU as epilogue)
through ``cublasLtMatmul`` with the first algorithm ``cublasLtMatmulAlgoGetHeuristic`` returns, which the heuristic
ranks by an estimate. On the H200 another of its candidates is faster for some of the tower's shapes (fc2 at 1024
rows: 18.2 against 21.0 µs; qkv, proj and fc1 at 4096 rows: 5-8% at the power limit; ``benchmarks/cublaslt_algos.py``).
PyTorch's TunableOp measures alternatives only on ROCm builds.

The heuristic's list is not all cuBLASLt can run. Each candidate's algorithm also takes the other tiles and cluster
shapes it lists among its capabilities, and some of those are faster still: fc1 + GELU at 4096 rows 59.2 µs with
128x128 tiles in 2x1 clusters, against ATen's 72.3 and the heuristic's best 69-75 (``benchmarks/cublaslt_space.py``).

``MeasuredProducts`` is the CUDA plugin's product chooser. At a shape's first call outside a capture (the manager's
warm-up) it gathers the heuristic's candidates without a workspace (the graphs capture without one) and those
configurations (``LtProduct.configurations``), drops any that cuBLASLt rejects or that is less accurate than ATen's
call against the float64 product, and ranks the rest in the rounds of ``RANKING``: one call each
(``MeasuredProducts.sweep``), then the 64 fastest with 3 calls each, then the 16 fastest of those with 5 calls each,
best of two passes. It times the ``SHORTLIST`` fastest of the last round and ATen's call in interleaved replays of
CUDA graphs, captured without a cuBLASLt workspace as the manager's are (``graphed_as_captured``). The fastest is
kept for the process; ATen's call stays where nothing beats it by ``MARGIN``. cuBLASLt is called through ctypes on
the ``libcublasLt`` that torch has loaded: nothing is built. The descriptors of the ``DESCRIPTORS`` products last used
are kept; older ones are destroyed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import logging
import math
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import environment_defaults
from hwgraph.manager import relative_error
from hwgraph.products import aten_linear_gelu_tanh
from hwgraph.timing import graphed_calls, measure_interleaved, ready_side_stream, side_stream
from hwgraph_cuda.graphs import CudaGraphBackend

log = logging.getLogger(__name__)

COMPUTE_32F, SCALE_32F = 68, 0  # cublasComputeType_t, cudaDataType_t
DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # cudaDataType_t of A, B, D
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8  # cublasLtMatmulDescAttributes_t
EPILOGUE_BIAS, EPILOGUE_GELU_BIAS = 4, 36  # cublasLtEpilogue_t (GELU is the tanh approximation)
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE_BYTES = 1
CFG_ID, CFG_TILE, CFG_SPLITK, CFG_SWIZZLING, CFG_CUSTOM, CFG_STAGES, CFG_CLUSTER = 0, 1, 2, 4, 5, 6, 8
CAP_TILE_IDS = 6  # cublasLtMatmulAlgoCapAttributes_t
CLUSTER_NAMES = {0: "auto", 2: "1x1", 3: "2x1", 4: "4x1", 5: "1x2", 6: "2x2", 7: "4x2", 8: "1x4", 9: "2x4",
                 10: "4x4"}  # cublasLtClusterShape_t
CLUSTERS = (2, 3, 5, 4, 8)  # the cluster shapes tried with every tile: 1x1, 2x1, 1x2, 4x1, 1x4
CANDIDATES = 32  # asked of the heuristic per shape
SWEEP_CHUNK = 64  # configurations launched behind one sleep in the sweep
FIRST_HOST_US_PER_CALL = 40.0  # host time assumed to launch one call in a sweep (and its share of an event),
# until measured: twice the 17 µs measured on the H200's host (``benchmarks/launch_queue.py``)
SLEEP_CYCLES_PER_US = 2_500  # above any SM clock in MHz: a sleep of this many cycles a µs lasts at least that long
SHORTLIST = 4  # the ranking's fastest, timed again against ATen's call in graphs
RANKING = ((1, 1, 64), (3, 1, 16), (5, 2, SHORTLIST))  # rounds of sweeps: (back-to-back calls per configuration,
# passes, fastest kept for the next round); the first round (the sweep) takes every accurate configuration, the
# later ones (the screen) the previous round's kept. With a 3-call sweep keeping 16, the screen's four fastest were
# among the sweep's first 9 in 34 of 35 shapes and its first 16 in all, and its 64th configuration took at least 1.16
# times the fastest's time (H200, ``benchmarks/products_startup.py --dump``).
CALLS = 20  # product calls per timed graph
MARGIN = 0.01  # a candidate replaces ATen's call only if it is this much faster
PHASES = ("configurations", "errors", "sweep", "screen", "timing")  # the parts of measuring a shape (``describe``)
ALIGNMENT = 256  # bytes; the heuristic assumes this alignment of every pointer unless told otherwise
DESCRIPTORS = 4096  # products whose cuBLASLt descriptors are kept (``MeasuredProducts.descriptor``): one per weight,
# bias and row count, so the 27-block tower captured at 9 budgets (64 to 16384 tokens) uses 9 x 117 = 1053 of them
# (patch embedding, 4 per block, 2 per merger): this keeps about four such towers', where unbounded every new tower
# (or weights moved to new addresses) added its own for the process's life


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # cublasLtMatmulHeuristicResult_t


def mapped_library(stem: str) -> str | None:
    """The path of a loaded shared library whose file name starts with ``stem`` (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if f"/{stem}" in line})
    except OSError:
        return None
    return paths[0] if paths else None


@functools.lru_cache(maxsize=1)
def cublaslt() -> tuple[ctypes.CDLL | None, str]:
    """torch's ``libcublasLt`` with the argument types set, or None and why it cannot be used."""
    if torch.version.hip:
        return None, f"torch is a ROCm (HIP {torch.version.hip}) build; measured products use NVIDIA's cuBLASLt"
    if not torch.version.cuda:
        return None, f"torch {torch.__version__} is not a CUDA build"
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible"
    if mapped_library("libcublasLt.so") is None:  # torch loads cuBLAS and cuBLASLt at its first product
        a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
        torch.addmm(a[0], a, a)
        torch.cuda.synchronize()
    path = mapped_library("libcublasLt.so")
    if path is None:
        return None, "no libcublasLt.so is mapped into this process after a bf16 addmm on CUDA"
    p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatmulDescDestroy": [p],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [p],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(Heuristic), ctypes.POINTER(i)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(Algo), p, size, p],
        "cublasLtMatmulAlgoInit": [p, i, i, i, i, i, i, i, ctypes.POINTER(Algo)],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, ctypes.POINTER(Algo), ctypes.POINTER(Heuristic)],
        "cublasLtMatmulAlgoCapGetAttribute": [ctypes.POINTER(Algo), i, p, size, ctypes.POINTER(size)],
        "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(Algo), i, p, size, ctypes.POINTER(size)],
        "cublasLtMatmulAlgoConfigSetAttribute": [ctypes.POINTER(Algo), i, p, size],
        "cublasLtGetVersion": [],
    }
    try:
        lib = ctypes.CDLL(path)
        for name, argtypes in signatures.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = size if name == "cublasLtGetVersion" else i
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not provide the cuBLASLt matmul API: {exc}"
    return lib, ""


def products_support(device: torch.device) -> Capability:
    if device.type != "cuda":
        return Capability.unavailable(f"measured products run on CUDA devices, not {device.type}")
    lib, reason = cublaslt()
    return Capability.available() if lib is not None else Capability.unavailable(reason)


def check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} returned cublasStatus_t {status}, expected 0 (CUBLAS_STATUS_SUCCESS)")


def config_value(lib, algo: Algo, attribute: int) -> int:
    """One of an algorithm's configuration attributes (``cublasLtMatmulAlgoConfigAttributes_t``), or -1. cuBLASLt
    takes only a buffer of the attribute's own size, which a first call without one reports."""
    get, size = lib.cublasLtMatmulAlgoConfigGetAttribute, ctypes.c_size_t(0)
    if get(ctypes.byref(algo), attribute, None, 0, ctypes.byref(size)) != 0 or not 0 < size.value <= 8:
        return -1
    value = ctypes.c_uint64(0)
    if get(ctypes.byref(algo), attribute, ctypes.byref(value), size.value, ctypes.byref(size)) != 0:
        return -1
    return value.value & ((1 << (8 * size.value)) - 1)


def configured(lib, algo: Algo, settings: dict[int, int]) -> Algo | None:
    """A copy of ``algo`` with configuration attributes set (cluster shapes are 16-bit, the rest 32-bit), or None
    if cuBLASLt refuses one."""
    copy = Algo.from_buffer_copy(algo)
    for attribute, value in settings.items():
        typed = ctypes.c_uint16(value) if attribute == CFG_CLUSTER else ctypes.c_uint32(value)
        if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(copy), attribute, ctypes.byref(typed),
                                                    ctypes.sizeof(typed)) != 0:
            return None
    return copy


def cap_values(lib, algo: Algo, attribute: int) -> list[int]:
    """A capability attribute (``cublasLtMatmulAlgoCapAttributes_t``) as uint32 values: an array attribute's
    elements (``CAP_TILE_IDS``: the tiles an algorithm lists), or a scalar's one value; [] if cuBLASLt refuses."""
    needed = ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attribute, None, 0, ctypes.byref(needed)) != 0:
        return []
    values = (ctypes.c_uint32 * max(1, needed.value // 4))()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attribute, values, ctypes.sizeof(values),
                                             ctypes.byref(needed)) != 0:
        return []
    return list(values[: needed.value // 4])


def describe_algo(lib, algo: Algo) -> str:
    """An algorithm's identity and configuration, for logs and the cache."""
    cluster = config_value(lib, algo, CFG_CLUSTER)
    return (f"algorithm {config_value(lib, algo, CFG_ID)}, tile {config_value(lib, algo, CFG_TILE)}, stages "
            f"{config_value(lib, algo, CFG_STAGES)}, cluster {CLUSTER_NAMES.get(cluster, cluster)}, custom "
            f"{config_value(lib, algo, CFG_CUSTOM)}, swizzle {config_value(lib, algo, CFG_SWIZZLING)}, split-K "
            f"{config_value(lib, algo, CFG_SPLITK)}")


class LtProduct:
    """``epilogue(x @ weight.T + bias)`` for one weight shape, bias and row count, as ``cublasLtMatmul`` descriptors.
    In cuBLAS's column-major view: A is the weight as ``K x N``, transposed; B is x as ``K x M``; D is out as
    ``N x M``. The descriptors hold the bias's address, not the tensor: they never keep a tower's memory alive."""

    def __init__(self, lib, handle, weight: torch.Tensor, bias: torch.Tensor, rows: int, gelu: bool):
        self.lib, self.handle = lib, handle
        n, k = weight.shape
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, SCALE_32F), "cublasLtMatmulDescCreate")
        self.set(DESC_TRANSA, ctypes.c_int32(OP_T))
        self.set(DESC_TRANSB, ctypes.c_int32(OP_N))
        self.set(DESC_EPILOGUE, ctypes.c_int32(EPILOGUE_GELU_BIAS if gelu else EPILOGUE_BIAS))
        self.set(DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        dtype = self.layouts_dtype = DATA_TYPES[weight.dtype]
        self.layouts = [self.layout(dtype, r, c) for r, c in ((k, n), (k, rows), (n, rows))]
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def set(self, attribute: int, value) -> None:
        check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
              f"cublasLtMatmulDescSetAttribute({attribute})")

    def layout(self, dtype: int, rows: int, cols: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows),
              "cublasLtMatrixLayoutCreate")
        return layout

    def close(self) -> None:
        """Destroy the descriptor and the layouts (cuBLASLt's host objects); nothing runs on this product after. A
        second call does nothing. A status other than success is logged, not raised: it costs a leak, not a result."""
        if self.desc is None:
            return
        statuses = [self.lib.cublasLtMatrixLayoutDestroy(layout) for layout in self.layouts]
        statuses.append(self.lib.cublasLtMatmulDescDestroy(self.desc))
        self.desc, self.layouts = None, []
        if any(statuses):
            log.warning("destroying a cuBLASLt product's descriptors returned cublasStatus_t %s", statuses)

    def candidates(self, count: int = CANDIDATES, workspace_bytes: int = 0) -> list[Heuristic]:
        """The heuristic's candidates, best estimate first, that need at most ``workspace_bytes``."""
        pref = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            limit = ctypes.c_uint64(workspace_bytes)
            check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit),
                                                                ctypes.sizeof(limit)), "set MAX_WORKSPACE_BYTES")
            results, returned = (Heuristic * count)(), ctypes.c_int(0)
            a, b, d = self.layouts
            check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, d, d, pref, count, results,
                                                          ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [r for r in results[:returned.value] if r.state == 0]

    def checked(self, algo: Algo) -> Heuristic | None:
        """cuBLASLt's check of ``algo`` for these descriptors (``cublasLtMatmulAlgoCheck``): its result, with the
        workspace it recommends and its wave count, or None if it rejects ``algo``."""
        result, (a, b, d) = Heuristic(), self.layouts
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a, b, d, d, ctypes.byref(algo),
                                                  ctypes.byref(result))
        return result if status == 0 and result.state == 0 else None

    def accepts(self, algo: Algo) -> bool:
        """Whether the check accepts ``algo``. The workspace it reports is not compared with the none that ``run``
        passes: it recommends one for the ``nvjet`` configurations of qkv and fc1, which run without one, as ATen's
        own kernel does in the graphs (``docs/benchmarks.md``, session 20). What cannot run without one fails in
        ``cublasLtMatmul`` and is left out by ``MeasuredProducts.errors`` (and ``recall``)."""
        return self.checked(algo) is not None

    def configurations(self, candidates: list[Heuristic]) -> list[Algo]:
        """Configurations beyond the heuristic's list: each candidate's algorithm and stage setting with every tile
        the algorithm supports, in each cluster shape of ``CLUSTERS``, without split-K (which would change the
        order of the sums) or swizzling; those cuBLASLt accepts, each once."""
        found, seen, dtype = [], {bytes(c.algo) for c in candidates}, self.layouts_dtype
        bases = {(config_value(self.lib, c.algo, CFG_ID), config_value(self.lib, c.algo, CFG_STAGES))
                 for c in candidates}
        for algo_id, stages in sorted(bases):
            if algo_id < 0 or stages < 0:
                continue
            base = Algo()
            if self.lib.cublasLtMatmulAlgoInit(self.handle, COMPUTE_32F, SCALE_32F, dtype, dtype, dtype, dtype,
                                               algo_id, ctypes.byref(base)) != 0:
                continue
            for tile in cap_values(self.lib, base, CAP_TILE_IDS):
                for cluster in CLUSTERS:
                    algo = configured(self.lib, base, {CFG_TILE: tile, CFG_STAGES: stages, CFG_SPLITK: 1,
                                                       CFG_SWIZZLING: 0, CFG_CLUSTER: cluster})
                    if algo is not None and bytes(algo) not in seen and self.accepts(algo):
                        seen.add(bytes(algo))
                        found.append(algo)
        return found

    def run(self, algo: Algo, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
            workspace: torch.Tensor | None = None):
        """``out`` = the product of ``x`` and ``weight`` (the shape and the bias the descriptors were made for) with
        ``algo``, on the current stream (captured if that stream captures)."""
        a, b, d = self.layouts
        d_ptr = ctypes.c_void_p(out.data_ptr())
        ws_ptr, ws_bytes = (None, 0) if workspace is None else \
            (ctypes.c_void_p(workspace.data_ptr()), workspace.numel())
        check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(weight.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), d_ptr, d, d_ptr, d, ctypes.byref(algo),
            ws_ptr, ws_bytes, ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)), "cublasLtMatmul")
        return out


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def graphed_as_captured(fns: dict) -> dict:
    """``graphed_calls(fn, CALLS)`` of each of ``fns``, captured under the CUDA plugin's ``capture_environment`` as
    the manager's graphs are. PyTorch reads ``CUBLASLT_WORKSPACE_SIZE`` at each cuBLASLt call, and with a workspace
    ATen's call to a larger product captures a dynamically scheduled kernel and a memset node, which the manager's
    graphs do not hold (``hwgraph_cuda.graphs``). Each runs once first on ``graphed_calls``' stream with the
    process's setting, as the manager's warm-up does, so that stream's workspaces are made at full size before a
    capture asks for none."""
    stream = side_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns.values():
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    with environment_defaults(CudaGraphBackend.capture_environment):
        return {key: graphed_calls(fn, CALLS) for key, fn in fns.items()}


class PhaseClock:
    """Seconds since the last lap, added to ``totals[phase]`` and to this clock's own seconds of ``phase`` at each
    ``lap``; ``str`` lists this clock's seconds per phase (a phase lapped again, as the screen's rounds are, sums)."""

    def __init__(self, totals: dict[str, float]):
        self.totals, self.laps, self.last = totals, {}, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self.last
        self.totals[phase] += now - self.last
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.laps.items()) or "nothing"


@dataclass
class Choice:
    algo: Algo | None  # None: ATen's call
    config: str | None  # the algorithm's configuration (``describe_algo``)
    aten_us: float
    chosen_us: float
    recalled: bool = False  # taken from the cache of an earlier process, not measured in this one

    def entry(self) -> dict:
        """The cache's record: the algorithm as its bytes (cuBLASLt's ``cublasLtMatmulAlgo_t`` is plain data, valid
        with the same library, which the cache's setting names), its configuration for people, and the timings."""
        return {"algo": None if self.algo is None else bytes(self.algo).hex(), "config": self.config,
                "aten_us": self.aten_us, "chosen_us": self.chosen_us}


@dataclass(frozen=True)
class Mark:
    """A ``MeasuredProducts``' totals at ``mark()``: ``describe(since=mark)`` reports what it did after."""

    shapes: int  # choices made, in order
    seconds: float
    phases: dict[str, float]


def cache_path() -> Path | None:
    """Where choices persist between processes: ``$HWGRAPH_CACHE_DIR`` (set empty: nowhere), else
    ``$XDG_CACHE_HOME/hwgraph``, else ``~/.cache/hwgraph``; the file is ``cublaslt-products.json``."""
    folder = os.environ.get("HWGRAPH_CACHE_DIR")
    if folder == "":
        return None
    try:
        if folder is None:
            folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hwgraph"
        # "~" is the shell's to expand (not done in Docker's ENV, systemd units or .env files), and a relative
        # folder would move with the working directory between reads and writes
        return Path(folder).expanduser().absolute() / "cublaslt-products.json"
    except RuntimeError as exc:  # no $HOME and no passwd entry (a container's arbitrary user)
        log.warning("measured products are not cached between processes: %s; set HWGRAPH_CACHE_DIR", exc)
        return None


class ChoiceCache:
    """Measured choices by shape and setting (GPU, cuBLASLt and torch versions), in a JSON file (``Choice.entry``).
    Reading or writing failures only cost a measurement: they are logged, never raised."""

    def __init__(self, path: Path | None, setting: str):
        self.path, self.setting = path, setting

    def key(self, label: str) -> str:
        return f"{self.setting} | {label}"

    def entries(self) -> dict:
        """The file's entries by key; {} if there is no file, or it cannot be read or is not a JSON object (logged)."""
        return self.read()[0]

    def read(self) -> tuple[dict, bool]:
        """``entries()``, and whether a write may replace the file: not one that exists but cannot be read (another
        user's file, an I/O error), whose entries replacing it would drop. A damaged file is replaced."""
        if self.path is None or not self.path.exists():
            return {}, True
        try:
            entries = json.loads(self.path.read_text())
        except OSError as exc:
            log.warning("ignoring the measured-products cache %s: %s", self.path, exc)
            return {}, False
        except ValueError as exc:  # not JSON, or not UTF-8
            log.warning("ignoring the measured-products cache %s: %s", self.path, exc)
            return {}, True
        if not isinstance(entries, dict):
            log.warning("ignoring the measured-products cache %s: it holds a JSON %s, not an object",
                        self.path, type(entries).__name__)
            return {}, True
        return entries, True

    @contextlib.contextmanager
    def locked(self):
        """An exclusive lock on the cache's folder for a read, add and replace: another process's ``put`` between
        this one's read and its replace would otherwise be lost (one process per GPU, parallel jobs). Where there
        is no ``fcntl`` (Windows), no lock."""
        try:
            import fcntl
        except ImportError:
            yield
            return
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def get(self, label: str) -> dict | None:
        entry = self.entries().get(self.key(label))
        if entry is not None and not isinstance(entry, dict):
            log.warning("ignoring the measured-products cache's entry for %s in %s: a JSON %s, not an object",
                        label, self.path, type(entry).__name__)
            return None
        return entry

    def put(self, label: str, entry: dict) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.locked():
                entries, replaceable = self.read()
                if not replaceable:
                    raise OSError("it exists but cannot be read, so replacing it would drop its entries")
                # TypeError, ValueError: an entry JSON cannot write; raised here, before any file is made
                text = json.dumps(entries | {self.key(label): entry}, indent=1, sort_keys=True)
                # created with the umask's mode, as the file itself would be (mkstemp's 0600 would lock other users
                # out of a shared folder); a unique name, since the lock may be missing
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                try:
                    with os.fdopen(fd, "w") as file:
                        file.write(text)
                    os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)  # a failed write (a full disk) leaves no temporary file behind
                    raise
        except (OSError, TypeError, ValueError) as exc:
            log.warning("could not write the measured-products cache %s: %s", self.path, exc)


class MeasuredProducts:
    """The product chooser of CUDA graphs (``hwgraph.products.ProductChooser``) on one GPU: per shape (rows, K, N,
    dtype, epilogue), the measured fastest of cuBLASLt's candidates, or one an earlier process measured on the same
    GPU with the same libraries (``ChoiceCache``; checked for accuracy again). It takes 2-D products with a bias, all
    in bf16 or fp16, contiguous and 256-byte aligned; anything else, and a shape first met inside a capture
    (measuring needs synchronisation), runs ATen's call."""

    def __init__(self, lib, device: torch.device, path: Path | None = None):
        self.lib, self.device = lib, device
        with torch.cuda.device(device):
            self.handle = ctypes.c_void_p()
            check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
            major, minor = torch.cuda.get_device_capability(device)
            setting = (f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}), "
                       f"cuBLASLt {lib.cublasLtGetVersion()}, torch {torch.__version__}")
        self.cache = ChoiceCache(path, setting)
        self.descriptors: OrderedDict[tuple, LtProduct] = OrderedDict()  # least recently used first
        self.choices: dict[tuple, Choice] = {}
        self.seconds = 0.0
        self.phases = dict.fromkeys(PHASES, 0.0)  # seconds of measuring, per phase (``measure``)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.takes(x, weight, bias):
            return F.linear(x, weight, bias)
        return self.product(x, weight, bias, gelu=False)

    def linear_gelu_tanh(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.takes(x, weight, bias):
            return aten_linear_gelu_tanh(x, weight, bias)
        return self.product(x, weight, bias, gelu=True)

    def takes(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        if bias is None or x.dim() != 2 or x.device != self.device or x.dtype not in DATA_TYPES or x.shape[0] == 0:
            return False
        tensors = (x, weight, bias)
        return (weight.dim() == 2 and x.shape[1] == weight.shape[1] and bias.shape == (weight.shape[0],)
                and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                        and t.data_ptr() % ALIGNMENT == 0 for t in tensors))

    def product(self, x, weight, bias, gelu: bool) -> torch.Tensor:
        rows, (n, k) = x.shape[0], weight.shape
        shape = (rows, k, n, x.dtype, gelu)
        # cuBLASLt launches in the current device's context: the chooser's device, whichever the caller has current
        with torch.cuda.device(self.device):
            choice = self.choices.get(shape)
            if choice is None:
                if torch.cuda.is_current_stream_capturing():
                    return self.aten(x, weight, bias, gelu)
                start = time.perf_counter()
                choice = self.recall(x, weight, bias, gelu) or self.measure(x, weight, bias, gelu)
                self.seconds += time.perf_counter() - start
                self.choices[shape] = choice
            if choice.algo is None:
                return self.aten(x, weight, bias, gelu)
            return self.descriptor(weight, bias, rows, gelu).run(choice.algo, x, weight, x.new_empty(rows, n))

    @staticmethod
    def aten(x, weight, bias, gelu: bool) -> torch.Tensor:
        return aten_linear_gelu_tanh(x, weight, bias) if gelu else F.linear(x, weight, bias)

    def descriptor(self, weight, bias, rows: int, gelu: bool) -> LtProduct:
        """The product's descriptors, made at its first call and kept while it is among the ``DESCRIPTORS`` last
        used; the least recently used beyond those is destroyed (``LtProduct.close``). Each caller uses what this
        returns at once, before another lookup could evict it. (ATen destroys its own cuBLASLt descriptors as each
        call returns, captured calls included.)"""
        key = (weight.data_ptr(), bias.data_ptr(), tuple(weight.shape), weight.dtype, rows, gelu)
        product = self.descriptors.get(key)
        if product is not None:
            self.descriptors.move_to_end(key)
            return product
        product = self.descriptors[key] = LtProduct(self.lib, self.handle, weight, bias, rows, gelu)
        while len(self.descriptors) > DESCRIPTORS:
            self.descriptors.popitem(last=False)[1].close()
        return product

    @staticmethod
    def label(x, weight, gelu: bool) -> str:
        return f"{x.shape[0]} x {weight.shape[1]} -> {weight.shape[0]}{' + GELU' if gelu else ''} ({x.dtype})"

    @staticmethod
    def accuracy(x, weight, bias, gelu: bool) -> tuple[torch.Tensor, float]:
        """The float64 product, and the relative error a candidate may have: ATen's, 1.5 times, plus 1e-4."""
        exact = x.double() @ weight.double().t() + bias.double()
        exact = F.gelu(exact, approximate="tanh") if gelu else exact
        return exact, 1.5 * relative_error(MeasuredProducts.aten(x, weight, bias, gelu), exact) + 1e-4

    def recall(self, x, weight, bias, gelu: bool) -> Choice | None:
        """The cached choice for this shape, if there is one, cuBLASLt still accepts its algorithm and it is still as
        accurate as ATen's call. Whatever fails in checking it (the entry, cuBLASLt, the run) is logged: a miss."""
        label = self.label(x, weight, gelu)
        try:
            entry = self.cache.get(label)
            if entry is None:
                return None
            aten_us, chosen_us = float(entry["aten_us"]), float(entry["chosen_us"])
            if entry["algo"] is None:
                return Choice(None, None, aten_us, chosen_us, recalled=True)
            algo = Algo.from_buffer_copy(bytes.fromhex(entry["algo"]))
            descriptor = self.descriptor(weight, bias, x.shape[0], gelu)
            if not descriptor.accepts(algo):
                reason = "cuBLASLt no longer accepts its algorithm for these operands"
            else:
                exact, bound = self.accuracy(x, weight, bias, gelu)
                if relative_error(descriptor.run(algo, x, weight, x.new_empty(exact.shape)), exact) <= bound:
                    return Choice(algo, describe_algo(self.lib, algo), aten_us, chosen_us, recalled=True)
                reason = "its algorithm is less accurate than ATen's call"
        except Exception as exc:  # a choice that cannot be checked is measured again
            reason = f"{type(exc).__name__}: {exc}"
        log.info("the cached choice for %s does not hold (%s); measuring again", label, reason)
        return None

    def measure(self, x, weight, bias, gelu: bool) -> Choice:
        """Rank the heuristic's candidates and the other configurations as accurate as ATen's call (``RANKING``), then
        time the ``SHORTLIST`` fastest and ATen's call interleaved; keep the fastest (see ``MARGIN``). A failure of the
        measurement, or a shape none of whose configurations ran, leaves the shape on ATen's call, logged and not
        cached. Runs on the chooser's device (``product``)."""
        label, clock = self.label(x, weight, gelu), PhaseClock(self.phases)
        try:
            descriptor = self.descriptor(weight, bias, x.shape[0], gelu)
            candidates = descriptor.candidates()
            algos = [c.algo for c in candidates] + descriptor.configurations(candidates)
            clock.lap("configurations")
            exact, bound = self.accuracy(x, weight, bias, gelu)
            scratch = x.new_empty(exact.shape)
            ran = self.errors(descriptor, algos, x, weight, exact, scratch)
            if not ran:  # nothing to compare ATen's call with: no choice for the cache
                raise RuntimeError(f"none of the {len(algos)} configurations cuBLASLt offered ran")
            accurate = [a for a, error in ran if error <= bound]
            clock.lap("errors")
            ranked = accurate
            for round_, (round_calls, passes, keep) in enumerate(RANKING):
                ranked = self.sweep(descriptor, ranked, x, weight, scratch, round_calls, passes)[:keep]
                clock.lap("screen" if round_ else "sweep")
            calls = {"aten": functools.partial(self.aten, x, weight, bias, gelu)}
            calls |= {i: functools.partial(descriptor.run, a, x, weight, scratch) for i, a in enumerate(ranked)}
            graphs = graphed_as_captured(calls)
            timed = measure_interleaved({key: graph.replay for key, graph in graphs.items()}, self.device,
                                        warmup=3, samples=10)
            del graphs
            clock.lap("timing")
        except Exception as exc:  # a shape that cannot be measured keeps ATen's call
            log.warning("measuring cuBLASLt algorithms for %s failed, it keeps ATen's: %s: %s", label,
                        type(exc).__name__, exc)
            return Choice(None, None, float("nan"), float("nan"))
        us = {key: latency.median * 1e3 / CALLS for key, latency in timed.items()}
        best = min(us, key=us.get)
        if best == "aten" or us[best] > us["aten"] * (1 - MARGIN):
            choice = Choice(None, None, us["aten"], us["aten"])
        else:
            choice = Choice(ranked[best], describe_algo(self.lib, ranked[best]), us["aten"], us[best])
        log.info("matrix product %s: %d of %d configurations as accurate as ATen's call (%.1f µs); %s; measured in "
                 "%s", label, len(accurate), len(algos), choice.aten_us,
                 "kept" if choice.algo is None else f"{choice.config}: {choice.chosen_us:.1f} µs instead", clock)
        self.cache.put(label, choice.entry())
        return choice

    @staticmethod
    def errors(descriptor: LtProduct, algos: list[Algo], x, weight, exact, out) -> list[tuple[Algo, float]]:
        """Each configuration's ``relative_error`` against ``exact``, computed on the device with one host read.
        Configurations that cuBLASLt accepted but will not run without a workspace are left out."""
        want, ran, norms = exact.float(), [], []
        for algo in algos:
            try:
                norms.append(torch.linalg.vector_norm(descriptor.run(algo, x, weight, out).float() - want))
            except RuntimeError:  # cublasLtMatmul's status: nothing was launched
                continue
            ran.append(algo)
        if not ran:
            return []
        errors = (torch.stack(norms) / torch.linalg.vector_norm(want).clamp_min(1e-30)).tolist()
        return list(zip(ran, errors, strict=True))

    @classmethod
    def sweep(cls, descriptor: LtProduct, algos: list[Algo], x, weight, out, calls: int = RANKING[0][0],
              passes: int = 1) -> list[Algo]:
        """``algos`` fastest first, by ``sweep_times``."""
        ms = cls.sweep_times(descriptor, algos, x, weight, out, calls, passes)
        return [algos[i] for i in sorted(range(len(algos)), key=ms.__getitem__)]

    @staticmethod
    def sweep_times(descriptor: LtProduct, algos: list[Algo], x, weight, out, calls: int = RANKING[0][0],
                    passes: int = 1) -> list[float]:
        """Each configuration's ms for ``calls`` back-to-back calls, by CUDA events between consecutive
        configurations; the shortest of ``passes`` passes (``sweep_pass``)."""
        ms, host_us = [math.inf] * len(algos), FIRST_HOST_US_PER_CALL * calls
        torch.cuda._sleep(1)  # the sleep kernel is loaded before any launching is timed
        for _ in range(passes):
            host_us = MeasuredProducts.sweep_pass(descriptor, algos, calls, host_us, ms, x, weight, out)
        return ms

    @staticmethod
    def sweep_pass(descriptor: LtProduct, algos: list[Algo], calls: int, host_us: float, ms: list[float], x, weight,
                   out) -> float:
        """One pass of ``sweep``: lowers ``ms[i]`` to the time of ``algos[i]``'s calls if shorter, and returns the host
        µs a configuration's launching took, doubled (the next pass's first sleep).

        The calls are launched ``SWEEP_CHUNK`` configurations at a time, each chunk on an idle device behind one
        ``torch.cuda._sleep`` at least twice as long as launching the previous chunk took (the first chunk assumes
        ``host_us`` a configuration). The device then runs the chunk's calls back to back, and each interval times
        one configuration's kernels. A chunk whose launching outlasted its sleep (the device may have waited for the
        host) is swept again with longer sleeps, twice at most. One host read a chunk. (A chunk is far smaller than
        the device's launch queue, about 1000 launches on the H200, so launching it never waits for the device:
        ``benchmarks/launch_queue.py``.)"""
        pending = list(range(len(algos)))
        for _ in range(3):
            late = []
            for start in range(0, len(pending), SWEEP_CHUNK):
                chunk, slept = pending[start:start + SWEEP_CHUNK], [timing_event(), timing_event()]
                slept[0].record()
                torch.cuda._sleep(int(SLEEP_CYCLES_PER_US * host_us * len(chunk)))
                slept[1].record()
                began, marks = time.perf_counter(), [slept[1]]
                for i in chunk:
                    for _ in range(calls):
                        descriptor.run(algos[i], x, weight, out)
                    marks.append(timing_event())
                    marks[-1].record()
                launch_us = (time.perf_counter() - began) * 1e6
                marks[-1].synchronize()
                for i, (a, b) in zip(chunk, itertools.pairwise(marks), strict=True):
                    ms[i] = min(ms[i], a.elapsed_time(b))
                if launch_us >= 1e3 * slept[0].elapsed_time(slept[1]):
                    late += chunk
                host_us = 2 * launch_us / len(chunk)
            if not late:
                break
            log.debug("sweeping %d configurations again: launching them outlasted their sleep", len(late))
            pending, host_us = late, 2 * host_us
        return host_us

    def mark(self) -> Mark:
        """What the chooser has done so far, for ``describe(since=...)``."""
        return Mark(len(self.choices), self.seconds, dict(self.phases))

    def describe(self, since: Mark | None = None) -> str:
        """What it chose, in a line: the shapes it measured or recalled and the seconds that took, in this process
        so far, or since ``since`` (a ``mark()``), then how many shapes the process has in all. The chooser is the
        process's: a manager that describes its capture without a mark taken when it began reports an earlier
        manager's shapes and seconds as its own."""
        start = since or Mark(0, 0.0, dict.fromkeys(self.phases, 0.0))
        choices = list(itertools.islice(self.choices.values(), start.shapes, None))  # only ever added, in order
        other = [c for c in choices if c.algo is not None]
        recalled = sum(c.recalled for c in choices)
        saved = sum(c.aten_us - c.chosen_us for c in other)
        phases = ", ".join(f"{name} {seconds - start.phases.get(name, 0.0):.1f} s"
                           for name, seconds in self.phases.items())
        cached = (f"{recalled} from the cache {self.cache.path}" if self.cache.path is not None else
                  "no cache between processes: HWGRAPH_CACHE_DIR is empty, or there is no home folder")
        described = (f"measured cuBLASLt algorithms: {len(choices)} shapes in {self.seconds - start.seconds:.1f} s "
                     f"({cached}; measuring: {phases}); {len(other)} run another "
                     f"configuration than ATen's, {saved:.1f} µs faster per call of each together")
        return described if since is None else f"{described}; {len(self.choices)} shapes in this process in all"

    def aten_calls(self) -> None:
        """ATen's calls that measuring times on ``side_stream`` (``graphed_as_captured``), once each on small bf16
        operands on the chooser's device: ``F.linear`` and, with the GELU epilogue, ``torch._addmm_activation``."""
        a = torch.ones(16, 16, device=self.device, dtype=torch.bfloat16)
        for gelu in (False, True):
            self.aten(a, a, a[0], gelu)


@functools.cache
def measured_products(index: int) -> MeasuredProducts:
    """The process's chooser for GPU ``index``: each shape is measured once, whichever manager captures it first.
    It is handed out with ``side_stream(index)`` readied by ATen's calls that measuring times there
    (``ready_side_stream``): a manager asks for its chooser before it reads any budget's memory baseline
    (``EncoderGraphManager.capture``), so that stream's cuBLAS workspaces, kept for the process, count in no
    budget's graph memory."""
    lib, reason = cublaslt()
    if lib is None:
        raise RuntimeError(f"measured products are unavailable: {reason}")
    chooser = MeasuredProducts(lib, torch.device("cuda", index), cache_path())
    ready_side_stream(index, chooser.aten_calls)
    return chooser
