"""The CPU sync guard rejects the index reads and mask writes CUDA's sync debug mode rejects, and no others.

A 0-dim index tensor is read back to pick its element, a boolean mask given to ``index_put_`` (or assigned a tensor
through) is expanded with ``nonzero()``, and ``masked_fill`` reads a tensor value back with ``.item()``; but
``t[mask] = 1.0`` becomes a ``masked_fill_`` of a host scalar and reads nothing back (PyTorch's own
``test_sync_warning`` expects the same of CUDA). ``complex(t)``, a list subscript holding a 0-dim index (torch reads
``t[[i, j]]`` as ``t[i, j]``) and a tensor given to a method as a size or a number (``x.view(n)``) read the value back
too. The ``cuda`` test checks those claims against the runtime.
"""

from __future__ import annotations

import copy
import io
import pickle
import re

import pytest
import torch

from hwgraph.graphs import HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.graphs.host_reads import RejectHostReads
from hwgraph.graphs.sequence_slots import put_back_sequence_slots, tensor_sequence_slots
from hwgraph.testing.threads import first_leaves_while_second_is_inside

# the tensor methods the guard replaces for these reads, on top of those tests/test_cpu_backend.py lists
NEW_GUARDED_METHODS = ("__setitem__", "index_put_", "index_put", "masked_fill", "masked_fill_", "__complex__", "view",
                       "reshape", "expand", "repeat", "tile", "narrow", "select", "unflatten", "new_empty", "new_zeros",
                       "new_ones", "new_full")
# torch warns that it reads a list subscript holding a tensor as a tuple (t[[i, j]] as t[i, j]), as these tests expect
LIST_SUBSCRIPT_WARNING = "ignore:Using a non-tuple sequence for multidimensional indexing"


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
    a compiled replay under the guard that calls tensor methods only runs the graph compiled before it."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()

    def forward(x, mask):
        y = x.masked_fill(mask, 0.0) + x.new_ones(x.shape[0]).cumsum(0)
        y[mask] = 1.0
        y = y.view(x.shape[0], 1).expand(-1, 2).reshape(-1).narrow(0, 0, x.shape[0]) + x.new_zeros(x.shape[0])
        y = y.unsqueeze(1).transpose(0, 1).flip(0).sum(0) * x.size(0)
        return y.index_put((x.new_zeros(1, dtype=torch.long),), x.new_tensor(2.0))

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    x, mask = torch.randn(4), torch.tensor([True, False, True, False])
    expected = compiled(x, mask)
    graphs = counters["stats"]["unique_graphs"]
    with backend.sync_guard():
        got = compiled(x, mask)
    assert counters["stats"]["unique_graphs"] == graphs, "the guard made torch.compile recompile the forward"
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()


