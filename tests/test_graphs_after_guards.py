"""The graph backends' state after their guards and captures end: tensors stay no sequences once a CPU sync guard
has replaced their indexing, a capture environment that cannot be applied is left unset and named, and a replay that
returns another number of outputs names both counts."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.graphs.torch_cuda import environment_defaults


@pytest.fixture
def backend():
    return CpuGraphBackend()


def tensor_of_values(*values: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(values))


def test_a_list_of_0_dim_tensors_still_makes_a_tensor_after_a_sync_guard_ended(backend):
    """The guard replaces ``__getitem__``/``__setitem__`` on ``torch.Tensor``; CPython then gives the class (and every
    subclass) the sequence slots that a Python ``__getitem__`` brings, and deleting the replacement does not take them
    away. Every tensor stayed a sequence for the rest of the process: ``torch.tensor([a.sum(), b.sum()])`` raised
    "len() of a 0-d tensor" after any sync_guard() had ended."""
    a, p = torch.ones(3), torch.nn.Parameter(torch.ones(2))
    assert tensor_of_values(a.sum(), torch.tensor(2.0)).tolist() == [3.0, 2.0]
    with backend.sync_guard():
        class MadeInside(torch.Tensor):  # a subclass made while the guard is open inherits its indexing then
            pass
    assert tensor_of_values(a.sum(), torch.tensor(2.0)).tolist() == [3.0, 2.0]
    assert tensor_of_values(torch.tensor(5.0).as_subclass(MadeInside)).tolist() == [5.0]
    assert torch.as_tensor([torch.tensor(1), 2]).tolist() == [1, 2]
    assert tensor_of_values(p.detach().sum()).tolist() == [2.0]
    assert a.new_tensor([torch.tensor(4.0)]).tolist() == [4.0]
    with pytest.raises(ValueError, match="only one element tensors"):  # torch's own error, as before any guard
        tensor_of_values(torch.ones(2), torch.ones(2))


def test_a_list_of_0_dim_tensors_read_inside_a_sync_guard_is_a_host_sync_error(backend):
    """``torch.tensor([t0, t1])`` reads each value back (a sync on a device): inside the guard it raised the misleading
    TypeError "len() of a 0-d tensor" (tensors had become sequences), not HostSyncError; indexing is still guarded."""
    a, mask = torch.ones(3), torch.tensor([True, False, True])
    with backend.sync_guard():
        with pytest.raises(HostSyncError):
            tensor_of_values(a.sum(), a.sum())
        with pytest.raises(HostSyncError, match="boolean-mask"):
            a[mask]
        a[mask] = 0.0
        assert a[torch.tensor([1])].shape == (1,)
    assert a.tolist() == [0.0, 1.0, 0.0]


def test_a_capture_environment_value_that_is_no_string_is_named_and_leaves_nothing_set(monkeypatch):
    """``os.environ.update`` set the variables before the bad one and raised outside the block that removes them: a
    plugin's ``capture_environment`` with a number in it left the others set for the process, and the TypeError
    ("str expected, not int") named no variable."""
    for name in ("HWGRAPH_TEST_ENV_A", "HWGRAPH_TEST_ENV_B"):  # unset, and unset again after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with pytest.raises(TypeError, match="HWGRAPH_TEST_ENV_B.*got 0"):
        with environment_defaults({"HWGRAPH_TEST_ENV_A": "1", "HWGRAPH_TEST_ENV_B": 0}):
            pytest.fail("the block ran")
    assert "HWGRAPH_TEST_ENV_A" not in os.environ and "HWGRAPH_TEST_ENV_B" not in os.environ
    with environment_defaults({"HWGRAPH_TEST_ENV_A": "1"}) as applied:
        assert applied == {"HWGRAPH_TEST_ENV_A": "1"} and os.environ["HWGRAPH_TEST_ENV_A"] == "1"
    assert "HWGRAPH_TEST_ENV_A" not in os.environ


def test_capture_environment_stays_set_while_an_overlapping_capture_in_another_thread_runs(monkeypatch):
    """Captures on two devices from two threads overlap. The first block set the variable and removed it as it left,
    while the second, which had found it set and left it alone, was still capturing: that capture ran without the
    plugin's setting (cuBLASLt's kernel choice for the CUDA plugin). The last block out removes it now."""
    name = "HWGRAPH_TEST_ENV_SHARED"
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with environment_defaults({name: "1"}) as applied:
            seen["first"] = dict(applied)
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second():
        first_in.wait(5)
        with environment_defaults({name: "2"}) as applied:
            seen["second"] = dict(applied)
            second_in.set()
            first_out.wait(5)
            seen["after the first left"] = os.environ.get(name)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == {"first": {name: "1"}, "second": {name: "1"}, "after the first left": "1"}
    assert name not in os.environ


def test_a_replay_that_returns_another_number_of_outputs_names_both_counts(backend):
    """The error said only "a different number of outputs", naming neither count (the NPU backend's names both)."""
    count = [1]
    graph = backend.capture(lambda: tuple(torch.ones(2) for _ in range(count[0])))
    count[0] = 3
    with pytest.raises(CaptureError, match=r"^the captured callable returned a different number of outputs on replay: "
                                           r"3, against 1 at capture$"):
        graph.replay()
