"""The CPU sync guard's replacements outside a guard: what it leaves behind rejects nothing, and what others set while
it was open stays theirs."""

from __future__ import annotations

import builtins

import pytest
import torch

from hwgraph.graphs import HostSyncError, host_reads
from hwgraph.graphs.host_reads import RejectHostReads


def replaced_now() -> list[str]:
    """The attributes that hold the guard's replacement now."""
    return [name for owner, name, made in RejectHostReads._replacements() if vars(owner).get(name) is made]


@pytest.fixture
def tensor_attributes_kept():
    """torch.Tensor's own attributes put back as they were after the test: a replacement left behind rejects nothing,
    but other tests compare the attributes with torch's."""
    kept = dict(vars(torch.Tensor))
    yield
    for name in [name for name in vars(torch.Tensor) if name not in kept]:
        delattr(torch.Tensor, name)
    for name, value in kept.items():
        if vars(torch.Tensor).get(name) is not value:
            setattr(torch.Tensor, name, value)


def test_a_stand_in_set_inside_a_guard_stays_and_its_undo_leaves_nothing_that_rejects(monkeypatch,
                                                                                    tensor_attributes_kept):
    """A monkeypatch made inside a guard: closing the guard put the saved method back over the stand-in, and the
    monkeypatch's undo then put back what it had seen, the guard's replacement, which rejected ``item()`` outside any
    guard for good (every later guard took it for its own and put it back)."""
    t = torch.tensor(3.0)
    with RejectHostReads():
        monkeypatch.setattr(torch.Tensor, "item", lambda self: 42.0)
        assert t.item() == 42.0
    assert t.item() == 42.0  # the stand-in stays until its own undo
    monkeypatch.undo()
    assert t.item() == 3.0
    with RejectHostReads():
        with pytest.raises(HostSyncError, match=r"\.item\(\)"):
            t.item()
    assert t.item() == 3.0


def test_a_stand_in_removed_inside_a_guard_is_not_put_back(monkeypatch):
    """Set before the guard and undone inside it: the guard put the stand-in back when it closed, for good."""
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: "stand-in")
    with RejectHostReads():
        monkeypatch.undo()
    assert torch.Tensor.tolist is real and torch.ones(2).tolist() == [1.0, 1.0]


def test_a_replacement_bound_inside_a_guard_rejects_nothing_outside_it(tensor_attributes_kept):
    """``from torch import nonzero`` in a module first imported inside a guard binds the replacement."""
    with RejectHostReads():
        nonzero, item = torch.nonzero, torch.Tensor.item
        with pytest.raises(HostSyncError):
            nonzero(torch.ones(2))
    assert nonzero is not torch.nonzero
    assert nonzero(torch.ones(2)).tolist() == [[0], [1]] and item(torch.tensor(2.0)) == 2.0
    with RejectHostReads(), pytest.raises(HostSyncError):
        nonzero(torch.ones(2))


def test_an_exit_interrupted_half_way_puts_back_the_rest_and_then_raises(monkeypatch, tensor_attributes_kept):
    """A Ctrl-C while the guard put its attributes back: the switch had already counted the guard closed, the rest
    stayed replaced for good, and ``torch.zeros(n)``, ``x.flip(n)`` and ``torch.nonzero`` raised outside any guard."""
    calls = []

    def interrupting_setattr(owner, name, value):
        calls.append(name)
        if len(calls) == 100:
            raise KeyboardInterrupt
        builtins.setattr(owner, name, value)

    with pytest.raises(KeyboardInterrupt):  # noqa: PT012 -- the guard's exit is what raises
        with RejectHostReads():
            monkeypatch.setattr(host_reads, "setattr", interrupting_setattr, raising=False)
    monkeypatch.undo()
    assert RejectHostReads.switch.depth == 0 and len(calls) > 100
    assert replaced_now() == [calls[99]]  # the one interrupted, and it rejects nothing now
    n = torch.tensor(2)
    torch.zeros(n), torch.ones(3).flip(n - 2), torch.nonzero(torch.ones(2)), torch.ones(1).item()
    with RejectHostReads(), pytest.raises(HostSyncError):
        torch.zeros(n)


def test_a_getitem_left_behind_is_put_back_by_the_next_guard(monkeypatch, tensor_attributes_kept):
    """A Python ``__getitem__`` on ``torch.Tensor`` fills the type's sequence slots: the guard's replacement, put back
    by a stand-in's undo after the guard closed, made ``torch.tensor([a.sum(), b.sum()])`` fail ("len() of a 0-d
    tensor") for the rest of the process, later guards included, which saved it as the original."""
    a, b = torch.ones(2), torch.ones(3)
    with RejectHostReads():
        monkeypatch.setattr(torch.Tensor, "__getitem__", lambda self, index: "stand-in")
    monkeypatch.undo()
    assert "__getitem__" in replaced_now()
    with RejectHostReads():
        pass
    assert "__getitem__" not in vars(torch.Tensor)
    assert torch.tensor([a.sum(), b.sum()]).tolist() == [2.0, 3.0] and a[0].item() == 1.0


def test_a_compiled_function_is_compiled_once_whatever_the_guards_depth():
    """The replacements asked whether a guard was open before whether dynamo was compiling: dynamo traced that and
    guarded on the guards' depth, so a function calling ``x.to(dtype)`` compiled again in a nested guard."""
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    fn = torch.compile(lambda x: torch.repeat_interleave(x.to(torch.float64), 2) + 1, backend=counting)
    x = torch.ones(3)
    with RejectHostReads():
        fn(x)
        with RejectHostReads(), RejectHostReads():
            fn(x)
    assert len(compiles) == 1  # (outside a guard it is compiled again: it calls a function the guard replaces)
