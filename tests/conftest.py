"""Test-session settings for the CPU suite, and fakes that several of its modules share."""

import pytest
import torch

# Two cores run two xdist workers: one intra-op thread each avoids oversubscription (10x slower otherwise).
torch.set_num_threads(1)


class RecordingKernel:
    """Stands in for a compiled kernel (``@triton.jit`` or Gluon): ``kernel[grid](*args, **kwargs)`` records the call
    as ``(grid, args, kwargs)`` and launches nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def recording_kernel():
    return RecordingKernel()


@pytest.fixture
def triton_kernel(monkeypatch):
    """``hwgraph.attention.triton_kernel`` with both Triton kernels recording instead of launching. (The launcher then
    takes itself to be interpreted, so it accepts CPU tensors.)"""
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    monkeypatch.setattr(module, "varlen_attention_kernel", RecordingKernel())
    monkeypatch.setattr(module, "varlen_attention_tma_kernel", RecordingKernel())
    return module


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core box: more intra-op threads only spin against each other (10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
