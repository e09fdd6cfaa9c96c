"""What the tower's refusals say about padded metadata and about a source that is not metadata."""

from __future__ import annotations

import pytest
import torch

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()


def test_pixels_of_the_real_rows_given_padded_metadata_are_refused_naming_the_padding(tower):
    """Padded metadata (a graph's, or ``padded()``'s) with the images' own pixel rows said ``grids [(1, 4, 4)] need
    32 patch rows``: a 4 x 4 grid needs 16, the 32 are the padded metadata's. The message names both."""
    metadata = tower.prepare_metadata([(1, 4, 4)]).padded(32, 2)
    with pytest.raises(ValueError, match=r"pixel_values has 16 rows but the metadata of grids \[\(1, 4, 4\)\] "
                                         r"\(16 patch rows\) is padded to 32 rows: pass 32 rows"):
        tower.forward_with_metadata(torch.randn(16, tower.patch_row_width), metadata)
    with torch.no_grad():  # the padded row count itself still runs
        out = tower.forward_with_metadata(torch.randn(32, tower.patch_row_width), metadata)
    assert out.embeds.shape == (8, tower.out_hidden_size)


def test_pixels_that_do_not_match_unpadded_metadata_still_name_the_grids_rows(tower):
    metadata = tower.prepare_metadata([(1, 4, 4), (2, 2, 2)])
    with pytest.raises(ValueError, match=r"pixel_values has 20 rows but grids \[\(1, 4, 4\), \(2, 2, 2\)\] need 24 "
                                         r"patch rows"):
        tower.forward_with_metadata(torch.randn(20, tower.patch_row_width), metadata)


@pytest.mark.parametrize("src", [[(1, 4, 4)], None])
def test_copy_from_a_source_that_is_not_metadata_names_what_it_takes(tower, src):
    """``copy_from([(1, 4, 4)])`` raised ``AttributeError: 'list' object has no attribute 'spatial_merge_size'``, which
    named neither the argument nor what it takes (``check_pixels`` names it for the same mistake)."""
    static = tower.prepare_metadata([(1, 4, 4)]).padded(32, 2)
    before = {name: t.clone() for name, t in static.tensors().items()}
    with pytest.raises(ValueError, match=r"copy_from\(\) takes a VisionMetadata \(prepare_metadata\(grid_thw\), "
                                         r"padded like these buffers\), got " + type(src).__name__):
        static.copy_from(src)
    assert all(torch.equal(t, before[name]) for name, t in static.tensors().items())
