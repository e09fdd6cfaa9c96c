"""CUDA graph capture and replay on a real GPU (skipped, with the reason, elsewhere)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.profiling import replay_activities

pytestmark = pytest.mark.cuda


@pytest.fixture
def backend():
    from hwgraph_cuda.graphs import CudaGraphBackend

    return CudaGraphBackend()


@pytest.fixture
def buffers(backend):
    torch.manual_seed(0)
    x = torch.zeros(16, 64, device=backend.device)  # the static input buffer the graph reads
    weight = torch.randn(64, 32, device=backend.device)
    return x, weight


def forward(x, weight):
    return torch.relu(x @ weight) * 2 + 1


def test_replay_after_copying_new_input_reflects_it(backend, buffers):
    x, weight = buffers
    graph = backend.capture(lambda: forward(x, weight))
    new = torch.randn(16, 64, device=backend.device)
    x.copy_(new)
    graph.replay()
    backend.synchronize()
    torch.testing.assert_close(graph.outputs, forward(new, weight))


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


def test_outputs_are_the_same_memory_across_replays(backend, buffers):
    x, weight = buffers
    graph = backend.capture(lambda: (forward(x, weight), x.sum(dim=1)))
    pointers = [t.data_ptr() for t in graph.outputs]
    for _ in range(3):
        x.normal_()
        graph.replay()
    assert [t.data_ptr() for t in graph.outputs] == pointers


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


def test_a_released_graph_refuses_to_replay(backend, buffers):
    x, _ = buffers
    graph = backend.capture(lambda: x + 1)
    graph.release()
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def memsets_in_replay(graph) -> int:
    """The memset activities of one profiled replay of ``graph``."""
    return sum("Memset" in e.name for e in replay_activities(graph))


def test_capture_takes_cublaslt_kernels_without_workspace_memsets(backend, monkeypatch):
    """The tower's qkv product at 4096 rows: captured with the process's cuBLASLt workspace, the graph zeroes the
    kernel's tile counter with a memset before it (on the H200); captured by the plugin (``capture_environment``),
    it has no memset, and the product equals the eager one (default workspace) bit for bit."""
    from hwgraph_cuda.graphs import CudaGraphBackend

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
