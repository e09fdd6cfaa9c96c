"""detect() on an Ascend machine: runtime_version is CANN's (not torch_npu's own version), and a runtime that cannot
read its SoC version is a note, not a crash."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from hwgraph.platform import detect
from hwgraph.testing.simulate import simulate_gpu


@pytest.fixture
def npu(monkeypatch):
    """A torch_npu shaped as the real one: torch_npu/version.py holds __version__ and git_version only (setup.py's
    generate_torch_npu_version), and torch.npu has get_cann_version and get_soc_version."""
    simulate_gpu(monkeypatch, count=0)
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.5.1.post1"
    fake.version = types.SimpleNamespace(__version__="2.5.1.post1", git_version="abc1234")
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    runtime = types.SimpleNamespace(device_count=lambda: 1, get_device_name=lambda index=0: "Ascend910B3",
                                    get_soc_version=lambda: 223, get_cann_version=lambda module="CANN": "8.3.RC1")
    monkeypatch.setattr(torch, "npu", runtime, raising=False)
    return runtime


def test_the_runtime_version_is_canns_not_torch_npus(npu):
    info = detect()
    assert (info.kind, info.runtime) == ("npu", "CANN")
    assert info.runtime_version == "8.3.RC1"


def test_a_soc_version_that_cannot_be_read_is_a_note_not_a_crash(npu, monkeypatch):
    def broken():
        raise RuntimeError("aclrtGetSocName failed")

    monkeypatch.setattr(npu, "get_soc_version", broken)
    info = detect()
    assert info.kind == "npu"
    assert any("aclrtGetSocName failed" in note for note in info.notes), info.notes
