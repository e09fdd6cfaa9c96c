"""The block's products through cuBLASLt configurations the heuristic does not offer: every enumerated algorithm's
tiles, stages, CTA swizzling and cluster shapes, and the heuristic's own candidates with other swizzling and clusters.

Usage: python benchmarks/cublaslt_space.py [--rows N ...] [--products qkv,proj,fc1,fc2] [--stages S] [--limit L]
       (default rows 4096 1024, all four products, at most 3 stage counts per tile, 800 configurations screened
       per shape besides the heuristic's)

``benchmarks/cublaslt_algos.py`` timed the heuristic's candidates (4-16 per shape), which is what
``measure_products=True`` chooses from. cuBLASLt also lists its algorithms for the data types
(``cublasLtMatmulAlgoGetIds``), each with the tiles, stage counts, swizzling and cluster shapes it supports
(``cublasLtMatmulAlgoCapGetAttribute``); any combination that ``cublasLtMatmulAlgoCheck`` accepts for the
descriptors without a workspace can run. This script screens all of them (split-K off: it changes the order of the
sums), then times ATen, the heuristic's fastest and the screen's three fastest as accurate as ATen interleaved,
as ``cublaslt_algos.py`` does. Every configuration runs without a workspace, as the graphs capture; those that
cannot are counted and skipped. µs per call, 20 calls per CUDA graph. Run with ``CUBLASLT_WORKSPACE_SIZE=0``.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import time

import torch
from cublaslt_algos import BLOCKS, PRODUCTS, Candidate, Operands, arguments, interleaved, session, shape_operands
from hwgraph_cuda.cublaslt import (
    CAP_TILE_IDS,
    CFG_CLUSTER,
    CFG_SPLITK,
    CFG_STAGES,
    CFG_SWIZZLING,
    CFG_TILE,
    COMPUTE_32F,
    DATA_TYPES,
    SCALE_32F,
    Algo,
    cap_values,
    check,
    configured,
    describe_algo,
)

from hwgraph.budget_capture import relative_error
from hwgraph.timing import graphed_ms

CAP_SWIZZLING, CAP_STAGES_IDS = 2, 13  # cublasLtMatmulAlgoCapAttributes_t (CAP_TILE_IDS: the plugin's)
CLUSTERS = (2, 3, 5, 6, 4, 8)  # cublasLtClusterShape_t 1x1, 2x1, 1x2, 2x2, 4x1, 1x4
SCREEN = {"warmup": 2, "samples": 5}


def bind(lib):
    """``cublasLtMatmulAlgoGetIds``, which the CUDA plugin does not use (``cublaslt()`` binds the rest)."""
    i = ctypes.c_int
    lib.cublasLtMatmulAlgoGetIds.argtypes = [ctypes.c_void_p, i, i, i, i, i, i, i, ctypes.POINTER(i), ctypes.POINTER(i)]
    lib.cublasLtMatmulAlgoGetIds.restype = i


def space(lib, handle, product, dtype: int, max_stages: int) -> list[tuple[str, Algo, float]]:
    """Every accepted configuration: the enumerated algorithms', then the heuristic candidates' variants."""
    found, seen = [], set()

    def offer(origin: str, algo: Algo):
        result = product.product.checked(algo)  # with the workspace it recommends: ATen's kernels report one too
        key = bytes(algo)
        if result is not None and key not in seen:
            seen.add(key)
            found.append((f"{origin} (workspace {result.workspace_size >> 10} KiB recommended)", algo, result.waves))

    ids, returned = (ctypes.c_int * 200)(), ctypes.c_int(0)
    check(lib.cublasLtMatmulAlgoGetIds(handle, COMPUTE_32F, SCALE_32F, dtype, dtype, dtype, dtype, 200, ids,
                                       ctypes.byref(returned)), "cublasLtMatmulAlgoGetIds")
    for algo_id in ids[: returned.value]:
        base = Algo()
        if lib.cublasLtMatmulAlgoInit(handle, COMPUTE_32F, SCALE_32F, dtype, dtype, dtype, dtype, algo_id,
                                      ctypes.byref(base)) != 0:
            continue
        tiles = cap_values(lib, base, CAP_TILE_IDS) or [0]
        stages = (cap_values(lib, base, CAP_STAGES_IDS) or [0])[-max_stages:]
        swizzles = [0, 1] if (cap_values(lib, base, CAP_SWIZZLING) or [0])[0] else [0]
        for tile, stage, swizzle, cluster in itertools.product(tiles, stages, swizzles, CLUSTERS):
            algo = configured(lib, base, {CFG_TILE: tile, CFG_STAGES: stage, CFG_SPLITK: 1, CFG_SWIZZLING: swizzle,
                                          CFG_CLUSTER: cluster})
            if algo is not None:
                offer(f"id {algo_id}", algo)
    enumerated = len(found)
    for index, heuristic in enumerate(product.product.candidates(32, 0)):
        offer(f"heuristic #{index}", heuristic.algo)
        for swizzle, cluster in itertools.product((0, 1), CLUSTERS):
            algo = configured(lib, heuristic.algo, {CFG_SWIZZLING: swizzle, CFG_CLUSTER: cluster})
            if algo is not None:
                offer(f"heuristic #{index} variant", algo)
    print(f"  {enumerated} enumerated configurations and {len(found) - enumerated} heuristic ones accepted "
          f"({returned.value} algorithm ids)", flush=True)
    return found


def main():
    rows_list = [int(r) for r in arguments("--rows", ["4096", "1024"])]
    wanted = arguments("--products", ["qkv,proj,fc1,fc2"])[0].split(",")
    max_stages = int(arguments("--stages", ["3"])[0])
    limit = int(arguments("--limit", ["800"])[0])
    lib, handle, gen = session()
    bind(lib)
    gains: dict[int, list[float]] = {}
    for rows in rows_list:
        for name, k, n, gelu in PRODUCTS:
            if name.split()[0] not in wanted:
                continue
            x, w, b, exact, bound, aten = shape_operands(rows, k, n, gelu, gen)
            product = Operands(lib, handle, x, w, b, gelu)
            print(f"\n{rows} rows, {name} (K {k}, N {n}): aten {graphed_ms(aten) * 1e3:.1f} µs", flush=True)
            start = time.perf_counter()
            screened, failed = [], 0
            configurations = space(lib, handle, product, DATA_TYPES[torch.bfloat16], max_stages)
            if len(configurations) > limit:  # the heuristic's come last: keep them, thin out the enumerated ones
                step = len(configurations) / limit
                configurations = [configurations[int(i * step)] for i in range(limit)] + [
                    c for c in configurations if c[0].startswith("heuristic")]
                print(f"  screening {len(configurations)} of them (--limit {limit})", flush=True)
            for origin, algo, waves in configurations:
                cand = Candidate(algo, None, waves, f"{origin}: {describe_algo(lib, algo)}")
                try:
                    err = relative_error(product.run(cand), exact)
                    if err > bound:
                        continue
                    us = graphed_ms(functools.partial(product.run, cand), **SCREEN) * 1e3
                except RuntimeError:  # run without a workspace, as the graphs do: some need one
                    failed += 1
                    continue
                screened.append((us, cand))
            screened.sort(key=lambda item: item[0])
            print(f"  {failed} did not run without a workspace; screened {len(screened)} accurate configurations "
                  f"in {time.perf_counter() - start:.0f} s; fastest:", flush=True)
            for us, cand in screened[:8]:
                print(f"    {us:6.1f} µs  waves {cand.waves:.2f}  {cand.label}")
            contenders = {"aten": aten}
            best_heuristic = next((c for _, c in screened if c.label.startswith("heuristic #")
                                   and "variant" not in c.label), None)
            if best_heuristic is not None:
                contenders["heuristic best"] = functools.partial(product.run, best_heuristic)
            for rank, (_, cand) in enumerate(screened[:3]):
                contenders[f"screen #{rank}"] = functools.partial(product.run, cand)
            per_call = interleaved(contenders)
            heuristic_us = per_call.get("heuristic best", per_call["aten"])[0]
            space_us = min((median for label, (median, _) in per_call.items() if label.startswith("screen")),
                           default=per_call["aten"][0])
            gains.setdefault(rows, []).append((per_call["aten"][0] - heuristic_us, per_call["aten"][0] - space_us))
    for rows, pairs in gains.items():
        print(f"\n{rows} rows, ms a replay's 27 blocks would save against ATen: heuristic's best "
              f"{sum(h for h, _ in pairs) * BLOCKS / 1e3:.3f}, the whole space's "
              f"{sum(s for _, s in pairs) * BLOCKS / 1e3:.3f}")


if __name__ == "__main__":
    main()
