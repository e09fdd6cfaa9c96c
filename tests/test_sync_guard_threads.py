"""The shared ``torch.cuda`` graph backend (``hwgraph.graphs.torch_cuda``) on a fake runtime namespace, on the CPU."""

from __future__ import annotations

import pytest
import torch

from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.testing.simulate import FakeGraphRuntime
from hwgraph.testing.threads import first_leaves_while_second_is_inside


class SyncDebugRuntime(FakeGraphRuntime):
    """A ``torch.cuda``-like namespace with a process-wide sync debug mode (0 off, 1 warn, 2 error)."""

    def __init__(self):
        super().__init__(count=2)
        self.debug_mode = 0

    def set_sync_debug_mode(self, mode):
        self.debug_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

    def get_sync_debug_mode(self):
        return self.debug_mode


def backend_on(runtime) -> TorchCudaGraphBackend:
    cls = type("FakeTorchCudaGraphBackend", (TorchCudaGraphBackend,),
               {"name": "fake", "runtime": classmethod(lambda cls: runtime),
                "capability": classmethod(lambda cls, device=None: Capability())})
    return cls("cuda:0")


def test_sync_guards_of_two_threads_keep_the_mode_on_until_the_last_ends_and_then_restore_the_original():
    """The sync debug mode is process-wide. Each guard restoring the mode it found turned it off while another
    thread's guard was still open (its host reads went unchecked) and left it at "error" for the whole process once
    both had ended (every later host read anywhere raised)."""
    runtime = SyncDebugRuntime()
    runtime.debug_mode = 1  # the process's own choice ("warn"), restored at the end
    backend = backend_on(runtime)
    assert first_leaves_while_second_is_inside(backend.sync_guard, lambda: runtime.debug_mode) == 2
    assert runtime.debug_mode == 1


def test_nested_sync_guards_restore_the_mode_only_when_the_outer_one_ends():
    runtime = SyncDebugRuntime()
    backend = backend_on(runtime)
    with backend.sync_guard():
        with backend_on(runtime).sync_guard():
            assert runtime.debug_mode == 2
        assert runtime.debug_mode == 2
    assert runtime.debug_mode == 0
    try:
        with backend.sync_guard():
            raise KeyError("boom")
    except KeyError:
        pass
    assert runtime.debug_mode == 0
    assert torch.ones(2).sum().item() == 2.0  # nothing of the guard is left behind


def test_a_counted_switch_left_more_often_than_entered_says_so():
    """A leave without its enter took the count below zero: the switch then never turned on again, silently."""
    from hwgraph.graphs.base import CountedSwitch

    log = []
    switch = CountedSwitch(lambda: log.append("on") or "found", log.append)
    with switch:
        with switch:
            assert switch.depth == 2
    assert log == ["on", "found"] and switch.depth == 0
    with pytest.raises(RuntimeError, match="left more often than entered"):
        switch.__exit__(None, None, None)
    with switch:
        assert log[-1] == "on"
