"""Resources over a long run: the host metadata caches stay within their byte and count limits whatever image sizes a
server meets, and a manager's bookkeeping stays bounded over many calls."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from hwgraph import bounded_cache as bc
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, metadata
from hwgraph.models.qwen3_omni.metadata import CACHE_BYTES, CACHE_ENTRY_BYTES, frame_tables, grid_metadata

MERGE, SIDE = 2, 48  # the Qwen3-Omni tower's spatial merge size and position-table side
ROW_BYTES = 64  # per patch row: 4 int64 indices, 4 float32 weights, 2 int64 rotary positions


@pytest.fixture(autouse=True)
def empty_caches():
    frame_tables.cache_clear()
    grid_metadata.cache_clear()
    yield
    frame_tables.cache_clear()
    grid_metadata.cache_clear()


def meta_bytes(meta) -> int:
    return sum(t.nbytes for t in meta.tensors().values())


def alive(refs) -> list:
    gc.collect()
    return [obj for obj in (r() for r in refs) if obj is not None]


def test_a_patch_row_costs_the_documented_bytes():
    meta = metadata.prepare_metadata([(1, 16, 16)], MERGE, SIDE)
    assert meta_bytes(meta) == 256 * ROW_BYTES + 2 * 4  # rows, plus cu_seqlens' two int32
    assert CACHE_ENTRY_BYTES // ROW_BYTES == 16384


def test_many_distinct_groups_keep_at_most_the_byte_limit():
    """A server meeting a new group of sizes at every call (hit rate 0): with count-only limits this kept the last 256
    groups' tables, 150 MiB for these ~550 KiB groups."""
    grid_refs, table_refs = [], []
    for j in range(1, 301):
        meta = metadata.prepare_metadata([(1, 128, 64), (1, 2, 2 * j)], MERGE, SIDE)
        grid_refs.append(weakref.ref(meta))
        table_refs.extend(weakref.ref(a) for a in frame_tables(2, 2 * j, MERGE, SIDE))
        del meta
    kept = alive(grid_refs)
    assert 0 < sum(meta_bytes(m) for m in kept) <= CACHE_BYTES
    assert len(kept) < 64  # ~550 KiB each within 32 MiB, not 256
    assert sum(a.nbytes for a in alive(table_refs)) <= CACHE_BYTES
    info = grid_metadata.cache_info()
    assert info.currsize == len(kept) and info.nbytes == sum(meta_bytes(m) for m in kept) <= info.max_bytes
    # The most recent group is among those kept: least recently used goes first.
    assert kept[-1].grid_thw == ((1, 128, 64), (1, 2, 600))


def test_a_huge_video_is_not_kept_while_small_grids_stay_cached():
    small = metadata.prepare_metadata([(1, 16, 16)], MERGE, SIDE)
    video_grid = [(36, 64, 64)]  # 147,456 patch rows, 9 MiB of tables
    video = metadata.prepare_metadata(video_grid, MERGE, SIDE)
    assert meta_bytes(video) > CACHE_ENTRY_BYTES
    video_ref = weakref.ref(video)
    again = metadata.prepare_metadata(video_grid, MERGE, SIDE)
    assert again is not video  # rebuilt, not cached ...
    torch.testing.assert_close(again.pos_weights, video.pos_weights, rtol=0, atol=0)  # ... to the same tables
    del video, again
    assert not alive([video_ref])
    assert metadata.prepare_metadata([(1, 16, 16)], MERGE, SIDE) is small
    assert grid_metadata.cache_info().nbytes == meta_bytes(small)
    # A frame over the entry limit is not kept either: 128 x 128 patches are 16,384 rows (1 MiB exactly, kept),
    # 128 x 132 more.
    assert frame_tables(128, 128, MERGE, SIDE)[0] is frame_tables(128, 128, MERGE, SIDE)[0]
    assert frame_tables(128, 132, MERGE, SIDE)[0] is not frame_tables(128, 132, MERGE, SIDE)[0]


def test_the_count_limits_hold_for_small_grids():
    grids = [[(1, 2 * a, 2 * b)] for a in range(1, 21) for b in range(1, 31)]  # 600 frames of 4 to 2,400 rows
    grid_refs = [weakref.ref(metadata.prepare_metadata(g, MERGE, SIDE)) for g in grids]
    assert len(alive(grid_refs)) == grid_metadata.cache_info().maxsize == 256
    assert grid_metadata.cache_info().nbytes < CACHE_BYTES  # so the count is what limited it
    assert frame_tables.cache_info().currsize == 512 == frame_tables.cache_info().maxsize
    assert grid_metadata.cache_info().misses == 600 and grid_metadata.cache_info().hits == 0


