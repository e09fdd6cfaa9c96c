"""EncoderGraphManager on the CPU reference backend: dispatch, buffer discipline, capture, caching, stats, errors."""

from __future__ import annotations

import copy
import logging
import random

import pytest
import torch

from hwgraph import budget_capture
from hwgraph import budgets as budget_rules
from hwgraph import manager as manager_module
from hwgraph.attention.sdpa import sdpa_varlen
from hwgraph.graphs.base import CaptureError
from hwgraph.graphs.cpu import CpuGraphBackend, CpuPool
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.models.qwen3_omni.metadata import VisionMetadata

BUDGETS = [16, 32, 64]


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny").eval()


@pytest.fixture
def manager(tower):
    m = EncoderGraphManager(tower, budgets=BUDGETS, max_images_per_graph=4, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.capture()
    yield m
    m.close()


def pixels_for(tower, grid, seed):
    g = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grid)
    return torch.randn(patches, tower.patch_row_width, generator=g)


def eager_per_image(tower, pixels, grid):
    with torch.inference_mode():
        out = tower.forward(pixels, grid)
    return out.split([t * h * w // tower.spatial_merge_size**2 for t, h, w in grid])


def assert_outputs_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.embeds, w.embeds)
        assert len(g.deepstack) == len(w.deepstack) > 0
        for gd, wd in zip(g.deepstack, w.deepstack, strict=True):
            torch.testing.assert_close(gd, wd)


def tokens(grid):
    return sum(t * h * w // 4 for t, h, w in grid)


def make_manager(tower, budgets=BUDGETS, max_images=2, **kwargs):
    # attention given every time: a manager built with attention=None keeps the shared tower's last kernel
    return EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=max_images, graph_backend="cpu",
                               attention=kwargs.pop("attention", "TORCH_SDPA"), **kwargs)


def encode_and_check(m, tower, grid, seed):
    """``m.encode`` of seeded pixels for ``grid``, checked against the eager tower per image; its outputs."""
    pixels = pixels_for(tower, grid, seed)
    out = m.encode(pixels, grid)
    assert_outputs_equal(out, eager_per_image(tower, pixels, grid))
    return out


@pytest.mark.parametrize("grid", [[(1, 8, 8)], [(1, 8, 16)], [(1, 16, 16)], [(1, 4, 4)]])
def test_single_image_replays_the_smallest_fitting_budget_and_equals_eager(tower, manager, grid):
    pixels = pixels_for(tower, grid, 1)
    got = manager.encode(pixels, grid)
    assert_outputs_equal(got, eager_per_image(tower, pixels, grid))
    stats = manager.stats()
    want_budget = min(b for b in BUDGETS if b >= tokens(grid))
    assert stats["hits"] == 1 and stats["misses"] == 0
    assert stats["replays_per_budget"] == {want_budget: 1}
    assert stats["padding_tokens"] == want_budget - tokens(grid)


def test_several_images_share_one_replay_in_caller_order(tower, manager):
    grid = [(1, 8, 8), (1, 4, 4), (1, 4, 8), (1, 2, 2)]  # 16 + 4 + 8 + 1 tokens -> budget 32
    pixels = pixels_for(tower, grid, 2)
    got = manager.encode(pixels, grid)
    assert [o.embeds.shape[0] for o in got] == [16, 4, 8, 1]
    assert_outputs_equal(got, eager_per_image(tower, pixels, grid))
    assert manager.stats()["replays_per_budget"] == {32: 1}
    assert manager.stats()["hits"] == 4


@pytest.mark.parametrize("grid, why", [
    ([(1, 16, 20)], "over budget"),  # 80 tokens > 64
    ([(2, 8, 8)], "video"),
    ([(1, 2, 2)] * 5, "too many images"),  # 5 images > max_images_per_graph=4
])
def test_group_that_fits_no_graph_runs_once_eagerly_and_is_counted(tower, manager, grid, why):
    pixels = pixels_for(tower, grid, 3)
    got = manager.encode(pixels, grid)
    assert_outputs_equal(got, eager_per_image(tower, pixels, grid))
    stats = manager.stats()
    assert stats["eager_groups"] == 1 and stats["misses"] == len(grid) and stats["hits"] == 0
    assert stats["eager_reasons"] == {why: 1}
    assert stats["replays"] == 0


def test_budgets_change_between_calls_and_no_stale_inputs_survive(tower, manager):
    calls = [[(1, 16, 16)], [(1, 4, 4)], [(1, 8, 8), (1, 8, 8)], [(1, 4, 4)], [(1, 16, 16)], [(1, 2, 4)]]
    for i, grid in enumerate(calls):
        pixels = pixels_for(tower, grid, 10 + i)
        assert_outputs_equal(manager.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    assert manager.stats()["replays_per_budget"] == {64: 2, 16: 3, 32: 1}


def test_metadata_is_copied_only_when_the_grid_in_a_graphs_buffers_changes(tower, manager, monkeypatch):
    copies = []
    for entry in manager.graphs.values():
        original = entry.metadata.copy_from
        monkeypatch.setattr(entry.metadata, "copy_from",
                            lambda src, budget=entry.budget, original=original: copies.append(budget) or original(src))
    a, b, c = [(1, 4, 8)], [(1, 4, 6)], [(1, 8, 12)]  # 8 and 6 tokens replay the 16-token graph, 24 the 32-token one
    for i, grid in enumerate([a, a, b, a, a, c, a]):
        pixels = pixels_for(tower, grid, 40 + i)
        assert_outputs_equal(manager.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    # a, b and a again each replace the 16-token graph's metadata, c the 32-token one's; the last a finds its own
    # metadata still in the 16-token buffers (c went elsewhere)
    assert copies == [16, 16, 16, 32]


def test_outputs_kept_from_call_one_are_not_overwritten_by_call_two(tower, manager):
    grid = [(1, 8, 8)]
    first = manager.encode(pixels_for(tower, grid, 20), grid)
    kept = [(o.embeds.clone(), [d.clone() for d in o.deepstack]) for o in first]
    manager.encode(pixels_for(tower, grid, 21), grid)  # same budget, new inputs
    for out, (embeds, deepstack) in zip(first, kept, strict=True):
        torch.testing.assert_close(out.embeds, embeds, rtol=0, atol=0)
        for d, k in zip(out.deepstack, deepstack, strict=True):
            torch.testing.assert_close(d, k, rtol=0, atol=0)


def test_no_padded_row_leaks_into_outputs(tower, manager):
    grid = [(1, 4, 4)]  # 4 tokens in a 16-token budget
    out = manager.encode(pixels_for(tower, grid, 30), grid)
    assert out[0].embeds.shape == (4, tower.out_hidden_size)
    assert all(d.shape == (4, tower.out_hidden_size) for d in out[0].deepstack)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_request_does_not_poison_later_requests_in_the_same_graph(tower, manager, poison):
    """The static pixel buffer's rows past a smaller call keep the larger call's pixels; attention must keep them
    out of the real rows, or one bad request turns every later, smaller one in that graph into NaN."""
    bad = [(1, 8, 8)]  # 16 tokens: fills the 16-token graph
    pixels = pixels_for(tower, bad, 50)
    pixels[-3:, :5] = poison
    manager.encode(pixels, bad)
    for i, grid in enumerate([[(1, 4, 4)], [(1, 4, 8), (1, 2, 4)]]):  # 4 and 10 tokens: the same graph
        pixels = pixels_for(tower, grid, 51 + i)
        got = manager.encode(pixels, grid)
        assert all(torch.isfinite(o.embeds).all() for o in got)
        assert_outputs_equal(got, eager_per_image(tower, pixels, grid))
    assert manager.stats()["replays_per_budget"] == {16: 3}


def test_encode_reads_nothing_back_from_the_device(tower, manager):
    grid = [(1, 8, 8), (1, 4, 4)]
    pixels = pixels_for(tower, grid, 40)
    with manager.backend.sync_guard():
        manager.encode(pixels, grid)  # replay
        manager.encode(pixels_for(tower, [(2, 4, 4)], 41), [(2, 4, 4)])  # eager fallback
    assert manager.stats()["hits"] == 2 and manager.stats()["misses"] == 1


@pytest.mark.parametrize("device, dtype, pixel_dtype", [("cpu", torch.bfloat16, torch.float32),
                                                         ("cpu", torch.float32, torch.float64),
                                                         ("cpu:0", torch.float32, torch.float32)])
def test_the_eager_fallback_casts_pixels_already_on_the_device_without_a_host_copy(device, dtype, pixel_dtype):
    """Pixels on the manager's device in another dtype (a processor's float32 rows for a bf16 manager) are cast
    there: the fallback named the device in a blocking .to(), which the sync guard rejects as a copy to the host,
    while the replay path took the same pixels."""
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, device=device, dtype=dtype, budgets=[16], max_images_per_graph=2,
                            graph_backend="cpu", attention="TORCH_SDPA")
    m.capture()
    for grid in ([(1, 8, 8)], [(2, 4, 4)]):  # a replay, then a video's eager fallback
        pixels = pixels_for(tower, grid, 43).to(pixel_dtype)
        with m.backend.sync_guard():
            got = m.encode(pixels, grid)
        assert_outputs_equal(got, eager_per_image(tower, pixels.to(dtype), grid))
    assert m.stats()["hits"] == 1 and m.stats()["misses"] == 1
    m.close()


def test_a_grid_tensor_the_caller_made_on_the_host_is_read_under_the_sync_guard(tower, manager):
    """The grid is host metadata (encode() takes a list or an int tensor on the host): reading it is no sync."""
    grid = [(1, 8, 8), (1, 4, 4)]
    pixels = pixels_for(tower, grid, 42)
    with manager.backend.sync_guard():
        got = manager.encode(pixels, torch.tensor(grid))
        by_rows = manager.encode(pixels, [torch.tensor(row) for row in grid])  # a list of 1-D tensors, one per image
    for out in (got, by_rows):
        assert_outputs_equal(out, eager_per_image(tower, pixels, grid))
    assert manager.stats()["hits"] == 4


def test_stats_are_the_callers_to_change_without_changing_the_managers(tower, monkeypatch):
    m = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=4, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.capture()
    times = iter([1.0, 0.5, 1.0, 0.5])  # (eager, replay) per budget: both kept
    monkeypatch.setattr(m, "time_ms", lambda fns, warmup=3, samples=10: {name: next(times) for name in fns})
    m.calibrate()
    grid = [(1, 4, 4)]
    m.encode(pixels_for(tower, grid, 43), grid)
    before = copy.deepcopy(m.stats())
    assert before["calibration"][16] == {"eager_ms": 1.0, "replay_ms": 0.5, "kept": True}
    mine = m.stats()
    mine["calibration"][16]["kept"] = "changed by the caller"
    mine["calibration"][32].clear()
    mine["replays_per_budget"][16] = 99
    assert m.stats() == before, "changing what stats() returned changed the manager's own stats"
    m.close()


def test_close_frees_the_graph_memory(tower):
    m = EncoderGraphManager(tower, budgets=BUDGETS, max_images_per_graph=4, graph_backend="cpu")
    before = m.backend.memory_in_use()
    m.capture()
    held = m.backend.memory_in_use()
    assert held > before
    # the CPU backend's memory_in_use holds its graph pools; each budget also keeps its static input buffers
    inputs = sum(budget_capture.storage_bytes(e.pixels, *e.metadata.tensors().values()) for e in m.graphs.values())
    assert sum(m.stats()["capture_bytes_per_budget"].values()) == held - before + inputs
    m.close()
    assert m.backend.memory_in_use() == before
    with pytest.raises(RuntimeError, match="after close"):
        m.encode(pixels_for(tower, [(1, 4, 4)], 0), [(1, 4, 4)])


@pytest.mark.parametrize("budgets, max_images, match", [
    ([], 1, "must not be empty"),
    ([16, 0], 1, "positive"),
    ([16, -8], 1, "positive"),
    ([16, 32, 16], 1, r"duplicates \[16\]"),
    ([16, 32], 17, r"max_images_per_graph \(17\) must not be above the smallest budget \(16\)"),
    ([16.0], 1, "must be ints"),
    ([16], 0, "positive int"),
    # past int32 cu_seqlens: refused here, where it was a logged capture failure at capture()
    ([16, 2**30], 1, r"budget 1073741824 is too large: 1073741824 tokens are 4294967296 patch rows"),
])
def test_bad_budgets_raise_naming_the_rule_and_values(tower, budgets, max_images, match):
    with pytest.raises(ValueError, match=match):
        EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=max_images, graph_backend="cpu")


def test_unsorted_budgets_are_sorted_and_auto_budgets_double_from_64(tower):
    assert EncoderGraphManager(tower, budgets=[64, 16, 32], max_images_per_graph=2).budgets == [16, 32, 64]
    assert EncoderGraphManager(tower).budgets == [64, 128, 256]


@pytest.mark.parametrize("pixels_rows, width, grid, match", [
    (60, None, [(1, 8, 8)], "64"),
    (64, 7, [(1, 8, 8)], "width"),
    (0, None, [], "empty"),
    (64, None, [(1, 8, 7)], "divisible"),
    (64, None, [(1, 0, 8)], "positive"),
])
def test_bad_inputs_raise_value_errors(tower, manager, pixels_rows, width, grid, match):
    pixels = torch.randn(pixels_rows, width or tower.patch_row_width)
    with pytest.raises(ValueError, match=match):
        manager.encode(pixels, grid)


def test_failed_capture_leaves_that_budget_eager_with_a_logged_reason(tower, caplog, monkeypatch):
    # one graph per budget: a kernel that is not slot-bound (the module's tower keeps the last kernel it was given)
    m = EncoderGraphManager(tower, budgets=BUDGETS, max_images_per_graph=4, graph_backend="cpu",
                            attention="TORCH_SDPA")
    real_capture = m.backend.capture
    attempts = []

    def capture(fn, pool=None):
        attempts.append(fn)
        if len(attempts) == 2:  # the second budget captured (largest first: 64, 32, 16)
            raise CaptureError("simulated: operation not permitted when stream is capturing")
        return real_capture(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    assert sorted(m.graphs) == [16, 64]
    assert "simulated" in m.stats()["capture_failures"][32]
    assert any("capture of budget 32 failed" in r.getMessage() for r in caplog.records)
    grid = [(1, 4, 8), (1, 4, 4)]  # 12 tokens: fits 16
    pixels = pixels_for(tower, grid, 50)
    assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    grid = [(1, 8, 12)]  # 24 tokens: 32 is gone, so 64 replays
    pixels = pixels_for(tower, grid, 51)
    assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    assert m.stats()["replays_per_budget"] == {16: 1, 64: 1}


def test_a_capture_that_replays_wrongly_is_refused_not_used(tower, monkeypatch):
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu")
    real_capture = m.backend.capture

    def stale_capture(fn, pool=None):
        graph = real_capture(fn, pool)
        graph.replay = lambda: None  # replays nothing: the output buffer keeps the capture-time answer
        return graph

    monkeypatch.setattr(m.backend, "capture", stale_capture)
    m.capture()
    assert m.graphs == {}
    assert "differs from eager" in m.stats()["capture_failures"][16]
    grid = [(1, 4, 4)]
    pixels = pixels_for(tower, grid, 60)
    assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    assert m.stats()["eager_reasons"] == {"capture failed": 1}


@pytest.mark.parametrize("timings, kept", [
    # (eager, replay) per budget, ascending
    ([1.0, 0.5, 1.0, 2.0, 1.0, 0.9], [16, 32, 64]),  # 32 loses, 64 wins: the cap is 64, and 32 stays under it
    ([1.0, 0.5, 2.0, 1.0, 1.0, 1.5], [16, 32]),  # 64 loses: above the cap, released
    ([1.0, 1.5, 2.0, 2.5, 3.0, 3.5], []),  # no winner: every call runs eagerly
])
def test_calibration_keeps_every_budget_up_to_the_largest_whose_replay_wins(tower, monkeypatch, timings, kept):
    m = EncoderGraphManager(tower, budgets=BUDGETS, max_images_per_graph=4, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.capture()
    times = iter(timings)
    monkeypatch.setattr(m, "time_ms", lambda fns, warmup=3, samples=10: {name: next(times) for name in fns})
    found = m.calibrate()
    assert {b: f["kept"] for b, f in found.items()} == {b: b in kept for b in BUDGETS}
    assert sorted(m.graphs) == m.budgets == kept
    s = m.stats()
    assert s["calibration"][32]["replay_ms"] == timings[3]
    assert sorted(s["capture_bytes_per_budget"]) == sorted(s["capture_seconds_per_budget"]) == kept
    grid = [(1, 8, 16)]  # 32 tokens
    pixels = pixels_for(tower, grid, 70)
    assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    assert m.stats()["replays"] == (1 if kept[-1:] >= [32] else 0)
    m.capture()  # a later capture() captures nothing calibration released
    assert sorted(m.graphs) == kept


def test_calibration_is_on_by_default_only_for_inferred_budgets_on_a_backend_that_accelerates(tower, monkeypatch):
    m = EncoderGraphManager(tower, graph_backend="cpu")
    assert (m.calibrate_on_capture, m.budgets) == (False, [64, 128, 256])  # the CPU backend only emulates replay
    assert EncoderGraphManager(tower, graph_backend="cpu", max_budget=128).budgets == [64, 128]
    monkeypatch.setattr(type(m.backend), "accelerates", True)
    m = EncoderGraphManager(tower, graph_backend="cpu")
    assert (m.calibrate_on_capture, m.budgets) == (True, [64, 128, 256, 512, 1024, 2048])
    assert not EncoderGraphManager(tower, graph_backend="cpu", budgets=[64]).calibrate_on_capture
    assert EncoderGraphManager(tower, graph_backend="cpu", calibrate=False).budgets == [64, 128, 256]


def slot_bound_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
    from hwgraph.attention.sdpa import sdpa_varlen

    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


slot_bound_sdpa.slot_bound = True


def test_slot_bound_kernel_gets_one_graph_per_slot_count_sharing_the_budgets_buffers(tower):
    with EncoderGraphManager(tower, budgets=[16, 64], max_images_per_graph=8, graph_backend="cpu",
                             attention=slot_bound_sdpa) as m:
        assert m.slot_counts == [1, 2, 4, 8]
        m.capture()
        entry = m.graphs[64]
        assert list(entry.graphs) == [1, 2, 4, 8]
        assert m.stats()["slot_counts"] == [1, 2, 4, 8]
        # every graph of the budget reads the same static buffers: one copy of the inputs serves them all
        assert entry.metadata.cu_seqlens.shape == (9,)
        one = [(1, 4, 4)]
        for n, slots in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (1, 1), (8, 8), (2, 2)]:
            grid = one * n
            pixels = pixels_for(tower, grid, 300 + n)
            assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
            assert entry.graph_for(n)[0] == slots
        s = m.stats()
        assert s["replays_per_slots"] == {1: 2, 2: 2, 4: 2, 8: 2}
        assert s["replays_per_budget"] == {16: 6, 64: 2}  # up to 4 images of 4 tokens fit the 16-token budget


def test_slot_counts_default_to_the_max_for_kernels_that_are_not_slot_bound_and_are_validated(tower):
    assert EncoderGraphManager(tower, budgets=[16], max_images_per_graph=8, graph_backend="cpu",
                               attention="TORCH_SDPA").slot_counts == [8]
    assert EncoderGraphManager(tower, budgets=[16], max_images_per_graph=6, graph_backend="cpu",
                               attention=slot_bound_sdpa).slot_counts == [1, 2, 4, 6]
    assert EncoderGraphManager(tower, budgets=[16], max_images_per_graph=4, graph_backend="cpu",
                               slot_counts=[2]).slot_counts == [2, 4]
    for counts, match in [([0], r"slot_counts must be ints in 1..max_images_per_graph \(4\), got \[0\]"),
                          ([5], r"got \[5\]"), ([2, 2], r"must not repeat, got duplicates \[2\]"),
                          ([1.5], r"got \[1.5\]")]:
        with pytest.raises(ValueError, match=match):
            EncoderGraphManager(tower, budgets=[16], max_images_per_graph=4, graph_backend="cpu",
                                slot_counts=counts)


def test_first_seqs_is_a_prefix_view_of_the_padded_metadata(tower):
    meta = tower.prepare_metadata([(1, 4, 4), (1, 2, 4)]).padded(64, 4)
    view = meta.first_seqs(2)
    assert view.cu_seqlens.tolist() == [0, 16, 24]
    assert view.cu_seqlens.data_ptr() == meta.cu_seqlens.data_ptr() and view.pos_indices is meta.pos_indices
    meta.cu_seqlens[1] = 15
    assert view.cu_seqlens[1] == 15  # a view: writes to the static buffer show through
    with pytest.raises(ValueError, match=r"num_seqs must be in 1..4 \(the slots of this metadata\), got 5"):
        meta.first_seqs(5)


def test_seeded_soak_every_output_equals_eager_and_stats_add_up(tower):
    rng = random.Random(1234)
    # graphs with 1, 2 and 4 sequence slots per budget: groups move between them and between budgets
    m = EncoderGraphManager(tower, budgets=BUDGETS, max_images_per_graph=4, graph_backend="cpu", slot_counts=[1, 2])
    m.capture()
    images = 0
    for call in range(1000):
        grid = []
        for _ in range(rng.randint(1, 6)):
            t = 2 if rng.random() < 0.05 else 1
            side = rng.choice([2, 4, 6, 8, 10, 16, 20]) if rng.random() < 0.1 else rng.choice([2, 4, 6, 8])
            grid.append((t, side, rng.choice([2, 4, 6, 8])))
        pixels = pixels_for(tower, grid, call)
        assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
        images += len(grid)
    s = m.stats()
    assert s["calls"] == 1000 and s["hits"] + s["misses"] == images == s["images"]
    assert s["replays"] + s["eager_groups"] == 1000
    assert sum(s["replays_per_budget"].values()) == s["replays"] == sum(s["replays_per_slots"].values())
    assert sorted(s["replays_per_slots"]) == [1, 2, 4]
    assert sum(s["eager_reasons"].values()) == s["eager_groups"]
    assert s["replays"] > 100 and s["eager_groups"] > 100  # both paths exercised
    m.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"budgets": 64}, r"budgets must be a list of ints \(merged-token counts\), got 64"),
    ({"budgets": [16, None]}, r"budgets must be ints \(merged-token counts\), got \[None\]"),
    ({"budgets": "64"}, r"budgets must be a list of ints .*got '64'"),
    ({"budgets": [16], "slot_counts": 4}, r"slot_counts must be a list of ints .*got 4"),
    ({"max_budget": 0}, r"max_budget must be an int >= 64 \(the smallest auto budget\), got 0"),
    ({"max_budget": 100.0}, r"max_budget must be an int >= 64 .*got 100.0"),
    ({"budgets": [16], "max_budget": 256}, r"max_budget=256 caps inferred budgets; with budgets=\[16\] given"),
])
def test_malformed_budget_arguments_raise_value_errors_naming_the_value(tower, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EncoderGraphManager(tower, graph_backend="cpu", **kwargs)


def test_budgets_may_be_any_iterable_of_integers(tower):
    numpy = pytest.importorskip("numpy", reason="numpy arrays as budgets")
    assert EncoderGraphManager(tower, graph_backend="cpu", budgets=(b for b in [32, 16])).budgets == [16, 32]
    m = EncoderGraphManager(tower, graph_backend="cpu", budgets=numpy.array([16, 32]), slot_counts=range(1, 3))
    assert m.budgets == [16, 32] and all(type(b) is int for b in m.budgets)


def test_budget_edges_are_accepted_and_a_bool_is_not_a_budget(tower):
    # the smallest auto budget is a valid cap; as many images as the smallest budget has tokens fit a graph
    assert EncoderGraphManager(tower, graph_backend="cpu", max_budget=64).budgets == [64]
    m = EncoderGraphManager(tower, graph_backend="cpu", budgets=[32, 16], max_images_per_graph=16, slot_counts=[16])
    assert (m.budgets, m.slot_counts) == ([16, 32], [16])
    with pytest.raises(ValueError, match=r"budgets must be ints \(merged-token counts\), got \[True\]"):
        EncoderGraphManager(tower, graph_backend="cpu", budgets=[16, True])


@pytest.mark.parametrize("max_images, counts", [(1, [1]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_default_slot_counts_double_up_to_the_max_without_repeating_it(max_images, counts):
    assert budget_rules.default_slot_counts(max_images) == counts


@pytest.mark.parametrize("tokens, grid", [(16, (1, 8, 8)), (49, (1, 14, 14)), (12, (1, 6, 8)), (7, (1, 2, 14)),
                                          (1, (1, 2, 2))])
def test_filling_grid_is_the_squarest_single_frame_grid_of_exactly_the_tokens(tokens, grid):
    assert budget_rules.filling_grid(tokens, 2) == grid


@pytest.mark.parametrize("budgets, images, tokens, video, expected", [
    ({256: "g", 64: "g", 128: "g"}, 1, 64, False, (64, "replay")),  # captured largest first: the smallest that fits
    ({256: "g", 64: "g", 128: "g"}, 4, 65, False, (128, "replay")),  # exactly max_images images
    ({256: "g", 64: "g"}, 5, 20, False, (None, "too many images")),
    ({256: "g", 64: "g"}, 1, 20, True, (None, "video")),
    ({}, 1, 20, False, (None, "no graphs")),
    ({256: "g", 64: "g"}, 1, 257, False, (None, "over budget")),
])
def test_single_replay_budget_is_the_smallest_that_holds_the_group_or_says_why_not(budgets, images, tokens, video,
                                                                                   expected):
    assert budget_rules.single_replay_budget(budgets, images, tokens, 4, video) == expected


@pytest.mark.parametrize("budgets, failed, tokens, expected", [
    ({64: "g"}, {128: "boom"}, 100, (None, "capture failed")),  # 128 would hold it, had it been captured
    ({}, {64: "boom", 128: "boom"}, 20, (None, "capture failed")),
    ({64: "g"}, {128: "boom"}, 129, (None, "over budget")),  # nothing configured holds it
    ({}, {64: "boom"}, 65, (None, "no graphs")),
    ({64: "g", 128: "g"}, {256: "boom"}, 100, (128, "replay")),
])
def test_a_group_that_a_failed_budget_would_hold_goes_eager_as_a_capture_failure(budgets, failed, tokens, expected):
    """Not "over budget" when the budget that fits it is configured and failed (the bench's rows said so)."""
    assert budget_rules.single_replay_budget(budgets, 1, tokens, 4, False, failed=failed) == expected


def test_the_manager_reports_a_group_a_failed_budget_would_hold_as_a_capture_failure(tower, monkeypatch):
    m = make_manager(tower, budgets=[16, 32], max_images=1)
    real, calls = m.backend.capture, []

    def capture(fn, pool=None):
        calls.append(fn)
        if len(calls) == 1:  # budget 32, captured first
            raise RuntimeError("no room")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    m.capture()
    assert sorted(m.graphs) == [16] and set(m.stats()["capture_failures"]) == {32}
    encode_and_check(m, tower, [(1, 8, 12)], 3)  # 24 tokens: budget 32's
    encode_and_check(m, tower, [(1, 8, 20)], 4)  # 40 tokens: over every budget
    assert m.stats()["eager_reasons"] == {"capture failed": 1, "over budget": 1}


def test_pixels_that_are_not_a_floating_point_tensor_raise_value_errors(tower, manager):
    grid = [(1, 4, 4)]
    pixels = pixels_for(tower, grid, 80)
    with pytest.raises(ValueError, match=r"pixel_values must be a floating-point torch.Tensor .* got ndarray"):
        manager.encode(pixels.numpy(), grid)
    with pytest.raises(ValueError, match=r"got Tensor of torch.int64"):
        manager.encode(pixels.long(), grid)
    for g in (grid, [(1, 8, 40)]):  # replayed, over budget: both raised AttributeError ('NoneType' ... 'shape')
        with pytest.raises(ValueError, match=rf"pixel_values must be a floating-point torch.Tensor \[patches, "
                                             rf"{tower.patch_row_width}\], got None"):
            manager.encode(None, g)
    # the eager forward took sparse pixels, and a replay's copy into its static buffer failed
    with pytest.raises(ValueError, match=r"must be a dense \(strided\) tensor, got layout torch.sparse_coo"):
        manager.encode(pixels.to_sparse(), grid)
    with pytest.raises(ValueError, match=r"got layout torch.sparse_coo: pass pixel_values.to_dense\(\)"):
        tower(pixels.to_sparse(), grid)
    # rows without data: torch's "Cannot copy out of meta tensor" on the replay and the eager path alike
    for g in (grid, [(1, 8, 40)]):  # replayed, over budget
        rows = g[0][0] * g[0][1] * g[0][2]
        with pytest.raises(ValueError, match=rf"pixel_values is on the meta device \(shape \({rows}, "
                                             rf"{tower.patch_row_width}\), no data\)"):
            manager.encode(torch.empty(rows, tower.patch_row_width, device="meta"), g)


def test_a_capture_that_failed_and_then_succeeded_is_no_longer_reported_as_failed(tower, monkeypatch):
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu", attention="TORCH_SDPA")
    real_capture = m.backend.capture

    def failing(fn, pool=None):
        raise CaptureError("simulated")

    monkeypatch.setattr(m.backend, "capture", failing)
    m.capture()
    assert m.stats()["capture_failures"] == {16: "CaptureError: simulated"} and m.graphs == {}
    monkeypatch.setattr(m.backend, "capture", real_capture)
    m.capture()
    assert m.stats()["capture_failures"] == {} and sorted(m.graphs) == [16]


def test_a_manager_whose_tower_was_moved_refuses_to_replay_the_old_weights():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    first = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu",
                                attention="TORCH_SDPA")
    first.capture()
    grid = [(1, 4, 4)]
    pixels = pixels_for(tower, grid, 90)
    first.encode(pixels, grid)
    tower.to(torch.float32)  # no change of dtype or device: the same weights, nothing to refuse
    first.encode(pixels, grid)
    # a second manager in another dtype moves the shared tower: the first one's graphs read the old weights
    second = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu",
                                 dtype=torch.float64)
    assert tower.dtype == torch.float64
    for call in (lambda: first.encode(pixels, grid), first.capture):
        with pytest.raises(RuntimeError, match=r"the tower's weights were moved since this manager was built for "
                                               r"torch.float32 on cpu \(the tower is now torch.float64 on cpu"):
            call()
    second.capture()
    assert_outputs_equal(second.encode(pixels, grid), eager_per_image(tower, pixels.double(), grid))
    # a third manager with another kernel: the others' stats still name the kernel their own calls ran (they named
    # the shared tower's, and choosing it again after a move changed the tower)
    third = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu",
                                dtype=torch.float64, attention=slot_bound_sdpa)
    assert tower.attention_kernel == third.stats()["attention"] == "slot_bound_sdpa"
    assert first.stats()["attention"] == second.stats()["attention"] == "TORCH_SDPA"


def test_a_move_that_leaves_the_weights_in_place_leaves_every_tensor_the_graphs_read():
    """to() of no move (a serving stack's model.to(device)), float() of a float32 tower and half() of a half one
    keep the weights where they are, so a manager goes on replaying; they gave the rotary frequencies a new buffer,
    and on a GPU the graphs went on reading the freed one (replay 1.8% off eager on the H100 after a few small
    allocations reused it, weights_key() unchanged)."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()

    def where():
        return {name: t.data_ptr() for name, t in (*tower.named_parameters(), *tower.named_buffers())}

    before = where()
    for move in (lambda: tower.to("cpu"), tower.float, lambda: tower.to(torch.float32)):
        move()
        assert where() == before
    tower.half()
    before = where()
    tower.half()
    assert where() == before and tower.rotary_pos_emb.inv_freq.dtype == torch.float32


def replaying_manager(seed: int):
    """A tiny tower of its own, a manager that has captured its one budget, and a 16-token grid with pixels for it."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    m = make_manager(tower, budgets=[16], max_images=1)
    m.capture()
    grid = [(1, 4, 4)]
    return tower, m, grid, pixels_for(tower, grid, seed)


def test_a_manager_refuses_a_tower_whose_rotary_frequencies_were_reallocated():
    tower, m, grid, pixels = replaying_manager(91)
    m.encode(pixels, grid)
    tower.rotary_pos_emb.reset()  # a new buffer: graphs captured before read the old one
    with pytest.raises(RuntimeError, match=r"the tower's weights were moved since this manager was built"):
        m.encode(pixels, grid)


def doubled_middle_weight(tower, how: str) -> None:
    """Give the second block's fc1 a new weight tensor (twice the old one), as ``how`` says."""
    block = tower.blocks[1]
    if how == "setattr":
        block.mlp.linear_fc1.weight = torch.nn.Parameter(block.mlp.linear_fc1.weight.detach() * 2)
    elif how == "assign":  # a checkpoint loaded into one block
        block.load_state_dict({k: v * 2 if k == "mlp.linear_fc1.weight" else v for k, v in block.state_dict().items()},
                              assign=True)
    else:  # copied into the same tensor: nothing moves
        block.load_state_dict({k: v * 2 if k == "mlp.linear_fc1.weight" else v for k, v in block.state_dict().items()})


@pytest.mark.parametrize("how", ["setattr", "assign"])
def test_a_manager_refuses_a_tower_one_of_whose_middle_weights_was_given_a_new_tensor(how):
    # weights_key() read only the first and the last weight: on a GPU the graphs went on reading the old fc1 weight
    # of block 1, freed, while eager used the new one (the CPU backend's emulated replays read the new one)
    tower, m, grid, pixels = replaying_manager(92)
    m.encode(pixels, grid)
    doubled_middle_weight(tower, how)
    with pytest.raises(RuntimeError, match=r"the tower's weights were moved since this manager was built .* a "
                                           r"parameter or buffer given a new tensor or new \.data"):
        m.encode(pixels, grid)


@pytest.mark.parametrize("how", ["data", "resized"])
def test_a_manager_refuses_the_replay_of_a_tower_whose_middle_weight_got_new_data_or_a_resized_storage(how):
    """``weights_key()`` reads three addresses: a middle weight given new ``.data``, or its storage freed and made
    again in place (FSDP), kept the same key, and on a device the graphs read the freed memory. The CPU backend's own
    check of its reads is set aside here, as a device backend has none."""
    tower, m, grid, pixels = replaying_manager(94)
    for entry in m.graphs.values():
        for graph in entry.graphs.values():
            graph.reads = None
    m.encode(pixels, grid)
    weight = tower.blocks[1].mlp.linear_fc1.weight
    if how == "data":
        weight.data = weight.data * 2
    else:
        address = weight.data_ptr()
        with torch.no_grad():
            values = weight.detach().clone()
            weight.untyped_storage().resize_(0)
            squatter = torch.empty_like(values)  # takes the freed memory: the storage comes back elsewhere
            weight.untyped_storage().resize_(values.numel() * values.element_size())
            weight.copy_(values)
        assert weight.data_ptr() != address, squatter.data_ptr()
    for _ in range(2):  # the replay's look at every weight, then the key before the next call
        with pytest.raises(RuntimeError, match=r"encode\(\): the tower's weights were moved since this manager"):
            m.encode(pixels, grid)
    assert m.stats()["replays"] == 1  # the refused one is not counted


def test_weights_copied_into_the_towers_own_tensors_keep_the_manager_replaying_them():
    tower, m, grid, pixels = replaying_manager(93)
    before = m.encode(pixels, grid)
    doubled_middle_weight(tower, "copy")
    torch.nn.Linear(3, 3)  # other modules' registrations: the key lists the addresses again, and they are the same
    after = m.encode(pixels, grid)
    assert_outputs_equal(after, eager_per_image(tower, pixels, grid))
    assert not torch.equal(after[0].embeds, before[0].embeds)
    assert m.stats()["replays"] == 2


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
    assert m.stats()["eager_reasons"] == {"capture failed": 1} and m.stats()["replays"] == 0


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


def install_backend(monkeypatch, cls: type) -> None:
    """Make ``cls`` (a backend class of this module) a discovered graph backend, chosen only by its name."""
    from hwgraph import registry
    from hwgraph.capability import Capability

    spec = registry.BackendSpec(cls.name, f"{__name__}:{cls.__name__}", ("cpu",), lambda p: Capability.available(),
                                modes=cls.modes, priority=-5)
    specs, problems = registry.discovered()
    monkeypatch.setattr(registry, "discovered", lambda: ((*specs, spec), problems))


class TwoModeBackend(CpuGraphBackend):
    """The CPU reference backend with a second mode, to see which one the manager asks for."""

    name = "twomode"
    modes = ("emulated", "other")


def test_graph_mode_reaches_the_backend_and_its_stats_and_a_mode_it_lacks_is_refused(monkeypatch, tower):
    install_backend(monkeypatch, TwoModeBackend)

    def manager(**kw):
        return EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="twomode",
                                   attention="TORCH_SDPA", **kw)

    other = manager(graph_mode="other")
    assert type(other.backend) is TwoModeBackend and other.backend.mode == "other"
    assert other.stats()["graph_mode"] == "other"
    assert manager().backend.mode == "emulated", "the backend's first mode by default"
    with pytest.raises(ValueError, match=r"graph backend 'twomode' has modes \['emulated', 'other'\], got "
                                         r"mode='full'"):
        manager(graph_mode="full")


