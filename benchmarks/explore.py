"""Where the tower's time goes on a GPU: kernel breakdown per forward, eager vs replay vs compiled replay.

Usage: python benchmarks/explore.py [--tokens 49 256 1024] [--compile] [--kernel FLASH_ATTN]
Prints per-kernel-name device time of one eager forward (torch.profiler), the number of kernels, and the
CUDA-event latency (median/p95 of 30 after 10 warm-ups) of eager, plain replay and (with --compile) compiled replay.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hwgraph.bench import warm_device
from hwgraph.budgets import filling_grid
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.timing import measure


def breakdown(fn, top=14):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.name][0] += e.time_range.elapsed_us()
            per[e.name][1] += 1
    total = sum(v[0] for v in per.values())
    count = sum(v[1] for v in per.values())
    print(f"  {count} device activities, {total / 1e3:.3f} ms summed")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / 1e3:8.3f} ms {n:5d}x  {name[:110]}")


def host_summary(fn, samples=30):
    """Host wall time of ``fn`` (returning before the device finishes), its CUDA runtime calls and top operators."""
    import warnings

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    walls = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        walls.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    walls.sort()
    print(f"  host wall of one eager call (no sync): median {walls[len(walls) // 2]:.3f} ms, "
          f"min {walls[0]:.3f}, max {walls[-1]:.3f}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    print(f"  device-to-host syncs in one eager call: {len(syncs)} {syncs[:3]}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    runtime = collections.defaultdict(lambda: [0.0, 0])
    kernels, first, last = 0.0, None, None
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels += e.time_range.elapsed_us()
            first = e.time_range.start if first is None else min(first, e.time_range.start)
            last = e.time_range.end if last is None else max(last, e.time_range.end)
        elif e.name.startswith(("cuda", "cu")) and not e.name.startswith("cudaDeviceSynchronize"):
            runtime[e.name][0] += e.time_range.elapsed_us()
            runtime[e.name][1] += 1
    span = (last - first) / 1e3 if first is not None else 0.0
    print(f"  device: {kernels / 1e3:.3f} ms of kernels in a {span:.3f} ms span (profiled)")
    for name, (us, n) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"  runtime {us / 1e3:8.3f} ms {n:5d}x  {name}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))


@contextlib.contextmanager
def startup_log(path: str):
    """Log Triton's compilations while the block runs, then dynamo's cache counters and a cProfile summary."""
    import cProfile
    import pstats

    import triton

    begin = time.perf_counter()

    def listener(*args, **kwargs):
        src, hit = kwargs.get("src", args[0] if args else None), kwargs.get("cache_hit")
        name = str(getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?"))
        print(f"  triton {'hit ' if hit else 'MISS'} at {time.perf_counter() - begin:6.2f} s: {name[:100]}")

    knobs = getattr(triton, "knobs", None)
    compilation = getattr(knobs, "compilation", None)
    if compilation is not None and hasattr(compilation, "listener"):
        compilation.listener = listener
    else:
        print("  (this Triton has no compilation listener)")
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        if compilation is not None and hasattr(compilation, "listener"):
            compilation.listener = None
        from torch._dynamo.utils import counters

        for group in ("inductor", "aot_autograd", "stats"):
            wanted = {k: v for k, v in counters[group].items() if "cache" in k or "calls" in k or "unique" in k}
            print(f"  dynamo counters[{group!r}]: {wanted}")
        prof.dump_stats(path)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(35)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[49, 256, 1024])
    ap.add_argument("--kernel", default="FLASH_ATTN")
    ap.add_argument("--images", type=int, default=1, help="split each token count into this many equal images")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--capture-only", action="store_true", help="capture and report startup cost, then stop")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain (uncompiled) replay")
    ap.add_argument("--measure-products", action="store_true",
                    help="capture with measured cuBLASLt products (EncoderGraphManager(measure_products=True))")
    ap.add_argument("--startup-log", metavar="PSTATS", help="where capture time goes: every Triton compilation "
                    "(kernel, cache hit or not, seconds since the capture began), dynamo's inductor and AOT cache "
                    "counters, and the top functions of a cProfile of the captures (saved to PSTATS, or "
                    "PSTATS.replay and PSTATS.compiled when both modes run)")
    ap.add_argument("--cpu-profile", action="store_true", help="host time per operator of one eager forward")
    ap.add_argument("--host", action="store_true", help="where one eager forward's host time goes: its wall time "
                    "without a sync, CUDA runtime calls, top operators by self time, device busy time, and any "
                    "device-to-host synchronisation (torch.cuda.set_sync_debug_mode)")
    ap.add_argument("--trace", metavar="DIR", help="write a Chrome trace (host and device) of one eager forward "
                    "per token count to DIR, to see where the host waits or the device idles")
    args = ap.parse_args()
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to("cuda", torch.bfloat16).eval()
    tower.set_attention(args.kernel)
    warm_device(torch.device("cuda"))
    budgets = sorted({1 << max(6, (t - 1).bit_length()) for t in args.tokens})
    modes = ([] if args.no_plain else [("replay", False)]) + ([("compiled", True)] if args.compile else [])
    managers = {}
    for name, comp in modes:
        start = time.perf_counter()
        m = EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=4, attention=args.kernel, compile=comp,
                                measure_products=args.measure_products)
        # one log per mode (a generator's context manager runs once); the stats file gets the mode's name when
        # both modes run
        stats = args.startup_log if len(modes) == 1 else f"{args.startup_log}.{name}"
        with startup_log(stats) if args.startup_log else contextlib.nullcontext():
            m.capture()
        compiling = {b: round(s, 1) for b, s in m.stats()["compile_seconds_per_budget"].items()}
        print(f"{name}: captured {sorted(m.graphs)} in {time.perf_counter() - start:.1f} s; per budget "
              f"{ {b: round(s, 1) for b, s in m.stats()['capture_seconds_per_budget'].items()} } s"
              f"{f' (compiling {compiling} s)' if compiling else ''}; memory MiB "
              f"{ {b: round(v / 2**20) for b, v in m.stats()['capture_bytes_per_budget'].items()} }; "
              f"failures {m.stats()['capture_failures']}")
        if m.stats()["products"]:
            print(f"  products: {m.stats()['products']}")
        managers[name] = m
    if args.capture_only:
        return
    from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference

    encoder = reference_encoder(tower, attn_implementation="sdpa")
    for tokens in args.tokens:
        grid = [filling_grid(tokens // args.images, 2)] * args.images
        pixels = torch.randn(tokens * 4, 1536, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            want = tower.forward(pixels, grid)

        def eager(pixels=pixels, grid=grid):
            with torch.inference_mode():
                return tower.forward(pixels, grid)

        ref = measure(lambda p=pixels, g=grid: run_reference(encoder, p, g), "cuda")
        line = [f"{args.images}x{tokens // args.images} tokens: transformers {ref.median:7.3f} (p95 {ref.p95:.3f}) "
                f"| eager "
                f"{measure(eager, 'cuda').median:7.3f}"]
        for name, m in managers.items():
            got = m.encode(pixels, grid)[0]
            err = (got.embeds.float() - want.embeds.float()).norm() / want.embeds.float().norm()
            lat = measure(lambda m=m, p=pixels, g=grid: m.encode(p, g), "cuda")
            line.append(f"{name} {lat.median:7.3f} (p95 {lat.p95:.3f}, rel err {err:.2e})")
        print(" | ".join(line))
        if args.cpu_profile:
            eager()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                eager()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        if args.host:
            host_summary(eager)
        if args.trace:
            eager()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                eager()
                torch.cuda.synchronize()
            prof.export_chrome_trace(f"{args.trace}/eager-{tokens}.json")
        if args.breakdown:
            print(f" eager breakdown at {tokens} tokens:")
            breakdown(eager)
            for name, m in managers.items():
                print(f" {name} breakdown at {tokens} tokens:")
                breakdown(lambda m=m, p=pixels, g=grid: m.encode(p, g))


if __name__ == "__main__":
    main()
