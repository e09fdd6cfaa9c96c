"""The tower: token counts that are not ints, metadata that is not metadata, and the rotary lanes its docstring
names."""

from __future__ import annotations

import pytest
import torch

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, VisionOutput
from hwgraph.models.qwen3_omni.layers import AxialRotary


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


def test_an_unloaded_meta_tower_refuses_to_run_naming_what_to_do():
    """A tower built under ``torch.device("meta")`` and never loaded (``load_state_dict`` without ``assign=True`` is a
    no-op into meta weights) failed in its first matmul with ``RuntimeError: Tensor on device meta is not on the
    expected device cpu!``, which named neither the tower's weights nor the way to load them."""
    with torch.device("meta"):
        tower = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA")
    pixels = torch.randn(16, tower.patch_row_width)
    with pytest.raises(ValueError, match=r"the tower's \S+, \S+, \S+ and \d+ more are on the meta device \(no "
                                         r"data: built under torch\.device\('meta'\) or set_default_device\('meta'\) "
                                         r"and not loaded\): load its weights first .*"
                                         r"load_state_dict\(\.\.\., assign=True\)"):
        tower(pixels, [(1, 4, 4)])
    tower.load_state_dict(Qwen3OmniVisionTower.from_preset("tiny").state_dict(), assign=True)
    with torch.no_grad():
        assert tower(pixels, [(1, 4, 4)]).embeds.shape == (4, tower.out_hidden_size)


@pytest.mark.parametrize("counts, named", [
    ([True, 3], r"token counts must be ints, got \[True, 3\]"),
    ([torch.tensor(True), 3], r"token counts must be ints, got \[tensor\(True\), 3\]"),
    (4, "token counts must be a sequence of ints, one per image, got 4"),
    (True, "token counts must be a sequence of ints, one per image, got True"),
    (None, "token counts must be a sequence of ints, one per image, got None"),
])
def test_split_refuses_bools_and_a_bare_count_naming_them(counts, named):
    """``split([True, 3])`` returned a row for the bool, silently (``operator.index(True)`` is 1); ``split(4)`` (the
    total instead of one count per image) raised ``TypeError: 'int' object is not iterable``, naming neither the value
    nor what was expected."""
    out = VisionOutput(torch.zeros(4, 2), (torch.zeros(4, 2),))
    with pytest.raises(ValueError, match=f"^{named}$"):
        out.split(counts)
    assert [p.num_tokens for p in out.split(n for n in [1, 3])] == [1, 3]  # any iterable of ints still splits
