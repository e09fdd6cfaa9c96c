"""What opening a CPU sync guard costs: its replacements are made once, and made again only for an attribute that
changed since (``RejectHostReads._replacements``).

The guard replaces some 540 attributes (tensor methods, ``torch`` functions, ``Tensor.device``, ``F.one_hot``). It made
every one of them again each time the first guard opened, which doubled the cost of a guard opened per encode call.
Reusing them must not cost correctness: an attribute that another library or a test replaced between two guards is the
one the next guard wraps and puts back, never the original it wrapped before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hwgraph.graphs import HostSyncError
from hwgraph.graphs.host_reads import RejectHostReads


def replaced_keys() -> list[tuple[object, str]]:
    return [(owner, name) for owner, name, _ in RejectHostReads._replacements()]


def installed(keys) -> dict:
    """What each replaced attribute is on its owner now (read inside a guard: the guard's replacement)."""
    return {(owner, name): vars(owner).get(name) for owner, name in keys}


def test_every_guard_installs_the_replacements_the_first_one_made():
    """Nested guards, one left by an exception, and guards opened one after another install the same objects."""
    keys = replaced_keys()
    assert len(keys) > 500  # the tensor methods and torch functions that can read a value back, and more
    with RejectHostReads():
        first = installed(keys)
    assert all(first.values())
    with pytest.raises(KeyError, match="boom"), RejectHostReads(), RejectHostReads():
        assert installed(keys) == first
        raise KeyError("boom")
    for _ in range(3):
        with RejectHostReads():
            now = installed(keys)
        remade = [name for key, name in keys if now[key, name] is not first[key, name]]
        assert not remade, f"a later guard made {len(remade)} replacements again, such as {remade[:5]}"


def test_a_guard_makes_no_replacement_again_until_an_attribute_changes(monkeypatch):
    """Counted where the wrappers of the non-number methods are made (``_rejecting_calls``): none for guards opened
    and closed over unchanged attributes, one for the one attribute a test replaced."""
    with RejectHostReads():  # the first guard of the process, or not: makes whatever is not made yet
        pass
    made = []
    rejecting_calls = RejectHostReads._rejecting_calls

    def counted(fn, what, reads):
        made.append(what)
        return rejecting_calls(fn, what, reads)

    monkeypatch.setattr(RejectHostReads, "_rejecting_calls", staticmethod(counted))
    for _ in range(5):
        with RejectHostReads():
            with RejectHostReads():
                pass
    assert made == []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *args, **kwargs: real_copy(self, *args, **kwargs))
    with RejectHostReads():
        pass
    with RejectHostReads():
        pass
    assert len(made) == 1 and made[0].startswith("copy_()"), made


def test_an_attribute_replaced_between_guards_is_the_one_the_next_guard_wraps_and_puts_back(monkeypatch):
    """A stand-in set between two guards (another library's wrapper, a test's monkeypatch) is called inside the next
    guard, under the guard's checks, and is what that guard puts back; once the stand-in is undone, the guard after
    wraps the original again and puts the original back, not the stand-in it last found.

    The replacement made for the original before is reused only where replacements are kept per function wrapped:
    for the ``torch`` functions (``torch_replacement``; torch.compile guards on their identity) and the tensor methods
    judged only by their number arguments (``flip``). The guard's other wrappers (``copy_``, ``item``,
    ``__getitem__``, ``to``, ``F.one_hot``...) are made again for the original, once (``Wrapped`` keeps only the last
    one made); for the tensor methods among them, which carry no compile guard, that costs only the making."""
    real_zeros, real_one_hot = torch.zeros, F.one_hot
    tensor_flip = vars(torch.Tensor).get("flip")  # None: Tensor.flip is TensorBase's
    x, n = torch.arange(4.0), torch.tensor(2)
    with RejectHostReads():  # made for the originals
        zeros_replacement, flip_replacement = torch.zeros, vars(torch.Tensor)["flip"]
    calls = []

    def zeros(*args, **kwargs):
        calls.append("zeros")
        return real_zeros(*args, **kwargs)

    def flip(self, *args, **kwargs):
        calls.append("flip")
        return torch._C.TensorBase.flip(self, *args, **kwargs)

    def one_hot(*args, **kwargs):
        calls.append("one_hot")
        return real_one_hot(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.Tensor, "flip", flip)
    monkeypatch.setattr(F, "one_hot", one_hot)
    with RejectHostReads():
        assert torch.zeros(2).shape == (2,) and F.one_hot(n, 3).shape == (3,)
        flipped = x.flip(0)
        with pytest.raises(HostSyncError, match=r"torch\.zeros\(\) with a tensor where a size"):
            torch.zeros(n)
        with pytest.raises(HostSyncError, match=r"^flip\(\) with a tensor where a size"):
            x.flip(torch.tensor(0))
        with pytest.raises(HostSyncError, match=r"^one_hot\(\) without num_classes"):
            F.one_hot(n)
    assert calls == ["zeros", "one_hot", "flip"] and flipped.tolist() == [3.0, 2.0, 1.0, 0.0]
    assert torch.zeros is zeros and vars(torch.Tensor)["flip"] is flip and F.one_hot is one_hot

    monkeypatch.undo()
    with RejectHostReads():
        assert torch.zeros is zeros_replacement and vars(torch.Tensor)["flip"] is flip_replacement
        assert torch.zeros(2).shape == (2,) and x.flip(0).shape == (4,) and F.one_hot(n, 3).shape == (3,)
        with pytest.raises(HostSyncError, match=r"torch\.zeros\(\) with a tensor where a size"):
            torch.zeros(n)
        with pytest.raises(HostSyncError, match=r"^flip\(\) with a tensor where a size"):
            x.flip(torch.tensor(0))
    assert calls == ["zeros", "one_hot", "flip"], "a stand-in undone before the guard was called inside it"
    assert torch.zeros is real_zeros and vars(torch.Tensor).get("flip") is tensor_flip and F.one_hot is real_one_hot
    assert torch.zeros(n).shape == (2,) and RejectHostReads.switch.depth == 0