def test_a_compiled_forward_calling_torch_functions_the_guard_replaces_is_compiled_again_once(backend):
    """The guard replaces the torch functions that can read a tensor back as a number (torch.arange, torch.full...),
    and torch.compile guards on the torch functions a forward calls: one calling them is compiled again inside the first
    guard (before, it was not: the guard left them alone), and that compilation serves every later guard, as the first
    one serves the calls outside. A one-element tensor given as an operand is traced, not judged."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()

    def forward(x, b):
        y = torch.add(x, b) + torch.arange(x.shape[0]) + torch.full((x.shape[0],), 2.0)
        return torch.cat([torch.clamp(y, max=b), torch.maximum(y, b), torch.zeros(2)])

    compiled = torch.compile(forward, backend="eager", fullgraph=True)
    x, b = torch.randn(4), torch.tensor(0.5)
    before = counters["stats"]["unique_graphs"]
    expected = compiled(x, b)
    graphs = [counters["stats"]["unique_graphs"] - before]
    for _ in range(3):
        with backend.sync_guard():
            got = compiled(x, b)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        torch.testing.assert_close(got, expected)
    compiled(x, b)
    graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [1, 2, 2, 2, 2], f"graphs compiled after the first call, each guard and a call after: {graphs}"
    torch._dynamo.reset()


@pytest.mark.filterwarnings(LIST_SUBSCRIPT_WARNING)
@pytest.mark.parametrize("device_read", [
    pytest.param(lambda x, n, m: complex(n), id="complex-of-an-int"),
    pytest.param(lambda x, n, m: complex(x[0, 0]), id="complex-of-a-float"),
    pytest.param(lambda x, n, m: x[[n - 1, n - 2]], id="list-of-0-dim-indices"),
    pytest.param(lambda x, n, m: x[[n - 1]], id="list-of-one-0-dim-index"),
    pytest.param(lambda x, n, m: x[[torch.tensor([0, 1]), n - 2]], id="list-of-an-index-tensor-and-a-0-dim-index"),
    pytest.param(lambda x, n, m: x[[n - 1, None]], id="list-of-a-0-dim-index-and-None"),
    pytest.param(lambda x, n, m: assign(x, [n - 1, 0], 1.0), id="list-of-a-0-dim-index-assigned"),
    pytest.param(lambda x, n, m: assign(x, [m, torch.tensor([0, 1])], 1.0), id="list-of-a-mask-and-an-index-assigned"),
    pytest.param(lambda x, n, m: x.view(n, -1), id="view"),
    pytest.param(lambda x, n, m: x.view((n, 3)), id="view-of-a-tuple"),
    pytest.param(lambda x, n, m: x.reshape(-1, n - 1), id="reshape"),
    pytest.param(lambda x, n, m: x.expand(2, n, 3), id="expand"),
    pytest.param(lambda x, n, m: x.repeat(n, 1), id="repeat"),
    pytest.param(lambda x, n, m: x.tile((n,)), id="tile"),
    pytest.param(lambda x, n, m: x.narrow(0, 0, n), id="narrow-length"),
    pytest.param(lambda x, n, m: x.narrow(0, n - 4, 1), id="narrow-tensor-start"),
    pytest.param(lambda x, n, m: x.select(0, n - 1), id="select"),
    pytest.param(lambda x, n, m: x.unflatten(1, (n - 1, 1)), id="unflatten"),
    pytest.param(lambda x, n, m: x.new_zeros(n), id="new_zeros"),
    pytest.param(lambda x, n, m: x.new_empty((n, 2)), id="new_empty"),
    pytest.param(lambda x, n, m: x.new_ones(size=(n,)), id="new_ones-keyword"),
    pytest.param(lambda x, n, m: x.new_full((2,), x[0, 0]), id="new_full-value"),
])
def test_sync_guard_rejects_complex_list_subscripts_and_tensors_given_as_sizes(backend, device_read):
    """Each passed the CPU guard: complex() reads the value, torch reads a list subscript holding a tensor as a tuple
    (a 0-dim index in it is read to pick the element, a mask expanded with nonzero()), and its argument parser reads
    a tensor given where a size or a number is expected with Tensor::item(), in C++ where no replaced method saw it."""
    x, n, mask = torch.zeros(4, 3), torch.tensor(4), torch.tensor([True, False, True, False])
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a device-to-host"):
        device_read(x, n, mask)
    device_read(x, n, mask)  # allowed again once the guard ends


@pytest.mark.filterwarnings(LIST_SUBSCRIPT_WARNING)
def test_sync_guard_allows_list_subscripts_of_index_tensors_and_sizes_given_as_ints(backend):
    """A list holding only index tensors is advanced indexing (x[[rows]] is x[rows]), one mask in a list assigned a
    number is the masked_fill_ of x[mask] = 1.0, and sizes given as ints, a dtype or a Size read nothing back."""
    def work(x, mask, rows):
        assign(x, [mask], 1.0)
        assign(x, [rows, rows], 2.0)
        return (x[[rows]], x[[rows, rows]], x.view(x.shape[0], -1), x.view(torch.int32), x.reshape((2, 6)),
                x.expand(2, -1, -1), x.repeat(1, 2), x.tile((2,)), x.narrow(0, 1, 2), x.select(1, 0),
                x.unflatten(0, (2, 2)), x.new_zeros(x.shape), x.new_full((2,), 3.0))

    mask, rows = torch.tensor([True, False, True, False]), torch.tensor([0, 2])
    x, expected = torch.zeros(4, 3), torch.zeros(4, 3)
    with backend.sync_guard():
        got = work(x, mask, rows)
    for g, e in zip((x, *got), (expected, *work(expected, mask, rows)), strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert x.tolist() == [[2.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 2.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("device_read", [
    pytest.param(lambda x, n: x.flip(n), id="flip"),
    pytest.param(lambda x, n: x.flip((n,)), id="flip-of-a-tuple"),
    pytest.param(lambda x, n: x.roll(1, n), id="roll-dims"),
    pytest.param(lambda x, n: x.roll(shifts=n, dims=0), id="roll-shifts-keyword"),
    pytest.param(lambda x, n: x.permute(n, 0, 2), id="permute-separate-sizes"),
    pytest.param(lambda x, n: x.permute(2, 0, n), id="permute-a-later-size"),
    pytest.param(lambda x, n: x.transpose(0, n), id="transpose"),
    pytest.param(lambda x, n: x.movedim(n, 0), id="movedim"),
    pytest.param(lambda x, n: x.unsqueeze(n), id="unsqueeze"),
    pytest.param(lambda x, n: x.flatten(n), id="flatten"),
    pytest.param(lambda x, n: x.chunk(n + 1), id="chunk"),
    pytest.param(lambda x, n: x.split(n), id="split"),
    pytest.param(lambda x, n: x.size(n), id="size"),
    pytest.param(lambda x, n: x.sum(n), id="sum-dim"),
    pytest.param(lambda x, n: x.sum(dim=(0, n)), id="sum-dim-keyword"),
    pytest.param(lambda x, n: x.softmax(n), id="softmax"),
    pytest.param(lambda x, n: x.index_select(n, torch.tensor([0])), id="index_select-dim"),
    pytest.param(lambda x, n: x.add(x, alpha=n), id="add-alpha"),
    pytest.param(lambda x, n: x.new_full((2,), 1.0, dtype=torch.float32).add_(1, alpha=n), id="add_-alpha"),
])
def test_sync_guard_rejects_a_tensor_where_any_method_wants_a_size_a_dimension_or_a_number(backend, device_read):
    """The guard judged only the methods it listed (view, reshape, new_zeros...); every other method's sizes,
    dimensions and numbers (x.flip(n), x.sum(dim=n), x.add(y, alpha=n)) took a tensor, read back by torch's argument
    parser. They are now judged from each method's ATen schemas: wherever no overload takes a tensor."""
    x, n = torch.zeros(4, 3, 2), torch.tensor(1)
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"with a tensor where a size, a dimension or a "
                                                                  r"number is expected \(its value is read back\) on "
                                                                  r"a tensor inside sync_guard\(\)"):
        device_read(x, n)
    device_read(x, n)  # allowed again once the guard ends


