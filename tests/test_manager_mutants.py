"""EncoderGraphManager behaviours a hand-made mutation audit of the replay path found unchecked: capture order and
idempotence, the refusal of kernels that are not graph-safe, the padded-metadata cache, a metadata copy that fails
half-way, stats logging, and outputs that track no gradients."""

from __future__ import annotations

import logging

import pytest
import torch

from hwgraph import manager as manager_module
from hwgraph.attention.sdpa import sdpa_varlen
from hwgraph.graphs.base import CaptureError
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.models.qwen3_omni.metadata import VisionMetadata

BUDGETS = [16, 32, 64]


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny").eval()


def make_manager(tower, budgets=BUDGETS, max_images=2, **kwargs):
    # attention given every time: a manager built with attention=None keeps the shared tower's last kernel
    return EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=max_images, graph_backend="cpu",
                               attention=kwargs.pop("attention", "TORCH_SDPA"), **kwargs)


def pixels_for(tower, grid, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def assert_equals_eager(tower, got, pixels, grid):
    with torch.inference_mode():
        want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.embeds, w.embeds)
        assert len(g.deepstack) == len(w.deepstack) > 0
        for gd, wd in zip(g.deepstack, w.deepstack, strict=True):
            torch.testing.assert_close(gd, wd)


def encode_and_check(m, tower, grid, seed):
    pixels = pixels_for(tower, grid, seed)
    out = m.encode(pixels, grid)
    assert_equals_eager(tower, out, pixels, grid)
    return out


def test_capture_goes_largest_budget_first(tower, monkeypatch):
    m = make_manager(tower)
    real_capture = m.backend.capture
    captured = []

    def recording(fn, pool=None):
        graph = real_capture(fn, pool)
        captured.append(graph.outputs.shape[1])  # the output buffer is [1 + deepstack, budget, out]
        return graph

    monkeypatch.setattr(m.backend, "capture", recording)
    m.capture()
    assert captured == [64, 32, 16]


def test_a_second_capture_keeps_the_graphs_it_already_has(tower, monkeypatch):
    m = make_manager(tower)
    m.capture()
    graphs = dict(m.graphs)
    held = m.backend.memory_in_use()
    calls = []
    monkeypatch.setattr(m.backend, "capture", lambda fn, pool=None: calls.append(fn))
    m.capture()
    assert calls == []
    assert all(m.graphs[b] is graphs[b] for b in BUDGETS) and sorted(m.graphs) == BUDGETS
    assert m.backend.memory_in_use() == held
    encode_and_check(m, tower, [(1, 4, 8)], 1)
    m.close()


def test_a_kernel_that_is_not_graph_safe_is_never_captured_and_says_why(caplog, monkeypatch):
    def host_bound_attention(q, k, v, cu_seqlens, max_seqlen, scale):
        return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)

    host_bound_attention.graph_safe = False  # as the NPU kernel: a capture would keep its host sequence lengths
    torch.manual_seed(0)
    own = Qwen3OmniVisionTower.from_preset("tiny").eval()  # not the module's: the kernel stays set on the tower
    m = make_manager(own, attention=host_bound_attention)
    calls = []
    monkeypatch.setattr(m.backend, "capture", lambda fn, pool=None: calls.append(fn))
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    why = "attention kernel host_bound_attention is not graph-safe"
    assert calls == [] and m.graphs == {}
    assert m.capture_refusal() == why
    assert m.stats()["capture_failures"] == {b: why for b in BUDGETS}
    assert any(why in r.getMessage() for r in caplog.records)
    encode_and_check(m, own, [(1, 4, 4)], 2)
    assert m.stats()["eager_reasons"] == {"no graphs": 1} and m.stats()["replays"] == 0


