"""Measured cuBLASLt products (``hwgraph_cuda.products``): refused with reasons off CUDA; on a GPU equal to ATen's
products, captured and replayed right, measured once per shape and never inside a capture.

Off the GPU, with a fake cuBLASLt and faked device queries: the binding's descriptors and configurations
(``hwgraph_cuda.cublaslt``), the chooser's choices per GPU model, library, shape, dtype and epilogue, the operands it
takes, its accuracy bound, and what measuring keeps and times. The cache has its own tests
(``test_cuda_product_cache.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hwgraph_cuda import cublaslt, product_cache, products
from hwgraph_cuda.graphs import CudaGraphBackend

from hwgraph import timing
from hwgraph.budget_capture import relative_error
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.products import aten_linear_gelu_tanh


class FakeCublasLt:
    """Stands in for ``libcublasLt``: records what ``LtProduct`` passes, and every call succeeds."""

    def __init__(self):
        self.attributes, self.layouts, self.matmuls = {}, [], []

    def cublasLtMatmulDescCreate(self, desc, compute, scale):
        desc._obj.value = 100
        self.compute = (compute, scale)
        return 0

    def cublasLtMatmulDescSetAttribute(self, desc, attribute, value, size):
        self.attributes[attribute] = value._obj.value
        return 0

    def cublasLtMatrixLayoutCreate(self, layout, dtype, rows, cols, ld):
        self.layouts.append((dtype, rows, cols, ld))
        layout._obj.value = len(self.layouts)
        return 0

    def cublasLtMatmul(self, handle, desc, alpha, a, a_desc, b, b_desc, beta, c, c_desc, d, d_desc, algo, workspace,
                       workspace_bytes, stream):
        self.matmuls.append({"A": (a.value, a_desc.value), "B": (b.value, b_desc.value), "C": (c.value, c_desc.value),
                             "D": (d.value, d_desc.value), "workspace": (workspace, workspace_bytes),
                             "stream": stream.value, "desc": desc.value})
        return 0

def test_lt_product_hands_cublaslt_the_column_major_view_of_the_call_and_holds_no_tensor(monkeypatch):
    fake, bf16 = FakeCublasLt(), torch.bfloat16
    weight, bias = torch.zeros(6, 4, dtype=bf16), torch.zeros(6, dtype=bf16)
    product = cublaslt.LtProduct(fake, ctypes.c_void_p(7), weight, bias, rows=5, gelu=True)
    assert fake.compute == (cublaslt.COMPUTE_32F, cublaslt.SCALE_32F)
    assert fake.attributes == {cublaslt.DESC_TRANSA: cublaslt.OP_T, cublaslt.DESC_TRANSB: cublaslt.OP_N,
                               cublaslt.DESC_EPILOGUE: cublaslt.EPILOGUE_GELU_BIAS,
                               cublaslt.DESC_BIAS_POINTER: bias.data_ptr()}
    # A: the weight as K x N (transposed by TRANSA), B: x as K x M, D: out as N x M; column-major, packed
    assert fake.layouts == [(14, 4, 6, 4), (14, 4, 5, 4), (14, 6, 5, 6)]
    assert not [name for name, value in vars(product).items() if isinstance(value, torch.Tensor)]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=99))
    x, other_weight, out = torch.zeros(5, 4, dtype=bf16), torch.zeros(6, 4, dtype=bf16), torch.empty(5, 6, dtype=bf16)
    assert product.run(cublaslt.Algo(), x, other_weight, out) is out
    assert fake.matmuls == [{"A": (other_weight.data_ptr(), 1), "B": (x.data_ptr(), 2), "C": (out.data_ptr(), 3),
                             "D": (out.data_ptr(), 3), "workspace": (None, 0), "stream": 99, "desc": 100}]


class FakeAlgorithms(FakeCublasLt):
    """Also stands in for cuBLASLt's algorithm calls: an algorithm's configuration attributes are its ``data``
    words in the order of ``SLOTS`` (id, tile, split-K, swizzle, custom, stages, cluster); algorithm 66 lists tiles
    20, 21 and 22, algorithm 7 tile 5; the check rejects tile 22 in 4x1 clusters."""

    TILES = {66: [20, 21, 22], 7: [5]}
    SLOTS = {cublaslt.CFG_ID: 0, cublaslt.CFG_TILE: 1, cublaslt.CFG_SPLITK: 2, cublaslt.CFG_SWIZZLING: 3,
             cublaslt.CFG_CUSTOM: 4, cublaslt.CFG_STAGES: 5, cublaslt.CFG_CLUSTER: 6}

    def cublasLtMatmulAlgoInit(self, handle, compute, scale, a, b, c, d, algo_id, algo):
        assert (compute, scale, a, b, c, d) == (cublaslt.COMPUTE_32F, cublaslt.SCALE_32F, 14, 14, 14, 14)
        algo._obj.data[:] = [algo_id] + [0] * 7
        return 0 if algo_id in self.TILES else 15

    def cublasLtMatmulAlgoCapGetAttribute(self, algo, attribute, buffer, size, written):
        tiles = self.TILES[algo._obj.data[0]]
        assert attribute == cublaslt.CAP_TILE_IDS
        written._obj.value = 4 * len(tiles)
        if buffer is not None:
            buffer[: len(tiles)] = tiles
        return 0

    def cublasLtMatmulAlgoConfigGetAttribute(self, algo, attribute, value, size, written):
        width = 2 if attribute == cublaslt.CFG_CLUSTER else 4  # as cuBLASLt: a buffer of the attribute's size, or none
        written._obj.value = width
        if value is None:
            return 0
        if size != width:
            return 7  # CUBLAS_STATUS_INVALID_VALUE
        value._obj.value = algo._obj.data[self.SLOTS[attribute]]
        return 0

    def cublasLtMatmulAlgoConfigSetAttribute(self, algo, attribute, value, size):
        assert size == (2 if attribute == cublaslt.CFG_CLUSTER else 4)
        algo._obj.data[self.SLOTS[attribute]] = value._obj.value
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, a, b, c, d, algo, result):
        data = algo._obj.data
        result._obj.state = 0
        return 15 if (data[1], data[6]) == (22, 4) else 0


def test_lt_product_refuses_a_dtype_cublaslt_is_not_given_here_by_name_before_creating_anything():
    fake = FakeCublasLt()
    with pytest.raises(ValueError, match=r"LtProduct takes a weight of torch.bfloat16 or torch.float16, got "
                                         r"torch.float32"):
        cublaslt.LtProduct(fake, ctypes.c_void_p(7), torch.zeros(6, 4), torch.zeros(6), rows=5, gelu=False)
    assert not hasattr(fake, "compute") and fake.layouts == []  # no descriptor left behind


def test_configurations_try_every_tile_and_cluster_of_the_candidates_algorithms_without_split_k_or_swizzling():
    fake, bf16 = FakeAlgorithms(), torch.bfloat16
    product = cublaslt.LtProduct(fake, ctypes.c_void_p(7), torch.zeros(6, 4, dtype=bf16), torch.zeros(6, dtype=bf16), 5,
                           gelu=False)
    candidates = [cublaslt.Heuristic(), cublaslt.Heuristic(), cublaslt.Heuristic()]
    candidates[0].algo.data[:] = [66, 20, 1, 0, 2, 35, 3, 0]  # algorithm 66, tile 20, custom 2, stages 35, 2x1
    candidates[1].algo.data[:] = [66, 21, 1, 0, 0, 35, 2, 0]
    candidates[2].algo.data[:] = [9, 1, 1, 0, 0, 12, 2, 0]  # an algorithm cuBLASLt cannot initialise
    found = [tuple(a.data) for a in product.configurations(candidates)]
    assert len(found) == len(set(found))
    # every tile and cluster of algorithm 66 at the candidates' stages, but the rejected one and candidate #1 itself
    want = {(66, tile, 1, 0, 0, 35, cluster, 0) for tile in (20, 21, 22) for cluster in cublaslt.CLUSTERS}
    assert set(found) == want - {(66, 22, 1, 0, 0, 35, 4, 0), tuple(candidates[1].algo.data)}
    assert cublaslt.describe_algo(fake, candidates[0].algo) == ("algorithm 66, tile 20, stages 35, cluster 2x1, "
                                                                "custom 2, swizzle 0, split-K 1")
    candidates[0].algo.data[6] = 9  # a cluster shape the heuristic offers but configurations do not try
    assert "cluster 2x4," in cublaslt.describe_algo(fake, candidates[0].algo)

GPU = torch.version.cuda is not None and not torch.version.hip and torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU with a CUDA build of torch")


@pytest.fixture
def fresh_cublaslt():
    cublaslt.cublaslt.cache_clear()
    yield
    cublaslt.cublaslt.cache_clear()


def test_refused_off_cuda_devices_with_the_device_named():
    assert products.products_support(torch.device("cpu")).reasons == ("measured products run on CUDA devices, not cpu",)


def test_refused_on_a_rocm_build(monkeypatch, fresh_cublaslt):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert cublaslt.cublaslt() == (None,
                                   "torch is a ROCm (HIP 6.2.41133) build; measured products use NVIDIA's cuBLASLt")
    assert products.products_support(torch.device("cuda")).reasons == (cublaslt.cublaslt()[1],)
    with pytest.raises(RuntimeError, match="measured products are unavailable: torch is a ROCm"):
        products.measured_products.__wrapped__(0)


@pytest.mark.skipif(GPU, reason="checks the reasons given without a usable NVIDIA GPU")
def test_refused_without_a_cuda_build_or_a_visible_gpu(fresh_cublaslt):
    lib, reason = cublaslt.cublaslt()
    assert lib is None
    assert reason in (f"torch {torch.__version__} is not a CUDA build", "no CUDA device is visible")


class OfflineDescriptor:
    """Stands in for ``LtProduct`` in ``recall`` and ``measure`` off the GPU: two configurations, which cuBLASLt
    accepts and will not run (``cublasLtMatmul``'s status raised by ``check``)."""

    def candidates(self):
        return [cublaslt.Heuristic()]

    def configurations(self, candidates):
        return [cublaslt.Algo()]

    def accepts(self, algo):
        return True

    def run(self, algo, x, weight, out, workspace=None):
        cublaslt.check(15, "cublasLtMatmul")


def offline_chooser(path, device=torch.device("cpu")) -> products.MeasuredProducts:
    """A ``MeasuredProducts`` without cuBLASLt (its constructor makes a handle on the GPU), on ``OfflineDescriptor``."""
    chooser = object.__new__(products.MeasuredProducts)
    chooser.lib, chooser.device, chooser.cache = None, device, product_cache.ChoiceCache(path, "H200")
    chooser.descriptors, chooser.choices, chooser.seconds = {}, {}, 0.0
    chooser.phases = dict.fromkeys(products.PHASES, 0.0)
    chooser.descriptor = lambda weight, bias, rows, gelu: OfflineDescriptor()
    return chooser


def cpu_operands():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 16, generator=g).bfloat16(), torch.randn(4, 16, generator=g).bfloat16(),
            torch.randn(4, generator=g).bfloat16())


