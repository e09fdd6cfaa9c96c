"""Randomized differential test of the image tower against transformers' ``Qwen3OmniMoeVisionEncoder``.

Seeded small configs that transformers builds (depth 1-4, 1-6 heads of 4 to 72 lanes, MLP widths of no particular
multiple, merge sizes 1-3, temporal patch 1-2, square and non-square position tables, DeepStack indexes empty,
unsorted, first and last block, every activation transformers knows, rope thetas) and random image groups (several
images, odd grids, videos, grids larger and smaller than the position table, the minimal ``1 x merge x merge`` image).
The weights are a transformers encoder's, written as a checkpoint in each layout ``from_pretrained`` reads (and by
transformers' own ``save_pretrained``) and loaded through it, so the name mapping is exercised too. Every output, the
merged embeddings and each DeepStack feature, must equal transformers' in float64 and float32, and so must the
gradients while autograd records. The configs the tower refuses are ones transformers cannot run either, or runs with
mergers whose weights it never uses.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.models.qwen3_omni.config import VisionConfig
from hwgraph.models.qwen3_omni.reference import as_vision_output

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 20260611
LAYOUTS = ("save_pretrained", "full checkpoint, sharded", "thinker, visual.", "vision-only, bare")
# |tower - transformers| allowed, relative to the output's largest magnitude. transformers rotates q and k in float32
# whatever the model's dtype (apply_rotary_pos_emb_vision calls .float()), and so does the tower: in float64 a q that
# the two matmuls (Conv3d there, a GEMM here) left a few float64 ulps apart can round to float32 values one float32 ulp
# apart, about 1e-8 of the output at worst over thousands of draws. A real difference is of the order of the output.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def activations() -> list[str]:
    from transformers.activations import ACT2FN

    return sorted(ACT2FN)


def random_fields(rng: random.Random) -> dict:
    """Vision config fields transformers accepts, small enough for the CPU."""
    depth = rng.randint(1, 4)
    heads, head_dim = rng.randint(1, 6), rng.choice([4, 8, 12, 16, 20, 24, 36, 72])
    side = rng.choice([1, 2, 3, 4, 5, 7, 9])
    deepstack = rng.sample(range(depth), rng.randint(0, min(depth, 3)))
    if rng.random() < 0.4:  # the first and the last block, in any order
        deepstack = list({0, depth - 1} | set(deepstack))
        rng.shuffle(deepstack)
    return dict(
        depth=depth, hidden_size=heads * head_dim, num_heads=heads, intermediate_size=rng.randint(1, 150),
        hidden_act=rng.choice(activations()), in_channels=rng.randint(1, 3), patch_size=rng.randint(1, 3),
        temporal_patch_size=rng.choice([1, 2]), spatial_merge_size=rng.choice([1, 2, 3]),
        # mostly perfect squares; otherwise the rows past side**2 are never read, by either
        num_position_embeddings=side * side + (rng.randint(1, 2 * side) if rng.random() < 0.2 else 0),
        deepstack_visual_indexes=deepstack, out_hidden_size=rng.choice([1, 3, 8, 13]),
        rope_parameters={"rope_type": "axial", "rope_theta": rng.choice([10000.0, 100.0, 7.5])},
    )


def random_grid(rng: random.Random, merge: int, side: int) -> list[tuple[int, int, int]]:
    """1-6 images or videos of (t, h, w) patches, h and w multiples of ``merge`` from one merge block up to a few
    past the position table's side, in either direction."""
    def axis():
        return merge * rng.randint(1, (side + 3) // merge + 1)

    grid = [(rng.choice([1, 1, 2, 3, 5]), axis(), axis()) for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.3:
        grid.insert(rng.randint(0, len(grid)), (1, merge, merge))
    return grid


def transformers_encoder(config: VisionConfig, dtype: torch.dtype, seed: int):
    """transformers' encoder in ``dtype``, every weight perturbed (LayerNorm weights of 1 and biases of 0 would hide a
    swapped or skipped norm)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    torch.manual_seed(seed)
    encoder = Qwen3OmniMoeVisionEncoder(config).to(dtype)
    with torch.no_grad():
        for p in encoder.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return encoder.eval()


def write_checkpoint(folder, encoder, layout: str) -> None:
    """``encoder``'s weights and config as a checkpoint folder in ``layout`` (one of ``LAYOUTS``)."""
    if layout == "save_pretrained":
        encoder.save_pretrained(folder)
        return
    folder.mkdir(parents=True)
    vision = encoder.config.to_dict()
    state = {name: t.detach().contiguous() for name, t in encoder.state_dict().items()}
    if layout.startswith("full"):
        config = {"model_type": "qwen3_omni_moe",
                  "thinker_config": {"model_type": "qwen3_omni_moe_thinker", "vision_config": vision}}
        tensors = {f"thinker.visual.{name}": t for name, t in state.items()}
        tensors["thinker.model.embed_tokens.weight"] = torch.zeros(3, 2)  # the rest of the model, not read
        names, weight_map = sorted(tensors), {}
        for i in range(2):
            file = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({n: tensors[n] for n in names[i::2]}, str(folder / file))
            weight_map.update((n, file) for n in names[i::2])
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        prefix = "visual." if layout.startswith("thinker") else ""
        config = {"model_type": "qwen3_omni_moe_thinker", "vision_config": vision} if prefix else vision
        save_file({prefix + name: t for name, t in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


def loaded_tower(tmp_path, encoder, layout: str, dtype: torch.dtype | None) -> Qwen3OmniVisionTower:
    """The tower ``from_pretrained`` builds from ``encoder``'s checkpoint, with weights equal to the encoder's."""
    folder = tmp_path / "checkpoint"
    write_checkpoint(folder, encoder, layout)
    tower = Qwen3OmniVisionTower.from_pretrained(folder, dtype=dtype, attention="TORCH_SDPA")
    ours, theirs = tower.state_dict(), encoder.state_dict()
    assert list(ours) == list(theirs)
    unequal = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not unequal, f"weights loaded from the {layout!r} checkpoint differ from transformers': {unequal}"
    return tower


def grid_form(rng: random.Random, grid):
    """The grid as a caller may pass it: a list of tuples, an int tensor or a numpy array."""
    return rng.choice([lambda g: g, torch.tensor, lambda g: np.array(g, dtype=np.int32)])(grid)


def assert_outputs_equal(got, want, dtype: torch.dtype, what: str) -> None:
    assert len(got.deepstack) == len(want.deepstack), f"{what}: DeepStack features {len(got.deepstack)} vs " \
                                                      f"transformers' {len(want.deepstack)}"
    names = ["embeds"] + [f"DeepStack feature {i}" for i in range(len(want.deepstack))]
    for name, g, w in zip(names, got.tensors(), want.tensors(), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what}: {name} {tuple(g.shape)} {g.dtype}, transformers' {tuple(w.shape)} {w.dtype}"
        atol = TOLERANCE[dtype] * max(1.0, w.abs().max().item() if w.numel() else 0.0)
        torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=lambda m, name=name: f"{what}: {name}: {m}")


def check_case(tmp_path, rng: random.Random, fields: dict, grid, dtype: torch.dtype, seed: int) -> str:
    """One config and image group: transformers' encoder, its checkpoint loaded into the tower, outputs compared.
    Returns the checkpoint layout drawn."""
    config = VisionConfig(**fields)
    encoder = transformers_encoder(config, dtype, seed)
    layout = rng.choice(LAYOUTS)
    tower = loaded_tower(tmp_path / f"case-{seed}", encoder, layout, rng.choice([None, dtype]))
    assert tower.dtype == dtype
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width,
                         generator=torch.Generator().manual_seed(seed), dtype=dtype)
    what = f"seed {seed}, {layout}, config {fields}, grid {grid}"
    with torch.no_grad():
        want = as_vision_output(encoder(pixels, torch.tensor(grid)))
        got = tower(pixels, grid_form(rng, grid))
    assert_outputs_equal(got, want, dtype, what)
    return layout


@pytest.mark.parametrize("dtype, cases", [(torch.float64, 48), (torch.float32, 24)], ids=["float64", "float32"])
def test_random_configs_and_image_groups_equal_transformers(tmp_path, dtype, cases):
    rng = random.Random(f"{SEED}-{dtype}")
    seen = {"merge": set(), "temporal": set(), "activations": set(), "layouts": set(), "empty deepstack": False,
            "first and last block": False, "video": False, "minimal image": False, "upsampled": False,
            "downsampled": False, "non-square table": False}
    for case in range(cases):
        fields = random_fields(rng)
        merge, side = fields["spatial_merge_size"], int(fields["num_position_embeddings"] ** 0.5)
        grid = random_grid(rng, merge, side)
        seen["layouts"].add(check_case(tmp_path, rng, fields, grid, dtype, seed=case))
        deepstack = fields["deepstack_visual_indexes"]
        seen["merge"].add(merge)
        seen["temporal"].add(fields["temporal_patch_size"])
        seen["activations"].add(fields["hidden_act"])
        seen["empty deepstack"] |= not deepstack
        seen["first and last block"] |= fields["depth"] > 1 and {0, fields["depth"] - 1} <= set(deepstack)
        seen["video"] |= any(t > 1 for t, _, _ in grid)
        seen["minimal image"] |= (1, merge, merge) in grid
        seen["upsampled"] |= any(max(h, w) > side for _, h, w in grid)
        seen["downsampled"] |= any(1 < min(h, w) < side for _, h, w in grid)
        seen["non-square table"] |= fields["num_position_embeddings"] != side * side
    # the draw must keep reaching every case it is meant to cover
    assert seen.pop("merge") == {1, 2, 3} and seen.pop("temporal") == {1, 2} and seen.pop("layouts") == set(LAYOUTS)
    assert len(seen.pop("activations")) >= min(12, len(activations()))
    assert all(seen.values()), f"cases the draw missed: {[name for name, hit in seen.items() if not hit]}"


CORNERS = {
    # merge 3: the minimal image, a video and a grid past the table on one axis only
    "merge 3": (dict(spatial_merge_size=3, num_position_embeddings=16), [(1, 3, 3), (2, 6, 9), (1, 3, 15)]),
    # merge 1: single-patch images, every patch its own token
    "merge 1": (dict(spatial_merge_size=1, temporal_patch_size=1), [(1, 1, 1), (3, 1, 5), (1, 7, 2)]),
    # a one-row table: every patch reads row 0 with weight 1
    "position table of one row": (dict(num_position_embeddings=1), [(1, 2, 2), (1, 10, 4)]),
    # side 4 of a 20-row table: rows 16..19 never read
    "non-square table": (dict(num_position_embeddings=20), [(1, 4, 4), (1, 2, 12), (2, 8, 6)]),
    "DeepStack after every block, unsorted": (dict(depth=4, deepstack_visual_indexes=[3, 0, 2, 1]), [(1, 6, 4)]),
    "no DeepStack": (dict(deepstack_visual_indexes=[]), [(1, 4, 6), (2, 2, 2)]),
    "heads of 72 lanes": (dict(hidden_size=144, num_heads=2, intermediate_size=100), [(1, 4, 4), (1, 2, 6)]),
    "PReLU's weight": (dict(hidden_act="prelu"), [(1, 4, 6)]),
    "xIELU's alphas": (dict(hidden_act="xielu"), [(1, 4, 6)]),
    "one block, one head": (dict(depth=1, hidden_size=8, num_heads=1, deepstack_visual_indexes=[0]), [(1, 2, 4)]),
}
BASE = dict(depth=3, hidden_size=24, num_heads=2, intermediate_size=37, hidden_act="gelu_pytorch_tanh", in_channels=3,
            patch_size=2, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=9,
            deepstack_visual_indexes=[0, 2], out_hidden_size=5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(CORNERS))
def test_corner_configs_equal_transformers(tmp_path, name, dtype):
    overrides, grid = CORNERS[name]
    check_case(tmp_path, random.Random(name), {**BASE, **overrides}, grid, dtype, seed=list(CORNERS).index(name))


def outputs_and_gradients(model, out, seed: int):
    """``out`` and the gradient of a random projection of it (the same for both models) for each weight by name."""
    projections = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=projections, dtype=t.dtype)).sum() for t in out.tensors())
    names, params = zip(*model.named_parameters(), strict=True)
    return out, dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True), strict=True))


