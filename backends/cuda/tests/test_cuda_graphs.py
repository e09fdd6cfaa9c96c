"""CUDA graph capture and replay: on a real GPU (the ``cuda`` tests, skipped with the reason elsewhere), and the host
side of the shared ``torch.cuda`` backend (``hwgraph.graphs.torch_cuda``, as the CUDA and ROCm plugins take it) on the
CPU: a released graph never replays; the sync guard turns the runtime's sync error into ``HostSyncError``; a capture
uses the caller's pool, the backend's device (its stream, memory, synchronisation and pool routing after a failure)
and lets Ctrl-C through; ROCm warms up one run more and catches a replay that disagrees with eager.

On the CPU the device runtime is a fake namespace (``FakeRuntime``) handed to a subclass of the backend (``on``), and
every tensor is a CPU tensor.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from hwgraph_cuda.graphs import CudaGraphBackend
from hwgraph_rocm.graphs import RocmGraphBackend

from hwgraph import timing
from hwgraph.capability import Capability
from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.torch_cuda import TorchCudaCapturedGraph, TorchCudaGraphBackend
from hwgraph.profiling import replay_activities
from hwgraph.testing.simulate import FakeGraphRuntime
from hwgraph.timing import graphed_calls


@pytest.fixture
def backend():
    return CudaGraphBackend()


@pytest.fixture
def buffers(backend):
    torch.manual_seed(0)
    x = torch.zeros(16, 64, device=backend.device)  # the static input buffer the graph reads
    weight = torch.randn(64, 32, device=backend.device)
    return x, weight


def forward(x, weight):
    return torch.relu(x @ weight) * 2 + 1


@pytest.mark.cuda
def test_replay_after_copying_new_input_reflects_it(backend, buffers):
    x, weight = buffers
    graph = backend.capture(lambda: forward(x, weight))
    new = torch.randn(16, 64, device=backend.device)
    x.copy_(new)
    graph.replay()
    backend.synchronize()
    torch.testing.assert_close(graph.outputs, forward(new, weight))


@pytest.mark.cuda
def test_replay_without_copying_returns_the_old_answer(backend, buffers):
    x, weight = buffers
    graph = backend.capture(lambda: forward(x, weight))
    first = torch.randn(16, 64, device=backend.device)
    x.copy_(first)
    graph.replay()
    not_copied = torch.randn(16, 64, device=backend.device)  # never copied into x
    graph.replay()
    backend.synchronize()
    torch.testing.assert_close(graph.outputs, forward(first, weight))
    assert not torch.allclose(graph.outputs, forward(not_copied, weight))


@pytest.mark.cuda
def test_outputs_are_the_same_memory_across_replays(backend, buffers):
    x, weight = buffers
    graph = backend.capture(lambda: (forward(x, weight), x.sum(dim=1)))
    pointers = [t.data_ptr() for t in graph.outputs]
    for _ in range(3):
        x.normal_()
        graph.replay()
    assert [t.data_ptr() for t in graph.outputs] == pointers


@pytest.mark.cuda
def test_graphs_captured_into_one_pool_replay_independently(backend, buffers):
    x, weight = buffers
    pool = backend.new_pool()
    double = backend.capture(lambda: x * 2, pool)
    shifted = backend.capture(lambda: x + 1, pool)
    x.fill_(3.0)
    double.replay()
    shifted.replay()
    backend.synchronize()
    assert torch.all(double.outputs == 6.0) and torch.all(shifted.outputs == 4.0)


@pytest.mark.cuda
def test_a_capture_that_syncs_with_the_host_fails_and_leaves_the_device_usable(backend, buffers):
    x, weight = buffers
    x.fill_(1.0)
    with pytest.raises(CaptureError, match="capture failed"):
        backend.capture(lambda: x * x.sum().item())
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    y = (x + 1).sum()  # eager work, a host read, freeing memory, and a new capture all still work
    assert y.item() == 2.0 * x.numel()
    torch.cuda.empty_cache()
    graph = backend.capture(lambda: forward(x, weight))
    graph.replay()
    backend.synchronize()
    torch.testing.assert_close(graph.outputs, forward(x, weight))


@pytest.mark.cuda
def test_random_numbers_after_a_failed_capture_go_on_as_without_it(backend):
    """A capture invalidated by a host read left torch 2.11's default generator marked as capturing, and the next
    ``randn`` on the device raised "Offset increment outside graph capture encountered unexpectedly"; so did the
    same failure in ``graphed_calls`` (the products' timing), which also left its stream current."""
    x = torch.ones(8, device=backend.device)
    torch.cuda.manual_seed(5)
    expected = [torch.randn(4, device=backend.device) for _ in range(3)]
    torch.cuda.manual_seed(5)
    drawn = [torch.randn(4, device=backend.device)]
    with pytest.raises(CaptureError, match="capture failed"):
        backend.capture(lambda: x * x.sum().item())
    drawn.append(torch.randn(4, device=backend.device))
    with pytest.raises(RuntimeError):
        graphed_calls(lambda: x * x.sum().item(), calls=2)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    drawn.append(torch.randn(4, device=backend.device))
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)
    pool = torch.cuda.MemPool()  # with the allocator still routing into the failed capture's pool, deleting one aborted
    del pool
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("host_read", [
    pytest.param(lambda t: t.sum().item(), id="item"),
    pytest.param(lambda t: t.cpu(), id="cpu"),
    pytest.param(lambda t: t.tolist(), id="tolist"),
])
def test_sync_guard_raises_on_host_reads_of_device_tensors(backend, host_read):
    tensor = torch.ones(8, device=backend.device)
    before = torch.cuda.get_sync_debug_mode()
    with backend.sync_guard():
        with pytest.raises(HostSyncError):
            host_read(tensor)
        doubled = tensor * 2  # device work is fine
    assert torch.cuda.get_sync_debug_mode() == before
    assert doubled.sum().item() == 16.0


