"""Whole replays with the ping-pong kernel's fixed softmax shift against the online softmax, in one process.

Usage: python benchmarks/fixed_shift.py [TOKENS ...] [--rounds N]   (default 1024 and 512, 2 rounds)
For each TOKENS, two graphs of one TOKENS-token image on the same tower and pixels (TRITON_ATTN, one slot:
``replay_gaps.one_image_graph``): one captured as shipped, one with ``gluon_kernel.FIXED_SHIFT_FROM`` raised past
every budget while it is captured (the online softmax and no fixup launch, the kernel before session 13). Their
replays are timed side by side (``measure_interleaved``: 10 warm-ups, 30 rounds in shuffled order), ``--rounds``
times, median / p95 in ms; then the relative L2 difference of each graph's merged embeddings against the
transformers reference (``Qwen3OmniMoeVisionEncoder``, sdpa, same weights and pixels) and, for scale, that of
FLASH_ATTN's eager tower, and the two graphs' difference to each other. The weights are random: the tower
amplifies any rounding difference across its 27 blocks.
"""

from __future__ import annotations

import sys

import torch
from replay_gaps import one_image_graph, preset_tower  # benchmarks/, the script's directory

from hwgraph.attention import gluon_kernel
from hwgraph.bench import kernel_view, warm_device
from hwgraph.budgets import filling_grid
from hwgraph.manager import relative_error
from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference
from hwgraph.timing import measure_interleaved


def main():
    args = sys.argv[1:]
    rounds = 2
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    token_counts = [int(a) for a in args] or [1024, 512]
    dev = torch.device("cuda")
    warm_device(dev)
    print(torch.cuda.get_device_name(), "FIXED_SHIFT_FROM", gluon_kernel.FIXED_SHIFT_FROM, flush=True)
    tower = preset_tower(dev)
    reference = reference_encoder(tower, attn_implementation="sdpa")
    for tokens in token_counts:
        pixels = torch.randn(tokens * 4, 1536, device=dev, dtype=torch.bfloat16)
        shipped = one_image_graph(tower, tokens, pixels)
        saved = gluon_kernel.FIXED_SHIFT_FROM
        gluon_kernel.FIXED_SHIFT_FROM = 1 << 30
        try:
            online = one_image_graph(tower, tokens, pixels)
        finally:
            gluon_kernel.FIXED_SHIFT_FROM = saved
        grid = [filling_grid(tokens, 2)]
        want = run_reference(reference, pixels, grid).embeds.float()
        with torch.inference_mode():
            flash = kernel_view(tower, "FLASH_ATTN").forward(pixels, grid).embeds
        errors = {name: relative_error(got.float(), want) for name, got in
                  (("fixed shift", shipped[3]), ("online softmax", online[3]), ("FLASH_ATTN eager", flash))}
        between = relative_error(shipped[3].float(), online[3].float())
        for r in range(rounds):
            lat = measure_interleaved({"fixed shift": shipped[2].replay, "online softmax": online[2].replay}, dev,
                                      seed=r)
            cells = " | ".join(f"{name} {x.median:.3f} / {x.p95:.3f}" for name, x in lat.items())
            ratio = lat["fixed shift"].median / lat["online softmax"].median
            print(f"1x{tokens} (budget {shipped[1]}) round {r}: {cells} ms ({ratio:.3f}x)", flush=True)
        against = ", ".join(f"{name} {err:.2e}" for name, err in errors.items())
        print(f"1x{tokens}: relative L2 against transformers: {against}; fixed shift against online softmax "
              f"{between:.2e}", flush=True)


if __name__ == "__main__":
    main()
