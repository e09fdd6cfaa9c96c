"""Whole replays of the shipped tower against the same tower with one kernel choice switched off, in one process.

Usage: python benchmarks/replay_toggle.py TOGGLE [TOKENS ...] [--rounds N]   (default 1024 and 512, 2 rounds)
TOGGLE is ``gluon-at:REV`` (TRITON_ATTN's Gluon kernels of commit ``REV``, loaded as ``attention_ab.py`` does,
against the working tree's) or one of ``TOGGLES``:
- ``fixed-shift``: the ping-pong kernel's fixed softmax shift (session 13) against the online softmax, with
  ``gluon_kernel.FIXED_SHIFT_FROM`` raised past every budget (no fixup launch either);
- ``mma-row-sum``: the ping-pong kernel's row sums on the tensor cores (session 14, ``gluon_kernel.sum_lane``)
  against the consumers' adds;
- ``out-tma``: the ping-pong kernel's output stored by TMA through the q buffer (session 14,
  ``gluon_kernel.OUT_TMA``) against pointer stores from the MMA layout;
- ``rotary-warps``: the rotary kernel with 8 warps per program (session 15, ``fused.rotary_warps``) against
  Triton's default 4;
- ``fc1-row-split``: fc1 + GELU in one cuBLAS call (shipped) against two, the last 256 rows in the second, for
  graphs of at least 2048 rows (``benchmarks/gemm_split.py``: 67.8 against 73.2 µs at 4096 rows; not shipped);
- ``wide-tiles``: the ping-pong kernel on 256-row q tiles from ``gluon_kernel.PINGPONG_WIDE_FROM`` rows (session
  16, ``PINGPONG_WIDE_TILES``; 4096 since 2048 measured slower) against 128-row tiles (``PINGPONG_TILES``) at
  every size;
- ``residual-in-gemm``: the shipped block against ``residual_gemm.block_forward_in_place`` (proj and fc2 add into
  the residual in place, cuBLAS beta = 1, their biases added by the LayerNorm kernels; not shipped).
- ``measured-products``: every product through the CUDA plugin's ``MeasuredProducts`` (per shape, the measured
  fastest of cuBLASLt's candidates; ``EncoderGraphManager(measure_products=True)``) against ATen's calls.
- ``merger-overlap``: the DeepStack mergers in line from ``tower.OVERLAP_MAX_ROWS`` rows (shipped; session 6
  measured overlap 0.4-0.5% slower from 1024 rows, with that session's kernels) against the mergers on their side
  stream at every size (``Qwen3OmniVisionTower.merge_stream``). Below that row count both graphs overlap.
For each TOKENS, two graphs of one TOKENS-token image on the same tower and pixels (TRITON_ATTN, one slot:
``replay_gaps.one_image_graph``): one captured as shipped, one with the toggle off while it is captured. Their
replays are timed side by side (``measure_interleaved``: 10 warm-ups, 30 rounds in shuffled order), ``--rounds``
times, median / p95 in ms; then the relative L2 difference of each graph's merged embeddings against the
transformers reference (``Qwen3OmniMoeVisionEncoder``, sdpa, same weights and pixels) and, for scale, that of
FLASH_ATTN's eager tower, and the two graphs' difference to each other. The weights are random: the tower
amplifies any rounding difference across its 27 blocks.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import torch
from replay_gaps import one_image_graph, preset_tower  # benchmarks/, the script's directory

from hwgraph import products
from hwgraph.attention import gluon_kernel
from hwgraph.bench import kernel_view, warm_device
from hwgraph.budget_capture import relative_error
from hwgraph.budgets import filling_grid
from hwgraph.models.qwen3_omni import fused, layers
from hwgraph.models.qwen3_omni import tower as tower_module
from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference
from hwgraph.timing import measure_interleaved


@contextlib.contextmanager
def patched(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


# name -> (label of the shipped graph, label of the other, context manager that switches the choice off)
TOGGLES = {
    "fixed-shift": ("fixed shift", "online softmax", lambda: patched(gluon_kernel, "FIXED_SHIFT_FROM", 1 << 30)),
    "mma-row-sum": ("row sums on tensor cores", "row sums added",
                    lambda: patched(gluon_kernel, "sum_lane", lambda head_dim: -1)),
    "out-tma": ("output by TMA", "output by pointer stores", lambda: patched(gluon_kernel, "OUT_TMA", False)),
    "rotary-warps": ("rotary with 8 warps", "rotary with 4 warps",
                     lambda: patched(fused, "rotary_warps", lambda heads, head_dim: 4)),
    "fc1-row-split": ("fc1 in one call", "fc1 in two calls", lambda: patched(layers, "linear_gelu_tanh", fc1_split)),
    "wide-tiles": ("256-row q tiles", "128-row q tiles", lambda: patched(gluon_kernel, "PINGPONG_WIDE_FROM", 1 << 30)),
    "residual-in-gemm": ("shipped", "residual in the products",
                         lambda: patched(layers.VisionBlock, "forward_fused", residual_in_gemm())),
    "measured-products": ("ATen's cuBLASLt algorithms", "measured cuBLASLt algorithms", lambda: measured_products()),
    "merger-overlap": ("mergers as shipped", "mergers overlapped at every size",
                       lambda: patched(tower_module, "OVERLAP_MAX_ROWS", 1 << 30)),
}


@contextlib.contextmanager
def measured_products():
    """The products through the CUDA plugin's chooser (``EncoderGraphManager(measure_products=True)``'s)."""
    from hwgraph_cuda.products import measured_products as chooser

    with products.chosen_by(chooser(torch.cuda.current_device())):
        yield


def residual_in_gemm():
    from residual_gemm import block_forward_in_place  # benchmarks/, the script's directory

    return block_forward_in_place


def fc1_split(x: torch.Tensor, linear: torch.nn.Linear, tail: int = 256) -> torch.Tensor:
    """``fused.linear_gelu_tanh`` with the last ``tail`` rows in a second cuBLAS call, from 2048 rows."""
    if x.shape[0] < 2048:
        return fused.linear_gelu_tanh(x, linear)
    out = x.new_empty(x.shape[0], linear.out_features)
    head = x.shape[0] - tail
    for rows in (slice(0, head), slice(head, None)):
        torch._addmm_activation(linear.bias, x[rows], linear.weight.t(), use_gelu=True, out=out[rows])
    return out


def gluon_at(rev: str):
    """The toggle that swaps in commit ``rev``'s ``launch_gluon_attention`` (with its own kernels and choices)."""
    from attention_ab import base_module  # benchmarks/, the script's directory

    folder = Path(tempfile.mkdtemp())
    base = base_module(rev, folder)
    return ("working tree", f"Gluon kernels of {rev}",
            lambda: patched(gluon_kernel, "launch_gluon_attention", base.launch_gluon_attention))