class WorkspaceBackend(CpuGraphBackend):
    """The CPU reference backend with what a CUDA stream's first use makes for the process (its cuBLAS workspaces,
    34 MiB on the H200): made by ``prepare`` or, failing that, by the first capture."""

    name = "workspace"
    kept_for_the_process = 34 << 20

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept, self.prepared, self.current_streams = 0, [], []

    def prepare(self, fn, *, current_stream=False):
        self.prepared.append(fn())
        self.current_streams.append(current_stream)
        self.kept = self.kept_for_the_process

    def capture(self, fn, pool=None):
        self.kept = self.kept_for_the_process
        return super().capture(fn, pool)

    def memory_in_use(self) -> int:
        return super().memory_in_use() + self.kept


def test_what_a_backend_keeps_for_the_process_is_not_counted_in_the_first_budgets_memory(monkeypatch, tower):
    install_backend(monkeypatch, WorkspaceBackend)
    first = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=2, graph_backend="workspace",
                                attention="TORCH_SDPA")
    first.capture()
    prepared = first.backend.prepared  # before each budget, with an eager forward of its shapes
    assert [embeds.shape for embeds, *_ in prepared] == [(32, tower.out_hidden_size), (16, tower.out_hidden_size)]
    assert all(len(deepstack) == len(tower.deepstack_visual_indexes) for _, *deepstack in prepared)
    assert first.backend.current_streams == [False, False]  # a plain capture runs nothing on the current stream
    second = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=2, graph_backend="cpu",
                                 attention="TORCH_SDPA")
    second.capture()
    got, want = first.stats()["capture_bytes_per_budget"], second.stats()["capture_bytes_per_budget"]
    assert got == want and all(0 < n < WorkspaceBackend.kept_for_the_process for n in got.values()), (got, want)


