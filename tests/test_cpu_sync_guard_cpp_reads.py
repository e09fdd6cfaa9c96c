"""Reads back to the host that CUDA's sync debug mode rejects and the CPU guard let
through, because torch does them in C++ where no replaced method sees them.

``t.numpy(force=True)`` and ``t.type("torch.FloatTensor")`` copy a device tensor to the host (``.cpu()`` in C++);
``bincount`` sizes its output by the largest value (``max().item()``), ``one_hot`` without ``num_classes`` by the
same, ``histc`` with ``min == max`` (its defaults) reads the input's range back, and ``x.new_tensor([a, b])`` reads
each tensor of its list. Each synchronises on CUDA (``tests/test_cpu_sync_guard_gaps.py``'s ``cuda`` test checks).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hwgraph.graphs import HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend


@pytest.fixture
def backend():
    return CpuGraphBackend()


@pytest.mark.parametrize("device_read", [
    pytest.param(lambda x, i: x.numpy(force=True), id="numpy-force"),
    pytest.param(lambda x, i: x.type("torch.DoubleTensor"), id="type-host-type-name"),
    pytest.param(lambda x, i: x.type(torch.FloatTensor), id="type-host-type"),
    pytest.param(lambda x, i: x.type(dtype="torch.sparse.FloatTensor"), id="type-host-sparse-type-keyword"),
    pytest.param(lambda x, i: i.bincount(), id="bincount"),
    pytest.param(lambda x, i: torch.bincount(i, minlength=2), id="torch.bincount"),
    pytest.param(lambda x, i: F.one_hot(i), id="one_hot-without-num_classes"),
    pytest.param(lambda x, i: F.one_hot(i, num_classes=-1), id="one_hot-num_classes-minus-one"),
    pytest.param(lambda x, i: x.histc(), id="histc-defaults"),
    pytest.param(lambda x, i: torch.histc(x, 10, 1.0, 1.0), id="torch.histc-min-equals-max"),
    pytest.param(lambda x, i: x.histc(bins=4, min=2, max=2), id="histc-keywords-min-equals-max"),
])
def test_sync_guard_rejects_reads_torch_does_in_cpp(backend, device_read):
    x, i = torch.arange(4.0), torch.tensor([0, 2, 1])
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a device-to-host"):
        device_read(x, i)
    device_read(x, i)  # allowed again once the guard ends


def test_sync_guard_allows_the_same_ops_where_they_read_nothing_back(backend):
    """A plain ``.numpy()`` only ever reads host memory (a device tensor is refused), ``.type()`` of a dtype or with
    no argument stays on the device, ``one_hot`` given ``num_classes`` and ``histc`` given a range read nothing."""
    x, i, grid = torch.arange(4.0), torch.tensor([0, 2, 1]), torch.tensor([[1, 2, 2]])
    with backend.sync_guard():
        assert grid.numpy().tolist() == [[1, 2, 2]] and grid.numpy(force=False).shape == (1, 3)
        assert x.type() == "torch.FloatTensor" and x.type(torch.float64).dtype == torch.float64
        assert x.type("torch.FloatTensor", non_blocking=True) is x  # non-blocking, as .to("cpu", non_blocking=True)
        one_hot = F.one_hot(i, 3)
        assert one_hot.shape == (3, 3) and F.one_hot(i, num_classes=4).shape == (3, 4)
        counts = x.histc(bins=4, min=0, max=4)
        assert torch.histc(x, 4, 0.0, 4.0).shape == (4,)
    assert counts.tolist() == [1.0, 1.0, 1.0, 1.0] and one_hot.sum().item() == 3


def test_the_replaced_functions_are_put_back_once_the_guard_ends(backend):
    before = (torch.Tensor.__dict__.get("numpy"), torch.Tensor.__dict__.get("type"), torch.bincount, torch.histc,
              F.one_hot)
    with backend.sync_guard():
        assert F.one_hot is not before[4] and torch.bincount is not before[2]
    assert (torch.Tensor.__dict__.get("numpy"), torch.Tensor.__dict__.get("type"), torch.bincount, torch.histc,
            F.one_hot) == before


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_sync_guard_rejects_new_tensor_of_a_list_holding_tensors(backend):
    """``x.new_tensor([a.sum(), b.sum()])`` reads each tensor of the list back in C++ (``Tensor::item()``, a sync on
    CUDA), where no replaced method saw it; a tensor or host numbers given whole read nothing back."""
    x = torch.arange(4.0)
    with backend.sync_guard():
        with pytest.raises(HostSyncError, match=r"new_tensor\(\) with a list holding a tensor"):
            x.new_tensor([x.sum(), x[:2].sum()])
        with pytest.raises(HostSyncError, match=r"new_tensor\(\) with a list holding a tensor"):
            x.new_tensor(data=[[x[1:2].sum(), 1.0]])
        copied = x.new_tensor(x)  # a copy on the device
        numbers = x.new_tensor([1.0, 2.0])
    assert copied.tolist() == x.tolist() and numbers.tolist() == [1.0, 2.0]
    assert x.new_tensor([x.sum(), x[:2].sum()]).tolist() == [6.0, 1.0]
