"""Does the shared-memory carveout of hwgraph's Triton kernels cost replay time between the tower's kernels?

Usage: python benchmarks/carveout.py
A replay of a small image with TRITON_ATTN spends about 0.1 ms more between kernels than with FLASH_ATTN although
its kernels sum to about the same (bench-session5-tma.md, 1x49). One suspect: a kernel whose preferred L1/shared
split differs from its neighbours' (cuBLAS GEMMs use most of the 228 KB) makes the SM drain and reconfigure at each
switch. This captures managers (FLASH_ATTN, TRITON_ATTN; budgets 64 and 256), times their replays interleaved,
then sets CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT to 100 (maximum shared memory) on every compiled
Triton kernel of hwgraph, captures again and times old and new managers together.
"""

from __future__ import annotations

import ctypes

import torch

from hwgraph.bench import warm_device
from hwgraph.budgets import filling_grid
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.timing import measure_interleaved

CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
GROUPS = ((49, 64), (256, 256))


def hwgraph_jit_functions():
    import triton

    from hwgraph.attention import triton_kernel
    from hwgraph.models.qwen3_omni import fused_kernels

    return [obj for mod in (triton_kernel, fused_kernels) for obj in vars(mod).values()
            if isinstance(obj, triton.runtime.JITFunction)]


def set_carveout(percent: int) -> int:
    libcuda = ctypes.CDLL("libcuda.so.1")
    count = 0
    for fn in hwgraph_jit_functions():
        for caches in fn.device_caches.values():
            for compiled in caches[0].values():
                compiled._init_handles()
                rc = libcuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function), CARVEOUT_ATTRIBUTE, percent)
                assert rc == 0, f"cuFuncSetAttribute returned {rc} for {fn.__name__}"
                count += 1
    return count


def managers(towers, label):
    out = {}
    for kernel, tower in towers.items():
        m = EncoderGraphManager(tower, budgets=[b for _, b in GROUPS], max_images_per_graph=1, attention=kernel)
        m.capture()
        out[f"{kernel} {label}"] = m
    return out


def main():
    torch.manual_seed(0)
    warm_device(torch.device("cuda"))
    base = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to("cuda", torch.bfloat16).eval()
    towers = {}
    for kernel in ("FLASH_ATTN", "TRITON_ATTN"):
        tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to("cuda", torch.bfloat16).eval()
        tower.load_state_dict(base.state_dict())
        tower.set_attention(kernel)
        towers[kernel] = tower
    inputs = {tokens: ([filling_grid(tokens, 2)], torch.randn(tokens * 4, 1536, device="cuda", dtype=torch.bfloat16))
              for tokens, _ in GROUPS}
    before = managers(towers, "default")
    for m in before.values():  # compile every Triton kernel before touching their attributes
        for grid, pixels in inputs.values():
            m.encode(pixels, grid)
    torch.cuda.synchronize()

    def timed(ms, title):
        print(title, flush=True)
        for tokens, (grid, pixels) in inputs.items():
            fns = {name: (lambda m=m, p=pixels, g=grid: m.encode(p, g)) for name, m in ms.items()}
            lat = measure_interleaved(fns, "cuda")
            print(f"  1x{tokens}: " + " | ".join(f"{n} {v.median:.3f} / {v.p95:.3f}" for n, v in lat.items()),
                  flush=True)

    timed(before, "replay, default carveout (median / p95 ms)")
    print(f"carveout set to 100 on {set_carveout(100)} compiled Triton kernels", flush=True)
    after = managers(towers, "carveout-100")
    timed(before | after, "replay after setting the attribute: managers captured before and after")


if __name__ == "__main__":
    main()
