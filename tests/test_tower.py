"""The Qwen3-Omni image tower against transformers' encoder: outputs, names, config, loading, metadata, sync-freedom."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from hwgraph.graphs.base import HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.models.qwen3_omni import (
    PRESETS,
    CheckpointError,
    Qwen3OmniVisionTower,
    VisionOutput,
    from_pretrained,
    preset_config,
)
from hwgraph.models.qwen3_omni.config import vision_config_from_dict
from hwgraph.models.qwen3_omni.reference import as_vision_output, reference_encoder, run_reference
from hwgraph.models.qwen3_omni.tower import OVERLAP_MAX_ROWS

pytestmark = pytest.mark.usefixtures("one_thread")


def masked_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """A sync-free varlen attention for these tests: a block-diagonal mask built on the device from cu_seqlens;
    rows past cu_seqlens[-1] give zeros (the kernel contract)."""
    rows = torch.arange(q.shape[0], device=q.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens[1:], rows, right=True)
    valid = rows < cu_seqlens[-1]
    mask = (seq[:, None] == seq[None, :]) & valid[:, None] & valid[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale).transpose(0, 1)
    return torch.where(valid[:, None, None], out, 0.0)


# A second config that differs from "tiny" in every dimension the forward depends on: heads, head_dim, depth,
# MLP activation, patch size, position-table side, out hidden, and unsorted DeepStack indexes.
SMALL = dict(depth=3, hidden_size=96, num_heads=3, intermediate_size=80, hidden_act="gelu", in_channels=3,
             patch_size=2, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36,
             deepstack_visual_indexes=[2, 0], out_hidden_size=48)
CONFIGS = {"tiny": preset_config("tiny"), "small": preset_config("tiny", **SMALL)}

GRIDS = {
    "one image": [(1, 8, 8)],
    "several sizes": [(1, 4, 4), (1, 8, 12), (1, 2, 2)],
    "non-square": [(1, 6, 14), (1, 12, 4)],
    "video frames": [(2, 4, 6)],
    "mixed": [(2, 8, 4), (1, 10, 6), (3, 2, 4)],
    "larger than the position table": [(1, 20, 18)],
}


def perturbed(tower: Qwen3OmniVisionTower, seed: int = 0) -> Qwen3OmniVisionTower:
    """Norm weights of 1 and biases of 0 would hide a swapped or skipped norm: make every tensor distinct."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return tower.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower(CONFIGS[request.param], attention=masked_attention))
    return tower, reference_encoder(tower)


