"""TRITON_ATTN's Gluon kernel for Hopper (``hwgraph/attention/gluon_kernel.py``) against its Triton TMA kernel and
ATen flash, at the tower's shapes (16 heads of 72, bf16).

Usage: python benchmarks/attention_gluon.py [--quick] [--tiles]
                                           [--tile BLOCK_M,BLOCK_N,WARPS,STAGES[,PINGPONG,MAXNREG,CONSUMER_REGS,
                                                   PERSISTENT] ...]
Every run shows ``gluon_tiles``' choice (the ping-pong kernel, ``gluon_pingpong.py``, from 2048 rows) next to
``hopper_attention_kernel`` with 128x64 tiles, the Triton TMA kernel and flash. ``--tile``: a ``GluonTiles``
(PINGPONG 1 for the ping-pong kernel, PERSISTENT 0 for its grid of one program per tile). Session 8's
warp-specialised variant without ping-pong is in this file at commit 7c34f41 (``--ws``).
Each cell is the device time of one call (20 calls captured in one CUDA graph, replayed, divided by 20) and the
relative L2 error of its real rows against flash, batches shaped as the manager builds them (q, k, v strided views
of one qkv tensor, max_seqlen the budget's patch count, padding rows after the last image). Every case also checks
the padding rows: the Gluon kernel's output there must be zeros, and NaN in the padding rows of k and v must not
reach the real rows.
"""

from __future__ import annotations

import sys

import torch
import triton
from attention_hd72 import D, err_of, flash, manager_batch  # benchmarks/, the script's directory

from hwgraph.attention.gluon_kernel import launch_gluon_attention
from hwgraph.attention.triton_kernel import launch_varlen_attention
from hwgraph.timing import graphed_ms


def row(label, seqs, rows, slots, tiles):
    qkv, cu, real, gflop = manager_batch(seqs, rows, slots)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    want = flash(q, k, v, cu, rows)[:real].float()
    ms = graphed_ms(lambda: flash(q, k, v, cu, rows))
    print(f"{label} ({gflop:.2f} GFLOP): flash {ms:.4f} ms {gflop / ms:.0f} TFLOP/s", flush=True)

    def report(name, fn, check_padding=False):
        try:
            got = fn()
            err = err_of(got[:real], want)
            extra = ""
            if check_padding:
                pad_zero = bool((got[real:] == 0).all()) if real < rows else True
                if real < rows:
                    saved = qkv[real:].clone()
                    qkv[real:, 1:] = float("nan")
                    nan_err = err_of(fn()[:real], want)
                    qkv[real:] = saved
                    extra = f" padding zero {pad_zero} err with NaN padding {nan_err:.1e}"
            t = graphed_ms(fn)
            print(f"  {name}: {t:.4f} ms {gflop / t:.0f} TFLOP/s err {err:.1e}{extra}", flush=True)
        except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
            print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    report("TRITON_ATTN automatic", lambda: launch_varlen_attention(q, k, v, cu, rows, D**-0.5))
    report("triton TMA kernel", lambda: launch_varlen_attention(q, k, v, cu, rows, D**-0.5, use_gluon=False))
    for cfg in tiles:
        report(f"gluon {cfg}", lambda c=cfg: launch_gluon_attention(q, k, v, cu, rows, D**-0.5, tiles=c),
               check_padding=True)


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    tiles = [None, (128, 64, 8, 3)]  # gluon_tiles' choice, and hopper_attention_kernel's tiles from 1024 rows
    if "--tiles" in sys.argv:
        tiles += [(128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 4), (64, 128, 4, 3),
                  (64, 64, 4, 3), (64, 64, 4, 4)]
    tiles += [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--tile"]
    cases = [("1x4096 in 4096", [4096], 4096, 1), ("1x3600 in 4096", [3600], 4096, 1),
             ("4x784 in 4096", [784] * 4, 4096, 4), ("1x1024 in 1024", [1024], 1024, 1),
             ("4x256 in 1024", [256] * 4, 1024, 4), ("1x2048 in 2048", [2048], 2048, 1),
             ("2x1024 in 2048", [1024] * 2, 2048, 2), ("1x392 in 512", [392], 512, 1), ("1x196 in 256", [196], 256, 1),
             ("2x196 in 512", [196] * 2, 512, 2), ("1x33 in 64", [33], 64, 1)]
    if "--quick" in sys.argv:
        cases = cases[:1]
    for label, seqs, rows, slots in cases:
        row(label, seqs, rows, slots, tiles)


if __name__ == "__main__":
    main()