def test_recalling_a_cached_choice_that_fails_to_run_or_a_broken_cache_is_a_miss(tmp_path, caplog):
    x, w, b = cpu_operands()
    chooser, label = offline_chooser(tmp_path / "choices.json"), products.MeasuredProducts.label(x, w, False)
    chooser.cache.put(label, products.Choice(cublaslt.Algo(), "algorithm 66", 5.0, 4.0).entry())
    with caplog.at_level(logging.INFO, logger=products.__name__):
        assert chooser.recall(x, w, b, gelu=False) is None
    assert (f"the cached choice for {label} does not hold (RuntimeError: cublasLtMatmul returned cublasStatus_t 15"
            in caplog.text)
    (tmp_path / "choices.json").write_text("[]")
    assert chooser.recall(x, w, b, gelu=False) is None


def test_a_shape_none_of_whose_configurations_ran_keeps_atens_call_uncached(tmp_path, caplog):
    x, w, b = cpu_operands()
    chooser = offline_chooser(tmp_path / "choices.json")
    choice = chooser.measure(x, w, b, gelu=False)
    assert choice.algo is None and math.isnan(choice.aten_us)
    assert (f"measuring cuBLASLt algorithms for {chooser.label(x, w, False)} failed, it keeps ATen's: RuntimeError: "
            f"none of the 2 configurations cuBLASLt offered ran") in caplog.text
    assert not (tmp_path / "choices.json").exists()  # a later process measures it again


def test_products_run_under_the_choosers_device(tmp_path, monkeypatch):
    current, seen = [], []

    @contextlib.contextmanager
    def device(d):
        current.append(d)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    chooser = offline_chooser(tmp_path / "choices.json", torch.device("cuda", 1))
    chooser.recall = lambda *args: seen.append(("recall", *current))
    chooser.measure = lambda *args: (seen.append(("measure", *current)), products.Choice(None, None, 5.0, 5.0))[1]
    x, w, b = cpu_operands()
    torch.testing.assert_close(chooser.product(x, w, b, gelu=False), F.linear(x, w, b), rtol=0, atol=0)
    assert seen == [("recall", torch.device("cuda", 1)), ("measure", torch.device("cuda", 1))]
    assert current == []


def test_timing_graphs_capture_without_a_cublaslt_workspace_after_a_warm_up_with_the_processs(monkeypatch):
    """As the manager's captures (``CudaGraphBackend.capture_environment``): ATen's call is timed on the kernel its
    graphs hold, and the timing stream's workspace is made at full size first."""
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    stream, seen = SimpleNamespace(wait_stream=lambda other: None), []
    monkeypatch.setattr(products, "side_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(products, "graphed_calls", lambda fn, calls: (fn(), ("graph", calls))[1])
    calls = {key: lambda key=key: seen.append((key, os.environ.get("CUBLASLT_WORKSPACE_SIZE"))) for key in ("aten", 0)}
    assert products.graphed_as_captured(calls) == {"aten": ("graph", products.CALLS), 0: ("graph", products.CALLS)}
    assert seen == [("aten", None), (0, None), ("aten", "0"), (0, "0")]
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ


def test_a_phase_clock_adds_each_lap_to_its_phases_total(monkeypatch):
    now = iter([10.0, 10.5, 12.0, 13.25])
    monkeypatch.setattr(products.time, "perf_counter", lambda: next(now))
    totals = dict.fromkeys(products.PHASES, 1.0)
    clock = products.PhaseClock(totals)
    clock.lap("configurations")
    clock.lap("errors")
    clock.lap("configurations")
    assert totals == {"configurations": 1.0 + 0.5 + 1.25, "errors": 1.0 + 1.5, "sweep": 1.0, "screen": 1.0,
                      "timing": 1.0}
    assert str(clock) == "configurations 1.75 s, errors 1.50 s"  # this clock's own seconds, summed per phase


def test_errors_leave_out_configurations_that_do_not_run(monkeypatch):
    fake, bf16 = FakeAlgorithms(), torch.bfloat16
    fake.cublasLtMatmul = lambda *args: 15 if args[12]._obj.data[1] == 22 else 0  # NOT_SUPPORTED for tile 22
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=99))
    product = cublaslt.LtProduct(fake, ctypes.c_void_p(7), torch.zeros(6, 4, dtype=bf16), torch.zeros(6, dtype=bf16), 5,
                           gelu=False)
    algos = [cublaslt.Algo(), cublaslt.Algo(), cublaslt.Algo()]
    for algo, tile in zip(algos, (20, 22, 21), strict=True):
        algo.data[1] = tile
    x, weight = torch.zeros(5, 4, dtype=bf16), torch.zeros(6, 4, dtype=bf16)
    out, exact = torch.ones(5, 6, dtype=bf16), torch.full((5, 6), 2.0, dtype=torch.float64)
    errors = products.MeasuredProducts.errors(product, algos, x, weight, exact, out)
    assert [a.data[1] for a, _ in errors] == [20, 21]
    assert all(math.isnan(e) for _, e in errors)  # the fake writes nothing: out holds the NaN set before each run
    assert products.MeasuredProducts.errors(product, algos[1:2], x, weight, exact, out) == []


