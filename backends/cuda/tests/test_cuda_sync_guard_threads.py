"""The CUDA graph backend's sync guard on a real GPU: torch's sync debug mode is process-wide, so guards of several
threads keep it on until the last one ends and then restore what the process had (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from hwgraph_cuda.graphs import CudaGraphBackend

from hwgraph.graphs import HostSyncError
from hwgraph.testing.threads import first_leaves_while_second_is_inside


@pytest.mark.cuda
def test_sync_guards_of_two_threads_restore_the_processs_mode_after_the_last_one_ends():
    backend = CudaGraphBackend()
    tensor = torch.ones(8, device=backend.device)
    before = torch.cuda.get_sync_debug_mode()

    def inside_second_only():
        try:
            tensor.sum().item()
        except HostSyncError:
            return torch.cuda.get_sync_debug_mode(), "rejected"
        return torch.cuda.get_sync_debug_mode(), "let through"

    try:
        assert first_leaves_while_second_is_inside(backend.sync_guard, inside_second_only) == (2, "rejected")
        assert torch.cuda.get_sync_debug_mode() == before
    finally:
        torch.cuda.set_sync_debug_mode(before)
    assert tensor.sum().item() == 8.0