def pixels_for(tower, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def assert_same_output(got: VisionOutput, want: VisionOutput, **tol):
    torch.testing.assert_close(got.embeds, want.embeds, **tol)
    assert len(got.deepstack) == len(want.deepstack)
    for i, (g, w) in enumerate(zip(got.deepstack, want.deepstack, strict=True)):
        torch.testing.assert_close(g, w, msg=lambda m, i=i: f"DeepStack feature {i}: {m}", **tol)


# ---------------------------------------------------------------------------------------------- equality
@pytest.mark.parametrize("grid", list(GRIDS.values()), ids=list(GRIDS))
def test_forward_equals_transformers_for_merged_output_and_every_deepstack_feature(pair, grid):
    tower, reference = pair
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        got, want = tower(pixels, grid), run_reference(reference, pixels, grid)
    assert got.embeds.shape == (sum(t * h * w for t, h, w in grid) // 4, tower.out_hidden_size)
    assert len(got.deepstack) == tower.num_deepstack
    assert_same_output(got, want)


def test_grid_as_int_tensor_or_array_gives_the_same_output(pair):
    tower, _ = pair
    grid = [(1, 4, 6), (2, 2, 4)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        want = tower(pixels, grid)
        # a list of 1-D tensors (one per image) was refused as "not a (t, h, w) row"
        for form in (torch.tensor(grid), np.array(grid, dtype=np.int32), [torch.tensor(row) for row in grid]):
            assert_same_output(tower(pixels, form), want, rtol=0, atol=0)


def test_split_returns_each_images_rows(pair):
    tower, _ = pair
    grid = [(1, 4, 4), (1, 8, 12), (2, 2, 2)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        whole = tower(pixels, grid)
        parts = whole.split(tower.prepare_metadata(grid).token_counts)
        alone = tower(pixels[16:112], [grid[1]])
    assert [p.num_tokens for p in parts] == [4, 24, 2]
    assert_same_output(parts[1], alone)
    with pytest.raises(ValueError, match="do not fit"):
        whole.split([4, 24, 3])


def test_metadata_equals_transformers_vision_helpers_bit_for_bit():
    utils = pytest.importorskip("transformers.vision_utils")
    if not hasattr(utils, "get_vision_interpolation_indices_and_weights"):
        pytest.skip("this transformers has no get_vision_interpolation_indices_and_weights")
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    grid = [(1, 8, 8), (2, 6, 4), (1, 2, 30), (1, 16, 2)]
    meta = tower.prepare_metadata(grid)
    grid_t = torch.tensor(grid)
    indices, weights = utils.get_vision_interpolation_indices_and_weights(
        grid_t, tower.num_grid_per_side, mode="bilinear", align_corners=True, spatial_merge_size=2)
    torch.testing.assert_close(meta.pos_indices, indices.T, rtol=0, atol=0)
    torch.testing.assert_close(meta.pos_weights, weights.T, rtol=0, atol=0)
    torch.testing.assert_close(meta.rotary_positions, utils.get_vision_position_ids(grid_t, 2), rtol=0, atol=0)
    torch.testing.assert_close(meta.cu_seqlens, utils.get_vision_cu_seqlens(grid_t), rtol=0, atol=0)
    assert meta.max_seqlen == 64 and meta.patch_counts == (64, 48, 60, 32) and meta.token_counts == (16, 12, 15, 8)


def test_bfloat16_tower_stays_close_to_the_bfloat16_reference():
    torch.manual_seed(1)
    tower = perturbed(Qwen3OmniVisionTower(CONFIGS["tiny"], attention=masked_attention)).to(torch.bfloat16)
    assert tower.rotary_pos_emb.inv_freq.dtype == torch.float32  # never rounded by the cast
    reference = reference_encoder(tower)
    assert reference.rotary_pos_emb.inv_freq.dtype == torch.float32
    grid = [(1, 8, 8), (1, 4, 6)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        got, want = tower(pixels, grid), run_reference(reference, pixels, grid)
    assert got.embeds.dtype == torch.bfloat16
    scale = want.embeds.float().abs().max().item()
    for g, w in zip(got.tensors(), want.tensors(), strict=True):
        assert (g.float() - w.float()).abs().max().item() <= 0.05 * scale


def test_reference_encoder_from_a_preset_name_runs():
    reference = reference_encoder("tiny")
    grid = [(1, 4, 4)]
    out = run_reference(reference, torch.randn(16, 96), grid)
    assert out.embeds.shape == (4, 32) and len(out.deepstack) == 3


def test_reference_output_adapter_reads_objects_and_tuples():
    merged, deep = torch.zeros(2, 3), [torch.ones(2, 3)]

    class Obj:
        pooler_output, deepstack_features = merged, deep

    for out in (Obj(), (torch.zeros(8, 5), merged, deep), (merged, deep)):
        got = as_vision_output(out)
        assert got.embeds is merged and got.deepstack == (deep[0],)
    with pytest.raises(TypeError, match="cannot read"):
        as_vision_output(merged)


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


# ---------------------------------------------------------------------------------------------- names and sizes
@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_names_and_shapes_equal_transformers(name):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    with torch.device("meta"):
        ours = Qwen3OmniVisionTower(CONFIGS[name]).state_dict()
        theirs = Qwen3OmniMoeVisionEncoder(CONFIGS[name]).state_dict()
    assert list(ours) == list(theirs)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert not any("inv_freq" in k for k in ours)


@pytest.mark.parametrize("act", ["prelu", "xielu"])
def test_an_activation_with_weights_has_transformers_names_and_a_transformers_state_dict_loads(act):
    """The block MLP's activation was ``mlp.act``, transformers' is ``mlp.act_fn``: with an activation that has
    weights (PReLU's slope, xIELU's alphas), which ``check_config`` accepts, a transformers state dict did not load
    (missing ``blocks.0.mlp.act.weight``), nor this tower's into transformers."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    config = preset_config("tiny", hidden_act=act)
    with torch.device("meta"):
        assert list(Qwen3OmniVisionTower(config).state_dict()) == list(Qwen3OmniMoeVisionEncoder(config).state_dict())
    torch.manual_seed(0)
    # float32 throughout: transformers builds xIELU's alphas in bfloat16, which would round them on each load.
    reference = reference_encoder(perturbed(Qwen3OmniVisionTower(config).float()))  # this tower's weights in
    tower = Qwen3OmniVisionTower(config, attention=masked_attention).float().eval()
    tower.load_state_dict(reference.state_dict())  # and transformers' into a fresh tower, strictly
    assert any(name.startswith("blocks.0.mlp.act_fn.") for name, _ in tower.named_parameters())
    grid = [(1, 4, 6), (2, 2, 2)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        got = tower(pixels, grid)
        assert_same_output(got, run_reference(reference, pixels, grid))
        # the loaded activation weights are used: the default ones give another output
        default = Qwen3OmniVisionTower(config, attention=masked_attention).float().eval()
        default.load_state_dict({k: v for k, v in reference.state_dict().items() if ".mlp.act_fn." not in k},
                                strict=False)
        assert not torch.allclose(default(pixels, grid).embeds, got.embeds)


def test_real_preset_has_the_qwen3_omni_30b_a3b_shapes_and_parameter_count():
    with torch.device("meta"):
        tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b")
    c = tower.config
    assert (c.depth, c.hidden_size, c.num_heads, c.intermediate_size, c.patch_size, c.temporal_patch_size,
            c.spatial_merge_size, c.num_position_embeddings, c.out_hidden_size) == \
        (27, 1152, 16, 4304, 16, 2, 2, 2304, 2048)
    assert tower.deepstack_visual_indexes == (8, 16, 24) and tower.num_deepstack == 3
    assert (tower.head_dim, tower.patch_row_width, tower.spatial_merge_size) == (72, 1536, 2)
    d, m, merged, out = 1152, 4304, 4 * 1152, 2048
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
    merger_mlp = merged * merged + merged + merged * out + out
    want = (d * 1536 + d) + 2304 * d + 27 * block + (2 * d + merger_mlp) + 3 * (2 * merged + merger_mlp)
    count = sum(p.numel() for p in tower.parameters())
    assert count == want == 538_631_408  # 1.08 GB in bf16
    assert tower.blocks[0].attn.qkv.weight.shape == (3456, 1152)
    assert tower.patch_embed.proj.weight.shape == (1152, 3, 2, 16, 16)
    assert tower.merger_list[0].ln_q.weight.shape == (4608,) and tower.merger.ln_q.weight.shape == (1152,)


def test_presets_and_config_checks():
    assert set(PRESETS) >= {"tiny", "qwen3-omni-30b-a3b"}
    with pytest.raises(ValueError, match="unknown tower preset 'nope'"):
        Qwen3OmniVisionTower.from_preset("nope")
    with pytest.raises(ValueError, match="head_dim 18"):
        Qwen3OmniVisionTower.from_preset("tiny", hidden_size=72)
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[0, 4\]"):
        Qwen3OmniVisionTower.from_preset("tiny", deepstack_visual_indexes=[0, 4])
    assert Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[1]).num_deepstack == 1


@pytest.mark.parametrize("overrides, match", [
    ({"detph": 2}, r"unknown vision config field\(s\) \['detph'\] for preset 'tiny': its fields are "
                   r".*deepstack_visual_indexes, depth,"),
    ({"hidden_act": "bogus"}, r"hidden_act 'bogus' is not an activation transformers knows: expected one of .*gelu"),
    ({"rope_parameters": {"rope_theta": -1.0}}, r"rope_parameters\['rope_theta'\] must be a positive finite "
                                                r"number, got -1\.0"),
    ({"rope_parameters": {"rope_theta": "abc"}}, r"rope_theta'\] must be a positive finite number, got 'abc'"),
])
def test_a_misspelt_field_or_a_bad_activation_or_rope_theta_is_refused_by_name(overrides, match):
    """A misspelt override once built the preset's value silently; a bad activation gave a bare KeyError; a negative
    rope_theta gave NaN outputs."""
    with pytest.raises(ValueError, match=match):
        Qwen3OmniVisionTower.from_preset("tiny", **overrides)


def test_duplicate_deepstack_indexes_are_refused():
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[1, 1\] must be distinct"):
        Qwen3OmniVisionTower.from_preset("tiny", deepstack_visual_indexes=[1, 1])


@pytest.mark.parametrize("alias, target, value", [("num_attention_heads", "num_heads", 2),
                                                  ("num_hidden_layers", "depth", 5)])
def test_preset_overrides_take_the_transformers_config_aliases(alias, target, value):
    """transformers' config takes ``num_attention_heads`` and ``num_hidden_layers`` (its ``attribute_map``) for
    ``num_heads`` and ``depth``; the preset refused them as unknown fields."""
    from hwgraph.models.qwen3_omni.config import VisionConfig

    config = preset_config("tiny", **{alias: value})
    assert getattr(config, target) == getattr(VisionConfig(**{alias: value}), target) == value
    assert config.to_dict() == preset_config("tiny", **{target: value}).to_dict()
    assert preset_config("tiny", **{alias: value, target: value}).to_dict() == config.to_dict()  # the same value: ok
    with torch.device("meta"):
        tower = Qwen3OmniVisionTower.from_preset("tiny", **{alias: value})
    assert (len(tower.blocks), tower.blocks[0].attn.num_heads) == (config.depth, config.num_heads)


def test_a_transformers_config_alias_and_its_target_with_different_values_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"num_attention_heads=2 and num_heads=4 name the same field \(num_heads\) "
                                         r"with different values"):
        preset_config("tiny", num_attention_heads=2, num_heads=4)
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 and depth=2"):
        Qwen3OmniVisionTower.from_preset("tiny", depth=2, num_hidden_layers=3)


def test_a_config_json_with_non_axial_rope_is_refused_as_transformers_refuses_it():
    config = vision_config_from_dict(dict(preset_config("tiny").to_dict(),
                                          rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ValueError, match="supports only axial rope"):
        reference_encoder(config)
    with pytest.raises(ValueError, match="only axial rope, got rope_type 'linear'"):
        Qwen3OmniVisionTower(config)


def test_a_config_json_whose_head_dim_differs_from_the_heads_width_is_refused_naming_both():
    """A ``head_dim`` in the vision config was ignored: the tower splits hidden_size evenly across its heads, while
    transformers' vision rotary reads head_dim, so the two encoders disagreed."""
    tiny = preset_config("tiny")
    config = vision_config_from_dict(dict(tiny.to_dict(), head_dim=2 * tiny.hidden_size // tiny.num_heads))
    with pytest.raises(ValueError, match=rf"head_dim {2 * tiny.hidden_size // tiny.num_heads} in the vision config "
                                         rf"differs from hidden_size {tiny.hidden_size} / num_heads {tiny.num_heads}"):
        Qwen3OmniVisionTower(config)
    same = vision_config_from_dict(dict(tiny.to_dict(), head_dim=tiny.hidden_size // tiny.num_heads))
    assert Qwen3OmniVisionTower(same).blocks[0].attn.head_dim == tiny.hidden_size // tiny.num_heads


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


def test_a_head_dim_over_256_runs_with_torch_sdpa_and_equals_transformers():
    """hidden 576 over 2 heads (head_dim 288) is a config transformers runs: TORCH_SDPA declared head dims up to 256,
    though its ``scaled_dot_product_attention`` takes any, so the tower built and its first forward raised
    ``SelectionError`` (no attention kernel available)."""
    config = preset_config("tiny", hidden_size=576, num_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower(config))  # automatic choice
    assert tower.head_dim == 288
    reference = reference_encoder(tower)
    grid = [(1, 4, 6), (2, 2, 2)]
    pixels = pixels_for(tower, grid)
    # Outputs reach 47 at hidden 576: summation order alone moves them by up to 5e-4 (head_dim 144 and 72 too).
    tol = dict(rtol=1e-5, atol=2e-3)
    with torch.no_grad():
        assert_same_output(tower(pixels, grid), run_reference(reference, pixels, grid), **tol)
    assert tower.attention_kernel == "TORCH_SDPA"
    explicit = Qwen3OmniVisionTower(config, attention="TORCH_SDPA")
    explicit.load_state_dict(tower.state_dict())
    with torch.no_grad():
        assert_same_output(explicit.eval()(pixels, grid), run_reference(reference, pixels, grid), **tol)


# ---------------------------------------------------------------------------------------------- attention choice
def test_attention_callable_and_explicit_names():
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)
    assert tower.attention_kernel == "masked_attention" and tower.attention_spec.graph_safe
    from hwgraph.registry import SelectionError

    with pytest.raises(SelectionError, match="unknown attention kernel 'NO_SUCH'"):
        tower.set_attention("NO_SUCH")
    assert tower.attention_kernel == "masked_attention"  # a refused request changes nothing
    assert tower.set_attention().spec.name == "masked_attention"



def test_a_registered_kernels_own_function_given_as_a_callable_keeps_its_specs_flags():
    """TRITON_ATTN's function given to the tower as a callable was taken as not slot-bound, so a manager captured
    each budget once instead of once per slot count. A function's own attributes still win."""
    from hwgraph.attention.sdpa import sdpa_varlen
    from hwgraph.attention.triton_attn import TRITON_ATTN, triton_varlen
    from hwgraph.models.qwen3_omni.tower import callable_spec

    assert TRITON_ATTN.slot_bound
    spec = callable_spec(triton_varlen)
    assert (spec.slot_bound, spec.graph_safe, spec.impl_path) == (True, True, "")
    assert "TRITON_ATTN" in spec.description
    assert not callable_spec(sdpa_varlen).slot_bound and "TORCH_SDPA" in callable_spec(sdpa_varlen).description

    def wrapped(q, k, v, cu_seqlens, max_seqlen, scale):  # not the registered function: nothing inherited
        return triton_varlen(q, k, v, cu_seqlens, max_seqlen, scale)

    assert not callable_spec(wrapped).slot_bound
    wrapped.slot_bound = True
    assert callable_spec(wrapped).slot_bound
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=triton_varlen)
    assert tower.attention_spec.slot_bound

def test_a_refused_kernel_request_does_not_stick_to_the_tower():
    """A manager refused a kernel the platform cannot run; the next manager on the same tower, asking for nothing,
    gets the automatic choice, not the refusal again."""
    from hwgraph.manager import EncoderGraphManager
    from hwgraph.registry import SelectionError

    tower = Qwen3OmniVisionTower.from_preset("tiny")
    with pytest.raises(SelectionError, match="'FLASH_ATTN' is unavailable"):
        EncoderGraphManager(tower, graph_backend="cpu", attention="FLASH_ATTN")
    manager = EncoderGraphManager(tower, graph_backend="cpu")
    assert tower.attention_kernel == "TORCH_SDPA"
    manager.close()


def test_registry_kernel_is_chosen_for_the_towers_dtype_and_equals_the_reference():
    torch.manual_seed(2)
    tower = perturbed(Qwen3OmniVisionTower.from_preset("tiny"))
    assert tower.attention_kernel == "TORCH_SDPA"  # the CPU choice
    assert tower.set_attention("TORCH_SDPA").spec.name == "TORCH_SDPA"
    grid = [(1, 8, 8), (2, 4, 4)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(tower(pixels, grid), run_reference(reference_encoder(tower), pixels, grid))


# ---------------------------------------------------------------------------------------------- metadata
@pytest.mark.parametrize("grid, match", [
    ([], "empty"),
    ([(1, 0, 4)], r"grid_thw\[0\] = \(1, 0, 4\): t, h and w must be positive"),
    ([(1, 4, 4), (-1, 4, 4)], r"grid_thw\[1\] = \(-1, 4, 4\)"),
    ([(1, 4, 6), (1, 6, 5)], r"grid_thw\[1\] = \(1, 6, 5\): h and w must be divisible by the spatial merge size 2"),
    ([(1, 4)], r"is not a \(t, h, w\) row"),
    ((1, 4, 4), r"is not a \(t, h, w\) row"),
    ([(1.0, 4, 4)], "must hold ints"),
    (torch.tensor([[1.0, 4, 4]]), "must hold integers"),
    # whole-grid tensors were turned to numpy unchecked: numpy's or torch's own error, naming neither
    (torch.tensor([[1, 4, 4]], dtype=torch.bfloat16), r"grid_thw must hold integers, got dtype torch\.bfloat16"),
    (torch.tensor([[1.0, 4, 4]], requires_grad=True), r"grid_thw must hold integers, got dtype torch\.float32"),
    (torch.tensor([[1, 4, 4]]).to_sparse(), r"grid_thw must be a dense \(strided\) tensor, got layout "
                                             r"torch\.sparse_coo"),
    ("1x4x4", "must be a list of"),
    (torch.tensor([1, 4, 4]), r"must be \[images, 3\]"),
    ([torch.tensor([1.0, 4, 4])], r"grid_thw\[0\] = \[1\.0, 4\.0, 4\.0\] must hold ints, got dtype torch\.float32"),
    ([torch.tensor([1, 4])], r"grid_thw\[0\] = \[1, 4\] is not a \(t, h, w\) row"),
    ([b"\x01\x04\x04"], r"grid_thw\[0\] = b'\\x01\\x04\\x04' is not a \(t, h, w\) row"),  # was read as (1, 4, 4)
    ([(torch.tensor([1]), 4, 4)], r"grid_thw\[0\] holds a tensor of shape \(1,\) where a number is expected"),
    ([(torch.tensor(1, device="meta"), 4, 4)], r"a value of grid_thw\[0\] is on meta; pass it on the host"),
    ([(torch.tensor(1.0), 4, 4)], r"grid_thw\[0\] = \(np\.float32\(1\.0\), 4, 4\) must hold ints"),
])
def test_bad_grids_raise_value_errors_naming_the_values(grid, match):
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    with pytest.raises(ValueError, match=match):
        tower.prepare_metadata(grid)


def test_grid_rows_of_0_d_int_tensors_are_read_as_their_values():
    """``[tuple(r) for r in image_grid_thw]`` (a processor's tensor split into rows) was refused: "grid_thw[0] =
    (tensor(1), 4, 4) must hold ints"."""
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    grid = torch.tensor([[1, 4, 4], [2, 8, 6]])
    want = tower.prepare_metadata([(1, 4, 4), (2, 8, 6)])
    got = tower.prepare_metadata([tuple(row) for row in grid])
    assert got.grid_thw == want.grid_thw == ((1, 4, 4), (2, 8, 6))
    assert torch.equal(got.pos_indices, want.pos_indices) and torch.equal(got.cu_seqlens, want.cu_seqlens)


def test_pixels_that_do_not_match_the_grid_raise_value_errors():
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)
    with pytest.raises(ValueError, match=r"has 60 rows but grids \[\(1, 8, 8\)\] need 64 patch rows"):
        tower(torch.randn(60, tower.patch_row_width), [(1, 8, 8)])
    with pytest.raises(ValueError, match=r"must be \[patches, 96\].*got shape \(64, 95\)"):
        tower(torch.randn(64, 95), [(1, 8, 8)])


def test_metadata_built_for_another_towers_merge_size_or_position_table_is_refused():
    """``prepare_metadata(grid, merge, side)`` is public: built for another tower, its position indices and merge
    groups gave wrong embeddings, silently (max error 0.39 and 0.62 on the tiny tower)."""
    from hwgraph.models.qwen3_omni import prepare_metadata

    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)
    grid = [(1, 4, 4)]
    pixels = torch.randn(16, tower.patch_row_width)
    side = tower.num_grid_per_side
    for merge, table in [(1, side), (2, side - 2)]:
        with pytest.raises(ValueError, match=rf"metadata was built for spatial_merge_size {merge} and a position table "
                                             rf"of side {table}, but this tower has spatial_merge_size 2 and side "
                                             rf"{side}: build it with this tower's prepare_metadata"):
            tower.forward_with_metadata(pixels, prepare_metadata(grid, merge, table))
    assert tower.forward_with_metadata(pixels, prepare_metadata(grid, 2, side)).embeds.shape[0] == 4


def test_metadata_on_the_meta_device_is_refused_by_name():
    """Metadata moved to the meta device (shapes only, e.g. for a dry run) failed deep in the forward with torch's
    "Cannot copy out of meta tensor; no data!", naming neither the metadata nor how to get real tables."""
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)
    grid = [(1, 4, 4)]
    pixels = torch.randn(16, tower.patch_row_width)
    metadata = tower.prepare_metadata(grid)
    with pytest.raises(ValueError, match=r"metadata is on the meta device \(no data\): build it with this tower's "
                                         r"prepare_metadata\(grid_thw\)"):
        tower.forward_with_metadata(pixels, metadata.to("meta"))
    assert tower.forward_with_metadata(pixels, metadata).embeds.shape[0] == 4


def test_pixels_that_do_not_match_a_huge_grid_are_refused_before_its_metadata_is_built(monkeypatch):
    """A grid's tables take memory in proportion to it (numpy's allocator refused 6 GiB for a 20000 x 20000 grid
    before the rows were compared): the eager forward and the manager compare the rows with the grid first."""
    from hwgraph.manager import EncoderGraphManager
    from hwgraph.models.qwen3_omni import metadata

    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention)
    manager = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu")
    monkeypatch.setattr(metadata, "frame_tables", lambda *a: pytest.fail("tables built for rows that do not match"))
    for encode in (tower.forward, manager.encode):
        with pytest.raises(ValueError, match=r"has 4 rows but grids \[\(1, 20000, 20000\)\] need 400000000 patch rows"):
            encode(torch.zeros(4, tower.patch_row_width), [(1, 20000, 20000)])
        with pytest.raises(ValueError, match=r"divisible by the spatial merge size"):  # the grid's own checks first
            encode(torch.zeros(4, tower.patch_row_width), [(1, 3, 4)])


def test_metadata_fields_and_padding_semantics():
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    meta = tower.prepare_metadata([(1, 4, 4), (2, 2, 4)])
    assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.tolist() == [0, 16, 24, 32]
    assert (meta.num_patches, meta.num_tokens, meta.num_rows, meta.num_seqs, meta.max_seqlen) == (32, 8, 32, 3, 16)
    assert meta.pos_indices.shape == meta.pos_weights.shape == (4, 32) and meta.rotary_positions.shape == (32, 2)
    assert meta.pos_indices.dtype == meta.rotary_positions.dtype == torch.int64
    assert meta.pos_weights.dtype == torch.float32 and not meta.is_padded
    torch.testing.assert_close(meta.pos_weights.sum(0), torch.ones(32))
    # merge order: the first 4 rows are the top-left 2x2 block, then the block to its right
    assert meta.rotary_positions[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    torch.testing.assert_close(meta.rotary_positions[24:], meta.rotary_positions[16:24])  # frame 2 repeats frame 1

    pad = meta.padded(48, 6)
    assert (pad.num_rows, pad.num_token_rows, pad.num_seqs, pad.max_seqlen, pad.is_padded) == (48, 12, 6, 48, True)
    assert (pad.num_patches, pad.num_tokens, pad.token_counts) == (32, 8, meta.token_counts)
    assert pad.cu_seqlens.tolist() == [0, 16, 24, 32, 32, 32, 32]
    assert not pad.pos_indices[:, 32:].any() and not pad.pos_weights[:, 32:].any()
    assert not pad.rotary_positions[32:].any()
    torch.testing.assert_close(pad.pos_weights[:, :32], meta.pos_weights, rtol=0, atol=0)
    assert meta.padded(32, 3, max_seqlen=20).max_seqlen == 20
    with pytest.raises(ValueError, match="32 patch rows do not fit in num_patches=28"):
        meta.padded(28, 6)
    with pytest.raises(ValueError, match="num_patches=50 is not a multiple of spatial_merge_size"):
        meta.padded(50, 6)
    with pytest.raises(ValueError, match=r"3 sequences \(frames\) do not fit in num_seqs=2"):
        meta.padded(48, 2)
    with pytest.raises(ValueError, match="longest sequence"):
        meta.padded(48, 6, max_seqlen=8)


def test_padded_forward_equals_unpadded_on_the_real_rows_and_copy_from_refills_static_buffers():
    torch.manual_seed(3)
    tower = perturbed(Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention))
    grid = [(1, 4, 6), (1, 2, 2)]
    pixels = pixels_for(tower, grid)
    meta = tower.prepare_metadata(grid)
    static = meta.padded(64, 4)
    padded_pixels = torch.cat((pixels, torch.zeros(64 - 28, tower.patch_row_width)))
    with torch.no_grad():
        want = tower(pixels, grid)
        got = tower.forward_with_metadata(padded_pixels, static)
        assert got.num_tokens == 16
        assert_same_output(got.split(meta.token_counts)[0], want.split(meta.token_counts)[0])
        assert_same_output(VisionOutput(got.embeds[:7], tuple(d[:7] for d in got.deepstack)), want)
        # new images into the same static buffers
        grid2 = [(1, 8, 8)]
        pixels2 = pixels_for(tower, grid2, seed=5)
        static.copy_from(tower.prepare_metadata(grid2).padded(64, 4))
        assert static.grid_thw == ((1, 8, 8),) and static.cu_seqlens.tolist() == [0, 64, 64, 64, 64]
        assert_same_output(tower.forward_with_metadata(pixels2, static), tower(pixels2, grid2))
    with pytest.raises(ValueError, match="does not match these static buffers"):
        static.copy_from(meta.padded(32, 4))


def test_copy_from_refuses_metadata_of_another_merge_size_or_position_table_naming_each_field():
    """``copy_from`` compared shapes and ``max_seqlen`` only: metadata built for another position table (same shapes)
    was copied in silently and the tower blended the wrong rows of its table (max error 4.2 on the tiny tower); another
    merge size was refused with "max_seqlen 16 vs 16", naming nothing that differed."""
    from hwgraph.models.qwen3_omni import prepare_metadata

    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention))
    grid, side = [(1, 4, 4)], tower.num_grid_per_side
    static = tower.prepare_metadata(grid).padded(16, 1, 16)
    before = {name: t.clone() for name, t in static.tensors().items()}
    for src, named in [
        (prepare_metadata(grid, 1, side).padded(16, 1, 16), r": spatial_merge_size 2 vs 1\b"),
        (prepare_metadata(grid, 2, side - 3).padded(16, 1, 16), rf": num_grid_per_side {side} vs {side - 3}\b"),
        (tower.prepare_metadata(grid).padded(16, 1, 20), r": max_seqlen 16 vs 20\b"),
        (tower.prepare_metadata(grid).padded(32, 2, 16),
         r": pos_indices \(4, 16\) vs \(4, 32\); .*cu_seqlens \(2,\) vs \(3,\)"),
    ]:
        with pytest.raises(ValueError, match=r"metadata does not match these static buffers \(theirs vs the given "
                                             r"one's\)" + named):
            static.copy_from(src)
    with pytest.raises(ValueError) as failure:  # several at once: each one named
        static.copy_from(prepare_metadata(grid, 1, 5).padded(16, 1, 20))
    assert all(f in str(failure.value) for f in ("spatial_merge_size 2 vs 1", f"num_grid_per_side {side} vs 5",
                                                 "max_seqlen 16 vs 20"))
    assert all(torch.equal(t, before[name]) for name, t in static.tensors().items())  # nothing was copied
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(tower.forward_with_metadata(pixels, static), tower(pixels, grid))


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


# ---------------------------------------------------------------------------------------------- sync-freedom
def test_forward_with_metadata_reads_nothing_back_under_the_sync_guard():
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention).eval()
    grid = [(1, 8, 8), (2, 4, 4)]
    pixels = pixels_for(tower, grid)
    meta = tower.prepare_metadata(grid).padded(128, 4).to("cpu")
    pixels = torch.cat((pixels, torch.zeros(128 - 96, tower.patch_row_width)))
    tower.set_attention()  # choose outside the guard, as a manager does before capture
    with torch.inference_mode(), CpuGraphBackend().sync_guard():
        out = tower.forward_with_metadata(pixels, meta)
    assert out.embeds.shape == (32, tower.out_hidden_size)

    def syncing_attention(q, k, v, cu_seqlens, max_seqlen, scale):
        cu_seqlens.max().item()  # what transformers' flash path does to find max_seqlen
        return masked_attention(q, k, v, cu_seqlens, max_seqlen, scale)

    tower.set_attention(syncing_attention)
    with pytest.raises(HostSyncError, match=r"\.item\(\)"):
        with torch.inference_mode(), CpuGraphBackend().sync_guard():
            tower.forward_with_metadata(pixels, meta)


def test_grid_on_the_host_only():
    meta_device = torch.tensor([[1, 4, 4]], device="meta")
    with pytest.raises(ValueError, match="pass it on the host"):
        Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata(meta_device)


# ---------------------------------------------------------------------------------------------- from_pretrained
def write_checkpoint(folder, tensors: dict, config: dict, shards: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update((n, file) for n in part)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(4)
    tower = perturbed(Qwen3OmniVisionTower(CONFIGS["small"], attention=masked_attention))
    state = {k: v.contiguous() for k, v in tower.state_dict().items()}
    return tower, state, CONFIGS["small"].to_dict()


def full_config(vision: dict) -> dict:
    return {"model_type": "qwen3_omni_moe", "thinker_config": {"model_type": "qwen3_omni_moe_thinker",
                                                                "vision_config": vision, "text_config": {}}}


@pytest.mark.parametrize("layout", ["full checkpoint, sharded", "thinker-style, visual.", "vision-only, bare",
                                    "full model's state_dict(), thinker.model.visual.",
                                    "thinker's state_dict(), model.visual."])
def test_from_pretrained_loads_every_layout_and_equals_the_source(tmp_path, source, layout):
    tower, state, vision = source
    if layout.startswith("full checkpoint"):
        tensors = {f"thinker.visual.{k}": v for k, v in state.items()}
        tensors["thinker.model.embed_tokens.weight"] = torch.zeros(4, 2)  # the rest of the model is ignored
        tensors["talker.visual.blocks.0.norm1.weight"] = torch.zeros(2)
        folder = write_checkpoint(tmp_path / "ckpt", tensors, full_config(vision), shards=3)
    elif "state_dict()" in layout:
        prefix = layout.rsplit(", ", 1)[1]
        tensors = {f"{prefix}{k}": v for k, v in state.items()}
        tensors[prefix.replace("visual.", "language_model.embed_tokens.weight")] = torch.zeros(4, 2)
        config = full_config(vision) if prefix.startswith("thinker") else {"model_type": "qwen3_omni_moe_thinker",
                                                                          "vision_config": vision}
        folder = write_checkpoint(tmp_path / "ckpt", tensors, config)
    elif layout.startswith("thinker"):
        folder = write_checkpoint(tmp_path / "ckpt", {f"visual.{k}": v for k, v in state.items()},
                                  {"model_type": "qwen3_omni_moe_thinker", "vision_config": vision})
    else:
        folder = write_checkpoint(tmp_path / "ckpt", state, vision)
    loaded = from_pretrained(folder, attention=masked_attention)
    assert loaded.config.to_dict() == tower.config.to_dict()
    assert loaded.rotary_pos_emb.inv_freq.device.type == "cpu" and not loaded.training
    assert all(p.requires_grad and isinstance(p, torch.nn.Parameter) for p in loaded.parameters())
    grid = [(1, 4, 6), (2, 2, 2)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(loaded(pixels, grid), tower(pixels, grid), rtol=0, atol=0)


def test_from_pretrained_casts_to_the_requested_dtype(tmp_path, source):
    tower, state, vision = source
    folder = write_checkpoint(tmp_path / "ckpt", state, vision)
    loaded = Qwen3OmniVisionTower.from_pretrained(folder, dtype=torch.bfloat16, attention=masked_attention)
    assert loaded.dtype == torch.bfloat16 and loaded.rotary_pos_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(loaded.pos_embed.weight, state["pos_embed.weight"].to(torch.bfloat16))


def test_from_pretrained_lists_missing_unexpected_and_misshapen_tensors(tmp_path, source):
    _, state, vision = source
    broken = {f"visual.{k}": v for k, v in state.items() if not k.startswith("blocks.1.")}
    broken["visual.blocks.9.norm1.weight"] = torch.zeros(96)
    folder = write_checkpoint(tmp_path / "a", broken, {"vision_config": vision}, shards=2)
    with pytest.raises(CheckpointError, match=r"missing 12: \[blocks\.1\.attn\.proj\.bias.*unexpected 1: "
                                              r"\[blocks\.9\.norm1\.weight\]"):
        from_pretrained(folder)
    misshapen = dict(state, **{"pos_embed.weight": torch.zeros(49, 96)})
    with pytest.raises(CheckpointError, match=r"wrong shape.*pos_embed\.weight \(49, 96\) \(tower \(36, 96\)\)"):
        from_pretrained(write_checkpoint(tmp_path / "b", misshapen, vision))
    with pytest.raises(CheckpointError, match="none of the tower's tensors"):
        from_pretrained(write_checkpoint(tmp_path / "c", {"lm_head.weight": torch.zeros(2)}, vision))
    with pytest.raises(ValueError, match="holds no vision config"):
        from_pretrained(write_checkpoint(tmp_path / "d", state, {"model_type": "qwen3_omni_moe_text"}))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "nothing-here")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{depth: 2}")
    with pytest.raises(ValueError, match=rf"{re.escape(str(broken / 'config.json'))} is not valid JSON: Expecting"):
        from_pretrained(broken)


def test_from_pretrained_refuses_a_tensor_in_two_unindexed_files_and_names_unreadable_files(tmp_path, source):
    """A stray shard of another checkpoint silently won (the last file sorted); a broken index or shard raised
    safetensors' or json's own error (``KeyError: 'weight_map'``), which did not name the file."""
    _, state, vision = source
    folder = write_checkpoint(tmp_path / "stray", state, vision)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in state.items()}, str(folder / "stale.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor '.*' is in both model-00001-of-00001\.safetensors and "
                                              r"stale\.safetensors in .*: remove the files of other checkpoints"):
        from_pretrained(folder)
    sharded = write_checkpoint(tmp_path / "sharded", state, vision, shards=2)
    index = sharded / "model.safetensors.index.json"
    for content, error in [("{}", "KeyError: 'weight_map'"), ("[1]", "TypeError"), ("{not json", "JSONDecodeError")]:
        index.write_text(content)
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(index))} is not a safetensors index .*{error}"):
            from_pretrained(sharded)
    single = write_checkpoint(tmp_path / "truncated", state, vision)
    data = (single / "model.safetensors").read_bytes()
    (single / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(single / 'model.safetensors'))} is not a readable "
                                              r"safetensors file: "):
        from_pretrained(single)


