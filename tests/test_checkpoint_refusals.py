"""from_pretrained's refusals of checkpoints whose tensors the tower cannot take as they are, each named."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from hwgraph.models.qwen3_omni import CheckpointError, Qwen3OmniVisionTower, from_pretrained, preset_config


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in Qwen3OmniVisionTower.from_preset("tiny").state_dict().items()}


def write_checkpoint(folder, tensors: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(preset_config("tiny").to_dict()))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_float8_checkpoint_is_refused_without_a_dtype_and_cast_with_one(tmp_path, state):
    """It built a float8 tower without a word; its first forward failed choosing an attention kernel."""
    folder = write_checkpoint(tmp_path / "fp8", {k: v.to(torch.float8_e4m3fn) for k, v in state.items()})
    with pytest.raises(CheckpointError, match=r"holds the tower's tensors in float8_e4m3fn, which the tower does not "
                                              r"run in: pass dtype="):
        from_pretrained(folder)
    loaded = from_pretrained(folder, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.pos_embed.weight,
                               state["pos_embed.weight"].to(torch.float8_e4m3fn).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_integer_tensors_are_refused_naming_them_not_cast(tmp_path, state, dtype):
    """With a dtype their raw integers became the weights silently; without, load_state_dict's RuntimeError ("Only
    Tensors of floating point ... can require gradients") did not say the checkpoint was the problem."""
    tensors = dict(state, **{"pos_embed.weight": state["pos_embed.weight"].to(torch.int8)})
    folder = write_checkpoint(tmp_path / "int8", tensors)
    with pytest.raises(CheckpointError, match=r"not floating point \(a quantized checkpoint\?\): "
                                              r"pos_embed\.weight \(int8\)$"):
        from_pretrained(folder, dtype=dtype)


def test_an_index_that_names_a_file_lacking_the_tensor_is_refused_naming_the_file(tmp_path, state):
    """safetensors' own error ("File does not contain tensor ...") named neither the file nor the index."""
    folder = write_checkpoint(tmp_path / "ckpt", state)
    names = sorted(state)
    save_file({n: state[n] for n in names[:3]}, str(folder / "part-a.safetensors"))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "part-a.safetensors" for n in names[:5]}
                                 | {n: "model.safetensors" for n in names[5:]}}))
    expected = (f"{index} maps 2 tensor(s) to part-a.safetensors, which does not hold them: "
                f"[{', '.join(names[3:5])}]")
    with pytest.raises(CheckpointError, match=f"^{re.escape(expected)}$"):
        from_pretrained(folder)