class CheckingBackend(CpuGraphBackend):
    """The CPU reference backend whose capture leaves blocks in an allocator's cache, as ROCm's check of each
    capture (an eager rerun, ``check_replay_after_capture``) does on a GPU; ``empty_cache`` returns them."""

    name = "checking"
    left_cached = 24 << 20

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cached = 0

    def capture(self, fn, pool=None):
        captured = super().capture(fn, pool)
        self.cached = self.left_cached
        return captured

    def empty_cache(self) -> None:
        self.cached = 0

    def memory_in_use(self) -> int:
        return super().memory_in_use() + self.cached


def test_blocks_a_capture_leaves_in_the_allocators_cache_are_not_counted_as_graph_memory(monkeypatch, tower):
    install_backend(monkeypatch, CheckingBackend)
    found = {}
    for name in ("checking", "cpu"):
        m = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=2, graph_backend=name,
                                attention="TORCH_SDPA")
        m.capture()
        found[name] = m.stats()["capture_bytes_per_budget"]
    assert found["checking"] == found["cpu"] and all(0 < n < CheckingBackend.left_cached
                                                     for n in found["checking"].values()), found


def test_encode_from_two_threads_gives_each_its_own_images_outputs(tower, monkeypatch):
    """The graphs' static buffers are the manager's: two threads encoding at once once got each other's outputs (a
    fill, the other thread's fill, then the first thread's replay). Filling is slowed here so that, without the
    manager's lock, the threads interleave there every time."""
    import threading
    import time

    m = make_manager(tower, budgets=[16], max_images=1)
    m.capture()
    fill = m._fill

    def slow_fill(*args):
        fill(*args)
        time.sleep(0.002)

    monkeypatch.setattr(m, "_fill", slow_fill)
    grid = [(1, 8, 8)]
    inputs = [pixels_for(tower, grid, seed) for seed in (1, 2)]
    wants = [eager_per_image(tower, p, grid)[0].embeds for p in inputs]
    wrong = []

    def run(i):
        for _ in range(20):
            got = m.encode(inputs[i], grid)[0].embeds
            if not torch.allclose(got, wants[i], rtol=1e-4, atol=1e-5):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and m.stats()["replays"] == 40