@pytest.mark.filterwarnings("ignore:This overload of add is deprecated")
def test_sync_guard_allows_tensor_overloads_deprecated_orders_and_tensors_too_large_to_be_a_number(backend):
    """A one-element tensor where an overload takes a tensor (x.add(n), x.clamp(n), x.pow(n)) is an operand, read
    nothing back; torch's deprecated orders put a number where the schemas list a tensor (x.add(2, y)); and a tensor of
    several elements where a number is wanted is torch's TypeError, not a read."""
    def work(x, y, n, m):
        return (x.add(n), x.clamp(min=n), x.pow(n), x.mul(n), x.lerp(y, n), x.clone().fill_(n), x.where(x > 0, n),
                x.add(2, y), m.addmm(0.5, m, m), x.transpose(0, 1), x.permute(2, 1, 0), x.sum((0, 1)),
                x.index_select(0, torch.tensor([0, 1])), x.gather(0, torch.zeros(1, 3, 2, dtype=torch.long)),
                x.view(torch.int32), x.size(), torch.tensor(x.size(0)))

    x, y, n, m = torch.rand(4, 3, 2), torch.rand(4, 3, 2), torch.tensor(2.0), torch.rand(2, 2)
    expected = work(x, y, n, m)
    with backend.sync_guard():
        got = work(x, y, n, m)
        with pytest.raises(TypeError, match="must be tuple of ints, not Tensor"):
            x.permute(torch.tensor([1, 0, 2]))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_sync_guard_names_the_complex_and_the_size_it_rejected(backend):
    n = torch.tensor(2)
    with backend.sync_guard():
        with pytest.raises(HostSyncError, match=r"^complex\(\) on a tensor inside sync_guard\(\)"):
            complex(n)
        with pytest.raises(HostSyncError, match=r"^view\(\) with a tensor where a size or a number is expected \(its "
                                                r"value is read back\) on a tensor inside sync_guard\(\)"):
            torch.zeros(4).view(n, -1)