class FakeDevice:
    """A device clock and a host clock for the sweep on the CPU: sleeps and product calls advance the device clock,
    events read it; each launch (a product call or an event record) costs ``HOST_US`` of the host clock, so whether
    a chunk's launching outlasted its sleep does not depend on how busy the CPU running the test is."""

    HOST_US = 1.0

    def __init__(self, us_per_tile: dict[int, float]):
        self.now_ms, self.us_per_tile, self.host_us = 0.0, us_per_tile, 0.0

    def event(self):
        device = self

        class Event:
            def record(self):
                device.host_us += device.HOST_US
                self.ms = device.now_ms

            def elapsed_time(self, other):
                return other.ms - self.ms

            def synchronize(self):
                pass

        return Event()

    def sleep(self, cycles: int):
        self.now_ms += cycles / products.SLEEP_CYCLES_PER_US / 1e3

    def run(self, algo, x, weight, out):
        self.host_us += self.HOST_US
        self.now_ms += self.us_per_tile[algo.data[1]] / 1e3

    def perf_counter(self) -> float:
        return self.host_us / 1e6


@pytest.mark.parametrize("first_host_us", [products.FIRST_HOST_US_PER_CALL, 0.0])
def test_the_sweep_ranks_configurations_by_their_calls_time_and_sweeps_late_chunks_again(monkeypatch, caplog,
                                                                                         first_host_us):
    us = {tile: 5.0 + (tile * 37) % 101 / 10 for tile in range(100)}  # distinct times, in no order of the tiles
    device = FakeDevice(us)
    monkeypatch.setattr(products, "timing_event", device.event)
    monkeypatch.setattr(torch.cuda, "_sleep", device.sleep)
    monkeypatch.setattr(products, "FIRST_HOST_US_PER_CALL", first_host_us)
    monkeypatch.setattr(products, "time", SimpleNamespace(perf_counter=device.perf_counter))
    algos = [cublaslt.Algo() for _ in us]
    for algo, tile in zip(algos, us, strict=True):
        algo.data[1] = tile
    with caplog.at_level(logging.DEBUG, logger=products.__name__):
        ranked = products.MeasuredProducts.sweep(SimpleNamespace(run=device.run), algos, None, None, None)
    assert [a.data[1] for a in ranked] == sorted(us, key=us.get)
    for calls, passes, _ in products.RANKING[1:]:  # as the screen's rounds call it
        screened = products.MeasuredProducts.sweep(SimpleNamespace(run=device.run), algos, None, None, None, calls,
                                                   passes)
        assert [a.data[1] for a in screened] == sorted(us, key=us.get)
    again = [int(n) for n in re.findall(r"sweeping (\d+) configurations again", caplog.text)]
    if first_host_us == 0:  # the first chunk's sleep is empty: it is late, and swept again
        assert again and again[0] >= products.SWEEP_CHUNK
    else:  # its sleep (2.56 ms of the fake clock) outlasts launching 64 fake configurations (128 µs of host time)
        assert not again or again[0] < products.SWEEP_CHUNK


def test_the_cuda_backends_product_chooser_is_its_devices(monkeypatch):
    asked = []
    monkeypatch.setattr(products, "measured_products", lambda index: asked.append(index) or f"chooser {index}")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert CudaGraphBackend("cuda:1").product_chooser() == "chooser 1"
    assert asked == [1]


class FakeLt:
    """The few cuBLASLt calls the chooser makes besides ``LtProduct``'s: a handle, the version, and no
    configuration attributes (``config_value`` reads -1)."""

    def __init__(self, version: int = 120805):
        self.version = version

    def cublasLtCreate(self, handle):
        return 0

    def cublasLtGetVersion(self):
        return self.version

    def cublasLtMatmulAlgoConfigGetAttribute(self, *args):
        return 7


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda's device queries for the chooser's constructor; the GPU's name is ``fake_gpu.name``."""
    gpu = SimpleNamespace(name="NVIDIA H200", capturing=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu.name)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: gpu.capturing)
    return gpu


def chooser_on(path, lib=None, device=torch.device("cpu")) -> products.MeasuredProducts:
    """A ``MeasuredProducts`` built by its constructor, on a fake cuBLASLt (``FakeLt``); needs ``fake_gpu``."""
    return products.MeasuredProducts(lib or FakeLt(), device, path)


def test_a_choice_is_recalled_only_on_the_same_gpu_model_and_cublaslt(tmp_path, fake_gpu):
    path, label = tmp_path / "c.json", "1024 x 4304 -> 1152 (torch.bfloat16)"
    entry = products.Choice(None, None, 5.0, 5.0).entry()
    chooser_on(path).cache.put(label, entry)
    assert chooser_on(path).cache.get(label) == entry
    fake_gpu.name = "NVIDIA H100 80GB HBM3"  # the same sm_90
    assert chooser_on(path).cache.get(label) is None
    fake_gpu.name = "NVIDIA H200"
    assert chooser_on(path, FakeLt(version=130000)).cache.get(label) is None


def test_a_choice_an_earlier_measuring_method_made_is_measured_again(tmp_path, fake_gpu, monkeypatch):
    """The setting named the GPU, cuBLASLt and torch only: a choice an earlier plugin's method made (ATen's call,
    recalled without a check) was kept for good, however the measuring changed."""
    path = tmp_path / "c.json"
    x, w, b = aligned_operands()
    version = products.METHOD_VERSION
    monkeypatch.setattr(products, "METHOD_VERSION", version - 1)
    earlier = chooser_on(path)
    earlier.cache.put(earlier.label(x, w, False), products.Choice(None, None, 21.0, 21.0).entry())
    assert chooser_on(path).recall(x, w, b, gelu=False) is not None  # the same method recalls it
    monkeypatch.setattr(products, "METHOD_VERSION", version)
    now = chooser_on(path)
    assert now.cache.setting.endswith(f", method {products.METHOD_VERSION}")
    assert now.recall(x, w, b, gelu=False) is None