# ------------------------------------------------------------------ lifecycle and stats (a dispatch fuzz's findings)
def test_close_waits_for_an_encode_in_flight(tower, monkeypatch):
    """encode() calls from several threads take turns on the graphs' buffers; close() did not wait its turn and
    released the graph under a call between its fill and its replay ("replay() of a released graph")."""
    import threading
    import time

    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu", attention="TORCH_SDPA")
    m.capture()
    fill, filled = m._fill, threading.Event()

    def slow_fill(*args):
        fill(*args)
        filled.set()
        time.sleep(0.2)

    monkeypatch.setattr(m, "_fill", slow_fill)
    grid, result = [(1, 4, 4)], []
    worker = threading.Thread(target=lambda: result.append(m.encode(pixels_for(tower, grid, 1), grid)))
    worker.start()
    assert filled.wait(timeout=60)
    m.close()
    worker.join(timeout=60)
    assert len(result) == 1 and m.stats()["replays"] == 1
    with pytest.raises(RuntimeError, match=r"encode\(\) after close\(\)"):
        m.encode(pixels_for(tower, grid, 1), grid)


def test_a_call_that_raised_counts_neither_as_a_call_nor_in_a_group(tower, monkeypatch):
    """calls == replays + eager groups: an eager forward that raised (out of memory on a huge group) was counted as
    a call, in no group."""
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu", attention="TORCH_SDPA")
    m.capture()
    forward = tower.forward_with_metadata

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")

    grid = [(1, 8, 12)]  # 24 tokens: over the budget, eager
    monkeypatch.setattr(tower, "forward_with_metadata", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        m.encode(pixels_for(tower, grid, 1), grid)
    monkeypatch.setattr(tower, "forward_with_metadata", forward)
    m.encode(pixels_for(tower, grid, 1), grid)
    s = m.stats()
    assert s["calls"] == s["replays"] + s["eager_groups"] == 1 and s["misses"] == 1 and s["eager_reasons"] == {
        "over budget": 1}


def test_a_failed_budget_that_calibration_released_is_no_eager_reason(tower, monkeypatch):
    """A group only a failed budget would hold goes eager as "capture failed"; once calibrate() had released that
    budget (m.budgets no longer lists it), its groups still did, not "over budget"."""
    m = EncoderGraphManager(tower, budgets=[8, 16, 32], max_images_per_graph=4, graph_backend="cpu",
                            attention="TORCH_SDPA")
    real, captured = m.backend.capture, []

    def capture(fn, pool=None):
        captured.append(fn)
        if len(captured) == 2:  # largest first: 32, then 16 fails, then 8
            raise CaptureError("simulated")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    m.capture()
    assert list(m.stats()["capture_failures"]) == [16]
    times = iter([(1.0, 0.5), (1.0, 2.0)])  # budget 8's replay wins, 32's loses: the cap is 8
    monkeypatch.setattr(m, "time_ms", lambda fns, warmup=3, samples=10: dict(zip(fns, next(times), strict=True)))
    findings = m.calibrate()
    assert m.budgets == [8] and sorted(m.graphs) == [8]
    findings.clear()  # the caller's copy
    assert sorted(m.stats()["calibration"]) == [8, 32]
    for grid in ([(1, 4, 6)], [(1, 4, 12)]):  # 6 tokens: replays budget 8; 12: nothing configured holds it
        m.encode(pixels_for(tower, grid, 1), grid)
    assert m.stats()["eager_reasons"] == {"over budget": 1} and m.stats()["replays"] == 1


def test_close_leaves_no_memory_or_seconds_of_the_graphs_it_released(tower):
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.capture()
    assert sorted(m.stats()["capture_bytes_per_budget"]) == [8, 16]
    m.close()
    s = m.stats()
    assert s["budgets"] == [] and s["capture_bytes_per_budget"] == {} and s["capture_seconds_per_budget"] == {}


def test_a_plain_capture_leaves_dynamos_limits_alone(tower, monkeypatch):
    """It read dynamo's recompile limits, which imported dynamo inside the first budget's timed capture where
    nothing had yet: 1.0 s of its 1.02 s on this CPU (4.6 s on a helper's run), reported as that budget's capture
    time. Only a compiled capture needs them."""
    def limits(num_budgets):
        raise AssertionError("a plain capture entered compile_limits")

    monkeypatch.setattr(budget_capture, "compile_limits", limits)
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=1, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.capture()
    assert sorted(m.graphs) == [8, 16] and m.stats()["capture_failures"] == {}


def test_a_device_named_without_index_is_the_one_the_backend_resolved(monkeypatch):
    """device="cuda" is the GPU current when the manager is made, as its graph backend resolves it; the manager kept
    the bare name, so its copies, streams and eager calls would follow whatever GPU the caller made current later.
    (Simulated on the CPU: a backend that resolves "cpu" to index 0, as the CUDA backend resolves "cuda".)"""
    from hwgraph import manager as manager_module
    from hwgraph.graphs.cpu import CpuGraphBackend

    real = manager_module.create_backend

    def resolving(name=None, device=None, mode=None, platform=None):
        backend = real(name, device=device, mode=mode, platform=platform)
        assert isinstance(backend, CpuGraphBackend) and backend.device == torch.device("cpu")
        backend.device = torch.device(device.type, 0)
        return backend

    monkeypatch.setattr(manager_module, "create_backend", resolving)
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    with make_manager(tower, budgets=[16], max_images=1, device="cpu") as m:
        assert m.device == torch.device("cpu", 0) == m.backend.device
        m.capture()
        encode_and_check(m, tower, [(1, 4, 4)], 5)


class StreamLog:
    """A ``torch.cuda``-like runtime for the manager's stream ordering: ``current`` names the caller's stream, and
    what the manager asks of streams and events is appended to ``calls``."""

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


def test_calibrate_on_another_stream_waits_for_the_last_replay_and_marks_its_own(tower, monkeypatch):
    # calibrate()'s replays fill the graphs' shared buffers: they queued at once on the caller's stream, ahead of an
    # encode() still queued on another, and left the host's record of the filled grid wrong for the next encode()
    m = EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, graph_backend="cpu", attention="TORCH_SDPA")
    m.capture()
    runtime = StreamLog()
    monkeypatch.setattr(m, "_runtime", runtime)
    real_fill = m._fill
    monkeypatch.setattr(m, "_fill", lambda *args: (runtime.calls.append("fill"), real_fill(*args)))
    monkeypatch.setattr(m, "time_ms", lambda fns, warmup=3, samples=10: {  # the replay wins: the budget is kept
        name: (fn(), {"eager": 2.0, "replay": 1.0}[name])[1] for name, fn in fns.items()})
    grid = [(1, 14, 14)]
    m.encode(pixels_for(tower, grid, 80), grid)
    assert runtime.calls == ["fill", "record on first"]
    runtime.current, runtime.calls = "second", []
    assert m.calibrate()[64]["kept"]
    assert runtime.calls == ["second waits", "fill", "record on second"]
    runtime.current, runtime.calls = "first", []
    full = [budget_rules.filling_grid(64, tower.spatial_merge_size)]
    pixels = pixels_for(tower, full, 81)
    assert_outputs_equal(m.encode(pixels, full), eager_per_image(tower, pixels, full))
    assert runtime.calls == ["first waits", "fill", "record on first"]


