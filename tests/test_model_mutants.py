"""Tower behaviours a hand-made mutation audit of the model (tower, layers, fused fallbacks, metadata, loading,
config, reference, output, dtypes) found unchecked: the config's rope_theta, the bf16 position-embedding blend,
non-float pixels and dtypes refused, duplicate DeepStack indexes and non-axial rope refused, full config objects,
vision-only configs, shards without an index, the checkpoint prefix tie rule, ``is_padded`` for sequence slots,
``VisionOutput.split``/``clone``, and the fp16 position-embedding kernel under the Triton interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, VisionOutput, from_pretrained, preset_config
from hwgraph.models.qwen3_omni.config import vision_config_from_dict
from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def masked_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """Sync-free varlen attention: a block-diagonal mask from cu_seqlens; rows past cu_seqlens[-1] give zeros."""
    rows = torch.arange(q.shape[0], device=q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens[1:], rows, right=True)
    valid = rows < cu_seqlens[-1]
    mask = (seq[:, None] == seq[None, :]) & valid[:, None] & valid[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale).transpose(0, 1)
    return torch.where(valid[:, None, None], out, 0.0)


def perturbed(tower: Qwen3OmniVisionTower, seed: int = 0) -> Qwen3OmniVisionTower:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return tower.eval()


def pixels_for(tower, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def assert_same_output(got: VisionOutput, want: VisionOutput, **tol):
    torch.testing.assert_close(got.embeds, want.embeds, **tol)
    assert len(got.deepstack) == len(want.deepstack)
    for g, w in zip(got.deepstack, want.deepstack, strict=True):
        torch.testing.assert_close(g, w, **tol)


def save_checkpoint(folder, tensors: dict, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# ---------------------------------------------------------------------------------------------- numerics
def test_a_configured_rope_theta_is_used_as_transformers_uses_it():
    config = preset_config("tiny", rope_parameters={"rope_type": "axial", "rope_theta": 100.0})
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower(config, attention=masked_attention))
    grid = [(1, 8, 12)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(tower(pixels, grid), run_reference(reference_encoder(tower), pixels, grid))


def test_bfloat16_position_embedding_blend_equals_transformers_bit_for_bit():
    """transformers blends the bf16 table rows with float32 weights (float32 products and sum), then rounds once.
    The input of the first block's norm1 (patch embedding + position embedding) must match it exactly."""
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)).to(torch.bfloat16)
    reference = reference_encoder(tower)
    seen = {}
    hooks = [module.blocks[0].norm1.register_forward_pre_hook(
        lambda mod, args, name=name: seen.__setitem__(name, args[0].detach().clone()))
        for name, module in (("ours", tower), ("theirs", reference))]
    grid = [(1, 8, 12), (1, 20, 18)]
    pixels = pixels_for(tower, grid)
    try:
        with torch.no_grad():
            tower(pixels, grid)
            run_reference(reference, pixels, grid)
    finally:
        for h in hooks:
            h.remove()
    assert seen["ours"].dtype == torch.bfloat16
    torch.testing.assert_close(seen["ours"], seen["theirs"], rtol=0, atol=0)


FP16_POSITION_CHILD = textwrap.dedent("""
    import os, sys, types
    import torch
    import hwgraph.models

    # The kernels without the package's __init__ (it imports transformers: most of this child's start-up time).
    package = types.ModuleType("hwgraph.models.qwen3_omni")
    package.__path__ = [os.path.join(os.path.dirname(hwgraph.models.__file__), "qwen3_omni")]
    sys.modules[package.__name__] = package
    from hwgraph.models.qwen3_omni import fused

    assert fused.use_triton(torch.empty(1)), "the interpreter path must be active in this child"
    torch.manual_seed(0)
    table, x = torch.randn(16, 32).half(), torch.randn(9, 32).half()
    indices, weights = torch.randint(0, 16, (4, 9)), torch.rand(4, 9)
    got = fused.add_position_embedding(x, table, indices, weights)
    torch.testing.assert_close(got, fused.add_position_embedding_reference(x, table, indices, weights),
                               rtol=0, atol=0)
    print("fp16 position ok")
""")