def run(toggle: str, token_counts: list[int], rounds: int) -> None:
    if toggle.startswith("gluon-at:"):
        shipped_name, other_name, switched_off = gluon_at(toggle.split(":", 1)[1])
    else:
        shipped_name, other_name, switched_off = TOGGLES[toggle]
    dev = torch.device("cuda")
    warm_device(dev)
    print(torch.cuda.get_device_name(), "toggle", toggle, flush=True)
    tower = preset_tower(dev)
    reference = reference_encoder(tower, attn_implementation="sdpa")
    for tokens in token_counts:
        pixels = torch.randn(tokens * 4, 1536, device=dev, dtype=torch.bfloat16)
        shipped = one_image_graph(tower, tokens, pixels)
        with switched_off():
            other = one_image_graph(tower, tokens, pixels)
        grid = [filling_grid(tokens, 2)]
        want = run_reference(reference, pixels, grid).embeds.float()
        with torch.inference_mode():
            flash = kernel_view(tower, "FLASH_ATTN").forward(pixels, grid).embeds
        errors = {name: relative_error(got.float(), want) for name, got in
                  ((shipped_name, shipped[3]), (other_name, other[3]), ("FLASH_ATTN eager", flash))}
        between = relative_error(shipped[3].float(), other[3].float())
        for r in range(rounds):
            lat = measure_interleaved({shipped_name: shipped[2].replay, other_name: other[2].replay}, dev, seed=r)
            cells = " | ".join(f"{name} {x.median:.3f} / {x.p95:.3f}" for name, x in lat.items())
            ratio = lat[shipped_name].median / lat[other_name].median
            print(f"1x{tokens} (budget {shipped[1]}) round {r}: {cells} ms ({ratio:.3f}x)", flush=True)
        against = ", ".join(f"{name} {err:.2e}" for name, err in errors.items())
        print(f"1x{tokens}: relative L2 against transformers: {against}; {shipped_name} against {other_name} "
              f"{between:.2e}", flush=True)


def main():
    args = sys.argv[1:]
    if not args or not (args[0] in TOGGLES or args[0].startswith("gluon-at:")):
        raise SystemExit(f"usage: replay_toggle.py {{{'|'.join(TOGGLES)}|gluon-at:REV}} [TOKENS ...] [--rounds N]")
    toggle, args = args[0], args[1:]
    rounds = 2
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    run(toggle, [int(a) for a in args] or [1024, 512], rounds)


if __name__ == "__main__":
    main()