def test_stats_read_from_another_thread_during_an_encode_are_those_of_whole_calls(tower):
    """stats() from a metrics thread while another thread encodes: it copied the counters in the middle of a call
    (a group counted, its call not: calls != replays + eager groups) and, when the call added a key to a counter
    dict meanwhile, raised "dictionary changed size during iteration". It now takes its turn, as calls do."""
    import threading

    m = make_manager(tower, budgets=[16], max_images=1)
    m.capture()
    worker, entered, release = None, threading.Event(), threading.Event()

    class PausingDict(dict):
        def __setitem__(self, key, value):
            if threading.current_thread() is worker:  # the encode's own update, not stats()'s deep copy
                entered.set()
                release.wait(timeout=0.5)  # the fixed stats() waits for the call: this pause ends it
            super().__setitem__(key, value)

    m._stats.eager_reasons = PausingDict()
    grid = [(1, 8, 12)]  # 24 tokens: over the budget, an eager group
    worker = threading.Thread(target=m.encode, args=(pixels_for(tower, grid, 1), grid))
    worker.start()
    assert entered.wait(timeout=60)  # the worker is inside its call, between the group's counters
    s = m.stats()
    release.set()
    worker.join(timeout=60)
    assert s["calls"] == s["replays"] + s["eager_groups"] and s["images"] == s["misses"] + s["hits"]
    assert (s["calls"], s["eager_groups"], s["eager_reasons"]) == (1, 1, {"over budget": 1})
    m.close()