@pytest.mark.cpu_machine
def test_from_pretrained_names_a_device_this_machine_lacks_before_reading(tmp_path, source):
    """It failed inside safetensors' pinned copy ("pin_memory=True requires a CUDA or other accelerator backend")."""
    _, state, vision = source
    folder = write_checkpoint(tmp_path / "ckpt", state, vision)
    with pytest.raises(ValueError, match=r"device 'cuda': this torch \(.*\) sees no cuda device"):
        from_pretrained(folder, device="cuda")
    with pytest.raises(ValueError, match=r"device 'cuda': this torch"):  # checked before the folder
        from_pretrained(tmp_path / "nothing-here", device="cuda")
    with pytest.raises(ValueError, match=r"device 'gpu' is not a torch device: expected e\.g\. cpu, cuda"):
        from_pretrained(folder, device="gpu")


def test_metadata_is_cached_per_grid_and_usable_outside_the_inference_mode_it_was_built_in():
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    grid = [(1, 4, 8), (2, 4, 4)]
    with torch.inference_mode():
        first = tower.prepare_metadata(grid)
    assert tower.prepare_metadata(torch.tensor(grid)) is first  # one cache entry per grid, whatever its form
    assert not any(t.is_inference() for t in first.tensors().values())
    pixels = pixels_for(tower, grid).requires_grad_()
    tower.forward(pixels, grid).embeds.sum().backward()  # autograd may save the cached metadata's tensors
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0