def test_cache_hits_return_the_same_read_only_metadata():
    first = metadata.prepare_metadata([(1, 4, 8), (2, 6, 6)], MERGE, SIDE)
    assert metadata.prepare_metadata(torch.tensor([[1, 4, 8], [2, 6, 6]]), MERGE, SIDE) is first
    info = grid_metadata.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 1, 1)
    assert not frame_tables(4, 8, MERGE, SIDE)[0].flags.writeable


def test_concurrent_callers_share_one_bounded_cache():
    grids = [[(1, 64, 64), (1, 2, 2 * j)] for j in range(1, 121)]
    want = {tuple(map(tuple, g)): metadata.grid_metadata(metadata.normalize_grid(g, MERGE), MERGE, SIDE).pos_weights
            for g in grids[:8]}
    grid_metadata.cache_clear()
    errors = []

    def worker(offset):
        try:
            for i in range(len(grids)):
                g = grids[(i + offset) % len(grids)]
                meta = metadata.prepare_metadata(g, MERGE, SIDE)
                if tuple(map(tuple, g)) in want:
                    torch.testing.assert_close(meta.pos_weights, want[tuple(map(tuple, g))], rtol=0, atol=0)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k * 30,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    info = grid_metadata.cache_info()
    assert info.hits + info.misses == 4 * len(grids)
    assert info.nbytes <= CACHE_BYTES and info.currsize <= 256


def test_a_thousand_calls_keep_the_manager_bounded():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=1, deepstack_visual_indexes=[0]).eval()
    manager = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu",
                                  attention="TORCH_SDPA")
    manager.capture()
    g = torch.Generator().manual_seed(0)
    keys = None
    for i in range(1000):
        # A new pair of sizes most calls: replayed (up to 16 tokens) or eager (larger).
        grid = [(1, 2, 2 * (1 + i % 40)), (1, 4, 2 * (1 + i % 7))]
        pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)
        manager.encode(pixels, grid)
        keys = keys or set(manager.stats())
        assert set(manager.stats()) == keys
    stats = manager.stats()
    assert stats["calls"] == 1000 and stats["replays"] > 0 and stats["eager_groups"] > 0
    assert len(manager._padded) <= 64
    assert len(stats["eager_reasons"]) <= 3 and set(stats["replays_per_budget"]) <= {8, 16}
    assert grid_metadata.cache_info().currsize <= 256 and grid_metadata.cache_info().nbytes <= CACHE_BYTES
    manager.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"maxsize": 0}, "maxsize must be a positive int, got 0"),
    ({"max_bytes": 1.5}, "max_bytes must be a positive int, got 1.5"),
    ({"max_entry_bytes": True}, "max_entry_bytes must be a positive int, got True"),
    ({"max_entry_bytes": 200}, "max_entry_bytes=200 exceeds max_bytes=100"),
])
def test_bounded_cache_refuses_bad_limits(kwargs, message):
    limits = {"maxsize": 4, "max_bytes": 100, "max_entry_bytes": 50, "size_of": len} | kwargs
    with pytest.raises(ValueError, match=message):
        bc.bounded_cache(**limits)


def test_bounded_cache_evicts_least_recently_used_by_bytes_and_count():
    calls = []

    @bc.bounded_cache(maxsize=3, max_bytes=10, max_entry_bytes=6, size_of=len)
    def build(n):
        calls.append(n)
        return "x" * n

    for n in (1, 2, 3):
        build(n)
    build(1)  # a hit: 1 is now the most recent
    build(4)  # count over 3: 2, the least recent, goes
    assert build.cache_info()[:5] == (1, 4, 3, 3, 8)
    build(2)  # 12 bytes over 10: 3 then nothing more (1 + 4 + 2 = 7)
    assert build.cache_info().nbytes == 7 and build.cache_info().currsize == 3
    build(7)  # over the entry limit: returned, not kept
    assert build(7) == "x" * 7 and build.cache_info().currsize == 3
    calls.clear()
    for n in (1, 4, 2):
        build(n)
    assert calls == []  # all three kept
    build.cache_clear()
    assert build.cache_info()[:5] == (0, 0, 3, 0, 0)
    assert build.__name__ == "build"