def test_outputs_and_gradients_equal_transformers_while_autograd_records():
    """With weights that require grad and autograd on, the tower runs its differentiable path: the same outputs and
    the same gradient for every weight as transformers'."""
    rng = random.Random(f"{SEED}-grad")
    for case in range(6):
        fields = random_fields(rng)
        grid = random_grid(rng, fields["spatial_merge_size"], int(fields["num_position_embeddings"] ** 0.5))
        encoder = transformers_encoder(VisionConfig(**fields), torch.float64, case)
        tower = Qwen3OmniVisionTower(VisionConfig(**fields), attention="TORCH_SDPA").double().eval()
        tower.load_state_dict(encoder.state_dict())
        pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, dtype=torch.float64)
        got, got_grads = outputs_and_gradients(tower, tower(pixels, grid), case)
        want, want_grads = outputs_and_gradients(encoder, as_vision_output(encoder(pixels, torch.tensor(grid))), case)
        what = f"case {case}, config {fields}, grid {grid}"
        assert_outputs_equal(got, want, torch.float64, what)
        assert list(got_grads) == list(want_grads)
        for name, want_grad in want_grads.items():
            got_grad, where = got_grads[name], f"{what}: gradient of {name}"
            assert (got_grad is None) == (want_grad is None), f"{where}: {got_grad} vs {want_grad}"
            if want_grad is not None:
                atol = TOLERANCE[torch.float64] * max(1.0, want_grad.abs().max().item())
                torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=atol,
                                           msg=lambda m, where=where: f"{where}: {m}")