@pytest.mark.cuda
def test_memory_in_use_grows_on_capture_and_drops_after_release(backend):
    big = torch.randn(1024, 1024, device=backend.device)
    nbytes = big.numel() * big.element_size()
    # A first capture makes the capture stream and its per-stream cuBLAS workspace, which outlive any graph.
    backend.capture(lambda: big @ big).release()
    gc.collect()
    torch.cuda.empty_cache()
    before = backend.memory_in_use()
    graph = backend.capture(lambda: (big @ big).relu() + 1)
    during = backend.memory_in_use()
    assert during >= before + nbytes  # the graph's private pool holds at least its output
    graph.release()
    gc.collect()
    torch.cuda.empty_cache()
    after = backend.memory_in_use()
    assert after <= during - nbytes


@pytest.mark.cuda
def test_a_failed_capture_leaves_no_use_of_the_shared_pool_so_it_is_given_back(backend):
    """Torch without pytorch#190348 (2.11 here) releases a graph's pool on ``reset`` only when its capture ended
    well: after one failed capture into the pool the budgets share, releasing every graph and the pool left all of
    their memory reserved for the process."""
    big = torch.randn(2048, 2048, device=backend.device)
    backend.capture(lambda: big @ big).release()  # the capture stream and its workspaces, kept for the process
    gc.collect()
    torch.cuda.empty_cache()
    before = backend.memory_in_use()
    pool = backend.new_pool()
    graph = backend.capture(lambda: (big @ big).relu(), pool)
    with pytest.raises(CaptureError, match="capture failed"):
        backend.capture(lambda: big * (big @ big).sum().item(), pool)  # a host read ends the capture invalidated
    graph.release()
    del graph, pool
    gc.collect()
    torch.cuda.empty_cache()
    assert backend.memory_in_use() <= before


@pytest.mark.cuda
def test_a_released_graph_refuses_to_replay(backend, buffers):
    x, _ = buffers
    graph = backend.capture(lambda: x + 1)
    graph.release()
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def memsets_in_replay(graph) -> int:
    """The memset activities of one profiled replay of ``graph``."""
    return sum("Memset" in e.name for e in replay_activities(graph))


@pytest.mark.cuda
def test_capture_takes_cublaslt_kernels_without_workspace_memsets(backend, monkeypatch):
    """The tower's qkv product at 4096 rows: captured with the process's cuBLASLt workspace, the graph zeroes the
    kernel's tile counter with a memset before it (on the H200); captured by the plugin (``capture_environment``),
    it has no memset, and the product equals the eager one (default workspace) bit for bit."""
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    torch.manual_seed(0)
    x = torch.randn(4096, 1152, device=backend.device, dtype=torch.bfloat16)
    weight = torch.randn(3456, 1152, device=backend.device, dtype=torch.bfloat16) * 0.03
    bias = torch.randn(3456, device=backend.device, dtype=torch.bfloat16)

    def fn():
        return F.linear(x, weight, bias)

    plain = type("PlainCapture", (CudaGraphBackend,), {"capture_environment": {}})()
    if memsets_in_replay(plain.capture(fn)) == 0:
        pytest.skip(f"cuBLASLt takes no workspace-counter kernel for this product on {torch.cuda.get_device_name()}")
    graph = backend.capture(fn)
    assert memsets_in_replay(graph) == 0
    graph.replay()
    backend.synchronize()
    assert torch.equal(graph.outputs, fn())
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ


