"""The CPU sync guard rejects the index reads and mask writes CUDA's sync debug mode rejects, and no others.

A 0-dim index tensor is read back to pick its element, a boolean mask given to ``index_put_`` (or assigned a tensor
through) is expanded with ``nonzero()``, and ``masked_fill`` reads a tensor value back with ``.item()``; but
``t[mask] = 1.0`` becomes a ``masked_fill_`` of a host scalar and reads nothing back (PyTorch's own
``test_sync_warning`` expects the same of CUDA). The ``cuda`` test checks those claims against the runtime.
"""

from __future__ import annotations

import pytest
import torch

from hwgraph.graphs import HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend, RejectHostReads

# the tensor methods the guard replaces for these reads, on top of those tests/test_cpu_backend.py lists
NEW_GUARDED_METHODS = ("__setitem__", "index_put_", "index_put", "masked_fill", "masked_fill_")


@pytest.fixture
def backend():
    return CpuGraphBackend()


def assign(target, index, value):
    target[index] = value
    return target


@pytest.mark.parametrize("device_read", [
    pytest.param(lambda x, m: assign(x, m, torch.tensor(5.0)), id="mask-assigned-a-0-dim-tensor"),
    pytest.param(lambda x, m: assign(x, m, torch.ones(3)), id="mask-assigned-a-tensor"),
    pytest.param(lambda x, m: assign(x, (m, [0]), 1.0), id="mask-and-a-list-assigned-a-number"),
    pytest.param(lambda x, m: assign(x, torch.tensor(1), 1.0), id="0-dim-index-assigned"),
    pytest.param(lambda x, m: x[torch.tensor(1)], id="0-dim-index"),
    pytest.param(lambda x, m: x[:, torch.tensor(0, dtype=torch.int32)], id="0-dim-index-in-a-tuple"),
    pytest.param(lambda x, m: x.index_put_((m,), torch.tensor(1.0)), id="index_put_-mask"),
    pytest.param(lambda x, m: x.index_put(indices=(m,), values=torch.ones(3)), id="index_put-mask-keyword"),
    pytest.param(lambda x, m: x.masked_fill(m[:, None], torch.tensor(1.0)), id="masked_fill-tensor-value"),
    pytest.param(lambda x, m: x.masked_fill_(m[:, None], value=torch.tensor(1.0)), id="masked_fill_-tensor-value"),
])
def test_sync_guard_rejects_index_reads_and_mask_writes_that_read_the_device_back(backend, device_read):
    """Each passed the CPU guard, while on CUDA each synchronises (nonzero() of the mask, or .item() of an index or
    value), so a replay path using one passed CPU CI and failed to capture on a GPU."""
    x, mask = torch.zeros(4, 3), torch.tensor([True, False, True, False])
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a device-to-host"):
        device_read(x, mask)
    device_read(x, mask)  # allowed again once the guard ends


def test_sync_guard_allows_a_number_assigned_through_one_mask_and_tensor_indexing(backend):
    """``t[mask] = 1.0`` is a masked_fill_ of a host scalar on CUDA (no sync), and so are the other ways of writing a
    number through one mask; index tensors of one or more dimensions and masked_fill with a number read nothing back."""
    def writes_and_reads(x, mask):
        assign(x, mask, 1.0)
        assign(x, (slice(None), torch.tensor([False, True, False])), 2)
        assign(x, (3, torch.tensor([True, False, True])), 4.0)
        assign(x, (..., mask, 0), 3.0)
        assign(x, torch.tensor([1]), torch.full((1, 3), 5.0))
        x.index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(6.0))
        return x.masked_fill(mask[:, None], 0.0), x[torch.tensor([0, 3])]

    mask = torch.tensor([True, False, True, False])
    x, expected = torch.zeros(4, 3), torch.zeros(4, 3)
    with backend.sync_guard():
        got = writes_and_reads(x, mask)
    for g, e in zip((x, *got), (expected, *writes_and_reads(expected, mask)), strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert x.tolist() == [[6.0, 2.0, 1.0], [5.0, 5.0, 5.0], [3.0, 2.0, 1.0], [4.0, 2.0, 4.0]]


def test_sync_guard_names_the_mask_assignment_it_rejected(backend):
    x, mask = torch.zeros(4), torch.tensor([True, False, True, False])
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"^an assignment through a 0-dim tensor index or a "
                                                                  r"boolean mask, other than one mask given a Python "
                                                                  r"number \(its size or value is read back\)"):
        x[mask] = torch.ones(2)


