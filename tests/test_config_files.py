"""Config files that from_pretrained and vision_config_from_dict once refused, or refused without naming them."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hwgraph.models.qwen3_omni import from_pretrained
from hwgraph.models.qwen3_omni.config import VISION_MODEL_TYPE, VisionConfig, vision_config_from_dict


def test_a_vision_config_naming_its_model_type_needs_no_other_vision_field():
    """It was refused as "config of model_type 'qwen3_omni_moe_vision_encoder' holds no vision config" unless it
    also held depth or num_heads, though transformers' config takes it and fills in the defaults."""
    config = vision_config_from_dict({"model_type": VISION_MODEL_TYPE, "out_hidden_size": 32})
    assert config.out_hidden_size == 32 and config.depth == VisionConfig().depth
    with pytest.raises(ValueError, match="holds no vision config"):  # another model's config still says so
        vision_config_from_dict({"model_type": "qwen3_omni_moe_text", "hidden_size": 32})


@pytest.mark.parametrize("content, named", [("[1, 2]", r"holds a JSON list \[1, 2\], expected an object"),
                                            ('"x"', r"holds a JSON str 'x', expected an object"),
                                            (b"\xff\xfe{}", r"is not valid JSON: 'utf-8' codec")])
def test_a_config_json_that_is_not_a_json_object_is_refused_naming_the_file(tmp_path, content, named):
    """A list failed in dict() ("cannot convert dictionary update sequence element #0 to a sequence"), a string with
    "dictionary update sequence element #0 has length 1", bytes that are not utf-8 with the codec's error: none
    named the file."""
    config = tmp_path / "config.json"
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=rf"{re.escape(str(config))} {named}"):
        from_pretrained(tmp_path)
    config.write_text(json.dumps({"model_type": "qwen3_omni_moe_text"}))  # an object goes on to the config check
    with pytest.raises(ValueError, match="holds no vision config"):
        from_pretrained(tmp_path)


def test_a_device_without_an_index_is_read_as_the_current_one_for_every_tensor(tmp_path, monkeypatch):
    """safetensors reads a bare "cuda" as cuda:0 and torch as the current device: with another device current, the
    weights went to cuda:0 and the rotary frequencies to the current one."""
    from hwgraph import platform
    from hwgraph.models.qwen3_omni import loading

    class Runtime:
        @staticmethod
        def current_device():
            return 1

    read = []

    def read_vision_tensors(folder, expected, device, dtype):
        read.append(device)
        raise LookupError("stop after the read's arguments")

    config = {"model_type": VISION_MODEL_TYPE, "depth": 1, "deepstack_visual_indexes": [0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(platform, "checked_device", lambda spec, *args: torch.device(spec))
    monkeypatch.setattr(platform, "device_runtime", lambda device: Runtime)
    monkeypatch.setattr(loading, "read_vision_tensors", read_vision_tensors)
    with pytest.raises(LookupError):
        from_pretrained(tmp_path, device="cuda")
    assert read == [torch.device("cuda", 1)]
