"""Review 58 of the manager: buffers released while the last replay, queued on another stream, may still read them."""

from __future__ import annotations

import pytest
import torch

from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

GRID = [(1, 8, 8)]  # 16 tokens: budget 16


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()


def pixels_for(tower, grid, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def assert_equal_to_eager(tower, got, pixels, grid):
    with torch.inference_mode():
        want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            torch.testing.assert_close(x, y)


class StreamLog:
    """A ``torch.cuda``-like runtime: ``current`` names the caller's stream; waits and records go to ``calls``."""

    def __init__(self, calls: list):
        self.calls, self.current = calls, "first"
        log = self

        class Event:
            def record(self, stream):
                log.calls.append(f"record on {stream}")

        class Stream(str):
            def wait_event(self, event):
                log.calls.append(f"{self} waits")

        self.Event, self.Stream = Event, Stream

    def current_stream(self, device):
        return self.Stream(self.current)


def logging_releases(m, calls: list, monkeypatch) -> None:
    for entry in m.graphs.values():
        real = entry.release
        monkeypatch.setattr(entry, "release", lambda real=real, b=entry.budget: (calls.append(f"release {b}"), real()))


def test_a_budget_captured_again_for_new_numerics_waits_for_the_last_replay_before_releasing_its_buffers(
        tower, monkeypatch):
    # The replaced graph's static buffers were released at once, while an encode() on another stream may still have
    # its fill, replay and copy out of them queued: the new capture's buffers, allocated on the capturing stream right
    # after, could take that memory and be written before the old replay read it (the caller's outputs wrong).
    setting = {"value": "ieee"}
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu", attention="TORCH_SDPA")
    m.backend.numerics_settings = lambda dtype: (("matmul precision", setting["value"]),)
    m.capture()
    calls: list = []
    runtime = StreamLog(calls)
    monkeypatch.setattr(m, "_runtime", runtime)
    pixels = pixels_for(tower, GRID, 1)
    assert_equal_to_eager(tower, m.encode(pixels, GRID), pixels, GRID)
    assert calls == ["record on first"]
    setting["value"] = "tf32"
    runtime.current = "second"
    calls.clear()
    logging_releases(m, calls, monkeypatch)
    m.capture()
    assert calls[:2] == ["second waits", "release 16"], calls
    pixels = pixels_for(tower, GRID, 2)
    assert_equal_to_eager(tower, m.encode(pixels, GRID), pixels, GRID)
    assert m.stats()["replays"] == 2
    m.close()


def test_close_waits_for_the_device_before_releasing_the_graphs_buffers(tower, monkeypatch):
    # close() released every graph and its static buffers first and synchronised after: memory the last replay was
    # still reading on the device could be handed to another allocation meanwhile.
    m = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=1, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.capture()
    pixels = pixels_for(tower, GRID, 3)
    m.encode(pixels, GRID)
    calls: list = []
    logging_releases(m, calls, monkeypatch)
    real_sync = m.backend.synchronize
    monkeypatch.setattr(m.backend, "synchronize", lambda: (calls.append("synchronize"), real_sync()))
    m.close()
    assert calls[0] == "synchronize" and sorted(calls[1:3]) == ["release 16", "release 32"], calls
    assert m.stats()["budgets"] == []
