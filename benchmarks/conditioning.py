"""How much the preset tower's random weights amplify a perturbation of its input: what relative errors of the merged
embeddings, such as ``fp8_products.py``'s, can and cannot say. Runs on the CPU in seconds.

Usage: python benchmarks/conditioning.py [TOKENS]   (default 49)

The tower is ``Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b")`` with its random initialisation (seed 0), one
TOKENS-token image of random pixels. Printed, each as the relative L2 (``hwgraph.budget_capture.relative_error``) of the
merged embeddings:
- the bf16 tower against the float32 tower (what a bf16 path's error against a reference is made of);
- in float32, and in bf16, the tower on the same pixels with one input element, then eight, scaled by 1 + 2^-7 (one
  bf16 ulp), against the tower on the unchanged pixels; beside each, the perturbation's own relative L2, and the
  ratio of the two (the gain).

How to read it: a gain of about 1 in float32 says the function itself is well conditioned. If in bf16 the same
one-ulp change moves the output by about as much as bf16's whole error against float32, then a change anywhere
re-draws the rounding of the whole path: two paths that round differently in a single place then differ by about
their rounding error, whatever their arithmetic (as ``fp8_products.py``'s ``fp8 fused`` and ``fp8`` do).
"""

from __future__ import annotations

import sys

import torch

from hwgraph.budget_capture import relative_error
from hwgraph.budgets import filling_grid
from hwgraph.models.qwen3_omni.tower import Qwen3OmniVisionTower


def perturbed(pixels: torch.Tensor, count: int) -> torch.Tensor:
    """``pixels`` with the first ``count`` values of its first row scaled by 1 + 2^-7, rounded to its dtype."""
    out = pixels.clone()
    out[0, :count] = (out[0, :count].double() * (1 + 2**-7)).to(pixels.dtype)
    return out


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 49
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").eval()
    grid = [filling_grid(tokens, 2)]
    pixels = torch.randn(tokens * 4, tower.patch_row_width)

    def embeds(t, p):
        with torch.inference_mode():
            return t.forward(p, grid).embeds.float()

    outputs = {}
    print(f"1x{tokens}, preset tower, random weights (seed 0), relative L2 of the merged embeddings:", flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        model, base = tower.to(dtype), pixels.to(dtype)
        name = str(dtype).removeprefix("torch.")
        outputs[name] = out = embeds(model, base)
        if dtype != torch.float32:
            print(f"  {name} against float32: {relative_error(out, outputs['float32']):.2e}", flush=True)
        for count in (1, 8):
            changed = perturbed(base, count)
            moved = relative_error(embeds(model, changed), out)
            size = relative_error(changed, base)
            print(f"  {name}, {count} input value(s) changed by one bf16 ulp (relative L2 {size:.1e}): output "
                  f"moves by {moved:.2e}, a gain of {moved / size:.3g}", flush=True)


if __name__ == "__main__":
    main()