def test_the_methods_the_guard_replaced_behave_as_before_once_it_ends(backend):
    originals = {name: torch.Tensor.__dict__.get(name) for name in NEW_GUARDED_METHODS}
    with backend.sync_guard():
        assert all(torch.Tensor.__dict__.get(name) is not originals[name] for name in NEW_GUARDED_METHODS)
    assert {name: torch.Tensor.__dict__.get(name) for name in NEW_GUARDED_METHODS} == originals
    x, mask = torch.zeros(3), torch.tensor([True, False, True])
    x[mask] = torch.tensor(2.0)
    assert x.index_put((mask,), torch.tensor(1.0)).tolist() == [1.0, 0.0, 1.0]
    assert x.masked_fill(~mask, torch.tensor(3.0)).tolist() == [2.0, 3.0, 2.0]
    assert RejectHostReads.switch.depth == 0


def test_a_compiled_forward_is_not_recompiled_by_the_guard(backend):
    """torch.compile guards on the identity of the torch functions a compiled forward calls, not on tensor methods:
    the guard replaces these reads only as methods (and leaves torch.arange alone), so a compiled replay under the
    guard runs the graph compiled before it."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()

    def forward(x, mask):
        y = x.masked_fill(mask, 0.0) + torch.arange(x.shape[0])
        y[mask] = 1.0
        return y.index_put((torch.tensor([0]),), torch.tensor(2.0))

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    x, mask = torch.randn(4), torch.tensor([True, False, True, False])
    expected = compiled(x, mask)
    graphs = counters["stats"]["unique_graphs"]
    with backend.sync_guard():
        got = compiled(x, mask)
    assert counters["stats"]["unique_graphs"] == graphs, "the guard made torch.compile recompile the forward"
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_cuda_sync_debug_mode_agrees_with_the_cpu_guard_on_these_reads():
    """What the CPU guard rejects here synchronises on CUDA, and what it allows does not; a blocking copy_ between host
    and device synchronises too, which the CPU guard leaves alone (it cannot tell such a copy from the emulated
    device's own CPU-to-CPU copies)."""
    # every tensor made before the mode is on: torch.tensor(..., device="cuda") is itself a blocking copy
    x, host = torch.zeros(4, 3, device="cuda"), torch.ones(4, 3)
    mask, value = torch.tensor([True, False, True, False], device="cuda"), torch.tensor(5.0, device="cuda")
    one, four, rows = (torch.tensor(v, device="cuda") for v in (1, 4, [0, 2]))
    syncs = {"x[mask] = value": lambda: assign(x, mask, value),
             "x[0-dim index]": lambda: x[one],
             "index_put_ with a mask": lambda: x.index_put_((mask,), value),
             "masked_fill with a tensor value": lambda: x.masked_fill(mask[:, None], value),
             "torch.arange(tensor)": lambda: torch.arange(four, device="cuda"),
             "blocking copy_ from the host": lambda: x.copy_(host),
             "blocking copy_ to the host": lambda: host.copy_(x)}
    no_sync = {"x[mask] = 1.0": lambda: assign(x, mask, 1.0),
               "x[:, mask] = 2": lambda: assign(x, (slice(None), mask[:3]), 2),
               "masked_fill with a number": lambda: x.masked_fill(mask[:, None], 0.0),
               "x[index tensor]": lambda: x[rows]}
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        missed = []
        for what, op in syncs.items():
            try:
                op()
            except RuntimeError as exc:
                assert "called a synchronizing" in str(exc), f"{what}: {exc}"
                continue
            missed.append(what)
        for op in no_sync.values():
            op()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert not missed, f"CUDA's sync debug mode let {missed} through"
