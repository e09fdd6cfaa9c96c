"""An installed torch_npu that does not import (CANN environment not set) is named, not hidden."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import pytest

from hwgraph.platform import checked_device, detect
from hwgraph.testing.simulate import simulate_gpu

FAILURE = "libascendcl.so: cannot open shared object file: No such file or directory"


class BrokenTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a ``torch_npu`` whose import raises, as one does where the CANN toolkit's set_env.sh was not sourced."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(FAILURE)


@pytest.fixture
def broken_torch_npu(monkeypatch):
    simulate_gpu(monkeypatch, count=0)  # a CPU build of torch, as torch_npu uses
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenTorchNpu(), *sys.meta_path])


def test_a_device_on_an_npu_whose_torch_npu_does_not_import_names_the_import_error(broken_torch_npu):
    with pytest.raises(ValueError) as raised:
        checked_device("npu:0", "device", "from_pretrained")
    message = str(raised.value)
    assert "torch_npu is installed but does not import" in message and FAILURE in message, message
    assert "is not a torch device" not in message  # it is one, once torch_npu imports


def test_detect_notes_why_an_installed_torch_npu_was_not_used(broken_torch_npu):
    info = detect()
    assert info.kind == "cpu"
    assert any(FAILURE in note for note in info.notes), info.notes
