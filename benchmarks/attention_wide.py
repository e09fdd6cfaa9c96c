"""The ping-pong attention kernel on 256-row q tiles (``gluon_kernel.PINGPONG_WIDE_TILES``: two consumers of 128 rows,
64-key blocks) against 128-row tiles (``PINGPONG_TILES``: two of 64 rows, 128-key blocks), for head widths other
than the tower's too: ``gluon_tiles`` takes the wide tiles from ``PINGPONG_WIDE_FROM`` rows up to
``PINGPONG_WIDE_MAX_HEAD_DIM`` lanes.

Usage: python benchmarks/attention_wide.py [--head-dims 40,64,72,80,96]
16 heads, bf16, batches as the manager builds them (``attention_hd72.manager_batch``: q, k, v views of one qkv
tensor). Per cell: µs per call (20 calls in one CUDA graph), relative L2 error against ATen flash, and the compiled
kernel's registers per thread and spilled bytes (ptxas; the consumers' registers after the producer gives its up are
set by ``setmaxnreg``, not shown here).
"""

from __future__ import annotations

import sys

import torch
import triton
from attention_hd72 import err_of, manager_batch  # benchmarks/, the script's directory

from hwgraph.attention.gluon_kernel import PINGPONG_TILES, PINGPONG_WIDE_TILES, kernel_call, launch_gluon_attention
from hwgraph.timing import graphed_ms

CASES = [("1x4096 in 4096", [4096], 4096), ("4x784 in 4096", [784] * 4, 4096), ("1x2048 in 2048", [2048], 2048),
         ("2x1024 in 2048", [1024] * 2, 2048)]


def registers(q, k, v, cu, rows, tiles):
    """(registers per thread, spilled bytes) of the compiled kernel, as ptxas reports them."""
    kernel, grid, args, kwargs = kernel_call(q, k, v, torch.empty_like(q), cu, rows, 0.1, tiles)
    compiled = kernel.warmup(*args, **kwargs, grid=grid)
    compiled._init_handles()
    return getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)


def main():
    dims = [int(x) for x in sys.argv[sys.argv.index("--head-dims") + 1].split(",")] if "--head-dims" in sys.argv \
        else [40, 64, 72, 80, 96]
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    for head_dim in dims:
        scale = head_dim**-0.5
        for label, seqs, rows in CASES:
            qkv, cu, real, _ = manager_batch(seqs, rows, len(seqs), head_dim)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            want = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, rows, rows, 0.0, False, False,
                                                           scale=scale)[0][:real].float()
            cells = []
            for name, tiles in (("128-row", PINGPONG_TILES), ("256-row", PINGPONG_WIDE_TILES)):
                def fn(tiles=tiles, call=(q, k, v, cu, rows, scale)):
                    return launch_gluon_attention(*call, tiles=tiles)
                err = err_of(fn()[:real], want)
                regs, spills = registers(q, k, v, cu, rows, tiles)
                cells.append(f"{name} {graphed_ms(fn) * 1e3:.1f} us err {err:.1e} regs {regs} spills {spills}")
            print(f"head_dim {head_dim}, {label}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
