"""Towers, inputs and eager answers for the conformance suite (cached: building the real preset takes seconds)."""

from __future__ import annotations

from functools import lru_cache

import torch

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, VisionOutput

Grid = list[tuple[int, int, int]]


@lru_cache(maxsize=4)
def suite_tower(preset: str, device: str, dtype: torch.dtype, seed: int = 0) -> Qwen3OmniVisionTower:
    """A randomly initialised tower of ``preset`` on ``device`` in ``dtype``, the same for every test."""
    torch.manual_seed(seed)
    with torch.device(device):
        tower = Qwen3OmniVisionTower.from_preset(preset)
    return tower.to(dtype=dtype).eval()


def image_tokens(grid: Grid, merge: int) -> list[int]:
    return [t * h * w // merge**2 for t, h, w in grid]


def pixels_for(tower: Qwen3OmniVisionTower, grid: Grid, seed: int) -> torch.Tensor:
    """``[patches, patch_row_width]`` random pixel rows for ``grid`` on the tower's device and dtype."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, tower.patch_row_width, generator=gen).to(tower.device, tower.dtype)


def eager_per_image(tower: Qwen3OmniVisionTower, pixels: torch.Tensor, grid: Grid) -> list[VisionOutput]:
    """The tower's eager answer for the whole group, split per image (the reference every replay must match)."""
    with torch.inference_mode():
        out = tower.forward(pixels, grid)
    return [o.clone() for o in out.split(image_tokens(grid, tower.spatial_merge_size))]


def grid_of(tokens: int, merge: int, frames: int = 1) -> tuple[int, int, int]:
    """A patch grid ``(frames, h, w)`` with ``tokens`` merged tokens per frame, as square as possible."""
    from hwgraph.budgets import filling_grid

    _, h, w = filling_grid(tokens, merge)
    return (frames, h, w)
