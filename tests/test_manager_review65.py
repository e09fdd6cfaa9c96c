"""Review 65: the manager's stream ordering, stats and clean-up after a call that raised part-way."""

from __future__ import annotations

import pytest
import torch

from hwgraph import budgets as budget_rules
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny").eval()


def pixels_for(tower, grid, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def eager_per_image(tower, pixels, grid):
    with torch.inference_mode():
        out = tower.forward(pixels, grid)
    return out.split([t * h * w // tower.spatial_merge_size**2 for t, h, w in grid])


class StreamLog:
    """A ``torch.cuda``-like runtime: ``current`` names the caller's stream; streams' waits and events' records are
    appended to ``calls``."""

    def __init__(self):
        self.calls, self.current = [], "first"
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


def test_a_replay_that_raised_after_filling_the_buffers_is_waited_for_by_the_next_call(tower, monkeypatch):
    # The failed call queued its pixel and metadata copies (and perhaps its replay) on its stream; the next call, on
    # another stream, skips the metadata as already filled and must wait for that work, or it replays what is not
    # there yet (and its pixel copy races the failed call's).
    m = EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, graph_backend="cpu", attention="TORCH_SDPA")
    m.capture()
    runtime = StreamLog()
    monkeypatch.setattr(m, "_runtime", runtime)
    graph = m.graphs[64].graphs[1]
    real_replay = graph.replay

    def failing_replay():
        graph.replay = real_replay  # once
        raise RuntimeError("replay failed")

    graph.replay = failing_replay
    grid = [(1, 14, 14)]
    with pytest.raises(RuntimeError, match="replay failed"):
        m.encode(pixels_for(tower, grid, 1), grid)
    assert runtime.calls == ["record on first"]
    runtime.current, runtime.calls = "second", []
    pixels = pixels_for(tower, grid, 2)
    out = m.encode(pixels, grid)
    assert runtime.calls == ["second waits", "record on second"]
    for got, want in zip(out, eager_per_image(tower, pixels, grid), strict=True):
        torch.testing.assert_close(got.embeds, want.embeds)
    m.close()


def test_a_calibration_that_raised_after_replaying_is_waited_for_by_the_next_call(tower, monkeypatch):
    m = EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, graph_backend="cpu", attention="TORCH_SDPA")
    m.capture()
    runtime = StreamLog()
    monkeypatch.setattr(m, "_runtime", runtime)

    def failing_time_ms(fns, warmup=3, samples=10):
        fns["replay"]()
        raise RuntimeError("timing failed")

    monkeypatch.setattr(m, "time_ms", failing_time_ms)
    with pytest.raises(RuntimeError, match="timing failed"):
        m.calibrate()
    assert runtime.calls == ["record on first"]
    runtime.current, runtime.calls = "second", []
    full = [budget_rules.filling_grid(64, tower.spatial_merge_size)]
    m.encode(pixels_for(tower, full, 3), full)
    assert runtime.calls == ["second waits", "record on second"]
    m.close()


@pytest.mark.parametrize("calls", [0, -1, 2.5, True])
def test_graphed_calls_refuses_a_call_count_that_is_not_a_positive_int_by_name(calls):
    # 0 captured an empty graph and graphed_ms divided its median by 0 (ZeroDivisionError); 2.5 failed in range()
    from hwgraph.timing import graphed_calls, graphed_ms

    for helper in (graphed_calls, graphed_ms):
        with pytest.raises(ValueError, match=rf"calls must be a positive int.*got {calls!r}"):
            helper(lambda: None, calls=calls)
