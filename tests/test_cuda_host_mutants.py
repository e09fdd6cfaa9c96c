"""Host-side behaviour of the shared ``torch.cuda`` graph backend, the CUDA and ROCm plugins and the measured-products
chooser that a hand-made mutation audit found unchecked on the CPU: a released graph never replays; the sync guard
turns the runtime's sync error into ``HostSyncError``; a capture uses the caller's pool, the backend's device (its
stream, memory, synchronisation and pool routing after a failure) and lets Ctrl-C through; ROCm warms up one run more
and catches a replay that disagrees with eager; the chooser's cache and choices are per GPU, library, shape, dtype
and epilogue, it never measures inside a capture, measures a shape once, keeps only configurations as accurate as
ATen's and faster by ``MARGIN``, and times only the ranking's shortlist in graphs.

The device runtime is a fake namespace (``FakeRuntime``) handed to a subclass of the backend, and cuBLASLt a fake
library; every tensor is a CPU tensor.
"""

from __future__ import annotations

import contextlib
import logging
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hwgraph_cuda import products as lt
from hwgraph_cuda.graphs import CudaGraphBackend
from hwgraph_cuda.platform import gate as cuda_gate
from hwgraph_rocm.graphs import RocmGraphBackend

from hwgraph.capability import Capability
from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.torch_cuda import (
    TorchCudaCapturedGraph,
    TorchCudaGraphBackend,
    torch_build,
    torch_version_capability,
)
from hwgraph.manager import relative_error
from hwgraph.platform import detect
from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

H200 = DeviceProperties("NVIDIA H200", 9, 0)


# ---------------------------------------------------------------- a fake torch.cuda namespace


class FakeStream:
    def __init__(self, name: str, device, runtime: FakeRuntime):
        self.name, self.device, self.runtime = name, device, runtime

    def wait_stream(self, other: FakeStream) -> None:
        self.runtime.events.append(f"{self.name} waits for {other.name}")


class FakeGraph:
    """Replays nothing: its outputs keep what the capture computed."""

    def __init__(self, runtime: FakeRuntime):
        self.runtime, self.replays, self.was_reset = runtime, 0, False

    def capture_begin(self, pool=None):
        self.runtime.capturing = True

    def capture_end(self):
        self.runtime.capturing = False

    def replay(self):
        self.replays += 1

    def reset(self):
        self.was_reset = True


class FakeGraphContext:
    """As ``torch.cuda.graph``: switches to the capture stream and begins; on exit ends, then switches back."""

    def __init__(self, runtime, graph, pool, stream):
        self.runtime, self.graph, self.pool, self.stream = runtime, graph, pool, stream

    def __enter__(self):
        self.runtime.pools_captured_into.append(self.pool)
        self.previous, self.runtime.current = self.runtime.current, self.stream
        self.graph.capture_begin(self.pool)

    def __exit__(self, *exc):
        self.graph.capture_end()
        self.runtime.current = self.previous


class FakeRuntime:
    """Stands in for ``torch.cuda`` with ``count`` devices, recording the devices the backend names."""

    def __init__(self, count: int = 2):
        self.count, self.events, self.capturing = count, [], False
        self.default = self.current = FakeStream("default", None, self)
        self.streams, self.graphs, self.pools_captured_into, self.synchronized = [], [], [], []
        self.debug_mode, self.pools_made = 0, 0

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def Stream(self, device=None):  # noqa: N802 (torch's spelling)
        self.streams.append(FakeStream(f"side{len(self.streams) + 1}", device, self))
        return self.streams[-1]

    def current_stream(self):
        return self.current

    def set_stream(self, stream):
        self.current = stream

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def device(self, device):
        yield

    def synchronize(self, device=None):
        self.synchronized.append(device)

    def memory_reserved(self, device=None):
        index = 0 if device is None else torch.device(device).index
        return 1000 * (index + 1)

    def is_current_stream_capturing(self):
        return self.capturing

    def graph_pool_handle(self):
        self.pools_made += 1
        return ("pool", self.pools_made)

    def CUDAGraph(self):  # noqa: N802 (torch's spelling)
        self.graphs.append(FakeGraph(self))
        return self.graphs[-1]

    def graph(self, graph, pool=None, stream=None):
        return FakeGraphContext(self, graph, pool, stream)

    def set_sync_debug_mode(self, mode):
        self.debug_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

    def get_sync_debug_mode(self):
        return self.debug_mode


@pytest.fixture
def runtime():
    return FakeRuntime()


def on(fake: FakeRuntime, base: type = TorchCudaGraphBackend) -> type:
    """``base`` with ``fake`` as its runtime namespace (devices stay of type "cuda")."""
    return type(f"Fake{base.__name__}", (base,), {"name": "fake", "runtime": classmethod(lambda cls: fake),
                                                  "capability": classmethod(lambda cls, device=None: Capability())})


