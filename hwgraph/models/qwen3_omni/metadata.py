"""Host metadata of one forward: everything the tower derives from the image grids, computed with numpy.

Patch rows arrive in *merge order*: within a frame, patches are grouped in ``merge x merge`` blocks (block row,
block column, row in block, column in block), so that every ``merge**2`` consecutive rows form one merged token.
All per-patch tables below are laid out in that order and repeated over a grid's ``t`` frames.

The bilinear weights reproduce transformers' float32 arithmetic step by step (``src = i * (side - 1) / (n - 1)``,
``w = 1 - |src - floor - offset|``), so the eager tower equals the reference exactly, not just closely.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hwgraph.bounded_cache import bounded_cache
from hwgraph.budgets import MAX_PATCH_ROWS, is_int, positive_ints
from hwgraph.hostmem import pinned_copy

Grid = tuple[tuple[int, int, int], ...]

TENSOR_FIELDS = ("pos_indices", "pos_weights", "rotary_positions", "cu_seqlens")

# Bounds of each metadata cache (``frame_tables``, ``grid_metadata``): at most CACHE_BYTES of tables, and no result
# over CACHE_ENTRY_BYTES kept. A patch row holds 64 bytes (4 int64 indices, 4 float32 weights, 2 int64 rotary
# positions), so an entry of 1 MiB is 16,384 rows: 4,096 merged tokens, twice the largest calibrated budget. Larger
# images and videos rebuild their tables at each call, which costs far less than their forward.
CACHE_BYTES = 32 << 20
CACHE_ENTRY_BYTES = 1 << 20


# eq=False: comparing tensors would call bool() on them, a device read; the repr stays one line for logs.
@dataclass(eq=False, repr=False)
class VisionMetadata:
    """What ``forward_with_metadata`` needs besides the pixels. ``R`` is the number of patch rows the forward
    expects: the real patch count, or more after ``padded()``; ``S`` the number of attention sequences.

    - ``pos_indices`` ``[4, R]`` int64: rows of the learned position table blended for each patch;
    - ``pos_weights`` ``[4, R]`` float32: their bilinear weights (0 on padding rows);
    - ``rotary_positions`` ``[R, 2]`` int64: (row, column) of each patch in its frame;
    - ``cu_seqlens`` ``[S + 1]`` int32: cumulative frame lengths; every frame is one attention sequence;
    - ``max_seqlen`` host int: the longest sequence (after ``padded()``, the value graphs are captured with).

    ``spatial_merge_size`` and ``num_grid_per_side`` are those of the tower it was built for (a tower refuses
    another's). Host fields describe the real images: ``grid_thw``, per-image ``patch_counts`` (t*h*w) and
    ``token_counts`` (t*h*w / merge**2). Tensors live on the host until ``to(device)``.
    """

    grid_thw: Grid
    spatial_merge_size: int
    num_grid_per_side: int  # the side of the learned position table that pos_indices index
    pos_indices: torch.Tensor
    pos_weights: torch.Tensor
    rotary_positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    patch_counts: tuple[int, ...]
    token_counts: tuple[int, ...]

    @property
    def num_patches(self) -> int:
        """Real patches (pixel rows of the images), padding excluded."""
        return sum(self.patch_counts)

    @property
    def num_tokens(self) -> int:
        """Real merged tokens, padding excluded."""
        return sum(self.token_counts)

    @property
    def num_frames(self) -> int:
        """Real attention sequences (one per frame)."""
        return sum(t for t, _, _ in self.grid_thw)

    @property
    def num_rows(self) -> int:
        """Pixel rows the forward expects (``num_patches`` unless padded)."""
        return int(self.pos_indices.shape[1])

    @property
    def num_token_rows(self) -> int:
        """Merged-token rows the forward returns (``num_tokens`` unless padded)."""
        return self.num_rows // self.spatial_merge_size**2

    @property
    def num_seqs(self) -> int:
        """Attention sequences, zero-length padding sequences included."""
        return int(self.cu_seqlens.shape[0]) - 1

    @property
    def is_padded(self) -> bool:
        return self.num_rows != self.num_patches or self.num_seqs != self.num_frames

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def __repr__(self) -> str:
        return (f"VisionMetadata(grid_thw={list(self.grid_thw)}, rows={self.num_rows}, tokens={self.num_tokens}, "
                f"seqs={self.num_seqs}, max_seqlen={self.max_seqlen}, device={self.device})")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (the static inputs a captured graph reads)."""
        return {name: getattr(self, name) for name in TENSOR_FIELDS}

    def to(self, device: torch.device | str) -> VisionMetadata:
        """The metadata with its tensors on ``device`` (asynchronous host-to-device copies; no sync; a copy to the host
        waits for its data, since it is read there at once): a copy, or this object itself when it is there already
        (callers do not modify it)."""
        device = torch.device(device)
        if device == self.device:
            return self
        source = self
        if self.device.type == "cpu" and device.type not in ("cpu", "meta"):
            # From pageable memory the "asynchronous" copy blocks the host until the stream has drained: a hidden
            # sync measured at 0.5 ms per tensor on the H200. Pinned, it is truly asynchronous.
            source = self.pin_memory()
        # Non-blocking into the host would hand back pinned tensors before the device has written them.
        non_blocking = device.type != "cpu"
        moved = {name: t.to(device, non_blocking=non_blocking) for name, t in source.tensors().items()}
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> VisionMetadata:
        """A copy with pinned host tensors, so that ``to()``/``copy_from()`` into an accelerator are truly
        asynchronous (needs an accelerator runtime)."""
        return dataclasses.replace(self, **{name: pinned_copy(t) for name, t in self.tensors().items()})

    def padded(self, num_patches: int, num_seqs: int, max_seqlen: int | None = None) -> VisionMetadata:
        """This metadata grown to ``num_patches`` rows and ``num_seqs`` sequences, for a captured graph.

        Extra rows get position index 0, weight 0 and rotary position 0; ``cu_seqlens`` repeats its last value,
        so extra sequences are empty and extra rows belong to none. ``max_seqlen`` becomes the capture value
        (default ``num_patches``). ``ValueError`` when a size is not an int or the images do not fit.
        """
        merge_area = self.spatial_merge_size**2
        max_seqlen = num_patches if max_seqlen is None else max_seqlen
        sizes = {"num_patches": num_patches, "num_seqs": num_seqs, "max_seqlen": max_seqlen}
        not_ints = [f"{name}={value!r}" for name, value in sizes.items() if not is_int(value)]
        if not_ints:  # a float max_seqlen was kept silently, and float sizes failed in torch naming neither
            raise ValueError(f"padded() takes ints, got {', '.join(not_ints)}")
        num_patches, num_seqs, max_seqlen = int(num_patches), int(num_seqs), int(max_seqlen)
        problems = []
        if num_patches < self.num_rows:
            problems.append(f"{self.num_rows} patch rows do not fit in num_patches={num_patches}")
        if num_patches % merge_area:
            problems.append(f"num_patches={num_patches} is not a multiple of spatial_merge_size**2={merge_area}")
        if num_seqs < self.num_seqs:
            empty = self.num_seqs - self.num_frames  # an already padded metadata's empty slots count too
            what = f"{self.num_frames} frames and {empty} empty slots" if empty else "frames"
            problems.append(f"{self.num_seqs} sequences ({what}) do not fit in num_seqs={num_seqs}")
        if max_seqlen < self.max_seqlen:
            problems.append(f"the longest sequence ({self.max_seqlen} patches) exceeds max_seqlen={max_seqlen}")
        if problems:
            raise ValueError("cannot pad the metadata of grids " + str(list(self.grid_thw)) + ": "
                             + "; ".join(problems))
        rows, seqs = num_patches - self.num_rows, num_seqs - self.num_seqs
        # torch ops (not numpy) so that device metadata pads on its device, without reading it back.
        return dataclasses.replace(
            self,
            pos_indices=torch.nn.functional.pad(self.pos_indices, (0, rows)),
            pos_weights=torch.nn.functional.pad(self.pos_weights, (0, rows)),
            rotary_positions=torch.nn.functional.pad(self.rotary_positions, (0, 0, 0, rows)),
            cu_seqlens=torch.cat((self.cu_seqlens, self.cu_seqlens[-1:].expand(seqs))),
            max_seqlen=max_seqlen,
        )

    def first_seqs(self, num_seqs: int) -> VisionMetadata:
        """This metadata limited to its first ``num_seqs`` sequence slots: the same tensors, with ``cu_seqlens`` a
        prefix view of this one's. A graph captured on it reads the same static buffers as one captured on self and
        is right for any contents with at most ``num_seqs`` sequences (the padding repeats the last offset), so it
        holds at least this metadata's own frames: fewer cut real rows out of every sequence, silently."""
        if not is_int(num_seqs) or not 1 <= num_seqs <= self.num_seqs:
            what = "" if is_int(num_seqs) else "an int "
            raise ValueError(f"num_seqs must be {what}in 1..{self.num_seqs} (the slots of this metadata), "
                             f"got {num_seqs!r}")
        if num_seqs < self.num_frames:
            raise ValueError(f"num_seqs={num_seqs} is fewer than the {self.num_frames} frames of grids "
                             f"{list(self.grid_thw)}: the rows of those past it would fall outside every sequence")
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens[: int(num_seqs) + 1])

    def copy_from(self, src: VisionMetadata) -> VisionMetadata:
        """Overwrite these (static, e.g. device) tensors in place with ``src``'s; shapes, ``max_seqlen``, the merge
        size and the position table side must match, since a captured graph keeps the first two and the tower's
        table lookups assume the last two. ``ValueError`` naming every field that differs, with both values, and
        nothing copied. Host fields follow ``src``. Returns self."""
        if not isinstance(src, VisionMetadata):  # a grid raised AttributeError "'list' ... no 'spatial_merge_size'"
            raise ValueError(f"copy_from() takes a VisionMetadata (prepare_metadata(grid_thw), padded like these "
                             f"buffers), got {type(src).__name__}")
        mismatched = [f"{name} {getattr(self, name)} vs {getattr(src, name)}"
                      for name in ("spatial_merge_size", "num_grid_per_side", "max_seqlen")
                      if getattr(self, name) != getattr(src, name)]
        mismatched += [f"{name} {tuple(dst.shape)} vs {tuple(getattr(src, name).shape)}"
                       for name, dst in self.tensors().items() if dst.shape != getattr(src, name).shape]
        if mismatched:
            raise ValueError(f"metadata does not match these static buffers (theirs vs the given one's): "
                             f"{'; '.join(mismatched)}; build it for the same tower and pad it with the same "
                             f"num_patches, num_seqs and max_seqlen")
        for name, dst in self.tensors().items():  # into the host: blocking, or it is read before the device wrote it
            dst.copy_(getattr(src, name), non_blocking=dst.device.type != "cpu")
        self.grid_thw, self.patch_counts, self.token_counts = src.grid_thw, src.patch_counts, src.token_counts
        return self


