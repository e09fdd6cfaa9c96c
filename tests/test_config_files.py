"""Config files that from_pretrained and vision_config_from_dict once refused, or refused without naming them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

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


# Qwen2.5-VL-7B's vision fields in a vision_config that names no model_type of its own.
QWEN2_5_VL_VISION = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                     "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                     "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                     "tokens_per_second": 2, "temporal_patch_size": 2}


@pytest.mark.parametrize("config, named", [
    ({"model_type": "qwen2_5_vl", "vision_config": QWEN2_5_VL_VISION}, "qwen2_5_vl"),
    ({"model_type": "qwen2_5_omni", "thinker_config": {"model_type": "qwen2_5_omni_thinker",
                                                       "vision_config": {"depth": 2, "num_heads": 2}}},
     "qwen2_5_omni_thinker"),
])
def test_another_models_config_is_refused_though_its_vision_config_names_no_model_type(tmp_path, config, named):
    """Only the vision config's own model_type was checked: a Qwen2.5-VL config whose vision_config names none built a
    Qwen3-Omni tower of Qwen2.5-VL's fields (hidden 1280, patch 14, SiLU) without a word, and from_pretrained went on
    to its tensors, while the same fields with model_type 'qwen2_5_vl' beside them were refused."""
    match = rf"config of model_type '{named}' holds a vision config that names no model_type: this tower is Qwen3-Omni"
    with pytest.raises(ValueError, match=match):
        vision_config_from_dict(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path)
    for owner in ("qwen3_omni_moe", "qwen3_omni_moe_thinker", None):  # Qwen3-Omni's own layouts still read
        outer = {"vision_config": {"depth": 2, "num_heads": 2}} | ({"model_type": owner} if owner else {})
        assert vision_config_from_dict({"model_type": "qwen3_omni_moe", "thinker_config": outer}).depth == 2
        assert vision_config_from_dict(outer).depth == 2


def test_config_and_index_are_read_as_utf_8_whatever_the_locale(tmp_path):
    """JSON files are UTF-8 (transformers reads them so), but they were read in the locale's encoding: under a C locale
    a config.json or an index holding one non-ASCII character was refused as "is not valid JSON: 'ascii' codec
    can't decode byte 0xc3"."""
    from safetensors.torch import save_file

    from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, preset_config

    state = {k: v.contiguous() for k, v in Qwen3OmniVisionTower.from_preset("tiny").state_dict().items()}
    vision = dict(preset_config("tiny").to_dict(), _name_or_path="/modèles/qwen3-omni")
    (tmp_path / "config.json").write_text(json.dumps(vision, ensure_ascii=False), encoding="utf-8")
    save_file(state, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"source": "modèles"}, "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index, ensure_ascii=False), encoding="utf-8")
    code = ("import sys; from hwgraph.models.qwen3_omni import from_pretrained; "
            "print(from_pretrained(sys.argv[1]).out_hidden_size)")
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         encoding="utf-8", errors="replace", timeout=300)
    assert run.returncode == 0 and run.stdout.split() == [str(vision["out_hidden_size"])], run.stderr[-2000:]