def test_guards_left_by_an_exception_or_by_one_of_two_threads_leave_each_replaced_attribute_as_found():
    """Process-wide: the second thread's guard keeps rejecting after the first thread's ended, and once both ended
    (or one ended by an exception) every attribute the guard replaces is the object it found."""
    def found():
        return [(owner, name, vars(owner).get(name)) for owner, name, _ in RejectHostReads._replacements()]

    def complex_inside():
        try:
            complex(torch.tensor(1.5))
        except HostSyncError:
            return "rejected"
        return "let through"

    before, slots = found(), tensor_sequence_slots()
    with pytest.raises(KeyError, match="boom"), RejectHostReads():
        raise KeyError("boom")
    assert first_leaves_while_second_is_inside(RejectHostReads, complex_inside) == "rejected"
    changed = [name for (_, name, was), (_, _, now) in zip(before, found(), strict=True) if now is not was]
    assert not changed, f"after every guard ended, {changed} are not the attributes found before"
    assert tensor_sequence_slots() == slots and RejectHostReads.switch.depth == 0
    assert complex(torch.tensor(1.5)) == 1.5 and torch.zeros(4).view(torch.tensor(2), -1).shape == (2, 2)


def test_an_entry_interrupted_half_way_leaves_nothing_replaced(monkeypatch):
    """An exception while the guard replaced its attributes one by one (a Ctrl-C) left those it had replaced for good:
    no guard was open to put them back, so every later .item() in the process raised HostSyncError."""
    replacements, slots = RejectHostReads._replacements(), tensor_sequence_slots()
    before = [(owner, name, vars(owner).get(name)) for owner, name, _ in replacements]
    # the last replacement fails: int's attributes cannot be set
    monkeypatch.setattr(RejectHostReads, "_replacements",
                        classmethod(lambda cls: [*replacements, (int, "no_such_attribute", None)]))
    try:
        with pytest.raises(TypeError, match="no_such_attribute"), RejectHostReads():
            pass
        left = [name for owner, name, was in before if vars(owner).get(name) is not was]
        assert not left, f"an interrupted guard entry left {left} replaced"
        assert RejectHostReads.switch.depth == 0 and torch.ones(1).item() == 1.0
    finally:  # what the code before the fix left behind, put back for the tests after this one
        for owner, name, was in before:
            if was is not None:
                setattr(owner, name, was)
            elif name in vars(owner):
                delattr(owner, name)
        put_back_sequence_slots(slots)


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_sync_guard_rejects_serialising_storage_reads_and_torchs_functions_bound_in_functional(backend):
    """torch.save and pickle copy each storage to the host, as a storage's tolist() reads it; torch.nn.functional
    binds some of torch's functions under its own names (F.avg_pool1d is torch.avg_pool1d), which the guard
    replaced in torch alone: all were let through. Copies that stay on the device, and sizes given as ints, still
    pass."""
    x, two = torch.ones(1, 1, 8), torch.tensor(2)
    reads = [("torch.save", lambda: torch.save(x, io.BytesIO())), ("pickling a tensor", lambda: pickle.dumps(x)),
             ("a storage's tolist()", lambda: x.untyped_storage().tolist()),
             ("a storage's tolist()", lambda: x.storage().tolist()),  # a typed storage
             ("torch.avg_pool1d()", lambda: torch.nn.functional.avg_pool1d(x, [two]))]
    with backend.sync_guard():
        for what, read in reads:
            with pytest.raises(HostSyncError, match=re.escape(what)):
                read()
        copy.copy(x), copy.deepcopy(x), torch.nn.functional.avg_pool1d(x, [2]), torch.nn.functional.relu(x)
        torch.save({"step": 3, "budgets": [16, 32], "shape": x.shape}, io.BytesIO())  # no tensor memory in it
    torch.save(x, io.BytesIO()), pickle.dumps(x), torch.nn.functional.avg_pool1d(x, [two])


