"""The CPU reference backend refuses a replay that would read a tensor put in place of one its capture read.

A device graph reads, at every replay, the buffers its capture read: a caller who replaces a tensor the captured
callable reads (``holder.x = new``) instead of copying into it (``holder.x.copy_(new)``) gets the old buffer's values
on a device (or freed memory), while the CPU backend's rerun read the new tensor and passed.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.testing.towers import grid_of, pixels_for

REPLACED = r"a device graph would read the captured buffer instead"


@pytest.fixture
def backend():
    return CpuGraphBackend()


def test_a_replay_refuses_a_tensor_put_in_place_of_a_captured_input_before_writing_its_outputs(backend):
    holder, weight = types.SimpleNamespace(x=torch.zeros(4, 8)), torch.ones(8, 3)
    graph = backend.capture(lambda: holder.x @ weight)
    holder.x.copy_(torch.full((4, 8), 2.0))  # the way a device graph sees new inputs
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4, 3), 16.0))
    captured = holder.x.data_ptr()
    holder.x = torch.full((4, 8), 3.0)  # a device graph keeps reading the old, now freed, buffer
    with pytest.raises(CaptureError) as refused:
        graph.replay()
    message = str(refused.value)
    assert message.startswith("replay of test_a_replay_refuses_a_tensor_put_in_place_of_a_captured_input_before_"
                              "writing_its_outputs.<locals>.<lambda> would read holder.x, now a tensor of shape (4, "
                              f"8), torch.float32, at {hex(holder.x.data_ptr())}, which existed before the replay but "
                              f"was not read by the capture: the capture read a tensor of shape (4, 8), torch.float32, "
                              f"at {hex(captured)} there, freed since"), message
    assert REPLACED in message.lower() and "(freed memory)" in message and "copy_" in message
    torch.testing.assert_close(graph.outputs, torch.full((4, 3), 16.0))  # refused before the rerun wrote them


def test_a_replaced_tensor_that_is_still_alive_is_refused_as_stale_values(backend):
    holder = types.SimpleNamespace(x=torch.zeros(4))
    graph = backend.capture(lambda: holder.x * 2)
    kept = holder.x  # alive: a device graph would read its stale values
    holder.x = torch.ones(4)
    with pytest.raises(CaptureError, match=r"would read holder\.x, .* at 0x[0-9a-f]+ there\. A device graph would "
                                           r"read the captured buffer instead \(stale values\)"):
        graph.replay()
    holder.x = kept  # put back: what the capture read, so the replay reads it again
    kept.fill_(5.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4,), 10.0))


@pytest.mark.parametrize("replace", [
    pytest.param(lambda lin: setattr(lin, "weight", torch.nn.Parameter(torch.randn(3, 8))), id="new-parameter"),
    pytest.param(lambda lin: setattr(lin.weight, "data", torch.randn(3, 8)), id="new-data"),
    pytest.param(lambda lin: lin.load_state_dict({"weight": torch.randn(3, 8), "bias": torch.randn(3)}, assign=True),
                 id="load_state_dict-assign"),
])
def test_a_parameter_given_a_new_tensor_is_refused_naming_it(backend, replace):
    lin, x = torch.nn.Linear(8, 3), torch.ones(2, 8)
    graph = backend.capture(lambda: lin(x))
    replace(lin)
    with pytest.raises(CaptureError, match=r"would read lin\.(weight|bias), now a tensor of shape \((3, 8|3,)\), "
                                           r"torch\.float32"):
        graph.replay()


def test_values_copied_into_captured_tensors_replay_without_error(backend):
    """What a device graph reads too: new values in the captured inputs and weights (``copy_``,
    ``load_state_dict`` without ``assign``), views of them, tensors the callable makes (factories, ``torch.tensor``,
    a scratch tensor it keeps) and a cache it filled in its warm-up."""
    lin = torch.nn.Linear(8, 3)
    holder = types.SimpleNamespace(x=torch.zeros(4, 8), scratch=None)
    inputs, cache = {"offset": torch.zeros(3)}, {}

    def fn():
        if "scale" not in cache:
            cache["scale"] = torch.full((3,), 2.0)  # made in the warm-up, read by the capture
        holder.scratch = torch.zeros(4, 3)  # made in every run, then read
        holder.scratch += lin(holder.x[1:].repeat(2, 1)[:4])
        return holder.scratch * cache["scale"] + inputs["offset"] + torch.tensor([1.0, 0.0, 0.0]) + torch.ones(3)

    graph = backend.capture(fn)
    for step in range(3):
        holder.x.copy_(torch.randn(4, 8))
        inputs["offset"].fill_(step)
        lin.load_state_dict({"weight": torch.randn(3, 8), "bias": torch.randn(3)})
        graph.replay()
        with torch.inference_mode():
            want = lin(holder.x[1:].repeat(2, 1)[:4]) * 2 + step + torch.tensor([2.0, 1.0, 1.0])
        torch.testing.assert_close(graph.outputs, want)


def test_a_tensor_the_callable_replaced_in_its_previous_run_is_refused(backend):
    """The capture read what the warm-up left in ``state.prev``; a device graph reads that buffer at every replay,
    while the rerun reads what the capture's run left there."""
    state = types.SimpleNamespace(prev=torch.zeros(2))

    def fn():
        state.prev = state.prev + 1
        return state.prev

    graph = backend.capture(fn)
    with pytest.raises(CaptureError, match=r"would read state\.prev, now a tensor of shape \(2,\), torch\.float32"):
        graph.replay()


