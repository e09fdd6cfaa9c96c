"""Compiled replay (torch.compile per budget, then capture) on the CPU reference backend, where inductor runs."""

from __future__ import annotations

import shutil

import pytest
import torch

from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="inductor on CPU needs a C compiler (gcc/cc)")


def test_compiled_replay_equals_eager_with_the_same_stats_and_fallback_rules():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    m.capture()
    assert sorted(m.graphs) == [16] and m.stats()["capture_failures"] == {}
    assert m.stats()["capture_seconds_per_budget"][16] > 0
    for seed, grid in enumerate([[(1, 4, 4), (1, 4, 8)], [(1, 8, 8)], [(1, 2, 2)], [(1, 8, 12)], [(2, 4, 4)]]):
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)
        with m.backend.sync_guard():
            got = m.encode(pixels, grid)
        want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
        for a, b in zip(got, want, strict=True):
            for x, y in zip(a.tensors(), b.tensors(), strict=True):
                torch.testing.assert_close(x, y)
    s = m.stats()
    assert s["replays_per_budget"] == {16: 3}
    assert s["eager_reasons"] == {"over budget": 1, "video": 1}
    assert s["hits"] == 4 and s["misses"] == 2
    m.close()


def my_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
    from hwgraph.attention.sdpa import sdpa_varlen

    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


def test_compiled_mode_compiles_one_block_per_shape_for_every_budget_without_hitting_the_recompile_limit():
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=6).eval()
    budgets = [1, 2, 4, 8, 16]  # 2 compiled block graphs each: 10, more than dynamo's default limit of 8
    counters.clear()
    for attention in ("TORCH_SDPA", my_sdpa):  # a second manager (other kernel) compiles as many graphs again
        m = EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=1, graph_backend="cpu", compile=True,
                                attention=attention)
        m.capture()
        assert sorted(m.graphs) == budgets and m.stats()["capture_failures"] == {}
        if attention == "TORCH_SDPA":
            m.close()
    # regional compilation: a 6-block tower traces one middle block and the last block per budget, not 6 blocks
    assert counters["stats"]["unique_graphs"] == 2 * 2 * len(budgets)
    for budget, grid in zip(budgets, [[(1, 2, 2)], [(1, 2, 4)], [(1, 4, 4)], [(1, 4, 8)], [(1, 8, 8)]], strict=True):
        pixels = torch.randn(budget * 4, tower.patch_row_width)
        got = m.encode(pixels, grid)[0]
        want = tower.forward(pixels, grid)
        for x, y in zip(got.tensors(), want.tensors(), strict=True):
            torch.testing.assert_close(x, y)
    assert m.stats()["replays_per_budget"] == dict.fromkeys(budgets, 1)
    m.close()
