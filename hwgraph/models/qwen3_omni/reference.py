"""The transformers reference encoder, built and called the same way by the tests and the benchmarks.

Its return type changed across transformers 5.x (an output object with ``pooler_output`` and
``deepstack_features`` in 5.24; a tuple in some versions), so ``run_reference`` turns either into ``VisionOutput``.
"""

from __future__ import annotations

import copy

import torch

from hwgraph.models.qwen3_omni.config import resolve_config
from hwgraph.models.qwen3_omni.metadata import normalize_grid
from hwgraph.models.qwen3_omni.output import VisionOutput


def reference_encoder(config_or_tower, dtype: torch.dtype | None = None, device=None,
                      attn_implementation: str | None = None):
    """transformers' ``Qwen3OmniMoeVisionEncoder``: for a tower, with its config and weights (and, unless
    given, its dtype and device); for a config or preset name, randomly initialised.

    Rotary ``inv_freq`` buffers stay float32 after a dtype cast, as after transformers' own ``from_pretrained``
    (a plain ``.to(bfloat16)`` would round them and move the reference away from the model as served).
    """
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    from hwgraph.models.qwen3_omni.tower import Qwen3OmniVisionTower

    tower = config_or_tower if isinstance(config_or_tower, Qwen3OmniVisionTower) else None
    config = copy.deepcopy(tower.config if tower is not None else resolve_config(config_or_tower))
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    if tower is not None:
        dtype = dtype or tower.dtype
        device = device or tower.device
    device = torch.device(device if device is not None else "cpu")
    with torch.device(device):
        encoder = Qwen3OmniMoeVisionEncoder(config)
    float32_buffers = {name: buf.detach().clone() for name, buf in encoder.named_buffers()
                       if buf.dtype == torch.float32 and name.endswith("inv_freq")}
    # Cast first, then load: loading into float32 parameters would round a float64 tower's weights.
    encoder.to(device=device, dtype=dtype)
    if tower is not None:
        encoder.load_state_dict(tower.state_dict(), strict=True)
    for name, buf in float32_buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(encoder.get_submodule(owner), leaf, buf.to(device))
    return encoder.eval()


def as_vision_output(out) -> VisionOutput:
    """``VisionOutput`` from whatever the reference returned: an output object (``pooler_output``,
    ``deepstack_features``), or a tuple ending ``(..., merged, deepstack_list)``."""
    if getattr(out, "pooler_output", None) is not None:
        return VisionOutput(out.pooler_output, tuple(getattr(out, "deepstack_features", None) or ()))
    if isinstance(out, (tuple, list)) and len(out) >= 2 and isinstance(out[-1], (tuple, list)) \
            and isinstance(out[-2], torch.Tensor):
        return VisionOutput(out[-2], tuple(out[-1]))
    raise TypeError(f"cannot read the reference encoder's output: got {type(out).__name__} "
                    f"({[type(x).__name__ for x in out] if isinstance(out, (tuple, list)) else out!r:.200})")


def run_reference(encoder, pixel_values: torch.Tensor, grid_thw) -> VisionOutput:
    """Run the transformers encoder on ``pixel_values`` ``[patches, row width]`` and host ``grid_thw``."""
    grid = normalize_grid(grid_thw, encoder.config.spatial_merge_size)
    param = next(encoder.parameters())
    grid = torch.tensor(grid, dtype=torch.int64, device=param.device)
    with torch.no_grad():
        out = encoder(pixel_values.to(param.device), grid)
    return as_vision_output(out)
