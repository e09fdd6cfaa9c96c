"""The npu plugin's torchair graphs: outputs that the graph interface accepts are kept as they were
returned, and a replay whose outputs no longer fit the capture's is refused, naming what it returned."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from hwgraph_npu.graphs import CompiledGraph, clone_outputs

from hwgraph.graphs import CaptureError


class Features(NamedTuple):
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]


def test_clone_outputs_keeps_a_named_tuple_of_tensors():
    """A named tuple is a tuple of tensors, which every graph backend takes as outputs (aclgraph mode too); cloning it
    as ``type(outputs)(generator)`` passed the generator as its first field and raised TypeError, so torchair mode
    refused the capture as "torchair compilation failed"."""
    a, b = torch.ones(2), torch.arange(3.0)
    copied = clone_outputs(Features(a, (b,)))
    assert type(copied) is Features and type(copied.deepstack) is tuple
    assert torch.equal(copied.embeds, a) and torch.equal(copied.deepstack[0], b)
    assert copied.embeds.data_ptr() != a.data_ptr() and copied.deepstack[0].data_ptr() != b.data_ptr()


def test_a_compiled_graph_with_named_tuple_outputs_replays_into_them():
    x = torch.zeros(3)
    with torch.inference_mode():
        graph = CompiledGraph(lambda: Features(x + 1, (x * 2,)), clone_outputs(Features(x + 1, (x * 2,))))
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    torch.testing.assert_close(graph.outputs.embeds, torch.tensor([2.0, 3.0, 4.0]))
    torch.testing.assert_close(graph.outputs.deepstack[0], torch.tensor([2.0, 4.0, 6.0]))


def test_a_replay_returning_another_number_of_outputs_names_both_counts():
    with torch.inference_mode():
        graph = CompiledGraph(lambda: (torch.ones(3), torch.ones(3)), (torch.zeros(3),))
    with pytest.raises(CaptureError, match=r"different number of outputs on replay: 2, against 1 at capture"):
        graph.replay()


def test_a_replay_returning_outputs_of_another_shape_is_refused_not_broadcast():
    """After a recompilation (a guard failed) the compiled callable may return other shapes; ``copy_`` broadcast a
    smaller one into the static output without a word, so every row held the same values."""
    with torch.inference_mode():
        graph = CompiledGraph(lambda: (torch.arange(3.0),), (torch.zeros(2, 3),))
    with pytest.raises(CaptureError, match=r"outputs of other shapes on replay: \[\(3,\)\], against \[\(2, 3\)\] at "
                                           r"capture"):
        graph.replay()
