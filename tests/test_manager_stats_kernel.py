"""EncoderGraphManager.stats() names the kernel its own calls ran, whatever a later manager did to the tower."""

from __future__ import annotations

import torch

from hwgraph.attention.sdpa import sdpa_varlen
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower


def other_kernel(q, k, v, cu_seqlens, max_seqlen, scale):
    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


def test_stats_name_the_kernel_the_managers_calls_ran_after_another_manager_changed_the_towers():
    """stats()['attention'] read the shared tower's kernel at each call: once a second manager on the tower chose
    another kernel, the first manager's stats named that one, though every call they count ran its own (and it now
    refuses to run)."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    first = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu",
                                attention="TORCH_SDPA")
    first.capture()
    grid = [(1, 4, 4)]
    first.encode(torch.randn(16, tower.patch_row_width), grid)
    second = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu",
                                 attention=other_kernel)
    assert tower.attention_kernel == second.stats()["attention"] == "other_kernel"
    s = first.stats()
    assert s["attention"] == "TORCH_SDPA" and s["replays"] == 1
    first.close()
    second.close()