def test_stats_read_from_another_thread_during_capture_wait_for_it(tower):
    """capture() changed the counters without the manager's lock: a metrics thread's stats() during it raised
    "dictionary changed size during iteration" or reported half the budgets. It now waits for the capture."""
    import threading

    m = make_manager(tower, budgets=[8, 16], max_images=1)
    worker, entered, release = None, threading.Event(), threading.Event()

    class PausingDict(dict):
        def __setitem__(self, key, value):
            if threading.current_thread() is worker and not entered.is_set():  # the first budget's capture time
                entered.set()
                release.wait(timeout=0.5)  # the fixed stats() waits for the capture: this pause ends it
            super().__setitem__(key, value)

    m._stats.capture_seconds_per_budget = PausingDict()
    worker = threading.Thread(target=m.capture)
    worker.start()
    assert entered.wait(timeout=60)  # the worker is inside capture(), one budget captured
    s = m.stats()
    release.set()
    worker.join(timeout=60)
    assert s["budgets"] == [8, 16] and sorted(s["capture_seconds_per_budget"]) == [8, 16]
    m.close()


def test_stats_read_by_a_log_handler_inside_an_encode_does_not_deadlock(tower):
    """stats() waits for a call in flight; a handler of the manager's own log records runs inside that call, in the
    same thread, and reads stats() there: it gets them instead of waiting for itself."""
    import threading

    m = make_manager(tower, budgets=[16], max_images=1, log_every=1)
    m.capture()
    seen = []

    class StatsHandler(logging.Handler):
        def emit(self, record):
            seen.append(m.stats()["calls"])

    handler, logger = StatsHandler(level=logging.INFO), logging.getLogger("hwgraph.manager")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        grid = [(1, 4, 4)]
        worker = threading.Thread(target=m.encode, args=(pixels_for(tower, grid, 1), grid), daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "encode() deadlocked in its own log handler's stats()"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert seen == [1]
    m.close()


def test_graph_memory_per_budget_counts_its_static_input_buffers(tower):
    """The bench's "graph memory per budget" left out the buffers every replay is filled into (at 1024 tokens in
    bf16 the pixels alone are 12 MiB): a budget whose graphs added no memory to a shared pool reported 0."""
    m = make_manager(tower, budgets=[16, 32])
    m.capture()
    memory = m.stats()["capture_bytes_per_budget"]
    for budget, entry in m.graphs.items():
        inputs = [entry.pixels, *entry.metadata.tensors().values()]
        assert memory[budget] >= sum(t.untyped_storage().nbytes() for t in inputs) > entry.pixels.nbytes, memory


def logging_releases(m, calls: list, monkeypatch) -> None:
    """Each of ``m``'s budgets appends ``release BUDGET`` to ``calls`` when its graphs and buffers are released."""
    for entry in m.graphs.values():
        real = entry.release
        monkeypatch.setattr(entry, "release", lambda real=real, b=entry.budget: (calls.append(f"release {b}"), real()))


def test_a_budget_captured_again_for_new_numerics_waits_for_the_last_replay_before_releasing_its_buffers(
        tower, monkeypatch):
    """The replaced graph's static buffers were released at once, while an encode() on another stream may still
    have its fill, replay and copy out of them queued: the new capture's buffers, allocated on the capturing stream
    right after, could take that memory and be written before the old replay read it (the caller's outputs wrong)."""
    setting = {"value": "ieee"}
    m = make_manager(tower, budgets=[16], max_images=1)
    m.backend.numerics_settings = lambda dtype: (("matmul precision", setting["value"]),)
    m.capture()
    runtime = StreamLog()
    monkeypatch.setattr(m, "_runtime", runtime)
    encode_and_check(m, tower, [(1, 8, 8)], 1)
    assert runtime.calls == ["record on first"]
    setting["value"] = "tf32"
    runtime.current = "second"
    runtime.calls.clear()
    logging_releases(m, runtime.calls, monkeypatch)
    m.capture()
    assert runtime.calls[:2] == ["second waits", "release 16"], runtime.calls
    encode_and_check(m, tower, [(1, 8, 8)], 2)
    assert m.stats()["replays"] == 2
    m.close()


def test_close_waits_for_the_device_before_releasing_the_graphs_buffers(tower, monkeypatch):
    """close() released every graph and its static buffers first and synchronised after: memory the last replay was
    still reading on the device could be handed to another allocation meanwhile."""
    m = make_manager(tower, budgets=[16, 32], max_images=1)
    m.capture()
    encode_and_check(m, tower, [(1, 8, 8)], 3)
    calls: list = []
    logging_releases(m, calls, monkeypatch)
    real_sync = m.backend.synchronize
    monkeypatch.setattr(m.backend, "synchronize", lambda: (calls.append("synchronize"), real_sync()))
    m.close()
    assert calls[0] == "synchronize" and sorted(calls[1:3]) == ["release 16", "release 32"], calls
    assert m.stats()["budgets"] == []


def test_a_second_capture_reuses_the_shared_pool_even_where_its_handle_is_falsy(tower, monkeypatch):
    """Every capture() goes into the manager's one pool. The pool was kept with ``self.pool or new_pool()``, so a
    backend whose pool handle is falsy (an int id 0, a pool object with a length) got a new pool at every capture()."""

    class EmptyPool(CpuPool):
        def __len__(self):  # falsy, as an int id 0 or an empty pool-like container would be
            return 0

    m = EncoderGraphManager(tower, budgets=[16, 32], max_images_per_graph=2, graph_backend="cpu")
    made = []

    def new_pool():
        made.append(EmptyPool())
        return made[-1]

    monkeypatch.setattr(m.backend, "new_pool", new_pool)
    m.capture()
    m.capture()
    assert len(made) == 1 and m.pool is made[0]
    captured = [g for entry in m.graphs.values() for g in entry.graphs.values()]
    assert len(captured) >= 2 and all(g in made[0].graphs for g in captured), "every budget's graphs share the pool"


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


def test_a_manager_built_after_a_weight_got_new_data_encodes():
    """The key a manager keeps is the tower's as it is: one read before a middle weight got new ``.data`` (an earlier
    manager's) kept the old layout number, the first replay's look then found the move, and every call raised."""
    tower, first, grid, pixels = replaying_manager(95)
    first.encode(pixels, grid)
    first.close()
    weight = tower.blocks[1].mlp.linear_fc1.weight
    weight.data = weight.data * 2  # weights loaded by .data, then a new manager built for them
    m = make_manager(tower, budgets=[16], max_images=1)
    m.capture()
    for _ in range(2):
        assert_outputs_equal(m.encode(pixels, grid), eager_per_image(tower, pixels, grid))
    assert m.stats()["replays"] == 2


def test_a_move_another_managers_look_found_first_still_refuses_this_replay(monkeypatch):
    """Two managers on one tower, replaying at once: the other manager's look at every weight found the move (and
    counted it) while this replay ran, so this manager's own look found nothing new and returned what its replay read
    at the old address."""
    tower, m, grid, pixels = replaying_manager(96)
    for entry in m.graphs.values():
        for graph in entry.graphs.values():
            graph.reads = None  # as on a device: no check of the CPU backend's own
    m.encode(pixels, grid)
    weight = tower.blocks[1].mlp.linear_fc1.weight
    weight.data = weight.data * 2
    fill = m._fill

    def fill_while_another_manager_looks(*args):
        fill(*args)
        assert tower.weights_moved()  # the other manager's look, during this replay

    monkeypatch.setattr(m, "_fill", fill_while_another_manager_looks)
    with pytest.raises(RuntimeError, match=r"encode\(\): the tower's weights were moved since this manager"):
        m.encode(pixels, grid)


def test_a_block_swapped_in_is_a_move():
    """A submodule assigned (``tower.blocks[1] = block``) runs no parameter or buffer registration hook: the list of
    weights was not made again, and the graphs went on reading the old block's."""
    tower, m, grid, pixels = replaying_manager(97)
    block = copy.deepcopy(tower.blocks[1])
    m.encode(pixels, grid)
    tower.blocks[1] = block
    with pytest.raises(RuntimeError, match=r"encode\(\): the tower's weights were moved since this manager"):
        m.encode(pixels, grid)
