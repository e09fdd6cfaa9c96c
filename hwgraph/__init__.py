"""hwgraph: portable device-graph capture and replay for multimodal encoders.

Importing hwgraph imports torch and nothing vendor-specific; backends and kernels load when chosen.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "EncoderGraphManager": "hwgraph.manager",
    "Qwen3OmniVisionTower": "hwgraph.models.qwen3_omni",
    "VisionOutput": "hwgraph.models.qwen3_omni",
    "detect": "hwgraph.platform",
    "Capability": "hwgraph.capability",
}


def __getattr__(name: str):
    # Only the names above are lazy; anything else is a real AttributeError (no catch-all forwarding).
    if name not in _LAZY:
        raise AttributeError(f"module 'hwgraph' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = sorted(_LAZY)
