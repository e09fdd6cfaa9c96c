"""Reads back to the host that CUDA's sync debug mode rejects and the CPU guard let
through, because torch does them in C++ where no replaced method sees them.

``t.numpy(force=True)`` and ``t.type("torch.FloatTensor")`` copy a device tensor to the host (``.cpu()`` in C++);
``bincount`` sizes its output by the largest value (``max().item()``), ``one_hot`` without ``num_classes`` by the
same, ``histc`` with ``min == max`` (its defaults) reads the input's range back, and ``x.new_tensor([a, b])`` reads
each tensor of its list. A ``torch`` function given a tensor where it wants a number (``torch.arange(n)``,
``torch.full(size, v)``) has its argument parser read it (``Tensor::item()``), ``torch.linspace`` and
``torch.masked_fill`` read a tensor start, end or value in their kernels, and ``torch.tensor([a, b])`` reads each tensor
of its list. A blocking ``copy_`` between a host and a device tensor waits for the device. Each synchronises on CUDA
(``tests/test_cpu_sync_guard_gaps.py``'s ``cuda`` test checks).
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


# x: a tensor; n and n0: 0-dim ints (4 and 0); t: a 0-dim float (2.0); mask: a boolean mask of x's rows
TORCH_FUNCTION_READS = [
    pytest.param(lambda x, n, n0, t, mask: torch.arange(n), id="arange"),
    pytest.param(lambda x, n, n0, t, mask: torch.arange(0, n, 2), id="arange-start-end-step"),
    pytest.param(lambda x, n, n0, t, mask: torch.full((2,), t), id="full-value"),
    pytest.param(lambda x, n, n0, t, mask: torch.full((n, 2), 1.0), id="full-size"),
    pytest.param(lambda x, n, n0, t, mask: torch.zeros(n), id="zeros"),
    pytest.param(lambda x, n, n0, t, mask: torch.ones(n, 2), id="ones-separate-sizes"),
    pytest.param(lambda x, n, n0, t, mask: torch.empty(size=(n,)), id="empty-keyword"),
    pytest.param(lambda x, n, n0, t, mask: torch.randint(n, (2,)), id="randint"),
    pytest.param(lambda x, n, n0, t, mask: torch.linspace(0, t, 5), id="linspace-tensor-end"),
    pytest.param(lambda x, n, n0, t, mask: torch.linspace(start=t, end=3.0, steps=5), id="linspace-tensor-start"),
    pytest.param(lambda x, n, n0, t, mask: torch.linspace(0.0, 1.0, n), id="linspace-steps"),
    pytest.param(lambda x, n, n0, t, mask: torch.logspace(0, t, 3), id="logspace-tensor-end"),
    pytest.param(lambda x, n, n0, t, mask: torch.full_like(x, t), id="full_like"),
    pytest.param(lambda x, n, n0, t, mask: torch.add(x, x, alpha=t), id="add-alpha"),
    pytest.param(lambda x, n, n0, t, mask: torch.add(input=x, other=x, alpha=t), id="add-input-keyword"),
    pytest.param(lambda x, n, n0, t, mask: torch.add(x, t, x), id="add-deprecated-alpha-first"),
    pytest.param(lambda x, n, n0, t, mask: torch.clamp(x, t, 1.0), id="clamp-a-number-rules-out-the-tensors"),
    pytest.param(lambda x, n, n0, t, mask: torch.sum(x, n0), id="sum-dim"),
    pytest.param(lambda x, n, n0, t, mask: torch.cat([x, x], dim=n0), id="cat-dim"),
    pytest.param(lambda x, n, n0, t, mask: torch.topk(x, n - 2, dim=0), id="topk"),
    pytest.param(lambda x, n, n0, t, mask: torch.narrow(x, 0, n0, 1), id="narrow-tensor-start"),
    pytest.param(lambda x, n, n0, t, mask: torch.tensor_split(x, (n - 2, 3)), id="tensor_split-list-of-indices"),
    pytest.param(lambda x, n, n0, t, mask: torch.masked_fill(x, mask[:, None], t), id="masked_fill-tensor-value"),
    pytest.param(lambda x, n, n0, t, mask: torch.repeat_interleave(x, 2, dim=n0), id="repeat_interleave-dim"),
    pytest.param(lambda x, n, n0, t, mask: torch.bincount(n.new_zeros(0), minlength=n), id="bincount-minlength"),
    pytest.param(lambda x, n, n0, t, mask: torch.tensor([t, t]), id="tensor-of-a-list-of-tensors"),
    pytest.param(lambda x, n, n0, t, mask: torch.as_tensor([[t]]), id="as_tensor-of-a-nested-list"),
]


def function_arguments():
    return torch.rand(4, 3), torch.tensor(4), torch.tensor(0), torch.tensor(2.0), torch.tensor([True, False] * 2)


@pytest.mark.filterwarnings("ignore:This overload of add is deprecated")
@pytest.mark.parametrize("device_read", TORCH_FUNCTION_READS)
def test_sync_guard_rejects_a_tensor_a_torch_function_reads_back(backend, device_read):
    """Each passed the guard, which replaced tensor methods only: torch's argument parser reads a tensor given where a
    torch function wants a size, a dimension or a number with Tensor::item() before the function runs, linspace's and
    masked_fill's tensor overloads and narrow's tensor start read it in the kernel, and torch.tensor each tensor of its
    list; on CUDA each is a synchronisation."""
    arguments = function_arguments()
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"^torch\.\w+\(\) with a .* inside sync_guard\(\): "
                                                                  r"a device-to-host synchronisation"):
        device_read(*arguments)
    device_read(*arguments)  # allowed again once the guard ends


def test_sync_guard_allows_tensors_that_torch_functions_take_as_operands(backend):
    """A one-element tensor that an overload takes as a tensor is an operand, read nothing back on CUDA (clamp's tensor
    bounds, add's other, where's values, a list of tensors to cat or stack), and numbers read nothing either."""
    def work(x, n, n0, t, mask):
        return (torch.clamp(x, max=t), torch.clamp(x, min=t), torch.add(x, t), torch.where(mask[:, None], x, t),
                torch.pow(x, t), torch.pow(t, x), torch.lerp(x, x.flip(0), t), torch.maximum(x, t),
                torch.index_select(x, 0, n0[None]), torch.stack([t, t]), torch.cat([t[None], n0[None]]),
                torch.add(t, n), torch.div(x, t, rounding_mode="floor"), torch.masked_fill(x, mask[:, None], 1.0),
                torch.narrow(x, 0, 1, 2), torch.full((2,), 1.0), torch.arange(x.shape[0]), torch.zeros(x.shape),
                torch.linspace(0, 1, 5), torch.tensor([1.0, 2.0]), torch.bucketize(x, t[None]), torch.isin(x, t),
                torch.quantile(x, t / 4), torch.sum(t))

    arguments = function_arguments()
    expected = work(*arguments)
    with backend.sync_guard():
        got = work(*arguments)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("split", [
    pytest.param(lambda x: x.tensor_split(torch.tensor(2)), id="0-dim-sections"),
    pytest.param(lambda x: torch.tensor_split(x, torch.tensor([1, 3])), id="torch.tensor_split-1-dim-indices"),
    pytest.param(lambda x: x.tensor_split(torch.tensor([1]), dim=1), id="1-element-indices"),
])
def test_sync_guard_lets_tensor_split_read_its_tensor_of_indices_or_sections(backend, split):
    """No gap: tensor_split takes a tensor of indices or sections only on the host (on CUDA a device one is refused,
    "expected tensor_indices_or_sections to be on cpu", before any read), so reading it is no synchronisation; a list
    holding a tensor is read as ints (rejected above)."""
    x = torch.arange(12.0).reshape(4, 3)
    expected = split(x)
    with backend.sync_guard():
        got = split(x)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]


@pytest.mark.parametrize("transfer", [
    pytest.param(lambda host, dev: dev.copy_(host), id="copy_-from-the-host"),
    pytest.param(lambda host, dev: host.copy_(dev), id="copy_-to-the-host"),
    pytest.param(lambda host, dev: dev.copy_(host, False), id="copy_-non_blocking-false"),
    pytest.param(lambda host, dev: dev.copy_(src=host, non_blocking=0), id="copy_-keywords"),
    pytest.param(lambda host, dev: host.to("meta"), id="to-a-device"),
    pytest.param(lambda host, dev: host.to(dev.device, torch.float16), id="to-a-device-and-a-dtype"),
])
def test_sync_guard_rejects_a_blocking_copy_between_the_host_and_a_device(backend, transfer):
    """On a device (the guard is the sync guard of the backends whose runtime has no sync debug mode), a copy between a
    host and a device tensor without non_blocking waits for the device, which CUDA's sync debug mode rejects either way
    (memcpy_and_sync); the guard let copy_ and .to() of a host tensor through. The meta device stands for a device."""
    host, dev = torch.ones(3), torch.empty(3, device="meta")
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a (device-to-host|blocking "
                                                                  r"host-to-device copy, a) synchronisation"):
        transfer(host, dev)


def test_sync_guard_allows_non_blocking_copies_and_copies_between_cpu_tensors(backend):
    """A non-blocking copy is queued on CUDA (into pinned memory or not) and not rejected. Between CPU tensors the
    emulated device cannot tell a host tensor from a device one: its replay writes outputs, and a manager fills static
    buffers from host metadata, by blocking copies between CPU tensors (non-blocking ones on a device), so copy_ goes
    through there: a blocking copy_ to or from the host is rejected on a device only (CUDA's own test checks it)."""
    host, dev, buffer = torch.arange(3.0), torch.empty(3, device="meta"), torch.zeros(3)
    with backend.sync_guard():
        dev.copy_(host, non_blocking=True)
        assert host.to("meta", non_blocking=True).device.type == "meta" and dev.copy_(dev).device.type == "meta"
        buffer.copy_(host)
    assert buffer.tolist() == [0.0, 1.0, 2.0] and dev.copy_(host).device.type == "meta"
