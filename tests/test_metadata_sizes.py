"""Host metadata: its sizes, padding and moves, and the budget's filling grid."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hwgraph.budgets import filling_grid
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, prepare_metadata
from hwgraph.models.qwen3_omni.metadata import grid_metadata


class RecordNonBlocking(TorchFunctionMode):
    """Records the ``non_blocking`` of every ``Tensor.to``/``Tensor.copy_`` and stands in for the copy (the meta
    tensors used here, as device tensors on a machine without one, hold no data to copy)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.seen.append(("to", kwargs.get("non_blocking", False)))
            return torch.zeros(args[0].shape, dtype=args[0].dtype, device=torch.device(args[1]))
        if func is torch.Tensor.copy_:
            self.seen.append(("copy_", kwargs.get("non_blocking", False)))
            return args[0]
        return func(*args, **kwargs)


def on_meta(meta):
    return dataclasses.replace(meta, **{name: t.to("meta") for name, t in meta.tensors().items()})


def test_metadata_moved_to_the_host_is_copied_blocking_and_to_a_device_asynchronously():
    """A non-blocking device-to-host copy hands back pinned tensors before the device has written them: ``to("cpu")``
    of device metadata gave tables that a host read saw half-written, silently."""
    meta = Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata([(1, 4, 4)])
    device_meta = on_meta(meta)
    with RecordNonBlocking() as mode:
        host = device_meta.to("cpu")
    assert host.device.type == "cpu" and mode.seen == [("to", False)] * 4
    with RecordNonBlocking() as mode:
        meta.to("meta")
    assert mode.seen == [("to", True)] * 4  # host to device stays asynchronous


def test_copy_from_device_metadata_into_host_buffers_blocks():
    meta = Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata([(1, 4, 4)]).padded(16, 2)
    host_buffers, device_meta = meta.padded(16, 2), on_meta(meta)
    with RecordNonBlocking() as mode:
        host_buffers.copy_from(device_meta)
    assert mode.seen == [("copy_", False)] * 4


def test_prepare_metadata_refuses_a_merge_size_or_table_side_that_is_not_a_positive_int():
    """A float side built float64 position indices and, equal to the int as a cache key, was handed to the tower's
    later calls for that grid (its forward then failed in embedding); a side of 0 gave indices of -1 silently; a merge
    size of 0 failed with 'integer modulo by zero'."""
    tower = Qwen3OmniVisionTower.from_preset("tiny")
    side, grid = tower.num_grid_per_side, [(1, 4, 4)]
    grid_metadata.cache_clear()
    for merge, table, named in [(2, float(side), f"num_grid_per_side must be a positive int, got {float(side)!r}"),
                                (2, 0, "num_grid_per_side must be a positive int, got 0"),
                                (0, side, "spatial_merge_size must be a positive int, got 0"),
                                (2.0, side, "spatial_merge_size must be a positive int, got 2.0"),
                                (True, side, "spatial_merge_size must be a positive int, got True")]:
        with pytest.raises(ValueError, match="prepare_metadata: " + named):
            prepare_metadata(grid, merge, table)
    assert tower.prepare_metadata(grid).pos_indices.dtype == torch.int64
    with torch.no_grad():
        assert tower(torch.randn(16, tower.patch_row_width), grid).embeds.shape[0] == 4


def test_first_seqs_refuses_fewer_slots_than_the_metadatas_own_frames():
    """``first_seqs(1)`` of three frames kept cu_seqlens [0, 16]: the other frames' rows became padding and the forward
    returned unspecified embeddings for them, silently."""
    meta = Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata([(1, 4, 4), (2, 4, 4)]).padded(64, 5)
    for fewer in (1, 2):
        with pytest.raises(ValueError, match=rf"num_seqs={fewer} is fewer than the 3 frames of grids \[\(1, 4, 4\), "
                                             r"\(2, 4, 4\)\]: the rows of those past it would fall outside every "
                                             r"sequence"):
            meta.first_seqs(fewer)
    with pytest.raises(ValueError, match=r"num_seqs must be an int in 1\.\.5 \(the slots of this metadata\), "
                                         r"got 3\.0"):
        meta.first_seqs(3.0)
    assert meta.first_seqs(3).cu_seqlens.tolist() == [0, 16, 32, 48]


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_patches=64, num_seqs=4, max_seqlen=20.5), "max_seqlen=20.5"),
    (dict(num_patches=64.0, num_seqs=4), "num_patches=64.0"),
    (dict(num_patches=64, num_seqs=4.0), "num_seqs=4.0"),
    (dict(num_patches=64, num_seqs=True), "num_seqs=True"),
])
def test_padded_refuses_sizes_that_are_not_ints_naming_them(kwargs, named):
    """A float ``max_seqlen`` was kept as the capture value silently; float sizes failed inside torch.pad/expand."""
    meta = Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata([(1, 4, 4), (2, 4, 4)])
    with pytest.raises(ValueError, match=rf"padded\(\) takes ints, got .*{named}"):
        meta.padded(**kwargs)


@pytest.mark.parametrize("tokens, merge, named", [
    (0, 2, "tokens must be a positive int, got 0"),  # was: max() arg is an empty sequence
    (-4, 2, "tokens must be a positive int, got -4"),  # was: isqrt() argument must be nonnegative
    (2.0, 2, "tokens must be a positive int, got 2.0"),
    (4, 0, "merge must be a positive int, got 0"),  # was: the grid (1, 0, 0)
])
def test_filling_grid_refuses_tokens_or_merge_that_are_not_positive_ints(tokens, merge, named):
    with pytest.raises(ValueError, match=f"filling_grid: {named}"):
        filling_grid(tokens, merge)


def test_padded_names_the_empty_slots_among_the_sequences_that_do_not_fit():
    """Padding metadata that already had empty sequence slots said "5 sequences (frames) do not fit", counting its
    empty slots as frames."""
    meta = Qwen3OmniVisionTower.from_preset("tiny").prepare_metadata([(1, 4, 4), (2, 4, 4)])
    with pytest.raises(ValueError, match=r"3 sequences \(frames\) do not fit in num_seqs=2"):
        meta.padded(64, 2)
    with pytest.raises(ValueError, match=r"5 sequences \(3 frames and 2 empty slots\) do not fit in num_seqs=4"):
        meta.padded(64, 5).padded(64, 4)
