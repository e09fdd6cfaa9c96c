"""Where the eager tower's host time goes, per attention kernel (the manager's eager call for a group no graph holds).

Usage: python benchmarks/eager_host.py [TOKENS ...]   (default 49 and 1024)
       python benchmarks/eager_host.py --parts
       python benchmarks/eager_host.py --layouts [TOKENS ...]
       python benchmarks/eager_host.py --device-guard [TOKENS ...]
For TRITON_ATTN and FLASH_ATTN, one image of TOKENS tokens (random weights of the qwen3-omni-30b-a3b preset, bf16):
- host ms: from the call to its return, no synchronisation (the time to issue the forward's work), and the call's
  latency to the end of its device work; medians of 10 after 3 warm-ups. Issue time close to the latency, with the
  device's kernels taking much less, means the host bounds the call;
- a cProfile of one call: the functions with the most time of their own, and those with the most time under them.
``--parts``: host µs per call (200 calls back to back, then one synchronisation) of TRITON_ATTN's attention call and
its pieces, and of FLASH_ATTN's, for the tower's inputs at 4096 and 256 rows (16 heads of 72, bf16), and a cProfile
of TRITON_ATTN's launcher.
``--layouts``: TRITON_ATTN's eager forward (host ms to issue, ms to the end) with the Gluon descriptors' shared
layouts cached (``gluon_kernel.shared_layout``, as shipped) against built anew for every descriptor, alternating,
three rounds.
``--device-guard``: the same for the launchers' device check (``varlen_inputs.launches_on_tensor_device``, as
shipped) against the undecorated launchers, alternating, five rounds, with the number of guarded launches per forward.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
from host_costs import host_us  # benchmarks/, the script's directory
from replay_gaps import preset_tower

from hwgraph.bench import eager_call, kernel_view, warm_device
from hwgraph.budgets import filling_grid


def host_and_latency(view, pixels, grid, samples: int = 10) -> tuple[float, float]:
    for _ in range(3):
        eager_call(view, pixels, grid)
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(samples):
        start = time.perf_counter()
        eager_call(view, pixels, grid)
        issued = time.perf_counter()
        torch.cuda.synchronize()
        host.append((issued - start) * 1e3)
        total.append((time.perf_counter() - start) * 1e3)
    return statistics.median(host), statistics.median(total)


def profile(view, pixels, grid, lines: int = 22) -> str:
    eager_call(view, pixels, grid)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    eager_call(view, pixels, grid)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumtime").print_stats(lines)
    return text.getvalue()


def parts_at(rows: int, heads: int = 16, head_dim: int = 72) -> None:
    from hwgraph_cuda.attention import flash_varlen

    from hwgraph.attention import gluon_kernel, triton_kernel
    from hwgraph.attention.triton_attn import triton_varlen

    qkv = torch.randn(rows, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]
    cu = torch.tensor([0, rows], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    cases = {
        "TRITON_ATTN (tower's call)": lambda: triton_varlen.padding_unspecified(q, k, v, cu, rows, scale),
        "FLASH_ATTN (tower's call)": lambda: flash_varlen.padding_unspecified(q, k, v, cu, rows, scale),
        "launch_varlen_attention": lambda: triton_kernel.launch_varlen_attention(q, k, v, cu, rows, scale),
    }
    if triton_kernel.uses_gluon(q, k, v, rows, 1):
        kernel, grid, args, kwargs = gluon_kernel.kernel_call(q, k, v, out, cu, rows, scale)
        cases.update({
            "gluon kernel_call (arguments only)": lambda: gluon_kernel.kernel_call(q, k, v, out, cu, rows, scale),
            "gluon descriptor, one": lambda: gluon_kernel.descriptor(k, 64, 64),
            "gluon kernel[grid](...) with built arguments": lambda: kernel[grid](*args, **kwargs),
            "gluon_tiles": lambda: gluon_kernel.gluon_tiles(rows, head_dim, 1),
        })
        if kwargs.get("FIXED_SHIFT"):
            flags = args[gluon_kernel.FLAGS_ARG]
            blocks = gluon_kernel.overflow_blocks(rows, kwargs["BLOCK_M"])
            cases["overflow fixup launch"] = lambda: triton_kernel.launch_overflow_fixup(
                q, k, v, out, cu, flags, blocks, kwargs["BLOCK_M"] // 2, scale)
    else:
        cases["triton head_descriptor, one"] = lambda: triton_kernel.head_descriptor(k, 64, 64)
    for name, fn in cases.items():
        print(f"{rows} rows, {name}: {host_us(fn):.1f} us of host time per call", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        cases["launch_varlen_attention"]()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"{rows} rows, cProfile of 200 calls of launch_varlen_attention:\n{text.getvalue()}", flush=True)


def layouts_ab(token_counts: list[int], rounds: int = 3) -> None:
    from hwgraph.attention import gluon_kernel

    cached = gluon_kernel.shared_layout
    dev = torch.device("cuda")
    warm_device(dev)
    view = kernel_view(preset_tower(dev), "TRITON_ATTN")
    for tokens in token_counts:
        grid = [filling_grid(tokens, 2)]
        pixels = torch.randn(tokens * 4, view.patch_row_width, device=dev, dtype=torch.bfloat16)
        for r in range(rounds):
            cells = []
            for name, fn in (("cached", cached), ("built per descriptor", cached.__wrapped__)):
                gluon_kernel.shared_layout = fn
                try:
                    host, total = host_and_latency(view, pixels, grid)
                finally:
                    gluon_kernel.shared_layout = cached
                cells.append(f"{name} {host:.2f} / {total:.2f}")
            print(f"1x{tokens} round {r}, layouts {' | '.join(cells)} ms (host to issue / to the end)", flush=True)


GUARDED_LAUNCHERS = (
    ("hwgraph.attention.triton_kernel", "launch_varlen_attention"),
    ("hwgraph.attention.triton_kernel", "launch_overflow_fixup"),
    ("hwgraph.attention.gluon_kernel", "launch_overflow_fixup"),  # gluon_kernel imports it by name
    ("hwgraph.attention.gluon_kernel", "launch_gluon_attention"),
    ("hwgraph.models.qwen3_omni.fused", "rotary_qk_launch"),
    ("hwgraph.models.qwen3_omni.fused", "add_layer_norm_launch"),
    ("hwgraph.models.qwen3_omni.fused", "add_position_embedding_launch"),
)


def set_launchers(replace) -> list:
    """Set each guarded launcher to ``replace(shipped)``; returns what restores them."""
    import importlib

    saved = []
    for module_name, name in GUARDED_LAUNCHERS:
        module = importlib.import_module(module_name)
        shipped = getattr(module, name)
        saved.append((module, name, shipped))
        setattr(module, name, replace(shipped))
    return saved


def restore(saved: list) -> None:
    for module, name, shipped in saved:
        setattr(module, name, shipped)


def device_guard_ab(token_counts: list[int], rounds: int = 5) -> None:
    dev = torch.device("cuda")
    warm_device(dev)
    view = kernel_view(preset_tower(dev), "TRITON_ATTN")
    calls = []

    def counted(shipped):
        def count(*args, **kwargs):
            calls.append(shipped.__name__)
            return shipped(*args, **kwargs)
        return count

    for tokens in token_counts:
        grid = [filling_grid(tokens, 2)]
        pixels = torch.randn(tokens * 4, view.patch_row_width, device=dev, dtype=torch.bfloat16)
        saved = set_launchers(counted)
        try:
            calls.clear()
            eager_call(view, pixels, grid)
            torch.cuda.synchronize()
        finally:
            restore(saved)
        print(f"1x{tokens}: {len(calls)} guarded launches per eager forward "
              f"({', '.join(f'{calls.count(n)} {n}' for n in sorted(set(calls)))})", flush=True)
        for r in range(rounds):
            cells = []
            for name, replace in (("guarded", lambda f: f), ("unguarded", lambda f: f.__wrapped__)):
                saved = set_launchers(replace)
                try:
                    host, total = host_and_latency(view, pixels, grid)
                finally:
                    restore(saved)
                cells.append(f"{name} {host:.3f} / {total:.3f}")
            print(f"1x{tokens} round {r}, launchers {' | '.join(cells)} ms (host to issue / to the end)", flush=True)
    check = torch.empty(1, device=dev)
    print(f"the check alone: {host_us(lambda: check.is_cuda and check.device.index != torch.cuda.current_device()):.2f}"
          " us per call", flush=True)


def main():
    if "--device-guard" in sys.argv:
        device_guard_ab([int(a) for a in sys.argv[1:] if a != "--device-guard"] or [49, 1024])
        return
    if "--layouts" in sys.argv:
        layouts_ab([int(a) for a in sys.argv[1:] if a != "--layouts"] or [49, 1024])
        return
    if "--parts" in sys.argv:
        for rows in (4096, 256):
            parts_at(rows)
        return
    token_counts = [int(a) for a in sys.argv[1:]] or [49, 1024]
    dev = torch.device("cuda")
    warm_device(dev)
    tower = preset_tower(dev)
    for tokens in token_counts:
        grid = [filling_grid(tokens, 2)]
        pixels = torch.randn(tokens * 4, tower.patch_row_width, device=dev, dtype=torch.bfloat16)
        for kernel in ("TRITON_ATTN", "FLASH_ATTN"):
            view = kernel_view(tower, kernel)
            host, total = host_and_latency(view, pixels, grid)
            print(f"1x{tokens} {kernel}: host {host:.2f} ms to issue, {total:.2f} ms to the end", flush=True)
        for kernel in ("TRITON_ATTN", "FLASH_ATTN"):
            print(f"==== 1x{tokens} {kernel}: cProfile of one eager call", flush=True)
            print(profile(kernel_view(tower, kernel), pixels, grid), flush=True)


if __name__ == "__main__":
    main()
