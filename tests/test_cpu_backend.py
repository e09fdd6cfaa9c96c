"""The CPU reference backend emulates graph semantics exactly: static inputs, static outputs, no host reads."""

from __future__ import annotations

import pytest
import torch

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend


@pytest.fixture
def backend():
    return CpuGraphBackend()


@pytest.fixture
def static_input():
    return torch.zeros(4, 8)


def captured_affine(backend, static_input):
    weight = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 10
    graph = backend.capture(lambda: (static_input @ weight, static_input.sum(dim=1)))
    return graph, weight


def test_replay_reflects_new_contents_of_the_input_buffer(backend, static_input):
    graph, weight = captured_affine(backend, static_input)
    new = torch.randn(4, 8)
    static_input.copy_(new)
    graph.replay()
    torch.testing.assert_close(graph.outputs[0], new @ weight)
    torch.testing.assert_close(graph.outputs[1], new.sum(dim=1))


def test_replay_without_copying_new_inputs_returns_the_old_answer(backend, static_input):
    graph, weight = captured_affine(backend, static_input)
    first = torch.randn(4, 8)
    static_input.copy_(first)
    graph.replay()
    graph.replay()  # nothing new copied in: the same answer again, neither accumulated nor reset
    torch.testing.assert_close(graph.outputs[0], first @ weight)
    torch.testing.assert_close(graph.outputs[1], first.sum(dim=1))


def test_outputs_are_the_same_tensor_objects_across_replays(backend, static_input):
    graph, _ = captured_affine(backend, static_input)
    before = [id(t) for t in graph.outputs]
    pointers = [t.data_ptr() for t in graph.outputs]
    static_input.copy_(torch.randn(4, 8))
    graph.replay()
    graph.replay()
    assert [id(t) for t in graph.outputs] == before
    assert [t.data_ptr() for t in graph.outputs] == pointers


def test_an_output_read_before_the_next_replay_is_overwritten_by_it(backend, static_input):
    graph, _ = captured_affine(backend, static_input)
    static_input.fill_(1.0)
    graph.replay()
    held = graph.outputs[1]  # a caller that keeps the graph's buffer instead of cloning it
    static_input.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(held, torch.full((4,), 16.0))


@pytest.mark.parametrize("host_read", [
    pytest.param(lambda t: t.sum().item(), id="item"),
    pytest.param(lambda t: t.tolist(), id="tolist"),
    pytest.param(lambda t: t.cpu(), id="cpu"),
    pytest.param(lambda t: t.numpy(), id="numpy"),
    pytest.param(lambda t: bool(t.sum()), id="bool"),
    pytest.param(lambda t: int(t.sum()), id="int"),
    pytest.param(lambda t: float(t.sum()), id="float"),
])
def test_sync_guard_rejects_each_host_read(backend, host_read):
    tensor = torch.ones(3)
    with backend.sync_guard(), pytest.raises(HostSyncError):
        host_read(tensor)


def test_sync_guard_allows_device_work_and_ends_with_the_block(backend):
    tensor = torch.ones(3)
    with backend.sync_guard():
        doubled = tensor * 2 + 1
    assert doubled.sum().item() == 9.0


def test_memory_in_use_drops_after_release(backend, static_input):
    graph, _ = captured_affine(backend, static_input)
    held = backend.memory_in_use()
    assert held > 0
    graph.release()
    assert backend.memory_in_use() < held
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def test_graphs_share_a_pool(backend, static_input):
    pool = backend.new_pool()
    one = backend.capture(lambda: static_input * 2, pool)
    two = backend.capture(lambda: static_input + 1, pool)
    assert set(pool.graphs) == {one, two}


def test_nested_sync_guards_keep_rejecting_until_the_outermost_ends(backend):
    tensor = torch.ones(3)
    with backend.sync_guard():
        with backend.sync_guard():
            pass
        with pytest.raises(HostSyncError):  # the inner guard ended, the outer one still holds
            tensor.sum().item()
    assert tensor.sum().item() == 3.0 and tensor.tolist() == [1.0, 1.0, 1.0] and bool(tensor.any())


def test_a_mode_the_backend_does_not_have_is_refused_naming_its_modes():
    assert CpuGraphBackend(mode="emulated").mode == CpuGraphBackend().mode == "emulated"
    with pytest.raises(ValueError, match=r"graph backend 'cpu' has modes \['emulated'\], got mode='full'"):
        CpuGraphBackend(mode="full")


def test_a_replay_whose_outputs_differ_from_the_captured_ones_raises(backend):
    # a device graph cannot change its output shapes or count: the emulation refuses instead of broadcasting
    shape = [4]
    graph = backend.capture(lambda: torch.ones(shape[0]))
    shape[0] = 1
    with pytest.raises(CaptureError, match=r"replay produced shape \(1,\), captured \(4,\)"):
        graph.replay()
    count = [1]
    graph = backend.capture(lambda: tuple(torch.ones(2) for _ in range(count[0])))
    count[0] = 2
    with pytest.raises(CaptureError, match="different number of outputs"):
        graph.replay()