def test_padded_metadata_gives_transformers_rows_whatever_the_padding_rows_hold():
    """What a captured graph runs: metadata padded with rows (whole merge blocks), empty sequence slots and a larger
    max_seqlen, the padding rows' pixels NaN, huge or zero. The real rows equal transformers' output."""
    rng = random.Random(f"{SEED}-padded")
    for case in range(16):
        fields = random_fields(rng)
        merge_area = fields["spatial_merge_size"] ** 2
        grid = random_grid(rng, fields["spatial_merge_size"], int(fields["num_position_embeddings"] ** 0.5))
        encoder = transformers_encoder(VisionConfig(**fields), torch.float64, case)
        tower = Qwen3OmniVisionTower(VisionConfig(**fields), attention="TORCH_SDPA").double().eval()
        tower.load_state_dict(encoder.state_dict())
        meta = tower.prepare_metadata(grid)
        extra = merge_area * rng.randint(1, 4)
        padded = meta.padded(meta.num_rows + extra, meta.num_seqs + rng.randint(0, 3),
                             meta.max_seqlen + rng.randint(0, 9))
        pixels = torch.randn(meta.num_rows, tower.patch_row_width, dtype=torch.float64)
        garbage = torch.full((extra, tower.patch_row_width), rng.choice([float("nan"), 1e30, 0.0]),
                             dtype=torch.float64)
        with torch.no_grad():
            got = tower.forward_with_metadata(torch.cat((pixels, garbage)), padded)
            want = as_vision_output(encoder(pixels, torch.tensor(grid)))
        assert got.num_tokens == meta.num_tokens + extra // merge_area
        real = got.split([meta.num_tokens])[0]
        assert_outputs_equal(real, want, torch.float64, f"case {case}, config {fields}, grid {grid}, {extra} rows")