@pytest.mark.cuda
@pytest.mark.filterwarnings(LIST_SUBSCRIPT_WARNING)
@pytest.mark.filterwarnings("ignore:This overload of add is deprecated")
def test_cuda_sync_debug_mode_agrees_with_the_cpu_guard_on_these_reads():
    """What the CPU guard rejects here synchronises on CUDA, and what it allows does not. A blocking copy between host
    and device synchronises either way, which the CPU guard rejects where one tensor is on a device (on the emulated
    device it cannot tell such a copy from the CPU-to-CPU copies of its own); a tensor where a torch function wants a
    number is read back as a method's is. tensor_split refuses a device tensor of indices or sections (no read) and
    reads a host one (no synchronisation), which the CPU guard lets through."""
    # every tensor made before the mode is on: torch.tensor(..., device="cuda") is itself a blocking copy
    x, host = torch.zeros(4, 3, device="cuda"), torch.ones(4, 3)
    pinned = torch.ones(4, 3, pin_memory=True)
    mask, value = torch.tensor([True, False, True, False], device="cuda"), torch.tensor(5.0, device="cuda")
    one, four, twelve, rows = (torch.tensor(v, device="cuda") for v in (1, 4, 12, [0, 2]))
    zero, two = torch.tensor(0, device="cuda"), torch.tensor(2, device="cuda")
    classes = torch.tensor([0, 2, 1], device="cuda")
    host_sections, host_indices = torch.tensor(2), torch.tensor([1, 3])
    syncs = {"x[mask] = value": lambda: assign(x, mask, value),
             "x[0-dim index]": lambda: x[one],
             "index_put_ with a mask": lambda: x.index_put_((mask,), value),
             "masked_fill with a tensor value": lambda: x.masked_fill(mask[:, None], value),
             "x[[0-dim index, 0-dim index]]": lambda: x[[one, one]],
             "complex(tensor)": lambda: complex(value),
             "x.view(tensor)": lambda: x.view(twelve),
             "x.new_zeros(tensor)": lambda: x.new_zeros(four),
             "x.flip(tensor)": lambda: x.flip(one),
             "x.sum(dim=tensor)": lambda: x.sum(dim=one),
             "x.add(y, alpha=tensor)": lambda: x.add(x, alpha=one),
             "x.clamp(tensor, 1.0)": lambda: x.clamp(value, 1.0),
             "x.add(tensor, y), a deprecated order": lambda: x.add(one, x),
             "torch.arange(tensor)": lambda: torch.arange(four, device="cuda"),
             "torch.full(size, tensor)": lambda: torch.full((2,), value, device="cuda"),
             "x.numpy(force=True)": lambda: x.numpy(force=True),
             "x.type('torch.FloatTensor')": lambda: x.type("torch.FloatTensor"),
             "bincount()": lambda: classes.bincount(),
             "one_hot() without num_classes": lambda: torch.nn.functional.one_hot(classes),
             "histc() with its default range": lambda: x.histc(),
             "x.new_tensor([tensor, tensor])": lambda: x.new_tensor([value, value]),
             "blocking copy_ from the host": lambda: x.copy_(host),
             "blocking copy_ to the host": lambda: host.copy_(x),
             "blocking copy_ to pinned memory": lambda: pinned.copy_(x),
             "blocking .to(device) of a host tensor": lambda: host.to("cuda"),
             "torch.zeros(tensor)": lambda: torch.zeros(four, device="cuda"),
             "torch.linspace(0, tensor, 5)": lambda: torch.linspace(0, value, 5, device="cuda"),
             "torch.full_like(x, tensor)": lambda: torch.full_like(x, value),
             "torch.randint(tensor, size)": lambda: torch.randint(four, (2,), device="cuda"),
             "torch.add(x, y, alpha=tensor)": lambda: torch.add(x, x, alpha=one),
             "torch.sum(x, tensor)": lambda: torch.sum(x, one),
             "torch.narrow(x, 0, tensor, 1)": lambda: torch.narrow(x, 0, zero, 1),
             "torch.masked_fill(x, mask, tensor)": lambda: torch.masked_fill(x, mask[:, None], value),
             "torch.tensor([tensor, tensor])": lambda: torch.tensor([value, value]),
             "x.tensor_split((tensor, 3))": lambda: x.tensor_split((two, 3)),
             "torch.save(x)": lambda: torch.save(x, io.BytesIO()),
             "pickle.dumps(x)": lambda: pickle.dumps(x),
             "x.untyped_storage().tolist()": lambda: x.untyped_storage().tolist(),
             "F.avg_pool1d(x, [tensor])": lambda: torch.nn.functional.avg_pool1d(x[None], [two])}
    no_sync = {"x[mask] = 1.0": lambda: assign(x, mask, 1.0),
               "x[:, mask] = 2": lambda: assign(x, (slice(None), mask[:3]), 2),
               "masked_fill with a number": lambda: x.masked_fill(mask[:, None], 0.0),
               "x[index tensor]": lambda: x[rows],
               "x.add(0-dim tensor)": lambda: x.add(value),
               "x.clamp(min=0-dim tensor)": lambda: x.clamp(min=value),
               "x[[index tensor]]": lambda: x[[rows]],
               "x[[mask]] = 1.0": lambda: assign(x, [mask], 1.0),
               "x.type(torch.float64)": lambda: x.type(torch.float64),
               "one_hot(classes, 3)": lambda: torch.nn.functional.one_hot(classes, 3),
               "histc() with a range": lambda: x.histc(bins=4, min=0, max=4),
               "non-blocking copy_ to pinned memory": lambda: pinned.copy_(x, non_blocking=True),
               "non-blocking copy_ from pinned memory": lambda: x.copy_(pinned, non_blocking=True),
               "copy_ on the device": lambda: x.copy_(x + 1),
               "x.to(x.device)": lambda: x.to(x.device),
               "x.to(x.device, float16)": lambda: x.to(x.device, torch.float16),
               "torch.clamp(x, max=0-dim tensor)": lambda: torch.clamp(x, max=value),
               "torch.add(x, 0-dim tensor)": lambda: torch.add(x, value),
               "torch.where(mask, x, 0-dim tensor)": lambda: torch.where(mask[:, None], x, value),
               "torch.stack([0-dim tensors])": lambda: torch.stack([value, value]),
               "x.tensor_split(host 0-dim tensor)": lambda: x.tensor_split(host_sections),
               "torch.tensor_split(x, host 1-dim tensor)": lambda: torch.tensor_split(x, host_indices),
               "copy.copy(x)": lambda: copy.copy(x),
               "copy.deepcopy(x)": lambda: copy.deepcopy(x),
               "F.avg_pool1d(x, [2])": lambda: torch.nn.functional.avg_pool1d(x[None], [2])}
    # refused by torch, before any read: tensor_split takes its tensor of indices or sections on the host only
    refused = {"x.tensor_split(device 0-dim tensor)": lambda: x.tensor_split(two),
               "torch.tensor_split(x, device 1-dim tensor)": lambda: torch.tensor_split(x, rows)}
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
        for what, op in refused.items():
            with pytest.raises(RuntimeError, match="tensor_indices_or_sections to be on cpu") as refusal:
                op()
            assert "called a synchronizing" not in str(refusal.value), what
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert not missed, f"CUDA's sync debug mode let {missed} through"