# ---------------------------------------------------------------- captured graphs and the backend


def test_a_released_graph_refuses_to_replay_and_its_graph_is_not_replayed(runtime):
    graph = FakeGraph(runtime)
    captured = TorchCudaCapturedGraph(graph, torch.ones(2))
    captured.replay()
    captured.release()
    assert graph.was_reset and captured.outputs is None
    with pytest.raises(RuntimeError, match="replay\\(\\) of a released graph"):
        captured.replay()
    assert graph.replays == 1


class Syncing(torch.Tensor):
    """A tensor whose ``item()`` fails as a CUDA tensor's does under ``set_sync_debug_mode("error")``."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.item:
            raise RuntimeError("called a synchronizing CUDA operation")
        if func is torch.Tensor.tolist:
            raise RuntimeError("another failure")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_sync_guard_turns_the_runtimes_sync_error_into_a_host_sync_error_and_restores_the_mode(runtime):
    backend = on(runtime)("cuda:0")
    runtime.debug_mode = 1
    tensor = torch.ones(2).as_subclass(Syncing)
    with backend.sync_guard():
        assert runtime.debug_mode == 2
        with pytest.raises(HostSyncError, match="item\\(\\) inside sync_guard\\(\\) synchronised the device"):
            tensor.item()
        with pytest.raises(RuntimeError, match="another failure") as other:  # any other error passes through
            tensor.tolist()
        assert not isinstance(other.value, HostSyncError)
    assert runtime.debug_mode == 1


def test_a_capture_goes_into_the_callers_pool(runtime):
    backend = on(runtime)("cuda:0")
    pool = object()
    x = torch.ones(2)
    backend.capture(lambda: x + 1, pool)
    backend.capture(lambda: x + 2, pool)
    assert runtime.pools_captured_into == [pool, pool] and runtime.pools_made == 0
    backend.capture(lambda: x + 3)  # none given: a new one
    assert runtime.pools_captured_into[-1] == ("pool", 1)


def test_each_device_has_its_own_capture_stream_made_on_it_and_shared_by_its_backends(runtime):
    backend_class, x = on(runtime), torch.ones(2)
    backend_class("cuda:0").capture(lambda: x + 1)
    backend_class("cuda:1").capture(lambda: x + 1)
    backend_class("cuda:1").capture(lambda: x + 2)
    assert [s.device for s in runtime.streams] == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_memory_and_synchronisation_are_the_backends_devices(runtime):
    backend = on(runtime)("cuda:1")
    assert backend.memory_in_use() == 2000  # memory_reserved of cuda:1, not of the current device
    backend.synchronize()
    assert runtime.synchronized == [torch.device("cuda", 1)]


def test_a_failed_capture_ends_the_allocators_routing_into_the_pool_on_the_backends_device(runtime, monkeypatch):
    ended = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: ended.append((index, pool)),
                        raising=False)
    backend, pool = on(runtime)("cuda:1"), object()

    def fails_in_capture():
        if runtime.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.ones(2)

    with pytest.raises(CaptureError, match="operation not permitted"):
        backend.capture(fails_in_capture, pool)
    assert ended == [(1, pool)]
    assert runtime.current is runtime.default and runtime.graphs[-1].was_reset


def test_ctrl_c_during_a_capture_is_not_turned_into_a_capture_error(runtime):
    backend = on(runtime)("cuda:0")

    def interrupted():
        if runtime.capturing:
            raise KeyboardInterrupt
        return torch.ones(2)

    with pytest.raises(KeyboardInterrupt):
        backend.capture(interrupted)
    assert runtime.current is runtime.default and not runtime.capturing


def test_ctrl_c_stays_ctrl_c_when_ending_the_interrupted_capture_fails_too(runtime, monkeypatch):
    """``torch.cuda.graph.__exit__`` ends the capture whatever the body raised, and that can raise as well; the
    manager treats a ``CaptureError`` as one failed budget and goes on, so Ctrl-C must not become one."""
    backend = on(runtime)("cuda:0")

    def failing_end(graph):
        runtime.capturing = False
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(FakeGraph, "capture_end", failing_end)

    def interrupted():
        if runtime.capturing:
            raise KeyboardInterrupt
        return torch.ones(2)

    with pytest.raises(KeyboardInterrupt):
        backend.capture(interrupted)
    assert runtime.current is runtime.default
    with pytest.raises(CaptureError, match=r"capture failed: ValueError: bad \(ending the capture then failed too: "
                                           r"RuntimeError: operation failed"):
        backend.capture(lambda: (_ for _ in ()).throw(ValueError("bad")) if runtime.capturing else torch.ones(2))


@pytest.mark.parametrize("returned", [3, {"x": torch.ones(2)}, None])
def test_a_capture_that_returns_no_tensors_is_refused_and_its_graph_reset(runtime, returned):
    backend = on(runtime)("cuda:0")
    with pytest.raises(CaptureError, match="must return tensors"):
        backend.capture(lambda: returned)  # refused by the warm-up: nothing captured
    assert runtime.graphs == []
    with pytest.raises(CaptureError, match="must return tensors"):
        backend.capture(lambda: returned if runtime.capturing else torch.ones(2))
    assert runtime.graphs[-1].was_reset


def test_rocm_warms_up_one_run_more_than_cuda_and_refuses_a_capture_whose_replay_disagrees_with_eager(runtime):
    calls = []

    def counting():
        calls.append(runtime.capturing)
        return torch.full((2,), float(len(calls)))  # the fake graph's replay keeps the captured value

    on(runtime, CudaGraphBackend)("cuda:0").capture(counting)
    assert calls == [False] * TorchCudaGraphBackend.warmup_runs + [True]
    calls.clear()
    with pytest.raises(CaptureError, match="pytorch#155684"):
        on(runtime, RocmGraphBackend)("cuda:0").capture(counting)
    assert calls[: TorchCudaGraphBackend.warmup_runs + 2] == [False] * (TorchCudaGraphBackend.warmup_runs + 1) + [True]
    assert runtime.graphs[-1].was_reset and runtime.graphs[-1].replays == 1


def test_a_device_index_equal_to_the_device_count_does_not_exist(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", count=1, props=H200)
    assert CudaGraphBackend.capability("cuda:0").ok
    assert CudaGraphBackend.capability("cuda:1").reasons == ("cuda:1 does not exist: 1 device(s) are visible",)


def test_a_rocm_build_that_also_names_a_cuda_version_is_rocm_to_the_cuda_gate(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", hip="6.4.0", props=DeviceProperties("MI250X", 9, 0, "gfx90a:sramecc+"))
    assert torch_build() == ("rocm", "6.4.0")
    assert cuda_gate(detect()).reasons == ("torch is a ROCm (HIP 6.4.0) build: use the rocm backend",)


@pytest.mark.parametrize("found", [None, "", "unknown"])
def test_an_unknown_torch_version_is_refused(found):
    cap = torch_version_capability("cuda", found)
    assert not cap.ok and "needs torch >= 2.10" in cap.describe()


@pytest.mark.parametrize(("found", "ok"), [("2.10.0a0+ecf3bae40a.nv25.11", True), ("2.10.0.dev20250901", True),
                                           ("2.10.1", True), ("2.9.1", False), ("2.9.0a0+git1234", False)])
def test_pre_releases_of_the_minimum_torch_count_as_it(found, ok):
    """NVIDIA's containers ship torch as ``2.10.0a0+<commit>.nv<yy.mm>``; vLLM's own check counts them as 2.10."""
    assert torch_version_capability("cuda", found).ok is ok


def test_the_cuda_backends_product_chooser_is_its_devices(monkeypatch):
    asked = []
    monkeypatch.setattr(lt, "measured_products", lambda index: asked.append(index) or f"chooser {index}")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert CudaGraphBackend("cuda:1").product_chooser() == "chooser 1"
    assert asked == [1]


# ---------------------------------------------------------------- the measured-products chooser


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


def chooser_on(path, lib=None, device=torch.device("cpu")) -> lt.MeasuredProducts:
    return lt.MeasuredProducts(lib or FakeLt(), device, path)


def test_a_choice_is_recalled_only_on_the_same_gpu_model_and_cublaslt(tmp_path, fake_gpu):
    path, label = tmp_path / "c.json", "1024 x 4304 -> 1152 (torch.bfloat16)"
    entry = lt.Choice(None, None, 5.0, 5.0).entry()
    chooser_on(path).cache.put(label, entry)
    assert chooser_on(path).cache.get(label) == entry
    fake_gpu.name = "NVIDIA H100 80GB HBM3"  # the same sm_90
    assert chooser_on(path).cache.get(label) is None
    fake_gpu.name = "NVIDIA H200"
    assert chooser_on(path, FakeLt(version=130000)).cache.get(label) is None


def aligned(shape, dtype=torch.bfloat16, shift_bytes=0):
    """A contiguous tensor starting ``shift_bytes`` past a 256-byte boundary."""
    numel, size = math.prod(shape), torch.tensor([], dtype=dtype).element_size()
    flat = torch.zeros(numel + 512 // size, dtype=dtype)
    start = ((-flat.data_ptr()) % 256 + shift_bytes) // size
    return flat[start:start + numel].view(shape)


def operands(dtype=torch.bfloat16):
    """x, weight and bias of a product the chooser takes: 256-byte aligned."""
    g = torch.Generator().manual_seed(0)
    return (aligned((8, 16), dtype).copy_(torch.randn(8, 16, generator=g)),
            aligned((4, 16), dtype).copy_(torch.randn(4, 16, generator=g) / 4),
            aligned((4,), dtype).copy_(torch.randn(4, generator=g)))


def test_cached_choices_are_per_dtype_and_epilogue_and_a_cached_aten_choice_is_recalled(tmp_path, fake_gpu):
    chooser = chooser_on(tmp_path / "c.json")
    x, w, b = operands()
    chooser.cache.put(chooser.label(x, w, False), lt.Choice(None, None, 5.0, 5.0).entry())
    assert chooser.recall(x, w, b, gelu=False) == lt.Choice(None, None, 5.0, 5.0, recalled=True)
    assert chooser.recall(x, w, b, gelu=True) is None
    assert chooser.recall(*operands(torch.float16), gelu=False) is None


class Recorder:
    def __init__(self, chooser):
        self.seen = []
        chooser.recall = lambda x, w, b, gelu: self.seen.append(("recall", x.dtype, gelu))
        chooser.measure = lambda x, w, b, gelu: (self.seen.append(("measure", x.dtype, gelu)),
                                                 lt.Choice(None, None, 5.0, 5.0))[1]


def test_a_shape_is_measured_once_per_dtype_and_never_inside_a_capture(tmp_path, fake_gpu):
    chooser = chooser_on(tmp_path / "c.json")
    record = Recorder(chooser)
    x, w, b = operands()
    fake_gpu.capturing = True  # first met inside a capture: ATen's call, nothing measured nor kept
    torch.testing.assert_close(chooser.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    assert record.seen == [] and chooser.choices == {}
    fake_gpu.capturing = False
    chooser.linear(x, w, b)
    chooser.linear(x, w, b)
    x16, w16, b16 = operands(torch.float16)
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


def test_the_accuracy_bound_is_one_and_a_half_times_atens_error_plus_1e_4():
    x, w, b = operands()
    exact, bound = lt.MeasuredProducts.accuracy(x, w, b, gelu=False)
    torch.testing.assert_close(exact, x.double() @ w.double().t() + b.double())
    assert bound == pytest.approx(1.5 * relative_error(F.linear(x, w, b), exact) + 1e-4)


class RankedDescriptor:
    """``LtProduct`` off the GPU: configurations are ``Algo``s named by ``data[0]``; ``run`` writes ATen's result,
    off by ``errors[id]`` where given. ``sweep_ms`` is what the sweep measures of each (``sweep_times``)."""

    def __init__(self, ids, bias, errors=None):
        self.ids, self.bias, self.errors = ids, bias, errors or {}

    def algo(self, algo_id):
        algo = lt.Algo()
        algo.data[0] = algo_id
        return algo

    def candidates(self):
        found = []
        for algo_id in self.ids[:2]:
            heuristic = lt.Heuristic()
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
        x, w, b = operands()
        descriptor = RankedDescriptor(ids, b, errors)
        chooser.descriptor = lambda weight, bias, rows, gelu: descriptor
        monkeypatch.setattr(lt.MeasuredProducts, "sweep_times", staticmethod(
            lambda descriptor, algos, x, weight, out, calls=1, passes=1: [sweep_ms[a.data[0]] for a in algos]))

        def graphed(calls):
            keys = {key: "aten" if key == "aten" else fn.args[0].data[0] for key, fn in calls.items()}
            timed.append(set(keys.values()))
            return {key: SimpleNamespace(replay=Replay(keys[key])) for key in calls}

        monkeypatch.setattr(lt, "graphed_as_captured", graphed)
        monkeypatch.setattr(lt, "measure_interleaved", lambda fns, device, warmup, samples: {
            key: SimpleNamespace(median=graph_us[fn.key] * lt.CALLS / 1e3) for key, fn in fns.items()})
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
    almost = 10.0 * (1 - lt.MARGIN / 2)
    x, w, b = ranked.setup(ids, {}, {1: 1.0, 2: 2.0}, {"aten": 10.0, 1: almost, 2: 11.0})
    choice = ranked.measure(x, w, b, gelu=False)
    assert choice.algo is None and choice.aten_us == choice.chosen_us == pytest.approx(10.0)
    assert ranked.cache.get(ranked.label(x, w, False)) == choice.entry()


def test_a_measured_shape_is_logged_with_its_choice(ranked, caplog):
    x, w, b = ranked.setup([1], {}, {1: 1.0}, {"aten": 10.0, 1: 8.0})
    with caplog.at_level(logging.INFO, logger=lt.__name__):
        ranked.measure(x, w, b, gelu=False)
    assert f"matrix product {ranked.label(x, w, False)}: 1 of 1 configurations as accurate" in caplog.text
