"""The CUDA graph backend's sync guard on a real GPU: torch's sync debug mode is process-wide, so guards of several
threads keep it on until the last one ends and then restore what the process had (skipped without a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from hwgraph_cuda.graphs import CudaGraphBackend

from hwgraph.graphs import HostSyncError


@pytest.mark.cuda
def test_sync_guards_of_two_threads_restore_the_processs_mode_after_the_last_one_ends():
    backend = CudaGraphBackend()
    tensor = torch.ones(8, device=backend.device)
    before = torch.cuda.get_sync_debug_mode()
    first_in, second_in, first_out, second_may_leave = (threading.Event() for _ in range(4))
    seen, errors = {}, []

    def first():
        try:
            with backend.sync_guard():
                first_in.set()
                second_in.wait(10)
        except BaseException as exc:  # noqa: BLE001 (reported by the main thread)
            errors.append(exc)
        finally:
            first_out.set()

    def second():
        try:
            first_in.wait(10)
            with backend.sync_guard():
                second_in.set()
                first_out.wait(10)
                seen["mode"] = torch.cuda.get_sync_debug_mode()
                try:
                    tensor.sum().item()
                except HostSyncError:
                    seen["host read"] = "rejected"
                second_may_leave.wait(10)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    threads[0].join(10)
    second_may_leave.set()
    threads[1].join(10)
    try:
        assert not errors
        assert seen == {"mode": 2, "host read": "rejected"}
        assert torch.cuda.get_sync_debug_mode() == before
    finally:
        torch.cuda.set_sync_debug_mode(before)
    assert tensor.sum().item() == 8.0
