"""NPU attention handed to a graph manager as its function (``attention=npu_varlen``) rather than by name: the manager
judges a callable by what the callable itself declares (``graph_safe``), as it has no ``KernelSpec`` to read."""

from __future__ import annotations

import torch

from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.testing.towers import eager_per_image, pixels_for


def test_the_npu_kernel_given_as_a_function_is_never_captured_and_says_why(fused_attention):
    """``NPU.graph_safe`` is False, but the function declared nothing, so a manager given it took it for graph-safe and
    captured it: every replay read ``cu_seqlens`` back to the host (on an NPU the capture would keep the host sequence
    lengths it was captured with, and attend across the next group's image boundaries)."""
    from hwgraph_npu import attention

    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").to(torch.float16).eval()
    m = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=2, graph_backend="cpu", dtype=torch.float16,
                            attention=attention.npu_varlen)
    m.capture()
    why = "attention kernel npu_varlen is not graph-safe"
    assert m.graphs == {} and m.capture_refusal() == why
    assert m.stats()["capture_failures"] == {16: why, 32: why}
    grid = [(1, 4, 4)]
    pixels = pixels_for(tower, grid, 7)
    (got,), (want,) = m.encode(pixels, grid), eager_per_image(tower, pixels, grid)
    torch.testing.assert_close(got.embeds, want.embeds)
    assert m.stats()["replays"] == 0
    m.close()


def test_the_npu_kernel_given_as_a_function_gets_host_boundaries_in_an_eager_forward(fused_attention, monkeypatch):
    """``NPU.reads_host_boundaries`` is True, but a tower given the function read only what the function declared, so
    every block of an eager forward read ``cu_seqlens`` back to the host (27 synchronisations on the real tower)
    instead of the forward reading it once."""
    from hwgraph_npu import attention

    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").to(torch.float16).eval()
    tower.set_attention(attention.npu_varlen)
    grid = [(1, 4, 4), (1, 2, 4)]
    pixels = pixels_for(tower, grid, 8)
    metadata = tower.prepare_metadata(grid, pixels)
    reads, tolist = [], torch.Tensor.tolist

    def counted(t, *args, **kwargs):
        reads.append(t.shape)
        return tolist(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    with torch.inference_mode():
        got = tower.forward_with_metadata(pixels, metadata)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert len(reads) == 1, f"cu_seqlens read back {len(reads)} times in one forward"
    want = eager_per_image(tower, pixels, grid)  # each image alone: attention cannot cross a boundary there
    torch.testing.assert_close(got.embeds, torch.cat([o.embeds for o in want]))
