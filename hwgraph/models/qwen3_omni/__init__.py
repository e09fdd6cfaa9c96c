"""The graph-ready Qwen3-Omni image tower: host metadata, device-only forward, weight loading."""

from hwgraph.models.qwen3_omni.config import PRESETS, preset_config
from hwgraph.models.qwen3_omni.loading import CheckpointError, from_pretrained
from hwgraph.models.qwen3_omni.metadata import VisionMetadata, prepare_metadata
from hwgraph.models.qwen3_omni.output import VisionOutput
from hwgraph.models.qwen3_omni.tower import Qwen3OmniVisionTower

__all__ = ["PRESETS", "CheckpointError", "Qwen3OmniVisionTower", "VisionMetadata", "VisionOutput",
           "from_pretrained", "prepare_metadata", "preset_config"]
