"""The ctypes binding of cuBLASLt that the CUDA plugin's product chooser (``hwgraph_cuda.products``) calls.

``cublaslt()`` binds the ``libcublasLt`` that torch has loaded: nothing is built. The constants are the values of
cuBLASLt's enums and attributes that the plugin passes, ``Algo`` and ``Heuristic`` its plain-data structures;
``config_value``, ``configured``, ``cap_values`` and ``describe_algo`` read and set an algorithm's attributes.
``LtProduct`` holds one product's descriptors: it asks the heuristic for candidates, lists the other configurations
cuBLASLt accepts (each candidate's algorithm with its other tiles, in the cluster shapes of ``CLUSTERS``), and runs one.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

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
ALIGNMENT = 256  # bytes; the heuristic assumes this alignment of every pointer unless told otherwise, and
# ``LtProduct``'s descriptors do not tell it otherwise


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]  # cublasLtMatmulAlgo_t


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]  # cublasLtMatmulHeuristicResult_t


def mapped_library(stem: str) -> str | None:
    """The path of a loaded shared library whose file name starts with ``stem`` (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps:
            # the path is the sixth field and may hold spaces (a venv under "My Projects"); one whose file was
            # replaced on disk since it was mapped is followed by " (deleted)"
            fields = [line.rstrip("\n").split(maxsplit=5) for line in maps]
    except OSError:
        return None
    paths = sorted({f[5].removesuffix(" (deleted)") for f in fields if len(f) == 6 and f"/{stem}" in f[5]})
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
        try:
            a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
            torch.addmm(a[0], a, a)
            torch.cuda.synchronize()
        except RuntimeError as exc:  # a gate gives reasons: a device that cannot run a product is one
            return None, f"a bf16 addmm on CUDA, run to load cuBLASLt, failed: {type(exc).__name__}: {exc}"
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
        if weight.dtype not in DATA_TYPES:  # before any descriptor exists (a KeyError after one left it behind)
            raise ValueError(f"LtProduct takes a weight of {' or '.join(map(str, DATA_TYPES))}, got {weight.dtype}")
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
        ``cublasLtMatmul`` and is left out by the chooser (``hwgraph_cuda.products.MeasuredProducts.errors`` and
        ``recall``)."""
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
        ``algo``, on the current stream (captured if that stream captures). ``workspace``: any tensor on the device,
        whose bytes cuBLASLt may use."""
        a, b, d = self.layouts
        d_ptr = ctypes.c_void_p(out.data_ptr())
        ws_ptr, ws_bytes = (None, 0) if workspace is None else \
            (ctypes.c_void_p(workspace.data_ptr()), workspace.numel() * workspace.element_size())
        check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(weight.data_ptr()), a,
            ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta), d_ptr, d, d_ptr, d, ctypes.byref(algo),
            ws_ptr, ws_bytes, ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)), "cublasLtMatmul")
        return out