def test_the_position_embedding_kernel_rounds_the_blend_before_the_add_in_float16():
    """The interpreter converts float32 to float16 by rounding (as the GPU does; bf16 it truncates), so fp16 checks
    the kernel bit for bit on the CPU: the blend is rounded to the activation dtype before the add, as unfused."""
    pytest.importorskip("triton", reason="the position-embedding kernel needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1", HWGRAPH_FUSED="1")
    done = subprocess.run([sys.executable, "-c", FP16_POSITION_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "fp16 position ok" in done.stdout


# ---------------------------------------------------------------------------------------------- inputs
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_integer_pixels_are_refused_not_cast(dtype):
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)
    with pytest.raises(ValueError, match=f"floating-point torch.Tensor.*of {dtype}"):
        tower(torch.zeros(64, tower.patch_row_width, dtype=dtype), [(1, 8, 8)])


def test_metadata_padded_with_sequence_slots_only_is_padded():
    meta = Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata([(1, 4, 4), (2, 2, 4)])
    assert not meta.padded(meta.num_rows, meta.num_seqs).is_padded
    slots_only = meta.padded(meta.num_rows, meta.num_seqs + 2)
    assert slots_only.num_rows == meta.num_rows and slots_only.is_padded


# ---------------------------------------------------------------------------------------------- config
def test_duplicate_deepstack_indexes_are_refused():
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[1, 1\] must be distinct"):
        Qwen3OmniVisionTower.from_preset("tiny", deepstack_visual_indexes=[1, 1])


def test_a_config_json_with_non_axial_rope_is_refused_as_transformers_refuses_it():
    config = vision_config_from_dict(dict(preset_config("tiny").to_dict(),
                                          rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ValueError, match="supports only axial rope"):
        reference_encoder(config)
    with pytest.raises(ValueError, match="only axial rope, got rope_type 'linear'"):
        Qwen3OmniVisionTower(config)


def test_a_full_or_thinker_config_object_builds_the_tower_of_its_vision_config():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

    vision = preset_config("tiny", depth=2, deepstack_visual_indexes=[1])
    full = Qwen3OmniMoeConfig(thinker_config={"vision_config": vision.to_dict()})
    for config in (full, full.thinker_config):
        with torch.device("meta"):
            tower = Qwen3OmniVisionTower(config)
        assert tower.config.to_dict() == full.thinker_config.vision_config.to_dict()
        assert len(tower.blocks) == 2 and tower.deepstack_visual_indexes == (1,)


@pytest.mark.parametrize("fields", [{"depth": 2}, {"num_heads": 4}])
def test_a_vision_only_config_needs_only_one_vision_field(fields):
    config = vision_config_from_dict(fields)
    assert all(getattr(config, k) == v for k, v in fields.items())


# ---------------------------------------------------------------------------------------------- loading
@pytest.fixture(scope="module")
def source():
    torch.manual_seed(4)
    tower = perturbed(Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention))
    return tower, {k: v.contiguous() for k, v in tower.state_dict().items()}, tower.config.to_dict()


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
def test_from_pretrained_refuses_a_dtype_object_that_is_not_floating_point(tmp_path, source, dtype):
    _, state, vision = source
    folder = save_checkpoint(tmp_path / "ckpt", state, vision)
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        from_pretrained(folder, dtype=dtype)


def test_from_pretrained_reads_every_safetensors_file_of_a_folder_without_an_index(tmp_path, source):
    tower, state, vision = source
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(vision))
    names = sorted(state)
    for i in range(3):
        save_file({n: state[n] for n in names[i::3]}, str(folder / f"part-{i}.safetensors"))
    loaded = from_pretrained(folder, attention=masked_attention)
    grid = [(1, 4, 6)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(loaded(pixels, grid), tower(pixels, grid), rtol=0, atol=0)


def test_from_pretrained_prefers_the_most_specific_prefix_when_two_hold_the_whole_tower(tmp_path, source):
    tower, state, vision = source
    tensors = {f"thinker.visual.{k}": v for k, v in state.items()}
    tensors.update((f"visual.{k}", torch.zeros_like(v)) for k, v in state.items())
    loaded = from_pretrained(save_checkpoint(tmp_path / "ckpt", tensors, vision), attention=masked_attention)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- output
def test_split_refuses_negative_token_counts():
    out = VisionOutput(torch.zeros(6, 2), (torch.zeros(6, 2),))
    with pytest.raises(ValueError, match=r"token counts \[-1, 4\]"):
        out.split([-1, 4])


def test_clone_copies_the_deepstack_features_too():
    out = VisionOutput(torch.zeros(4, 2), (torch.zeros(4, 2), torch.ones(4, 2)))
    copy = out.clone()
    for original, cloned in zip(out.tensors(), copy.tensors(), strict=True):
        assert cloned.data_ptr() != original.data_ptr()
        torch.testing.assert_close(cloned, original, rtol=0, atol=0)
    for t in out.tensors():
        t.fill_(5.0)
    assert not any((t == 5.0).any() for t in copy.tensors())