def holds_ints(t: torch.Tensor) -> bool:
    """Whether tensor ``t``'s dtype is an integer one (bool is not)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def refuse_device_tensor(t: torch.Tensor, where: str) -> None:
    """``ValueError`` naming ``where`` when ``t`` is not on the host: reading it would synchronise with the device."""
    if t.device.type != "cpu":
        raise ValueError(f"{where} is on {t.device}; pass it on the host (a list or a CPU tensor): reading a device "
                         f"tensor would synchronise with the device")


def host_scalar(x, where: str):
    """``x`` as it is, or a 0-d host tensor's value as a numpy scalar (a host read, which sync guards allow); a
    device tensor, whose read would synchronise, or one of more dimensions is ``ValueError`` naming ``where``."""
    if not isinstance(x, torch.Tensor):
        return x
    refuse_device_tensor(x, f"a value of {where}")
    if x.dim() != 0:
        raise ValueError(f"{where} holds a tensor of shape {tuple(x.shape)} where a number is expected")
    return x.numpy()[()]


def normalize_grid(grid_thw, spatial_merge_size: int) -> Grid:
    """``grid_thw`` (rows of (t, h, w): a list, or an int array/tensor on the host) as a tuple of int triples.

    ``ValueError`` naming the values for an empty grid, a malformed row, non-positive entries, or h, w not
    divisible by the merge size. A device tensor is refused: reading it would synchronise with the device.
    """
    if isinstance(grid_thw, torch.Tensor):
        refuse_device_tensor(grid_thw, "grid_thw")
        if not holds_ints(grid_thw):
            raise ValueError(f"grid_thw must hold integers, got dtype {grid_thw.dtype}")
        if grid_thw.layout != torch.strided:
            raise ValueError(f"grid_thw must be a dense (strided) tensor, got layout {grid_thw.layout}: pass "
                             f"grid_thw.to_dense()")
        grid_thw = grid_thw.numpy()
    if isinstance(grid_thw, np.ndarray):
        if grid_thw.dtype.kind not in "iu":
            raise ValueError(f"grid_thw must hold integers, got dtype {grid_thw.dtype}")
        if grid_thw.size and (grid_thw.ndim != 2 or grid_thw.shape[1] != 3):
            raise ValueError(f"grid_thw must be [images, 3] (t, h, w rows), got shape {grid_thw.shape}")
        rows = grid_thw.tolist()
    elif isinstance(grid_thw, Sequence) and not isinstance(grid_thw, str):
        rows = list(grid_thw)
    else:
        raise ValueError(f"grid_thw must be a list of (t, h, w) rows or an int array, got {type(grid_thw).__name__}")
    if not rows:
        raise ValueError("grid_thw is empty: at least one (t, h, w) image grid is needed")
    grid = []
    for i, row in enumerate(rows):
        if isinstance(row, torch.Tensor):  # a list of 1-D tensors, one per image
            refuse_device_tensor(row, f"grid_thw[{i}]")
            if not holds_ints(row):
                raise ValueError(f"grid_thw[{i}] = {row.numpy().tolist()!r} must hold ints, got dtype {row.dtype}")
            row = row.numpy().tolist()  # numpy: a host read, which sync guards allow (they reject .tolist())
        if not isinstance(row, (Sequence, np.ndarray)) or isinstance(row, (str, bytes)) or len(row) != 3:
            raise ValueError(f"grid_thw[{i}] = {row!r} is not a (t, h, w) row; grid_thw must be a list of "
                             f"(t, h, w) rows, e.g. [(1, 32, 32)]")
        if any(isinstance(x, torch.Tensor) for x in row):  # [tuple(r) for r in image_grid_thw]: 0-d tensors
            row = [host_scalar(x, f"grid_thw[{i}]") for x in row]
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in row):
            raise ValueError(f"grid_thw[{i}] = {tuple(row)} must hold ints")
        t, h, w = (int(x) for x in row)
        if min(t, h, w) <= 0:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: t, h and w must be positive")
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: h and w must be divisible by the spatial merge size "
                             f"{spatial_merge_size}")
        grid.append((t, h, w))
    rows = sum(t * h * w for t, h, w in grid)
    if rows > MAX_PATCH_ROWS:  # cu_seqlens is int32: past it the boundaries wrapped, silently
        raise ValueError(f"grid_thw = {tuple(grid)} holds {rows} patch rows in all; cu_seqlens are int32, so a call "
                         f"takes at most {MAX_PATCH_ROWS}")
    return tuple(grid)


def merge_order_coords(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of an h x w frame, listed in merge order."""
    rows, cols = np.indices((h, w), dtype=np.int64)
    blocked = (h // merge, merge, w // merge, merge)
    return (rows.reshape(blocked).transpose(0, 2, 1, 3).ravel(),
            cols.reshape(blocked).transpose(0, 2, 1, 3).ravel())


def axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two bilinear taps into a ``side``-long table (align_corners) for positions ``index`` of an axis of
    ``size``: (tap0, tap1, weight0, weight1), weights in float32 computed the way transformers does."""
    f32 = np.float32
    src = index.astype(f32) * f32(side - 1) / f32(max(size - 1, 1))
    floor = np.floor(src)
    frac = src - floor
    tap0 = np.minimum(floor.astype(np.int64), side - 1)
    tap1 = np.minimum(tap0 + 1, side - 1)
    weight0 = np.maximum(f32(1) - np.abs(frac), f32(0))
    weight1 = np.maximum(f32(1) - np.abs(frac - f32(1)), f32(0))
    return tap0, tap1, weight0, weight1


def _arrays_bytes(arrays) -> int:
    return sum(a.nbytes for a in arrays)


def _metadata_bytes(meta: VisionMetadata) -> int:
    return sum(t.nbytes for t in meta.tensors().values())


@bounded_cache(maxsize=512, max_bytes=CACHE_BYTES, max_entry_bytes=CACHE_ENTRY_BYTES, size_of=_arrays_bytes)
def frame_tables(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-frame tables in merge order: position indices ``[4, h*w]``, weights ``[4, h*w]``, rotary ``[h*w, 2]``.

    Cached (least recently used out, within ``CACHE_BYTES``): a server sees the same few image sizes again and again.
    The arrays are read-only.
    """
    rows, cols = merge_order_coords(h, w, merge)
    r0, r1, rw0, rw1 = axis_taps(rows, h, side)
    c0, c1, cw0, cw1 = axis_taps(cols, w, side)
    indices = np.stack((r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1))
    weights = np.stack((rw0 * cw0, rw0 * cw1, rw1 * cw0, rw1 * cw1))
    rotary = np.stack((rows, cols), axis=1)
    for table in (indices, weights, rotary):
        table.flags.writeable = False
    return indices, weights, rotary


def prepare_metadata(grid_thw, spatial_merge_size: int, num_grid_per_side: int) -> VisionMetadata:
    """Host metadata for images of ``grid_thw`` (see ``VisionMetadata``); numpy only, never the device.

    Cached per grid, least recently used out, within ``CACHE_BYTES`` (a server sees the same groups of image sizes
    again and again; building them cost about 45 us of host time per call on the H200's host, ahead of every
    replay): treat the result as read-only (a result changed in place by torch ops is built again at the next call,
    so the change does not reach later calls). ``ValueError`` unless ``spatial_merge_size`` and ``num_grid_per_side``
    are positive ints: a float one built float indices and, equal to the int as a cache key, was handed to the
    tower's later calls."""
    merge, side = positive_ints("prepare_metadata", spatial_merge_size=spatial_merge_size,
                                num_grid_per_side=num_grid_per_side)
    return grid_metadata(normalize_grid(grid_thw, merge), merge, side)


def grid_metadata(grid: Grid, spatial_merge_size: int, num_grid_per_side: int) -> VisionMetadata:
    """``prepare_metadata`` of a normalised grid, from the cache. A cached result whose tensors a caller has changed in
    place (``copy_from`` into it, a ``mul_``: their version counters moved) is built again, not handed out: such a
    change made every later forward of that grid wrong, silently. ``cache_info()`` and ``cache_clear()`` are the
    cache's."""
    box = _cached_grid_metadata(grid, spatial_merge_size, num_grid_per_side)
    meta = box[0]
    if (meta.pos_indices._version or meta.pos_weights._version or meta.rotary_positions._version
            or meta.cu_seqlens._version):  # what tensors() holds, read without building its dict
        meta = box[0] = build_grid_metadata(grid, spatial_merge_size, num_grid_per_side)
    return meta


# The cache holds a one-item list, so that grid_metadata can replace a changed result in place (its key, byte count
# and recency stay as they are).
@bounded_cache(maxsize=256, max_bytes=CACHE_BYTES, max_entry_bytes=CACHE_ENTRY_BYTES,
               size_of=lambda box: _metadata_bytes(box[0]))
def _cached_grid_metadata(grid: Grid, spatial_merge_size: int, num_grid_per_side: int) -> list[VisionMetadata]:
    return [build_grid_metadata(grid, spatial_merge_size, num_grid_per_side)]


grid_metadata.cache_info = _cached_grid_metadata.cache_info
grid_metadata.cache_clear = _cached_grid_metadata.cache_clear


def build_grid_metadata(grid: Grid, spatial_merge_size: int, num_grid_per_side: int) -> VisionMetadata:
    indices, weights, rotary, seqlens = [], [], [], []
    for t, h, w in grid:
        idx, wts, rot = frame_tables(h, w, spatial_merge_size, num_grid_per_side)
        indices.append(np.tile(idx, (1, t)))
        weights.append(np.tile(wts, (1, t)))
        rotary.append(np.tile(rot, (t, 1)))
        seqlens.extend([h * w] * t)
    cu_seqlens = np.zeros(len(seqlens) + 1, dtype=np.int32)
    np.cumsum(seqlens, out=cu_seqlens[1:])
    patch_counts = tuple(t * h * w for t, h, w in grid)
    with torch.inference_mode(False):  # cached: usable later outside inference mode too (autograd, tests)
        return VisionMetadata(
            grid_thw=grid,
            spatial_merge_size=spatial_merge_size,
            num_grid_per_side=num_grid_per_side,
            pos_indices=torch.from_numpy(np.concatenate(indices, axis=1)),
            pos_weights=torch.from_numpy(np.concatenate(weights, axis=1)),
            rotary_positions=torch.from_numpy(np.concatenate(rotary, axis=0)),
            cu_seqlens=torch.from_numpy(cu_seqlens),
            max_seqlen=max(seqlens),
            patch_counts=patch_counts,
            token_counts=tuple(n // spatial_merge_size**2 for n in patch_counts),
        )
