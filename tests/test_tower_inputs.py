"""The tower: the fused add + LayerNorm with strided norm weights, token counts that are not ints,
metadata that is not metadata, and the rotary lanes its docstring names."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.models.qwen3_omni.layers import AxialRotary

STRIDED_NORM_CHILD = textwrap.dedent("""
    import os, sys, types
    import torch
    import hwgraph.models

    # The kernels without the package's __init__ (it imports transformers: most of this child's start-up time).
    package = types.ModuleType("hwgraph.models.qwen3_omni")
    package.__path__ = [os.path.join(os.path.dirname(hwgraph.models.__file__), "qwen3_omni")]
    sys.modules[package.__name__] = package
    from hwgraph.models.qwen3_omni import fused

    assert fused.use_triton(torch.empty(1)), "the interpreter path must be active in this child"
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    rows, width = 5, 64
    norm = torch.nn.LayerNorm(width, eps=1e-6)
    # Parameters assigned strided views (load_state_dict(assign=True) of such tensors does the same).
    norm.weight = torch.nn.Parameter(torch.randn(width, 2)[:, 0])
    norm.bias = torch.nn.Parameter(torch.randn(width, 2)[:, 1])
    x, delta = torch.randn(rows, width), torch.randn(rows, width)
    got = fused.add_layer_norm(x, delta, norm)
    want = fused.add_layer_norm_reference(x, delta, norm)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    print("strided norm ok")
""")


def test_add_layer_norm_with_strided_norm_weights_equals_the_reference():
    """The fused kernel read the LayerNorm's weight and bias as contiguous rows: with a strided weight (a parameter
    assigned a view) the normalised rows were off by up to 10 while the CPU reference was right."""
    pytest.importorskip("triton", reason="the add + LayerNorm kernel needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1", HWGRAPH_FUSED="1")
    done = subprocess.run([sys.executable, "-c", STRIDED_NORM_CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "strided norm ok" in done.stdout


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()


@pytest.mark.parametrize("counts", [[2.5], [1.9, 1.9], ["2"]])
def test_split_refuses_token_counts_that_are_not_ints_naming_them(tower, counts):
    """``int()`` truncated them: ``split([2.5])`` returned 2 rows, ``split([1.9, 1.9])`` two of 1, silently."""
    with torch.no_grad():
        out = tower(torch.randn(16, tower.patch_row_width), [(1, 4, 4)])
    with pytest.raises(ValueError, match=r"token counts must be ints, got \[" + repr(counts[0]).replace(".", r"\.")):
        out.split(counts)
    assert [p.num_tokens for p in out.split([torch.tensor(1), 3])] == [1, 3]  # integer scalars still split


def test_forward_with_metadata_given_a_grid_names_what_it_expected(tower):
    """A grid where metadata belongs raised ``AttributeError: 'list' object has no attribute 'grid_thw'``."""
    pixels = torch.randn(16, tower.patch_row_width)
    with pytest.raises(ValueError, match=r"metadata must be a VisionMetadata \(this tower's "
                                         r"prepare_metadata\(grid_thw\)\), got list"):
        tower.forward_with_metadata(pixels, [(1, 4, 4)])


def test_rotary_lanes_are_the_ones_the_docstring_names():
    """Pairs (i, i + D/2) with i < D/4 rotate by the row, the others by the column (the docstring said the first
    half of each head rotates with the row, the second with the column: lanes [D/4, D/2) rotate with the column)."""
    d = 16
    rotary = AxialRotary(d, 1e4)
    cos_row, _ = rotary(torch.tensor([[3, 0]]))
    cos_col, _ = rotary(torch.tensor([[0, 3]]))
    row_lanes = torch.tensor([i % (d // 2) < d // 4 for i in range(d)])
    assert (cos_row[0, ~row_lanes] == 1).all() and (cos_row[0, row_lanes] != 1).all()
    assert (cos_col[0, row_lanes] == 1).all() and (cos_col[0, ~row_lanes] != 1).all()
