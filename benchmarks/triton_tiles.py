"""Tile sizes for TRITON_ATTN on this GPU, against ATen's flash kernel, at the tower's shapes (16 heads of 72, bf16).

Usage: python benchmarks/triton_tiles.py. Each case is a packed batch as the manager builds it: ``cu_seqlens`` with
5 entries (up to 4 images, empty slots repeat the last boundary), rows past the last sequence as padding, and
``max_seqlen`` either the longest sequence (eager) or the budget's patch count (a captured graph). Each cell is the
device time of one call: 20 calls captured in one CUDA graph, replayed (CUDA events, median of 30 after 10
warm-ups), divided by 20, so host launch cost is left out. Each config is checked against the flash output.
"""

import torch
from hwgraph_cuda.attention import aten_flash

from hwgraph.attention.triton_kernel import launch_varlen_attention
from hwgraph.timing import graphed_ms

CONFIGS = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2),
           (256, 64, 8, 2)]
# (label, sequence lengths in patches, max_seqlen, rows): eager calls and the graphs of budgets 256 and 1024.
CASES = [("1x196 eager", [196], 196, 196), ("1x196 in budget 256", [196], 1024, 1024),
         ("4x256 in budget 256", [256] * 4, 1024, 1024), ("1x1024 eager", [1024], 1024, 1024),
         ("4x784 in budget 1024", [784] * 4, 4096, 4096), ("1x4096 eager or budget 1024", [4096], 4096, 4096)]
HEADS, HEAD_DIM = 16, 72


def main():
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    for label, seqlens, max_seqlen, rows in CASES:
        q, k, v = (torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bounds = [0]
        for n in seqlens:
            bounds.append(bounds[-1] + n)
        bounds += [bounds[-1]] * (5 - len(bounds))
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
        real = bounds[-1]
        want = aten_flash(q, k, v, cu, max_seqlen, scale)[:real]
        flash = graphed_ms(lambda q=q, k=k, v=v, cu=cu, m=max_seqlen: aten_flash(q, k, v, cu, m, scale))
        gflop = sum(4 * n * n * HEADS * HEAD_DIM for n in seqlens) / 1e9
        row = [f"{label} ({gflop:.1f} GFLOP): flash {flash:.4f} ms ({gflop / flash:.0f} TFLOP/s)"]
        for cfg in CONFIGS:
            try:
                got = launch_varlen_attention(q, k, v, cu, max_seqlen, scale, tiles=cfg)[:real]
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                ms = graphed_ms(lambda c=cfg, q=q, k=k, v=v, cu=cu, m=max_seqlen:
                              launch_varlen_attention(q, k, v, cu, m, scale, tiles=c))
                row.append(f"{cfg}: {ms:.4f} ({gflop / ms:.0f} TFLOP/s, err {err:.1e})")
            except Exception as exc:  # a config that does not fit shared memory is reported, not fatal
                row.append(f"{cfg}: failed {type(exc).__name__}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