def test_a_compiled_callable_captures_replays_compiled_and_refuses_a_replaced_input(backend):
    """Dynamo runs no compiled frame under a dispatch mode ("non-infra torch dispatch mode present"; with fullgraph a
    RuntimeError): the capture's reads are noted with compiled code running eagerly, and a replay adds no mode, so it
    runs the compiled graph."""
    graphs_run = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            graphs_run.append(1)
            return gm.forward(*args)
        return run

    holder = types.SimpleNamespace(x=torch.ones(4))
    compiled = torch.compile(lambda: holder.x * 3 + 1, backend=counting_backend, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        graph = backend.capture(compiled)
    holder.x.fill_(2.0)
    before = len(graphs_run)
    graph.replay()
    assert len(graphs_run) == before + 1, "the replay did not run the compiled graph"
    torch.testing.assert_close(graph.outputs, torch.full((4,), 7.0))
    holder.x = torch.zeros(4)
    with pytest.raises(CaptureError, match=r"would read holder\.x, now a tensor of shape \(4,\)"):
        graph.replay()


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.x = torch.nn.Linear(4, 4), torch.ones(2, 4)

    def forward(self):
        return self.lin(self.x)


def scaled_first(scale, buffers):
    return buffers["a"][0] * scale


@pytest.mark.parametrize("make, replace, where", [
    pytest.param(Scaled, lambda m: setattr(m.lin, "bias", torch.nn.Parameter(torch.ones(4))), r"self\.lin\.bias",
                 id="a-module"),
    pytest.param(lambda: Scaled().forward, lambda f: setattr(f.__self__, "x", torch.ones(2, 4)), r"self\.x",
                 id="a-bound-method"),
    pytest.param(lambda: functools.partial(scaled_first, 2.0, {"a": [torch.ones(3)]}),
                 lambda f: f.args[1]["a"].__setitem__(0, torch.zeros(3)), r"partial\.args\[1\]\['a'\]\[0\]",
                 id="a-partial-list-in-a-dict"),
])
def test_the_refusal_names_the_replaced_tensor_as_the_caller_reaches_it(backend, make, replace, where):
    fn = make()
    graph = backend.capture(fn)
    replace(fn)
    with pytest.raises(CaptureError, match=rf" would read {where}, now a tensor of shape"):
        graph.replay()


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_the_read_check_composes_with_the_sync_guard_a_callers_dispatch_mode_and_inference_mode(backend):
    holder = types.SimpleNamespace(x=torch.ones(3))
    counter = OpCounter()
    with counter, torch.inference_mode(), backend.sync_guard():  # the guard's replaced methods serve the capture too
        graph = backend.capture(lambda: (holder.x * 2).sum(0, keepdim=True))
        graph.replay()
    # the warm-up, the capture and the replay: a product and a sum each; the replay copies its result out too
    assert counter.ops == 2 + 2 + 3, "the caller's mode did not see each op"
    torch.testing.assert_close(graph.outputs, torch.tensor([6.0]))
    holder.x = torch.zeros(3)
    with backend.sync_guard(), pytest.raises(CaptureError, match=r"would read holder\.x"):
        graph.replay()
    with pytest.raises(HostSyncError):  # the guard still rejects host reads around the check
        with backend.sync_guard():
            graph.outputs.item()


def test_a_manager_replay_refuses_weights_given_new_data_that_its_own_check_misses():
    """The manager compares the tower's weights' addresses before each call, but a middle parameter given new data
    (``.data = ...``) escapes it (``Qwen3OmniVisionTower.weights_key``): its graphs would read the old weights on a
    device, and the CPU backend's replay now says so."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    manager = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu")
    manager.capture()
    grid = [grid_of(16, tower.spatial_merge_size)]
    pixels = pixels_for(tower, grid, seed=1)
    manager.encode(pixels, grid)
    assert manager.stats()["hits"] == 1
    weight = tower.blocks[0].mlp.linear_fc1.weight
    weight.data = weight.data.clone()
    with pytest.raises(CaptureError, match=r"would read tower\.blocks\.0\.mlp\.linear_fc1\.weight, now a tensor of "
                                           r"shape \(\d+, \d+\), torch\.float32"):
        manager.encode(pixels, grid)
