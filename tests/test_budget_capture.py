"""capture_budget on the CPU reference backend: one graph per slot count over one set of static buffers."""

from __future__ import annotations

import pytest
import torch

from hwgraph.budget_capture import VERIFY_TOLERANCE, BudgetGraph, capture_budget, relative_error
from hwgraph.graphs.base import CaptureError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    t = Qwen3OmniVisionTower.from_preset("tiny").eval()
    t.set_attention("TORCH_SDPA")
    return t


def random_pixels(tower):
    g = torch.Generator().manual_seed(1)
    return lambda rows: torch.randn(rows, tower.patch_row_width, generator=g)


def capture(tower, backend, budget=16, **kwargs):
    return capture_budget(tower, backend, backend.new_pool(), budget, device=torch.device("cpu"),
                          slot_counts=kwargs.pop("slot_counts", [1, 2, 4]), max_images=4,
                          random_pixels=random_pixels(tower), **kwargs)


def test_each_slot_count_gets_a_graph_reading_the_budgets_one_set_of_buffers(tower):
    backend = CpuGraphBackend()
    checked = []
    entry = capture(tower, backend, verify=lambda entry, graph, host, grid: checked.append((graph, grid)))
    assert list(entry.graphs) == [1, 2, 4]  # ascending, whatever order they were captured in
    assert entry.num_patches == 16 * tower.spatial_merge_size ** 2 == entry.pixels.shape[0]
    assert [g for g, _ in checked] == list(entry.graphs.values())
    assert entry.compile_seconds is None and entry.capture_seconds > 0
    # every graph reads the static pixels: changing them changes every replay's answer, as eager's
    grid = checked[0][1]
    entry.pixels.copy_(torch.randn(entry.pixels.shape, generator=torch.Generator().manual_seed(2)))
    with torch.inference_mode():
        want = torch.stack(tower.forward(entry.pixels, grid).tensors())
    for graph in entry.graphs.values():
        graph.replay()
        assert relative_error(graph.outputs[:, : want.shape[1]], want) <= VERIFY_TOLERANCE[torch.float32]
    assert entry.graph_for(1)[0] == 1 and entry.graph_for(3)[0] == 4
    entry.release()


def test_a_graph_the_check_refuses_releases_the_budgets_others_and_raises(tower, monkeypatch):
    backend = CpuGraphBackend()
    captured = []
    real_capture = backend.capture

    def recording_capture(fn, pool=None):
        graph = real_capture(fn, pool)
        captured.append(graph)
        return graph

    monkeypatch.setattr(backend, "capture", recording_capture)

    def refuse_the_second(entry, graph, host, grid):
        if graph is list(entry.graphs.values())[1]:
            raise CaptureError("simulated: replay differs from eager")

    with pytest.raises(CaptureError, match="simulated"):
        capture(tower, backend, verify=refuse_the_second)
    assert len(captured) == 3
    for graph in captured:  # the CPU backend's released graphs refuse to replay
        with pytest.raises(RuntimeError, match="released"):
            graph.replay()


def test_a_plain_capture_neither_compiles_nor_enters_dynamos_limits(tower, monkeypatch):
    from hwgraph import budget_capture

    def limits(num_budgets):
        raise AssertionError("a plain capture entered compile_limits")

    monkeypatch.setattr(budget_capture, "compile_limits", limits)
    entry = capture(tower, CpuGraphBackend(), slot_counts=[4])
    assert list(entry.graphs) == [4] and entry.compile_seconds is None
    entry.release()


def test_relative_error_is_the_l2_distance_over_the_norm_of_what_was_wanted():
    want = torch.tensor([3.0, 4.0])
    assert relative_error(want, want) == 0.0
    assert relative_error(torch.tensor([3.0, 0.0]), want) == pytest.approx(4.0 / 5.0)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0  # no division by zero


def test_graph_for_more_sequences_than_any_graph_holds_names_them():
    """It raised min()'s "arg is an empty sequence", naming neither the count nor the graphs' slots."""
    graph = object()
    entry = BudgetGraph(16, 64, None, None, {1: graph, 4: graph}, 0, 0.0)
    assert entry.graph_for(3) == (4, graph) and entry.graph_for(1) == (1, graph)
    with pytest.raises(ValueError, match=r"^no graph of budget 16 holds num_seqs=5 sequences: its slot counts are "
                                         r"\[1, 4\]$"):
        entry.graph_for(5)
