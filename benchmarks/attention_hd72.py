"""Attention kernels for head_dim 72 on Hopper, at the tower's shapes (16 heads, bf16), against ATen flash.

Usage: python benchmarks/attention_hd72.py [--quick] [--tiles] [--small] [--no-extras]
Each cell is the device time of one call (20 calls captured in one CUDA graph, replayed, divided by 20) and the
relative L2 error of its real rows against flash. Batches are shaped as the manager builds them (q, k, v strided
views of one qkv tensor; max_seqlen the budget's patch count; padding rows after the last image). Rows:

- ``triton``: TRITON_ATTN as shipped: on Hopper its Gluon kernel (TMA kernel from 512 to 2047 rows; both against
  each other: ``attention_gluon.py``), and its pointer kernel (``use_tma=False``; the
  only kernel before session 5). ``--tiles`` sweeps the TMA kernel's tiles and pipeline stages.
- ``cudnn-dense``: cuDNN's dense kernel on the whole padded sequence, keys past the image's end masked by one extra
  head lane (q gets 1, k gets 0 for real keys and -30000 for padding; head 72 -> 80, no bias tensor); and the same
  kernel on an exact-length sequence (what no graph can promise).
- ``flex``: torch.compile'd flex_attention on one exact sequence (no mask), torch's own Triton template.

Session 5's first runs also timed the Triton variants that led to the TMA kernel (a tutorial-style pointer loop, a
TMA loop with p.v split 64 + 16): they are in this file at commit f4acd6c, their logs in docs/reports/h200/.
Session 6's --variants (the key loop with q.k of the next block computed first, with
tl.range(warp_specialize=True), and as a programmatic dependent launch; none faster) are in this file at commit
f32b8d3 (attention_hd72-session6-variants.log, replay_gaps.log).
"""

from __future__ import annotations

import sys

import torch
import triton

from hwgraph.attention.triton_kernel import (
    launch_varlen_attention,
)
from hwgraph.timing import graphed_ms

H, D = 16, 72


def flash(q, k, v, cu, max_seqlen):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False,
                                                   scale=D**-0.5)[0]


def cudnn_dense_extra_dim(q, k, v, cu, rows):
    """One sequence padded to ``rows``: keys past ``cu[1]`` pushed to -inf through a 73rd lane (q 1, k -30000),
    zero lanes up to 80; cuDNN's dense kernel, no bias tensor."""
    pad_q = q.new_zeros(rows, H, 8)
    pad_q[..., 0] = 1
    pad_k = q.new_zeros(rows, H, 8)
    far = (torch.arange(rows, device=q.device) >= cu[1]).to(q.dtype) * -30000.0
    pad_k[..., 0] = far[:, None]
    q80, k80, v80 = torch.cat([q, pad_q], -1), torch.cat([k, pad_k], -1), torch.cat([v, torch.zeros_like(pad_q)], -1)
    dense = [t.transpose(0, 1).unsqueeze(0) for t in (q80, k80, v80)]
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(*dense, None, False, 0.0, False, False,
                                                             scale=D**-0.5)[0]
    return out[0].transpose(0, 1)[..., :D]


def err_of(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def manager_batch(seqs, rows, slots, head_dim=D):
    """A batch as the manager builds it: ``(qkv [rows, 3, H, head_dim], cu_seqlens with slots + 1 entries, real rows,
    GFLOP)``; q, k, v are qkv's strided views, the rows past the last image padding."""
    torch.manual_seed(0)
    qkv = torch.randn(rows, 3, H, head_dim, device="cuda", dtype=torch.bfloat16)
    bounds = [0]
    for n in seqs:
        bounds.append(bounds[-1] + n)
    bounds += [bounds[-1]] * (slots + 1 - len(bounds))
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    return qkv, cu, bounds[-1], sum(4 * n * n * H * head_dim for n in seqs) / 1e9


def row(label, seqs, rows, slots, tiles, extras):
    qkv, cu, real, gflop = manager_batch(seqs, rows, slots)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    max_seqlen = rows
    want = flash(q, k, v, cu, max_seqlen)[:real].float()
    ms = graphed_ms(lambda: flash(q, k, v, cu, max_seqlen))
    print(f"{label} ({gflop:.1f} GFLOP): flash {ms:.4f} ms {gflop / ms:.0f} TFLOP/s", flush=True)

    def report(name, fn):
        try:
            err = err_of(fn()[:real], want)
            t = graphed_ms(fn)
            print(f"  {name}: {t:.4f} ms {gflop / t:.0f} TFLOP/s err {err:.1e}", flush=True)
        except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
            print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)

    report("triton (shipped: Gluon or TMA on Hopper)",
           lambda: launch_varlen_attention(q, k, v, cu, max_seqlen, D**-0.5))
    report("triton pointer kernel", lambda: launch_varlen_attention(q, k, v, cu, max_seqlen, D**-0.5, use_tma=False))
    report("triton TMA without the padding slot", lambda: launch_varlen_attention(q, k, v, cu, max_seqlen, D**-0.5,
                                                                                  padding_slot=False, use_gluon=False))
    for cfg in tiles:
        report(f"triton TMA tiles {cfg}", lambda c=cfg: launch_varlen_attention(q, k, v, cu, max_seqlen, D**-0.5,
                                                                              tiles=c, use_tma=True))
    if "cudnn" in extras and len(seqs) == 1:
        report("cudnn-dense (extra dim)", lambda: cudnn_dense_extra_dim(q, k, v, cu, rows))
        exact = [t[: seqs[0]].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        report("cudnn-dense exact length hd72", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            *exact, None, False, 0.0, False, False, scale=D**-0.5)[0][0].transpose(0, 1))
    if "flex" in extras and len(seqs) == 1 and seqs[0] == rows:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        dense = [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
        report("flex (compiled, exact)", lambda: flex(*dense, scale=D**-0.5)[0].transpose(0, 1))


def main():
    quick = "--quick" in sys.argv
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    # (BLOCK_M, BLOCK_N, num_warps, num_stages); 128x128 with 4 stages does not fit shared memory.
    tiles = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 128, 4, 3), (64, 64, 4, 4),
             (128, 32, 8, 4)] if "--tiles" in sys.argv else []
    extras = () if "--no-extras" in sys.argv else ("cudnn",)
    cases = [("1x4096 in 4096", [4096], 4096, 1), ("1x3600 in 4096", [3600], 4096, 1),
             ("4x784 in 4096", [784] * 4, 4096, 4), ("1x1024 in 1024", [1024], 1024, 1),
             ("1x196 in 256", [196], 256, 1)]
    if "--small" in sys.argv:  # the budgets below 1024 tokens, as the manager fills them
        tiles = [(64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3),
                 (128, 128, 8, 3)]
        cases = [("1x196 in 256", [196], 256, 1), ("2x196 in 512", [196] * 2, 512, 2),
                 ("1x392 in 512", [392], 512, 1), ("4x256 in 1024", [256] * 4, 1024, 4),
                 ("1x1024 in 1024", [1024], 1024, 1), ("1x784 in 1024", [784], 1024, 1),
                 ("1x2048 in 2048", [2048], 2048, 1)]
    if quick:
        cases = cases[:1]
    for i, (label, seqs, rows, slots) in enumerate(cases):
        row(label, seqs, rows, slots, tiles, extras + ("flex",) if i == 0 and extras else extras)


if __name__ == "__main__":
    main()
