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
