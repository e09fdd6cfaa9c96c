"""Tower configurations: named presets and the vision config found in any Qwen3-Omni config layout.

The tower is built from transformers' ``Qwen3OmniMoeVisionEncoderConfig`` so that a config written for the
transformers encoder builds the same tower. ``check_config`` rejects what this tower (or transformers) cannot run,
with the offending values named.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeVisionEncoderConfig,
)

VisionConfig = Qwen3OmniMoeVisionEncoderConfig
VISION_MODEL_TYPE = VisionConfig.model_type  # "qwen3_omni_moe_vision_encoder"
# The configs that hold a Qwen3-Omni vision config: the full model's and the thinker's.
OWNER_MODEL_TYPES = (Qwen3OmniMoeConfig.model_type, Qwen3OmniMoeThinkerConfig.model_type)

PRESETS: dict[str, dict] = {
    # The image tower of Qwen/Qwen3-Omni-30B-A3B-{Instruct,Thinking,Captioner}.
    "qwen3-omni-30b-a3b": dict(
        depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, hidden_act="gelu_pytorch_tanh",
        in_channels=3, patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24], out_hidden_size=2048,
    ),
    # Same structure, CPU-fast: tests (the manager's soak test runs it thousands of times) use it.
    "tiny": dict(
        depth=4, hidden_size=64, num_heads=4, intermediate_size=128, hidden_act="gelu_pytorch_tanh",
        in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
        deepstack_visual_indexes=[0, 1, 3], out_hidden_size=32,
    ),
}


def preset_config(name: str, **overrides) -> VisionConfig:
    """The config of preset ``name`` with ``overrides`` (config field names, or the aliases transformers' config
    takes for them: ``num_attention_heads``, ``num_hidden_layers``) applied. An alias and its field given different
    values is a ``ValueError`` naming both (transformers would keep the alias's silently)."""
    if name not in PRESETS:
        raise ValueError(f"unknown tower preset {name!r}; known: {', '.join(PRESETS)}")
    known = set(VisionConfig().to_dict())
    unknown = sorted(set(overrides) - known - set(VisionConfig.attribute_map))
    if unknown:  # the config class would keep a misspelt field and build the preset's value instead
        raise ValueError(f"unknown vision config field(s) {unknown} for preset {name!r}: its fields are "
                         f"{', '.join(sorted(PRESETS[name]))}")
    fields = {}
    for key, value in overrides.items():
        field = VisionConfig.attribute_map.get(key, key)
        if field in fields and fields[field][1] != value:
            pair = sorted([fields[field], (key, value)], key=lambda kv: kv[0] == field)  # the alias first
            (alias, alias_value), (_, field_value) = pair
            raise ValueError(f"{alias}={alias_value!r} and {field}={field_value!r} name the same field ({field}) "
                             f"with different values")
        fields[field] = (key, value)
    return VisionConfig(**{**copy.deepcopy(PRESETS[name]), **{field: value for field, (_, value) in fields.items()}})


def vision_config_from_dict(data: Mapping) -> VisionConfig:
    """The vision config inside a config.json dict: a full Qwen3-Omni config (``thinker_config.vision_config``),
    a config holding ``vision_config``, or a vision-only config. ``ValueError`` naming the model_type for another
    model's: a vision config naming another model_type, or naming none inside a config of another model."""
    data = dict(data)
    owners = []  # the model_types of the configs the vision config sits in
    if isinstance(data.get("thinker_config"), Mapping):
        owners.append(data.get("model_type"))
        data = dict(data["thinker_config"])
    if isinstance(data.get("vision_config"), Mapping):
        owners.append(data.get("model_type"))
        data = dict(data["vision_config"])
    elif "depth" not in data and "num_heads" not in data and data.get("model_type") != VISION_MODEL_TYPE:
        # a config naming the vision encoder's model_type is one, whichever fields it leaves at their defaults
        raise ValueError(f"config of model_type {data.get('model_type')!r} holds no vision config: expected "
                         f"'thinker_config.vision_config', 'vision_config' or vision fields such as 'depth'; "
                         f"keys: {sorted(data)}")
    model_type = data.get("model_type")
    if model_type is not None and model_type != VISION_MODEL_TYPE:
        raise ValueError(f"vision config of model_type {model_type!r}: this tower is Qwen3-Omni's "
                         f"({VISION_MODEL_TYPE!r}); another model's encoder differs in more than its fields")
    foreign = [owner for owner in owners if owner is not None and owner not in OWNER_MODEL_TYPES]
    if model_type is None and foreign:
        # e.g. Qwen2.5-VL's config.json, whose vision_config names no model_type: its fields built a tower silently
        raise ValueError(f"config of model_type {foreign[-1]!r} holds a vision config that names no model_type: this "
                         f"tower is Qwen3-Omni's, whose vision config sits in a config of model_type "
                         f"{' or '.join(map(repr, OWNER_MODEL_TYPES))} or names {VISION_MODEL_TYPE!r} itself")
    return VisionConfig.from_dict(data)


def resolve_config(config) -> VisionConfig:
    """A ``VisionConfig`` from a preset name, a config dict, a vision config, or a full/thinker config object."""
    if isinstance(config, str):
        return preset_config(config)
    if isinstance(config, Mapping):
        return vision_config_from_dict(config)
    for attr in ("thinker_config", "vision_config"):
        config = getattr(config, attr, config)
    if not isinstance(config, VisionConfig):
        raise TypeError(f"expected a preset name, a config dict or a Qwen3OmniMoeVisionEncoderConfig, "
                        f"got {type(config).__name__}")
    return config


def check_config(config: VisionConfig) -> None:
    """``ValueError`` naming the values when the tower cannot be built from ``config``."""
    ints = {name: getattr(config, name) for name in (
        "depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
        "temporal_patch_size", "spatial_merge_size", "num_position_embeddings", "out_hidden_size")}
    bad = {k: v for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0}
    if bad:
        raise ValueError(f"vision config fields must be positive ints, got {bad}")
    if config.hidden_size % config.num_heads:
        raise ValueError(f"hidden_size {config.hidden_size} is not divisible by num_heads {config.num_heads}")
    head_dim = config.hidden_size // config.num_heads
    given = getattr(config, "head_dim", None)
    if given is not None and given != head_dim:
        # the tower's attention, as transformers' vision attention, splits hidden_size evenly; transformers' rotary
        # would read head_dim instead, so the two disagree: refused rather than ignored
        raise ValueError(f"head_dim {given!r} in the vision config differs from hidden_size {config.hidden_size} / "
                         f"num_heads {config.num_heads} = {head_dim}, the width of the tower's attention heads")
    if head_dim % 4:
        # Axial rotary splits each head in two halves, each rotating (row, col) pairs: 4 must divide it.
        raise ValueError(f"head_dim {head_dim} (hidden_size {config.hidden_size} / num_heads {config.num_heads}) "
                         f"must be divisible by 4 for the axial rotary embedding")
    if config.hidden_act not in ("gelu_pytorch_tanh", "gelu"):  # the common ones need no transformers import
        from transformers.activations import ACT2FN

        if config.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not an activation transformers knows: expected one "
                             f"of {', '.join(sorted(ACT2FN))}")
    rope = config.rope_parameters or {}
    theta = rope.get("rope_theta", 1e4)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ValueError(f"rope_parameters['rope_theta'] must be a positive finite number, got {theta!r}")
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"the vision tower supports only axial rope, got rope_type {rope.get('rope_type')!r}")
    indexes = list(config.deepstack_visual_indexes)
    out_of_range = [i for i in indexes if not isinstance(i, int) or not 0 <= i < config.depth]
    if out_of_range or len(set(indexes)) != len(indexes):
        raise ValueError(f"deepstack_visual_indexes {indexes} must be distinct block indexes in "
                         f"0..{config.depth - 1} (depth {config.depth})")
