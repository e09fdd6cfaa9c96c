"""Host cost and memory of the tower's metadata caches (any machine; numpy only).

Usage: python benchmarks/metadata_cache.py
- microseconds per ``prepare_metadata`` call that hits the cache (the grid normalised and looked up), and per bare
  ``grid_metadata`` hit (best of 5 repeats of 100,000 calls);
- what the caches keep (``tracemalloc``) after 300 distinct ~550 KiB image groups, ``[(1, 128, 64), (1, 2, 2j)]``
  (a server whose every call brings a new pair of sizes), and after five distinct 147,456-row videos.
"""

from __future__ import annotations

import gc
import timeit
import tracemalloc

from hwgraph.models.qwen3_omni import metadata

MERGE, SIDE = 2, 48  # the Qwen3-Omni tower's merge size and position-table side


def hit_us(fn, calls=100_000) -> float:
    fn()
    return 1e6 * min(timeit.repeat(fn, number=calls, repeat=5)) / calls


def kept_mib(grids) -> float:
    metadata.grid_metadata.cache_clear()
    metadata.frame_tables.cache_clear()
    gc.collect()
    tracemalloc.start()
    for grid in grids:
        metadata.prepare_metadata(grid, MERGE, SIDE)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return kept / 2**20


def main() -> None:
    grid = [(1, 16, 16), (1, 32, 32)]
    normal = metadata.normalize_grid(grid, MERGE)
    print(f"prepare_metadata hit: {hit_us(lambda: metadata.prepare_metadata(grid, MERGE, SIDE)):.2f} us/call")
    print(f"grid_metadata hit alone: {hit_us(lambda: metadata.grid_metadata(normal, MERGE, SIDE)):.2f} us/call")
    groups = [[(1, 128, 64), (1, 2, 2 * j)] for j in range(1, 301)]
    print(f"300 distinct ~550 KiB groups: kept {kept_mib(groups):.1f} MiB")
    print(f"  grid_metadata {metadata.grid_metadata.cache_info()}")
    print(f"  frame_tables {metadata.frame_tables.cache_info()}")
    videos = [[(36, 64, 64 + 2 * k)] for k in range(5)]
    print(f"5 distinct 147k-row videos: kept {kept_mib(videos):.1f} MiB")


if __name__ == "__main__":
    main()
