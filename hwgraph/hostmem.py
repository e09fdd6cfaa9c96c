"""Host memory for asynchronous copies to an accelerator."""

from __future__ import annotations

import torch


def pinned_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of host ``tensor`` in pinned memory, in ``dtype`` (default: its own), for a truly asynchronous copy to
    an accelerator.

    ``Tensor.pin_memory()`` first asks the driver whether the pointer is already pinned; on the H200's host that
    query cost about 0.5 ms per tensor in the eager tower's profile. Allocating from the pinned host allocator and
    copying skips it. Give the dtype the copy lands in on the device: torch converts a host tensor of another dtype
    on the host, into pageable memory, before a host-to-device copy, which then stages through the driver again."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype if dtype is None else dtype, pin_memory=True)
    return out.copy_(tensor)