def aligned(shape, dtype=torch.bfloat16, shift_bytes=0):
    """A contiguous tensor starting ``shift_bytes`` past a 256-byte boundary."""
    numel, size = math.prod(shape), torch.tensor([], dtype=dtype).element_size()
    flat = torch.zeros(numel + 512 // size, dtype=dtype)
    start = ((-flat.data_ptr()) % 256 + shift_bytes) // size
    return flat[start:start + numel].view(shape)


def aligned_operands(dtype=torch.bfloat16):
    """x, weight and bias of a product the chooser takes: 256-byte aligned."""
    g = torch.Generator().manual_seed(0)
    return (aligned((8, 16), dtype).copy_(torch.randn(8, 16, generator=g)),
            aligned((4, 16), dtype).copy_(torch.randn(4, 16, generator=g) / 4),
            aligned((4,), dtype).copy_(torch.randn(4, generator=g)))


def test_cached_choices_are_per_dtype_and_epilogue_and_a_cached_aten_choice_is_recalled(tmp_path, fake_gpu):
    chooser = chooser_on(tmp_path / "c.json")
    x, w, b = aligned_operands()
    chooser.cache.put(chooser.label(x, w, False), products.Choice(None, None, 5.0, 5.0).entry())
    assert chooser.recall(x, w, b, gelu=False) == products.Choice(None, None, 5.0, 5.0, recalled=True)
    assert chooser.recall(x, w, b, gelu=True) is None
    assert chooser.recall(*aligned_operands(torch.float16), gelu=False) is None


class Recorder:
    def __init__(self, chooser):
        self.seen = []
        chooser.recall = lambda x, w, b, gelu: self.seen.append(("recall", x.dtype, gelu))
        chooser.measure = lambda x, w, b, gelu: (self.seen.append(("measure", x.dtype, gelu)),
                                                 products.Choice(None, None, 5.0, 5.0))[1]


def test_a_shape_is_measured_once_per_dtype_and_never_inside_a_capture(tmp_path, fake_gpu):
    chooser = chooser_on(tmp_path / "c.json")
    record = Recorder(chooser)
    x, w, b = aligned_operands()
    fake_gpu.capturing = True  # first met inside a capture: ATen's call, nothing measured nor kept
    torch.testing.assert_close(chooser.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    assert record.seen == [] and chooser.choices == {}
    fake_gpu.capturing = False
    chooser.linear(x, w, b)
    chooser.linear(x, w, b)
    x16, w16, b16 = aligned_operands(torch.float16)
    torch.testing.assert_close(chooser.linear(x16, w16, b16), F.linear(x16, w16, b16), rtol=0, atol=0)
    assert record.seen == [("recall", torch.bfloat16, False), ("measure", torch.bfloat16, False),
                           ("recall", torch.float16, False), ("measure", torch.float16, False)]
    assert len(chooser.choices) == 2
    fake_gpu.capturing = True  # measured before: its choice runs inside a capture too
    chooser.linear(x, w, b)
    assert len(record.seen) == 4


def test_the_chooser_takes_aligned_operands_on_its_own_device_only(tmp_path, fake_gpu):
    chooser = chooser_on(tmp_path / "c.json")
    x, w, b = aligned((8, 16)), aligned((4, 16)), aligned((4,))
    assert chooser.takes(x, w, b)
    assert not chooser.takes(aligned((8, 16), shift_bytes=32), w, b)  # cuBLASLt's heuristic assumes 256 bytes
    assert not chooser.takes(x, aligned((4, 16), shift_bytes=64), b)
    other = chooser_on(tmp_path / "c.json", device=torch.device("cuda", 1))
    assert not other.takes(x, w, b)  # cpu operands, a chooser of cuda:1


@pytest.mark.parametrize("gelu", [False, True])
def test_while_autograd_records_the_chooser_hands_back_atens_differentiable_products(tmp_path, fake_gpu, gelu):
    """The chooser's cuBLASLt call has no backward: a product whose operands record gradients (a forward under
    ``products.chosen_by`` outside ``inference_mode``) came back without a history, so the weights' gradients were
    silently missing. Such a product now runs ATen's differentiable call, as ``aten_linear_gelu_tanh`` does."""
    chooser = chooser_on(tmp_path / "c.json")
    x, w, b = aligned_operands()
    chooser.choices[(8, 16, 4, torch.bfloat16, gelu)] = products.Choice(cublaslt.Algo(), "algorithm 66", 5.0, 4.0)
    ran = []

    def run(algo, x, weight, out):  # as cuBLASLt writes: into out, with no autograd history
        ran.append(algo)
        with torch.no_grad():
            return out.copy_(aten(x, weight, b, gelu))

    chooser.descriptor = lambda weight, bias, rows, gelu: SimpleNamespace(run=run)
    product = chooser.linear_gelu_tanh if gelu else chooser.linear
    product(x, w, b)
    assert len(ran) == 1  # without autograd the chosen configuration runs
    w.requires_grad_()
    got = product(x, w, b)
    assert len(ran) == 1 and got.grad_fn is not None
    got.float().sum().backward()
    want_grad, w.grad = w.grad, None
    aten(x, w, b, gelu).float().sum().backward()
    torch.testing.assert_close(want_grad, w.grad, rtol=0, atol=0)
    with torch.no_grad():  # the same tensors without recording: the chosen configuration again
        product(x, w, b)
    assert len(ran) == 2


def test_operands_whose_product_is_not_finite_grade_nothing_and_leave_no_choice_in_the_cache(ranked, caplog):
    """With a NaN among the operands (an uninitialised tower's), ATen's own error against the float64 product was NaN:
    no configuration was within that bound, and the verdict, ATen's call for good, was cached, so every later process
    recalled it unchecked. Such operands grade nothing: the shape keeps ATen's call in this process only, and a
    cached configuration is not recalled on them."""
    x, w, b = ranked.setup([1, 2], {}, {1: 1.0, 2: 2.0}, {"aten": 10.0, 1: 8.0, 2: 9.0})
    x[0, 0] = math.nan
    choice = ranked.measure(x, w, b, gelu=False)
    assert choice.algo is None and math.isnan(choice.aten_us)
    assert "failed, it keeps ATen's" in caplog.text and "not finite" in caplog.text
    assert ranked.cache.get(ranked.label(x, w, False)) is None  # a later process measures it again
    assert ranked.timed == []
    algo = cublaslt.Algo()
    algo.data[0] = 1
    ranked.cache.put(ranked.label(x, w, False), products.Choice(algo, "x", 10.0, 8.0).entry())
    ranked.lib = SimpleNamespace(cublasLtMatmulAlgoConfigGetAttribute=lambda *args: 7)
    ranked.descriptor(w, b, 8, False).accepts = lambda algo: True
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=products.__name__):
        assert ranked.recall(x, w, b, gelu=False) is None
    assert "does not hold" in caplog.text and "not finite" in caplog.text


def test_a_product_that_overflows_gives_no_accuracy_bound():
    """fp16 operands whose product overflows: ATen's error was inf, so every configuration that ran, whatever it
    wrote, was within the bound."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(8, 16, generator=g).half(), (torch.randn(4, 16, generator=g) / 4).half(),
               torch.randn(4, generator=g).half())
    x[0] = 6e4 * torch.sign(w[0])  # row 0 times weight row 0: about 1.6e5, past fp16's 65504
    with pytest.raises(ValueError, match=r"ATen's relative error against the float64 product is inf"):
        products.MeasuredProducts.accuracy(x, w, b, gelu=False)


def test_the_accuracy_bound_is_one_and_a_half_times_atens_error_plus_1e_4():
    x, w, b = aligned_operands()
    exact, bound = products.MeasuredProducts.accuracy(x, w, b, gelu=False)
    torch.testing.assert_close(exact, x.double() @ w.double().t() + b.double())
    assert bound == pytest.approx(1.5 * relative_error(F.linear(x, w, b), exact) + 1e-4)


class RankedDescriptor:
    """``LtProduct`` off the GPU: configurations are ``Algo``s named by ``data[0]``; ``run`` writes ATen's result,
    off by ``errors[id]`` where given. ``sweep_ms`` is what the sweep measures of each (``sweep_times``)."""

    def __init__(self, ids, bias, errors=None):
        self.ids, self.bias, self.errors = ids, bias, errors or {}

    def algo(self, algo_id):
        algo = cublaslt.Algo()
        algo.data[0] = algo_id
        return algo

    def candidates(self):
        found = []
        for algo_id in self.ids[:2]:
            heuristic = cublaslt.Heuristic()
            heuristic.algo = self.algo(algo_id)
            found.append(heuristic)
        return found

    def configurations(self, candidates):
        return [self.algo(i) for i in self.ids[2:]]

    def run(self, algo, x, weight, out, workspace=None):
        return out.copy_(F.linear(x, weight, self.bias) + self.errors.get(algo.data[0], 0.0))


class Replay:
    def __init__(self, key):
        self.key = key

    def __call__(self):
        pass


@pytest.fixture
def ranked(tmp_path, fake_gpu, monkeypatch):
    """A chooser whose ``measure`` runs on ``RankedDescriptor`` with the sweep's and the graphs' times set by the
    test (``setup(ids, errors, sweep_ms, graph_us)``; graph_us has "aten"); records the keys timed in graphs."""
    chooser, timed = chooser_on(tmp_path / "c.json"), []

    def setup(ids, errors, sweep_ms, graph_us):
        x, w, b = aligned_operands()
        descriptor = RankedDescriptor(ids, b, errors)
        chooser.descriptor = lambda weight, bias, rows, gelu: descriptor
        monkeypatch.setattr(products.MeasuredProducts, "sweep_times", staticmethod(
            lambda descriptor, algos, x, weight, out, calls=1, passes=1: [sweep_ms[a.data[0]] for a in algos]))

        def graphed(calls):
            keys = {key: "aten" if key == "aten" else fn.args[0].data[0] for key, fn in calls.items()}
            timed.append(set(keys.values()))
            return {key: SimpleNamespace(replay=Replay(keys[key])) for key in calls}

        monkeypatch.setattr(products, "graphed_as_captured", graphed)
        monkeypatch.setattr(products, "measure_interleaved", lambda fns, device, warmup, samples: {
            key: SimpleNamespace(median=graph_us[fn.key] * products.CALLS / 1e3) for key, fn in fns.items()})
        return x, w, b

    chooser.setup, chooser.timed = setup, timed
    return chooser


def test_measuring_keeps_the_fastest_accurate_configuration_times_only_the_shortlist_and_caches_it(ranked):
    ids = list(range(1, 11))  # 9 and 10 are the sweep's and the graphs' fastest, and inaccurate
    sweep_ms = {i: 1.0 + i / 10 for i in ids} | {9: 0.1, 10: 0.2}
    graph_us = {"aten": 10.0} | {i: 9.0 + i / 10 for i in ids} | {9: 5.0, 10: 5.0}
    x, w, b = ranked.setup(ids, {9: 1.0, 10: -0.5}, sweep_ms, graph_us)
    choice = ranked.measure(x, w, b, gelu=False)
    assert ranked.timed == [{"aten", 1, 2, 3, 4}]  # the SHORTLIST fastest accurate ones, and ATen's call
    assert choice.algo is not None and choice.algo.data[0] == 1
    assert (choice.aten_us, choice.chosen_us) == (pytest.approx(10.0), pytest.approx(9.1))
    assert ranked.cache.get(ranked.label(x, w, False)) == choice.entry()


def test_measuring_keeps_atens_call_unless_a_configuration_beats_it_by_the_margin(ranked):
    ids = [1, 2]
    almost = 10.0 * (1 - products.MARGIN / 2)
    x, w, b = ranked.setup(ids, {}, {1: 1.0, 2: 2.0}, {"aten": 10.0, 1: almost, 2: 11.0})
    choice = ranked.measure(x, w, b, gelu=False)
    assert choice.algo is None and choice.aten_us == choice.chosen_us == pytest.approx(10.0)
    assert ranked.cache.get(ranked.label(x, w, False)) == choice.entry()


def test_a_measured_shape_is_logged_with_its_choice(ranked, caplog):
    x, w, b = ranked.setup([1], {}, {1: 1.0}, {"aten": 10.0, 1: 8.0})
    with caplog.at_level(logging.INFO, logger=products.__name__):
        ranked.measure(x, w, b, gelu=False)
    assert f"matrix product {ranked.label(x, w, False)}: 1 of 1 configurations as accurate" in caplog.text


class FakeDescriptors(FakeCublasLt):
    """``FakeCublasLt`` for the chooser's constructor too (a handle, a version), with numbered descriptors, recording
    the descriptors and layouts destroyed."""

    def __init__(self):
        super().__init__()
        self.destroyed, self.made = [], 0

    def cublasLtCreate(self, handle):
        return 0

    def cublasLtGetVersion(self):
        return 120805

    def cublasLtMatmulDescCreate(self, desc, compute, scale):
        self.made += 1
        desc._obj.value = 1000 + self.made
        return 0

    def cublasLtMatmulDescDestroy(self, desc):
        self.destroyed.append(("desc", desc.value))
        return 0

    def cublasLtMatrixLayoutDestroy(self, layout):
        self.destroyed.append(("layout", layout.value))
        return 0


def test_only_the_last_used_products_keep_descriptors_and_the_least_recently_used_is_destroyed(tmp_path, fake_gpu,
                                                                                                monkeypatch):
    """Descriptors are per weight, bias and row count: unbounded, every new tower's added its own for the process's
    life, with their cuBLASLt objects never destroyed."""
    monkeypatch.setattr(products, "DESCRIPTORS", 2)
    fake = FakeDescriptors()
    chooser, bias = chooser_on(tmp_path / "c.json", fake), aligned((4,))
    weights = [aligned((4, 16)) for _ in range(3)]
    first, second = (chooser.descriptor(w, bias, 8, gelu=False) for w in weights[:2])
    objects = {p: [("layout", layout.value) for layout in p.layouts] + [("desc", p.desc.value)]
               for p in (first, second)}
    assert chooser.descriptor(weights[0], bias, 8, gelu=False) is first  # used again: the most recent now
    third = chooser.descriptor(weights[2], bias, 8, gelu=False)
    assert list(chooser.descriptors.values()) == [first, third]
    assert fake.destroyed == objects[second] and second.desc is None and second.layouts == []
    second.close()  # closed already: nothing more is destroyed
    assert fake.destroyed == objects[second]
    again = chooser.descriptor(weights[1], bias, 8, gelu=False)  # made anew; first is now the least recently used
    assert again is not second and list(chooser.descriptors.values()) == [third, again]
    assert fake.destroyed == objects[second] + objects[first]


def test_described_since_a_mark_are_only_the_shapes_and_seconds_after_it(tmp_path, fake_gpu, monkeypatch):
    """The chooser is the process's: a second manager that measured nothing reported the first one's shapes and
    seconds. ``describe()`` without a mark still reports the process's."""
    chooser, algo = chooser_on(tmp_path / "c.json"), cublaslt.Algo()
    made = {8: products.Choice(algo, "algorithm 66", 10.0, 8.0),
            16: products.Choice(None, None, 5.0, 5.0, recalled=True),
            24: products.Choice(algo, "algorithm 66", 6.0, 5.5)}

    def measure(x, w, b, gelu):
        chooser.phases["sweep"] += 1.0
        return made[x.shape[0]]

    chooser.recall = lambda x, w, b, gelu: made[x.shape[0]] if made[x.shape[0]].recalled else None
    chooser.measure = measure
    chooser.descriptor = lambda weight, bias, rows, gelu: SimpleNamespace(run=lambda algo, x, weight, out: out)
    clock = itertools.count(0.0, 1.5)  # a shape's recall or measuring reads it twice: 1.5 s
    monkeypatch.setattr(products, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    w, b = aligned((4, 16)), aligned((4,))
    cache = f"the cache {tmp_path / 'c.json'}"
    chooser.linear(aligned((8, 16)), w, b)  # an earlier manager's shape
    mark = chooser.mark()
    assert chooser.describe(since=mark) == (
        f"measured cuBLASLt algorithms: 0 shapes in 0.0 s (0 from {cache}; measuring: configurations 0.0 s, errors "
        f"0.0 s, sweep 0.0 s, screen 0.0 s, timing 0.0 s); 0 run another configuration than ATen's, 0.0 µs faster "
        f"per call of each together; 1 shapes in this process in all")
    chooser.linear(aligned((16, 16)), w, b)
    chooser.linear(aligned((24, 16)), w, b)
    chooser.linear(aligned((8, 16)), w, b)  # chosen before the mark: not again
    assert chooser.describe(since=mark) == (
        f"measured cuBLASLt algorithms: 2 shapes in 3.0 s (1 from {cache}; measuring: configurations 0.0 s, errors "
        f"0.0 s, sweep 1.0 s, screen 0.0 s, timing 0.0 s); 1 run another configuration than ATen's, 0.5 µs faster "
        f"per call of each together; 3 shapes in this process in all")
    assert chooser.describe() == (
        f"measured cuBLASLt algorithms: 3 shapes in 4.5 s (1 from {cache}; measuring: configurations 0.0 s, errors "
        f"0.0 s, sweep 2.0 s, screen 0.0 s, timing 0.0 s); 2 run another configuration than ATen's, 2.5 µs faster "
        f"per call of each together")


def test_readying_the_side_stream_runs_the_call_there_after_the_current_streams_work_and_waits_for_it(monkeypatch):
    events, devices, streams = [], [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

        def synchronize(self):
            events.append(f"{self.name} synchronized")

    @contextlib.contextmanager
    def entered(into, value):
        into.append(value)
        yield
        into.pop()

    side = Stream("side")
    monkeypatch.setattr(timing, "side_stream", lambda device: side if device == 1 else None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered(devices, device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(f"current of {devices[-1]}"))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: entered(streams, stream))
    assert timing.ready_side_stream(1, lambda: events.append(f"call on {streams[-1].name} of {devices[-1]}")) is side
    assert events == ["side waits for current of 1", "call on side of 1", "side synchronized"]
    assert devices == streams == []


def test_the_processs_chooser_is_handed_out_with_its_side_stream_readied_by_the_aten_calls_measuring_times(
        monkeypatch, fake_gpu):
    """Measuring times ATen's calls on ``side_stream``, whose first use makes cuBLAS's workspaces for the process
    (34 MiB on the H200): made as the chooser is, before a manager's memory baseline, not inside its first budget."""
    readied, aten = [], []
    monkeypatch.setattr(cublaslt, "cublaslt", lambda: (FakeLt(), ""))
    monkeypatch.setattr(products, "ready_side_stream", lambda index, fn: readied.append((index, fn)))
    chooser = products.measured_products.__wrapped__(2)
    assert chooser.device == torch.device("cuda", 2) and readied == [(2, chooser.aten_calls)]
    monkeypatch.setattr(products.MeasuredProducts, "aten", staticmethod(
        lambda x, w, b, gelu: aten.append((x.dtype, tuple(x.shape), tuple(w.shape), tuple(b.shape), gelu))))
    chooser.device = torch.device("cpu")  # the calls' operands are made on the chooser's device
    chooser.aten_calls()
    assert aten == [(torch.bfloat16, (16, 16), (16, 16), (16,), gelu) for gelu in (False, True)]


# ---------------------------------------------------------------- on the GPU
TOWER_PRODUCTS = [(1152, 3456, False), (1152, 1152, False), (1152, 4304, True), (4304, 1152, False)]


def operands(rows: int, k: int, n: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    return x, w, torch.randn(n, device="cuda", generator=g).bfloat16()


def aten(x, w, b, gelu):
    return aten_linear_gelu_tanh(x, w, b) if gelu else F.linear(x, w, b)


@pytest.fixture
def chooser():
    lib, reason = cublaslt.cublaslt()
    assert lib is not None, reason
    return products.MeasuredProducts(lib, torch.device("cuda", 0), None)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("rows", [256, 1024, 4096])
def test_measured_products_equal_atens_within_its_rounding(chooser, rows):
    for k, n, gelu in TOWER_PRODUCTS:
        x, w, b = operands(rows, k, n)
        got = chooser.linear_gelu_tanh(x, w, b) if gelu else chooser.linear(x, w, b)
        want = aten(x, w, b, gelu)
        exact = x.double() @ w.double().t() + b.double()
        exact = F.gelu(exact, approximate="tanh") if gelu else exact
        assert relative_error(got, exact) <= 1.5 * relative_error(want, exact) + 1e-4
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2e-3)
    assert len(chooser.choices) == len(TOWER_PRODUCTS)
    described = chooser.describe()
    assert described.startswith(f"measured cuBLASLt algorithms: {len(TOWER_PRODUCTS)} shapes in ")
    assert "(no cache between processes: HWGRAPH_CACHE_DIR is empty, or there is no home folder; measuring: " \
           "configurations " in described
    assert all(seconds > 0 for seconds in chooser.phases.values())  # every shape was measured, in every phase
    assert sum(chooser.phases.values()) <= chooser.seconds


@pytest.mark.cuda
@needs_gpu
def test_configurations_add_accepted_tiles_and_clusters_beyond_the_heuristics_list(chooser):
    x, w, b = operands(4096, 1152, 4304)  # fc1 + GELU at 4096 rows: 128x128 tiles in 2x1 clusters beat the list
    descriptor = chooser.descriptor(w, b, 4096, gelu=True)
    candidates = descriptor.candidates()
    assert candidates and all(cublaslt.config_value(chooser.lib, c.algo, cublaslt.CFG_ID) >= 0 for c in candidates)
    found = descriptor.configurations(candidates)
    assert len(found) > len(candidates)
    assert not {bytes(a) for a in found} & {bytes(c.algo) for c in candidates}
    assert all(descriptor.accepts(a) and cublaslt.config_value(chooser.lib, a, cublaslt.CFG_SPLITK) == 1 for a in found)


@pytest.mark.cuda
@needs_gpu
def test_the_sweep_ranks_every_configuration_and_sweeps_again_where_launching_outlasted_the_sleep(
        chooser, monkeypatch, caplog):
    x, w, b = operands(1024, 1152, 4304)
    descriptor = chooser.descriptor(w, b, 1024, gelu=True)
    candidates = descriptor.candidates()
    out, exact = x.new_empty(1024, 4304), F.gelu(x.double() @ w.double().t() + b.double(), approximate="tanh")
    # as in measure: every configuration has been launched once (its first launch is slow) before the sweep
    algos = [a for a, _ in chooser.errors(descriptor, [c.algo for c in candidates] +
                                          descriptor.configurations(candidates), x, w, exact, out)]
    with caplog.at_level(logging.DEBUG, logger=products.__name__):
        assert sorted(map(bytes, chooser.sweep(descriptor, algos, x, w, out))) == sorted(map(bytes, algos))
    assert f"sweeping {len(algos)} configurations again" not in caplog.text  # sleeps sized to the launching hold
    caplog.clear()
    # the first chunk's sleep is far shorter than its launching
    monkeypatch.setattr(products, "FIRST_HOST_US_PER_CALL", 1e-3)
    with caplog.at_level(logging.DEBUG, logger=products.__name__):
        ranked = chooser.sweep(descriptor, algos, x, w, out)
    again = [int(n) for n in re.findall(r"sweeping (\d+) configurations again", caplog.text)]
    assert again and again[0] >= min(len(algos), products.SWEEP_CHUNK)  # the first chunk, at least, was swept again
    assert sorted(map(bytes, ranked)) == sorted(map(bytes, algos))


@pytest.mark.cuda
@needs_gpu
def test_measuring_ranks_in_rounds_each_on_the_previous_rounds_fastest(chooser, monkeypatch):
    rounds, sweep_times = [], products.MeasuredProducts.sweep_times

    def recorded(descriptor, algos, x, weight, out, calls=products.RANKING[0][0], passes=1):
        ms = sweep_times(descriptor, algos, x, weight, out, calls, passes)
        rounds.append({"algos": list(map(bytes, algos)), "calls": calls, "passes": passes, "ms": ms})
        return ms

    monkeypatch.setattr(products.MeasuredProducts, "sweep_times", staticmethod(recorded))
    x, w, b = operands(1024, 1152, 1152)
    chooser.linear(x, w, b)
    (choice,) = chooser.choices.values()
    assert [(r["calls"], r["passes"]) for r in rounds] == [(calls, passes) for calls, passes, _ in products.RANKING]
    assert len(rounds[0]["algos"]) > products.RANKING[0][2]  # every accurate configuration, hundreds of them
    assert all(0 < ms < math.inf for r in rounds for ms in r["ms"])  # every configuration was timed
    for earlier, later, (_, _, keep) in zip(rounds, rounds[1:], products.RANKING, strict=False):
        fastest = sorted(range(len(earlier["algos"])), key=earlier["ms"].__getitem__)[:keep]
        assert later["algos"] == [earlier["algos"][i] for i in fastest]
    shortlist = sorted(range(len(rounds[-1]["algos"])), key=rounds[-1]["ms"].__getitem__)[:products.SHORTLIST]
    assert choice.algo is None or bytes(choice.algo) in {rounds[-1]["algos"][i] for i in shortlist}


def warmed_and_captured(warm, body):
    """``warm()`` run on a side stream, then ``body()`` captured there, as ``torch.cuda.graph`` asks: the graph and
    what ``body`` returned."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, stream=side):
        out = body()
    return graph, out


@pytest.mark.cuda
@needs_gpu
def test_a_chosen_product_replays_on_new_inputs_and_an_unseen_shape_is_not_measured_while_capturing(chooser):
    x, w, b = operands(1024, 4304, 1152)  # fc2 at 1024 rows: another configuration than ATen's on the H200
    static = x.clone()
    chooser.linear(static, w, b)  # measured here, outside the capture
    (choice,) = chooser.choices.values()
    unseen_x, unseen_w, unseen_b = operands(512, 1152, 1152, seed=1)
    graph, (out, unseen) = warmed_and_captured(
        lambda: chooser.linear(static, w, b),
        lambda: (chooser.linear(static, w, b), chooser.linear(unseen_x, unseen_w, unseen_b)))
    assert len(chooser.choices) == 1  # the shape first met while capturing ran ATen's call, unmeasured
    for seed in (2, 3):
        static.copy_(operands(1024, 4304, 1152, seed)[0])
        graph.replay()
        torch.testing.assert_close(out, F.linear(static, w, b), rtol=2**-7, atol=2e-3)
        torch.testing.assert_close(unseen, F.linear(unseen_x, unseen_w, unseen_b), rtol=2**-7, atol=2e-3)
    assert choice.aten_us > 0 and choice.chosen_us > 0


@pytest.mark.cuda
@needs_gpu
def test_a_tower_shape_chooses_a_cublaslt_configuration_which_its_capture_runs_and_replays_equal_to_eager(
        chooser, monkeypatch):
    """Were every shape to fall back to ATen's call, the other tests would pass. On the H200, 26 of the tower's 35
    shapes choose another configuration, these by 12-20% (fc2 at 1024 rows, then fc1 + GELU at 4096 rows); the
    first that does is captured."""
    for rows, k, n, gelu in [(1024, 4304, 1152, False), (4096, 1152, 4304, True)]:
        x, w, b = operands(rows, k, n)
        product = chooser.linear_gelu_tanh if gelu else chooser.linear
        static = x.clone()
        product(static, w, b)  # measured here
        choice = chooser.choices[(rows, k, n, torch.bfloat16, gelu)]
        if choice.algo is not None:
            break
    else:
        pytest.fail(f"every shape kept ATen's call: {chooser.describe()}")
    assert choice.config and choice.chosen_us <= choice.aten_us * (1 - products.MARGIN)
    launched, run = [], cublaslt.LtProduct.run

    def recording(self, algo, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            launched.append(bytes(algo))
        return run(self, algo, *args, **kwargs)

    monkeypatch.setattr(cublaslt.LtProduct, "run", recording)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        product(static, w, b)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, stream=side):
        out = product(static, w, b)
    assert launched == [bytes(choice.algo)]  # the graph holds the chosen configuration, not ATen's call
    for seed in (1, 2):
        static.copy_(operands(rows, k, n, seed)[0])
        graph.replay()
        torch.testing.assert_close(out, product(static, w, b), rtol=0, atol=0)  # eager, the same configuration
        torch.testing.assert_close(out, aten(static, w, b, gelu), rtol=2**-7, atol=2e-3)


@pytest.mark.cuda
@needs_gpu
def test_measuring_leaves_no_memory_allocated_per_shape(chooser):
    """cuBLAS keeps a workspace per stream: measuring times its graphs on one side stream, so after the first shape
    (which may make that stream's workspace) each shape measured leaves nothing allocated behind."""
    shapes = [(1024, 4304, 1152), (1024, 1152, 4304), (512, 3456, 1152)]
    operand_sets = [operands(*shape, seed=i) for i, shape in enumerate(shapes)]
    chooser.linear(*operand_sets[0])
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    for x, w, b in operand_sets[1:]:
        chooser.linear(x, w, b)
        chooser.linear_gelu_tanh(x, w, b)
    torch.cuda.synchronize()
    assert len(chooser.choices) == 5
    assert torch.cuda.memory_allocated() - allocated < 2**20


@pytest.mark.cuda
@needs_gpu
def test_a_second_chooser_recalls_the_first_ones_choices_from_the_cache_and_measures_what_no_longer_holds(tmp_path):
    lib, _ = cublaslt.cublaslt()
    first = products.MeasuredProducts(lib, torch.device("cuda", 0), tmp_path / "choices.json")
    shapes = [operands(1024, 4304, 1152), operands(256, 1152, 1152)]
    for x, w, b in shapes:
        first.linear(x, w, b)
    second = products.MeasuredProducts(lib, torch.device("cuda", 0), tmp_path / "choices.json")
    for x, w, b in shapes:
        torch.testing.assert_close(second.linear(x, w, b), first.linear(x, w, b), rtol=0, atol=0)
    assert [c.recalled for c in second.choices.values()] == [True, True]
    assert [c.config for c in second.choices.values()] == [c.config for c in first.choices.values()]
    assert "2 shapes in " in second.describe() and "(2 from the cache" in second.describe()
    label = products.MeasuredProducts.label(shapes[0][0], shapes[0][1], False)
    x, w, b = shapes[0]
    descriptor = first.descriptor(w, b, x.shape[0], gelu=False)
    rejected = cublaslt.configured(lib, descriptor.candidates()[0].algo, {cublaslt.CFG_TILE: 10**6})  # no such tile
    assert rejected is not None and not descriptor.accepts(rejected)
    broken = [{"index": 3, "aten_us": 1.0, "chosen_us": 0.5},  # session 19's format
              {"algo": "not hex", "config": None, "aten_us": 1.0, "chosen_us": 0.5},
              {"algo": bytes(rejected).hex(), "config": None, "aten_us": 1.0, "chosen_us": 0.5}]
    for entry in broken:
        second.cache.put(label, entry)
        third = products.MeasuredProducts(lib, torch.device("cuda", 0), tmp_path / "choices.json")
        third.linear(*shapes[0])
        (choice,) = third.choices.values()
        assert not choice.recalled and choice.aten_us > 1.0  # measured again, and cached again
        assert third.cache.get(label) == choice.entry()


@pytest.mark.cuda
@needs_gpu
def test_inputs_it_does_not_take_run_atens_call_unmeasured(chooser):
    x, w, b = operands(256, 1152, 1152)
    wide = torch.empty(256, 1160, device="cuda", dtype=torch.bfloat16)
    wide[:, :1152] = x
    misaligned = x.view(-1)[8:8 + 255 * 1152].view(255, 1152)  # contiguous, 16 bytes past a 256-byte boundary
    cases = [(x, w, None), (x.float(), w.float(), b.float()), (wide[:, :1152], w, b), (misaligned, w, b),
             (x.unsqueeze(0), w, b)]
    for xi, wi, bi in cases:
        assert not chooser.takes(xi, wi, bi)
        assert torch.equal(chooser.linear(xi, wi, bi), F.linear(xi, wi, bi))
    assert chooser.choices == {}
    assert chooser.takes(x, w, b)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("gelu", [False, True])
def test_products_that_autograd_records_train_as_atens_do_even_where_a_configuration_was_chosen(chooser, gelu):
    """The chosen cuBLASLt call has no backward: under ``products.chosen_by`` with autograd recording, the weights'
    gradients were silently missing. Such products run ATen's call; without recording, the chosen one again."""
    x, w, b = operands(1024, 4304, 1152)
    product = chooser.linear_gelu_tanh if gelu else chooser.linear
    with torch.no_grad():
        product(x, w, b)  # measured now
    assert len(chooser.choices) == 1
    w.requires_grad_()
    got = product(x, w, b)
    assert got.grad_fn is not None
    got.float().square().sum().backward()
    want, w.grad = w.grad, None
    aten(x, w, b, gelu).float().square().sum().backward()
    torch.testing.assert_close(want, w.grad)  # the same ATen calls


@pytest.mark.cuda
@needs_gpu
def test_the_manager_captures_measured_products_equal_to_eager_without_host_reads_on_replay():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", depth=4, deepstack_visual_indexes=[1, 2, 3]).to(
        "cuda", torch.bfloat16).eval()
    with EncoderGraphManager(tower, budgets=[64, 256], max_images_per_graph=2, measure_products=True) as m:
        m.capture()
        s = m.stats()
        assert sorted(m.graphs) == [64, 256], s["capture_failures"]
        assert s["products"].startswith("measured cuBLASLt algorithms: ")
        for i, grid in enumerate([[(1, 14, 14)], [(1, 14, 14), (1, 16, 16)], [(1, 32, 32)]]):
            g = torch.Generator(device="cuda").manual_seed(i)
            pix = torch.randn(sum(t * h * w for t, h, w in grid), 1536, device="cuda", dtype=torch.bfloat16,
                              generator=g)
            m.encode(pix, grid)  # warms the pinned host allocator for this grid
            with m.backend.sync_guard():
                got = m.encode(pix, grid)
            with torch.inference_mode():
                want = tower.forward(pix, grid).split([t * h * w // 4 for t, h, w in grid])
            for a, e in zip(got, want, strict=True):
                for gt, wt in zip(a.tensors(), e.tensors(), strict=True):
                    torch.testing.assert_close(gt, wt, rtol=1.6e-2, atol=1e-2)
        assert m.stats()["replays_per_budget"] == {64: 2, 256: 4}


@pytest.mark.cuda
@needs_gpu
def test_compiled_captures_run_the_measured_products_and_replay_equal_to_eager(monkeypatch):
    captured = []
    product = products.MeasuredProducts.product

    def recording(self, x, weight, bias, gelu):
        if torch.cuda.is_current_stream_capturing():
            captured.append((x.shape[0], tuple(weight.shape), gelu))
        return product(self, x, weight, bias, gelu)

    monkeypatch.setattr(products.MeasuredProducts, "product", recording)
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", depth=4, deepstack_visual_indexes=[1, 2, 3]).to(
        "cuda", torch.bfloat16).eval()
    with EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, measure_products=True) as m:
        m.capture()
        assert sorted(m.graphs) == [64], m.stats()["capture_failures"]
    plain, captured[:] = list(captured), []
    # qkv, proj, fc1 (with its GELU epilogue) and fc2 of each block, and what else the chooser takes
    assert sum(gelu for _, _, gelu in plain) == 4 and len(plain) >= 4 * 4
    with EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, compile=True, measure_products=True) as m:
        m.capture()
        s = m.stats()
        assert sorted(m.graphs) == [64] and s["compile_failures"] == {}, s["capture_failures"]
        assert s["products"].startswith("measured cuBLASLt algorithms: ")
        assert sorted(captured) == sorted(plain)  # the compiled blocks' products too
        assert 0 < s["compile_seconds_per_budget"][64] < s["capture_seconds_per_budget"][64]
        grid = [(1, 14, 14)]
        pix = torch.randn(196, 1536, device="cuda", dtype=torch.bfloat16)
        m.encode(pix, grid)  # warms the pinned host allocator for this grid
        with m.backend.sync_guard():
            got = m.encode(pix, grid)
        with torch.inference_mode():
            want = tower.forward(pix, grid)
        for gt, wt in zip(got[0].tensors(), want.tensors(), strict=True):
            torch.testing.assert_close(gt, wt, rtol=1.6e-2, atol=1e-2)
        assert m.stats()["replays_per_budget"] == {64: 2}


FIRST_MEASURING_MANAGERS_MEMORY = """
import json, torch
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
torch.manual_seed(0)
tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", depth=2, deepstack_visual_indexes=[0, 1]).to(
    "cuda", torch.bfloat16).eval()
found = []
for _ in range(2):
    with EncoderGraphManager(tower, budgets=[64, 128], max_images_per_graph=2, measure_products=True) as m:
        m.capture()
        found.append([m.stats()["capture_bytes_per_budget"], m.stats()["products"]])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
print(json.dumps(found))
"""


@pytest.mark.cuda
@needs_gpu
def test_the_first_manager_measuring_products_in_a_process_counts_only_its_graphs(tmp_path):
    """Measuring times ATen's calls on the process's side stream, whose first use makes cuBLAS's workspaces for good
    (34 MiB on the H200; 38.0 against 4.0 MiB in the first budget measured). In a new process (a new side stream)
    with an empty choice cache (every shape measured, none recalled), the first manager's budgets cost what the
    second's do, which measures nothing."""
    run = subprocess.run([sys.executable, "-c", FIRST_MEASURING_MANAGERS_MEMORY], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "HWGRAPH_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-4000:]
    (first, described), (second, _) = json.loads(run.stdout.strip().splitlines()[-1])
    assert re.match(r"measured cuBLASLt algorithms: [1-9]\d* shapes in .* \(0 from the cache", described), described
    assert first.keys() == second.keys() == {"64", "128"}
    for budget, nbytes in second.items():  # allocator rounding at most
        assert abs(first[budget] - nbytes) <= 4 << 20, (first, second)


@pytest.mark.cuda
@needs_gpu
def test_a_graph_replays_right_after_its_products_descriptors_were_evicted_and_destroyed(chooser, monkeypatch):
    """The captured kernel keeps what it was launched with: destroying the descriptors behind a graph's product
    (``DESCRIPTORS`` exceeded) leaves its replays as they were."""
    monkeypatch.setattr(products, "DESCRIPTORS", 1)
    rows, k, n = 1024, 1152, 4304  # fc1, with the GELU epilogue and its bias in the descriptor
    x, w, b = operands(rows, k, n)
    descriptor = chooser.descriptor(w, b, rows, gelu=True)
    algo = descriptor.candidates()[0].algo  # chosen without measuring: the graph runs cuBLASLt, not ATen's call
    chosen = products.Choice(algo, cublaslt.describe_algo(chooser.lib, algo), 1, 1)
    chooser.choices[(rows, k, n, torch.bfloat16, True)] = chosen
    static = x.clone()
    graph, out = warmed_and_captured(lambda: chooser.linear_gelu_tanh(static, w, b),
                                     lambda: chooser.linear_gelu_tanh(static, w, b))
    other_w, other_b = operands(rows, k, n, seed=1)[1:]
    chooser.linear_gelu_tanh(static, other_w, other_b)  # the same shape, other operands: their descriptors evict
    torch.cuda.synchronize()
    assert descriptor.desc is None and len(chooser.descriptors) == 1
    for seed in (2, 3):
        static.copy_(operands(rows, k, n, seed)[0])
        graph.replay()
        torch.testing.assert_close(out, aten(static, w, b, True), rtol=2**-7, atol=2e-3)


@pytest.mark.cuda
@needs_gpu
def test_atens_fused_gelu_product_trains_as_the_unfused_pair_does():
    """On CUDA the product runs the GELU as cuBLASLt's epilogue (``torch._addmm_activation``), which has no backward:
    a direct caller whose tensors record gradients got a forward whose backward raised "derivative for
    aten::_addmm_activation is not implemented"."""
    x, w, b = (t.float().requires_grad_() for t in operands(64, 96, 80))
    aten_linear_gelu_tanh(x, w, b).square().sum().backward()
    got = [t.grad for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.gelu(F.linear(x, w, b), approximate="tanh").square().sum().backward()
    for g, t in zip(got, (x, w, b), strict=True):
        torch.testing.assert_close(g, t.grad)
    with torch.no_grad():  # without autograd the epilogue runs still: equal to the pair within its rounding
        torch.testing.assert_close(aten_linear_gelu_tanh(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh"),
                                   rtol=1e-4, atol=1e-4)
