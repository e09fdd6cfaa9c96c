"""An automatic choice that finds no backend for the platform because the installed plugin for it failed to load
says so, instead of telling the user to pip install the plugin they have; so does a kernel asked for by name whose
plugin module failed to import."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from importlib.metadata import EntryPoint

import pytest
import torch

from hwgraph import registry
from hwgraph.attention.registry import kernel_named
from hwgraph.platform import PlatformInfo
from hwgraph.registry import GRAPH_BACKEND_ENV, SelectionError, choose_backend

ROCM = PlatformInfo("rocm", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-", torch.__version__, "HIP", "6.4", 1)


@pytest.fixture(autouse=True)
def fresh_discovery(monkeypatch):
    monkeypatch.delenv(GRAPH_BACKEND_ENV, raising=False)
    registry.discovered.cache_clear()
    yield
    registry.discovered.cache_clear()


def test_the_fallback_names_the_installed_plugin_that_failed_to_load(monkeypatch):
    def probe():  # e.g. hwgraph-backend-rocm built against another hwgraph core
        raise ImportError("cannot import name 'torch_build' from 'hwgraph.graphs.torch_cuda'")

    module = types.ModuleType("hwgraph_fake_rocm")
    module.probe = probe
    monkeypatch.setitem(sys.modules, module.__name__, module)
    eps = [EntryPoint(name="rocm", value="hwgraph_fake_rocm:probe", group=registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry.discovered.cache_clear()

    selected = choose_backend(platform=ROCM)
    assert selected.spec.name == "cpu"
    assert "cannot import name 'torch_build'" in selected.reason, selected.reason
    assert "pip install 'hwgraph[rocm]'" not in selected.reason, selected.reason


class BrokenModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``name`` as a module whose import raises, as a plugin's attention module built against another core."""

    def __init__(self, name: str, error: str):
        self.name, self.error = name, error

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(self.error)


def test_an_unknown_kernel_names_the_plugin_attention_module_that_failed_to_import(monkeypatch):
    pytest.importorskip("hwgraph_rocm", reason="needs the rocm plugin installed (pip install -e backends/rocm)")
    error = "cannot import name 'register_varlen_kernel' from 'hwgraph.attention.varlen_inputs'"
    monkeypatch.delitem(sys.modules, "hwgraph_rocm.attention", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenModule("hwgraph_rocm.attention", error), *sys.meta_path])
    registry.discovered.cache_clear()

    with pytest.raises(SelectionError) as raised:
        kernel_named("ROCM_AITER_FA")
    assert "unknown attention kernel 'ROCM_AITER_FA'" in str(raised.value)
    assert f"hwgraph_rocm.attention brings no attention kernels: ImportError: {error}" in str(raised.value)