# ---------------------------------------------------------------- the host side on a fake torch.cuda namespace (CPU)


class FakeGraph:
    """Replays nothing: its outputs keep what the capture computed. As in torch 2.11, beginning a capture marks the
    default generator as capturing (``runtime.generator_marked``) and only an ending that succeeds unmarks it; the
    next ``runtime.failing_ends`` captures fail to end, as one invalidated by a host read does."""

    def __init__(self, runtime: FakeRuntime):
        self.runtime, self.replays, self.was_reset = runtime, 0, False

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.runtime.capturing = self.runtime.generator_marked = True
        self.began_on, self.capture_error_mode = self.runtime.current, capture_error_mode

    def capture_end(self):
        self.runtime.capturing = False
        if self.runtime.failing_ends:
            self.runtime.failing_ends -= 1
            raise RuntimeError("operation failed due to a previous error during capture")
        self.runtime.generator_marked = False

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


class FakeRuntime(FakeGraphRuntime):
    """Stands in for ``torch.cuda`` with ``count`` devices, recording the devices the backend names."""

    def __init__(self, count: int = 2):
        super().__init__(count)
        self.graphs, self.pools_captured_into, self.synchronized = [], [], []
        self.debug_mode, self.pools_made, self.failing_ends, self.generator_marked = 0, 0, 0, False

    def synchronize(self, device=None):
        self.synchronized.append(device)

    def memory_reserved(self, device=None):
        index = 0 if device is None else torch.device(device).index
        return 1000 * (index + 1)

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


class FakeMemPool:
    """As ``torch.cuda.MemPool``: one use for the object, one per graph captured into it (``FakeGraph``)."""

    def __init__(self, runtime):
        self.uses, self.id = 1, ("mempool", len(runtime.mem_pools) + 1)
        runtime.mem_pools.append(self)

    def use_count(self):
        return self.uses