REFUSED = {
    # transformers builds these encoders, then fails in the forward (cos/sin wider or narrower than a head)
    "head_dim 6, not divisible by 4": (dict(hidden_size=12, num_heads=2), "divisible by 4", None),
    "head_dim field differs from the heads' width": (dict(head_dim=4), "differs from hidden_size", None),
    # transformers runs these with fewer features than DeepStack mergers: one merger's weights are never used
    "repeated DeepStack index": (dict(deepstack_visual_indexes=[1, 1]), r"deepstack_visual_indexes \[1, 1\]", 1),
    "DeepStack index past the last block": (dict(deepstack_visual_indexes=[0, 3]), r"in 0\.\.2", 1),
    "negative DeepStack index": (dict(deepstack_visual_indexes=[-1]), r"\[-1\] must be distinct", 0),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_configs_the_tower_refuses_are_ones_transformers_cannot_run_as_configured(tmp_path, name):
    overrides, match, features = REFUSED[name]
    encoder = transformers_encoder(VisionConfig(**{**BASE, **overrides}), torch.float64, 0)
    with pytest.raises(ValueError, match=match):
        loaded_tower(tmp_path, encoder, "save_pretrained", None)
    grid = [(1, 2, 2)]
    pixels = torch.randn(4, encoder.config.in_channels * encoder.config.temporal_patch_size
                         * encoder.config.patch_size**2, dtype=torch.float64)
    with torch.no_grad():
        if features is None:
            with pytest.raises(RuntimeError):
                encoder(pixels, torch.tensor(grid))
        else:
            out = as_vision_output(encoder(pixels, torch.tensor(grid)))
            assert len(out.deepstack) == features < len(encoder.merger_list)
