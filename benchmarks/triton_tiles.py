"""Tile sizes for TRITON_ATTN on this GPU, against FLASH_ATTN, at the tower's shapes (16 heads, head_dim 72, bf16).

Usage: python benchmarks/triton_tiles.py. Prints median ms (CUDA events, 10 warm-ups, 30 samples) per config for one
sequence of 196, 1024 and 4096 patches, checking each config against FLASH_ATTN's output.
"""

import torch
from hwgraph_cuda.attention import flash_varlen

from hwgraph.attention.triton_kernel import launch_varlen_attention
from hwgraph.timing import measure

CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 2),
           (128, 32, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 2), (256, 64, 8, 2)]


def main():
    torch.manual_seed(0)
    for tokens in (196, 1024, 4096):
        q, k, v = (torch.randn(tokens, 16, 72, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
        want = flash_varlen(q, k, v, cu, tokens, 72**-0.5)
        flash = measure(lambda q=q, k=k, v=v, cu=cu, n=tokens: flash_varlen(q, k, v, cu, n, 72**-0.5), "cuda").median
        flops = 4 * tokens * tokens * 16 * 72 / 1e9  # q.k and p.v, 16 heads of 72: GFLOP, so GFLOP / ms = TFLOP/s
        row = [f"{tokens:5d} patches ({flops:.1f} GFLOP): FLASH {flash:.3f} ({flops / flash:.0f} TFLOP/s)"]
        for cfg in CONFIGS:
            try:
                got = launch_varlen_attention(q, k, v, cu, tokens, 72**-0.5, tiles=cfg)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                ms = measure(lambda c=cfg, q=q, k=k, v=v, cu=cu, n=tokens:
                             launch_varlen_attention(q, k, v, cu, n, 72**-0.5, tiles=c), "cuda").median
                row.append(f"{cfg}: {ms:.3f} ({flops / ms:.0f} TFLOP/s, err {err:.1e})")
            except Exception as exc:  # a config that does not fit shared memory is reported, not fatal
                row.append(f"{cfg}: failed {type(exc).__name__}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