class GraphKeepingItsPool(FakeGraph):
    """As torch's graph without pytorch#190348: ``reset`` gives the pool's use back only after a capture that ended."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        super().capture_begin(pool, capture_error_mode)
        self.pool, self.ended = self.runtime.mem_pool_by_id.get(pool), False  # None: a private pool, not counted
        if self.pool is not None:
            self.pool.uses += 1

    def capture_end(self):
        super().capture_end()
        self.ended = True

    def reset(self):
        super().reset()
        if getattr(self, "ended", False) and self.pool is not None:
            self.pool.uses -= 1
            self.ended = False


class RuntimeWithMemPools(FakeRuntime):
    def __init__(self):
        super().__init__()
        self.mem_pools = []

    @property
    def mem_pool_by_id(self):
        return {pool.id: pool for pool in self.mem_pools}

    def MemPool(self):  # noqa: N802 (torch's spelling)
        return FakeMemPool(self)

    def CUDAGraph(self):  # noqa: N802
        self.graphs.append(GraphKeepingItsPool(self))
        return self.graphs[-1]


def test_a_failed_capture_gives_back_the_use_of_the_pool_its_graph_kept(monkeypatch):
    """The pool a backend makes is a MemPool whose use count shows what a failed capture's graph kept after its reset
    (torch without pytorch#190348); that use is released, so the pool goes once its graphs and owner do. A capture
    that failed in the function, whose capture still ended, keeps none and nothing more is released."""
    runtime = RuntimeWithMemPools()
    released = []

    def release_pool(index, pool_id):
        released.append((index, pool_id))
        runtime.mem_pool_by_id[pool_id].uses -= 1

    monkeypatch.setattr(torch._C, "_cuda_releasePool", release_pool, raising=False)
    backend, x = on(runtime)("cuda:1"), torch.ones(2)
    pool = backend.new_pool()
    assert isinstance(pool, FakeMemPool) and runtime.pools_made == 0
    kept = backend.capture(lambda: x + 1, pool)
    assert pool.use_count() == 2 and runtime.pools_captured_into == [("mempool", 1)]  # the graph context gets its id

    def invalidates():
        if runtime.capturing:
            runtime.failing_ends = 1  # a host read while capturing: ending the capture fails
            raise RuntimeError("operation not permitted when stream is capturing")
        return x + 2

    with pytest.raises(CaptureError, match="operation not permitted"):
        backend.capture(invalidates, pool)
    assert pool.use_count() == 2 and released == [(1, ("mempool", 1))]

    def raises():
        if runtime.capturing:
            raise RuntimeError("out of memory while capturing")
        return x + 3

    with pytest.raises(CaptureError, match="out of memory"):
        backend.capture(raises, pool)
    assert pool.use_count() == 2 and len(released) == 1
    kept.release()
    assert pool.use_count() == 1


def test_each_device_has_its_own_capture_stream_made_on_it_and_shared_by_its_backends(runtime):
    backend_class, x = on(runtime), torch.ones(2)
    backend_class("cuda:0").capture(lambda: x + 1)
    backend_class("cuda:1").capture(lambda: x + 1)
    backend_class("cuda:1").capture(lambda: x + 2)
    assert [s.device for s in runtime.streams] == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_prepare_runs_the_forward_once_on_the_capture_stream_and_on_the_current_one_where_it_runs_there(runtime):
    """cuBLAS gives a stream its workspaces on first use and keeps them for the process: ``prepare`` (which the
    manager calls before measuring a budget's memory) runs the forward once on the device's capture stream, where
    the capture will run it, and once on the current stream only where the forward runs there too before the memory
    is read (a compiled forward's first call, ROCm's eager check of each capture), so that what those streams' first
    use makes is not counted as the capture's; after a failed capture replaced the capture stream, on the new one."""
    backend, ran_on = on(runtime)("cuda:1"), []

    def forward():
        ran_on.append(runtime.current)
        if runtime.capturing and len(runtime.graphs) == 2:  # the second capture fails
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.ones(2)

    backend.prepare(forward)
    first, default = runtime.streams[0], runtime.default
    assert ran_on == [first] and first.device == torch.device("cuda", 1) and runtime.current is default
    backend.prepare(forward, current_stream=True)
    assert ran_on[1:] == [first, default] and runtime.current is default
    del ran_on[:]
    on(runtime)("cuda:1").prepare(forward)  # another backend on the device shares the capture stream
    assert ran_on == [first]
    del ran_on[:]
    backend.capture(forward)
    assert ran_on == [first] * (backend.warmup_runs + 1)  # the warm-up runs and the capture
    with pytest.raises(CaptureError):
        backend.capture(forward)
    del ran_on[:]
    backend.prepare(forward, current_stream=True)
    assert len(runtime.streams) == 2 and ran_on == [runtime.streams[1], default]


def test_prepare_readies_the_current_stream_where_the_backend_checks_each_capture_eagerly_there(runtime):
    """ROCm's backend reruns each capture eagerly on the current stream (``check_replay_after_capture``), before the
    manager reads the budget's memory: ``prepare`` readies that stream even for an uncompiled forward."""
    ran_on = []

    def forward():
        ran_on.append(runtime.current)
        return torch.ones(2)

    on(runtime, RocmGraphBackend)("cuda:1").prepare(forward)
    assert ran_on == [runtime.streams[0], runtime.default]


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


def test_a_capture_that_fails_to_end_leaves_the_default_generator_unmarked(runtime, caplog):
    """Torch 2.11 unmarks the generator only when a capture ends well: after one invalidated by a host read, every
    random op outside a capture raised "Offset increment outside graph capture encountered unexpectedly" for the
    rest of the process. The backend then captures nothing, on a new stream of its device in thread-local mode (so
    no other thread's work is refused meanwhile), ends that capture and resets its graph."""
    backend, x = on(runtime)("cuda:1"), torch.ones(2)
    runtime.failing_ends = 1
    with pytest.raises(CaptureError, match="capture failed: RuntimeError: operation failed due to a previous error"):
        backend.capture(lambda: x + 1)
    failed, empty = runtime.graphs
    assert failed.was_reset and empty.was_reset and not runtime.generator_marked
    assert empty.capture_error_mode == "thread_local" and empty.began_on is runtime.streams[-1]
    assert runtime.streams[-1].device == torch.device("cuda", 1) and runtime.current is runtime.default

    runtime.failing_ends = 2  # the empty capture fails to end as well: said, with the device and the reason
    with caplog.at_level("WARNING", logger="hwgraph.graphs.torch_cuda"):
        with pytest.raises(CaptureError):
            backend.capture(lambda: x + 1)
    assert runtime.generator_marked and runtime.graphs[-1].was_reset
    assert ("could not end the default generator's capture on cuda:1 after a failed capture; random ops there may "
            "raise: RuntimeError: operation failed") in caplog.text


def test_graphed_calls_cleans_up_a_failed_capture_as_the_backend_does(runtime, monkeypatch):
    """``graphed_calls`` (the products' timing) captured with ``torch.cuda.graph`` and let a failure through as it
    was: on torch 2.11 an invalidated capture left its stream current, the generator marked and the allocator routing
    into its pool, after which deleting a ``MemPool`` aborted the process (the H100, session 63)."""
    ended = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: ended.append((index, pool)),
                        raising=False)
    monkeypatch.setattr(torch, "cuda", runtime)
    timing.retire_side_stream()
    try:
        other = timing.side_stream(1)
        runtime.failing_ends = 1
        with pytest.raises(RuntimeError, match="operation failed due to a previous error"):
            graphed_calls(lambda: torch.ones(2), calls=2)
        failed, empty = runtime.graphs
        assert ended == [(0, ("pool", 1))] and runtime.pools_captured_into == [("pool", 1)]
        assert runtime.current is runtime.default and failed.was_reset and empty.was_reset
        assert not runtime.generator_marked and empty.capture_error_mode == "thread_local"
        assert timing.side_stream(0) is not failed.began_on  # the stream the failed capture touched is not reused
        assert timing.side_stream(1) is other  # another device's stream (and its cuBLAS workspace) stays
    finally:
        timing.retire_side_stream()


@contextlib.contextmanager
def garbage_collector_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("ending_fails", [False, True], ids=["capture-fails", "ending-the-capture-fails-too"])
def test_a_failed_capture_frees_what_its_function_allocated_without_the_garbage_collector(runtime, monkeypatch,
                                                                                         ending_fails):
    """What the function allocated before failing lives in the graph's pool (the manager's, shared by its budgets).
    The exception held the capturing frame through its traceback and that frame held the exception: a reference
    cycle that kept those tensors (a budget's activations) until the garbage collector ran, while the manager went
    on to capture the next budget into the same pool."""
    if ending_fails:
        def failing_end(graph):
            runtime.capturing = False
            raise RuntimeError("operation failed due to a previous error during capture")

        monkeypatch.setattr(FakeGraph, "capture_end", failing_end)
    backend, made = on(runtime)("cuda:0"), []

    def fails_in_capture():
        activations = torch.ones(1024)
        if runtime.capturing:
            made.append(weakref.ref(activations))
            raise RuntimeError("out of memory while capturing")
        return activations

    with garbage_collector_off():
        try:
            backend.capture(fails_in_capture)
        except CaptureError as exc:
            assert "capture failed: RuntimeError: out of memory while capturing" in str(exc)
        else:
            pytest.fail("the capture did not fail")
        assert made and made[0]() is None, "the failed capture's tensors outlived its CaptureError"


def assert_ctrl_c_in_a_capture_stays_ctrl_c(backend, runtime):
    """A capture whose function is interrupted (Ctrl-C) while captured raises KeyboardInterrupt, not a CaptureError,
    and leaves the default stream current."""

    def interrupted():
        if runtime.capturing:
            raise KeyboardInterrupt
        return torch.ones(2)

    with pytest.raises(KeyboardInterrupt):
        backend.capture(interrupted)
    assert runtime.current is runtime.default


def test_ctrl_c_during_a_capture_is_not_turned_into_a_capture_error(runtime):
    assert_ctrl_c_in_a_capture_stays_ctrl_c(on(runtime)("cuda:0"), runtime)
    assert not runtime.capturing


def test_ctrl_c_stays_ctrl_c_when_ending_the_interrupted_capture_fails_too(runtime, monkeypatch):
    """``torch.cuda.graph.__exit__`` ends the capture whatever the body raised, and that can raise as well; the
    manager treats a ``CaptureError`` as one failed budget and goes on, so Ctrl-C must not become one."""
    backend = on(runtime)("cuda:0")

    def failing_end(graph):
        runtime.capturing = False
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(FakeGraph, "capture_end", failing_end)
    assert_ctrl_c_in_a_capture_stays_ctrl_c(backend, runtime)
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