def test_deepstack_mergers_run_in_line_off_cuda_and_when_overlap_is_off():
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    assert tower.overlap_deepstack  # on by default; it only acts on CUDA/ROCm devices
    assert tower.merge_stream(torch.device("cpu"), 196) is None
    assert tower.merge_stream(torch.device("meta"), 196) is None
    # Neither asks anything of CUDA: above the row limit the GEMMs fill the GPU; and overlap can be turned off.
    assert tower.merge_stream(torch.device("cuda", 0), OVERLAP_MAX_ROWS + 4) is None
    tower.overlap_deepstack = False
    assert tower.merge_stream(torch.device("cuda", 0), 196) is None


def test_a_float64_tower_equals_its_float64_reference_to_float64_precision():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention).double().eval()
    with torch.no_grad():  # weights that float32 cannot hold (a float32 init cast up could)
        for p in tower.parameters():
            p.add_(torch.rand_like(p) * 1e-6)
    reference = reference_encoder(tower)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), tower.parameters(), strict=True))
    grid = [(3, 6, 10), (1, 2, 2)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(tower(pixels, grid), run_reference(reference, pixels, grid),
                           rtol=1e-12, atol=1e-12)


def test_float64_activations_take_the_exact_fallbacks_not_the_float32_kernels(monkeypatch):
    from hwgraph.models.qwen3_omni import fused

    monkeypatch.setattr(fused, "use_triton", lambda t: True)  # as on a GPU, or under the Triton interpreter
    called = []
    monkeypatch.setattr(fused, "add_layer_norm_reference", lambda *a: called.append("add_layer_norm") or (a[0], a[0]))
    monkeypatch.setattr(fused, "add_position_embedding_reference", lambda *a: called.append("position") or a[0])
    x = torch.randn(4, 8, dtype=torch.float64)
    fused.add_layer_norm(x, x.clone(), torch.nn.LayerNorm(8).double())
    table, indices = torch.randn(16, 8, dtype=torch.float64), torch.zeros(4, 4, dtype=torch.int64)
    fused.add_position_embedding(x, table, indices, torch.zeros(4, 4))
    assert called == ["add_layer_norm", "position"]


def test_a_config_of_another_model_is_refused_naming_its_model_type():
    other = {"model_type": "qwen2_5_omni", "thinker_config": {"vision_config": {
        "model_type": "qwen2_5_omni_vision_encoder", "depth": 2, "num_heads": 2}}}
    with pytest.raises(ValueError, match=r"vision config of model_type 'qwen2_5_omni_vision_encoder': this tower is "
                                         r"Qwen3-Omni's \('qwen3_omni_moe_vision_encoder'\)"):
        vision_config_from_dict(other)


def test_from_pretrained_takes_dtype_names_and_refuses_mixed_dtypes(tmp_path, source):
    tower, state, vision = source
    folder = write_checkpoint(tmp_path / "ckpt", state, vision)
    assert Qwen3OmniVisionTower.from_pretrained(folder, dtype="bfloat16", attention=masked_attention).dtype \
        == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        Qwen3OmniVisionTower.from_pretrained(folder, dtype="int8")
    mixed = dict(state, **{"pos_embed.weight": state["pos_embed.weight"].to(torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"mixes dtypes bfloat16, float32 .* pass dtype= to load them in one"):
        Qwen3OmniVisionTower.from_pretrained(write_checkpoint(tmp_path / "mixed", mixed, vision))
    loaded = Qwen3OmniVisionTower.from_pretrained(write_checkpoint(tmp_path / "cast", mixed, vision),
                                                  dtype=torch.float32, attention=masked_attention)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool])
def test_from_pretrained_refuses_a_dtype_object_that_is_not_floating_point(tmp_path, source, dtype):
    _, state, vision = source
    folder = write_checkpoint(tmp_path / "ckpt", state, vision)
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
    loaded = from_pretrained(write_checkpoint(tmp_path / "ckpt", tensors, vision), attention=masked_attention)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


def test_a_channels_last_patch_embedding_weight_gives_the_reference_output():
    """``PatchEmbed`` flattened its Conv3d weight with ``view``, which fails on a weight that is not contiguous
    (``tower.to(memory_format=torch.channels_last_3d)``, or one loaded with ``assign=True``); transformers' conv
    runs."""
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower.from_preset("tiny", attention=masked_attention))
    reference = reference_encoder(tower)
    tower.to(memory_format=torch.channels_last_3d)
    assert not tower.patch_embed.proj.weight.is_contiguous()
    grid = [(2, 4, 6)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        assert_same_output(tower(pixels, grid), run_reference(reference, pixels, grid))


def test_the_compiled_tower_gives_every_parameter_the_eager_gradient():
    """Under torch.compile the attention kernel is its custom op, which has no autograd formula: compiling the tower
    with autograd recording failed ("Trying to backward through hwgraph.sdpa_varlen"). While autograd records the
    kernels run differentiable torch code, so the compiled tower's gradients are the eager tower's."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    pixels = torch.randn(int(grid.prod(-1).sum()), tower.patch_row_width)
    metadata = tower.prepare_metadata(grid, pixels)

    def gradients(forward):
        tower.zero_grad(set_to_none=True)
        out = forward(pixels, metadata)
        (out.embeds.sum() + sum(d.square().sum() for d in out.deepstack)).backward()
        return {name: p.grad for name, p in tower.named_parameters()}

    eager = gradients(tower.forward_with_metadata)
    compiled = gradients(torch.compile(tower.forward_with_metadata, backend="aot_eager"))
    assert [name for name, g in eager.items() if g is None] == []
    for name, g in compiled.items():
        assert g is not None, f"no gradient reached {name}"
        torch.testing.assert_close(g, eager[name], msg=lambda m, name=name: f"{name}: {m}")


def test_the_whole_tower_compiles_for_a_grid_it_has_not_seen():
    """``torch.compile(tower)(pixels, grid)`` traced the host metadata's numpy code and crashed ("Expected np.nditer
    base") for a grid not yet in the metadata cache; the metadata is now a graph break and the outputs are eager's."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    grid = [(1, 10, 6), (1, 2, 18)]  # a grid no other test builds, so not in this process's metadata cache
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width)
    with torch.no_grad():
        got = torch.compile(tower, backend="aot_eager")(pixels, grid)
        want = tower(pixels, grid)
    for g, w in zip((got.embeds, *got.deepstack), (want.embeds, *want.deepstack), strict=True):
        torch.testing.assert_close(g, w)