def test_a_grid_that_moves_to_a_newly_captured_budget_replays_there_and_equals_eager(tower, monkeypatch):
    m = make_manager(tower, budgets=[16, 64])
    real_capture = m.backend.capture
    attempts = []

    def fail_the_second(fn, pool=None):  # largest first: 64 captures, 16 fails
        attempts.append(fn)
        if len(attempts) == 2:
            raise CaptureError("simulated")
        return real_capture(fn, pool)

    monkeypatch.setattr(m.backend, "capture", fail_the_second)
    m.capture()
    assert sorted(m.graphs) == [64]
    grid = [(1, 4, 4)]
    encode_and_check(m, tower, grid, 3)  # replays the 64-token graph
    monkeypatch.setattr(m.backend, "capture", real_capture)
    m.capture()
    assert sorted(m.graphs) == [16, 64]
    encode_and_check(m, tower, grid, 4)  # the same grid, now in the 16-token graph: its own padded metadata
    assert m.stats()["replays_per_budget"] == {64: 1, 16: 1}
    m.close()


def test_padded_metadata_is_cached_for_the_most_recently_used_grids_and_the_cache_is_bounded(tower, monkeypatch):
    monkeypatch.setattr(manager_module, "PADDED_CACHE_SIZE", 2)
    m = make_manager(tower, budgets=[16])
    m.capture()
    padded_grids = []
    real_padded = VisionMetadata.padded

    def counting(self, *args, **kwargs):
        padded_grids.append(self.grid_thw)
        return real_padded(self, *args, **kwargs)

    monkeypatch.setattr(VisionMetadata, "padded", counting)
    a, b, c = ((1, 4, 4),), ((1, 4, 8),), ((1, 2, 8),)  # all in the 16-token graph, none its capture grid
    for i, grid in enumerate([a, b, a, c, a, b]):
        encode_and_check(m, tower, list(grid), 10 + i)
    # least recently used goes first: c evicts b (a was used since), the fifth call finds a, the last b is gone
    assert padded_grids == [a, b, c, b]
    m.close()


def test_a_metadata_copy_that_fails_half_way_is_redone_by_the_next_call(tower, monkeypatch):
    m = make_manager(tower, budgets=[16])
    m.capture()
    entry = m.graphs[16]
    a, b = [(1, 4, 4)], [(1, 4, 8)]
    encode_and_check(m, tower, a, 20)

    def interrupted(src):
        entry.metadata.pos_indices.copy_(src.pos_indices)  # one static buffer overwritten, then the copy fails
        raise RuntimeError("simulated: copy interrupted")

    monkeypatch.setattr(entry.metadata, "copy_from", interrupted)
    with pytest.raises(RuntimeError, match="copy interrupted"):
        m.encode(pixels_for(tower, b, 21), b)
    monkeypatch.undo()
    encode_and_check(m, tower, a, 22)  # the buffers no longer hold a's metadata: it is copied again
    m.close()


def test_stats_are_logged_every_log_every_calls(tower, caplog):
    m = make_manager(tower, budgets=[16], log_every=2)
    m.capture()
    grid = [(1, 4, 4)]
    with caplog.at_level(logging.INFO, logger="hwgraph.manager"):
        for i in range(5):
            m.encode(pixels_for(tower, grid, 30 + i), grid)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("encoder graph stats")]
    assert [msg.split(":")[0] for msg in logged] == ["encoder graph stats after 2 calls",
                                                     "encoder graph stats after 4 calls"]
    assert "'hits': 4" in logged[-1]
    m.close()


def test_outputs_of_replays_and_eager_fallbacks_track_no_gradients(tower):
    assert next(tower.parameters()).requires_grad  # the tower's weights do: outputs must not hold its graph
    m = make_manager(tower, budgets=[16])
    m.capture()
    for grid in ([(1, 4, 4)], [(1, 8, 12)]):  # a replay, then an over-budget eager call
        out = encode_and_check(m, tower, grid, 40)
        tensors = [t for o in out for t in o.tensors()]
        assert not any(t.requires_grad or t.grad_fn is not None for t in tensors)
    assert m.stats()["replays"] == 1 and m.stats()["eager_groups"] == 1
    m.close()
