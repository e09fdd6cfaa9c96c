"""Selection and detection behaviour that a hand-made mutation audit found unchecked: every refused candidate is
named, a CPU tensor on a GPU machine is a CPU job, and detection asks torch.cuda before torch_npu.

Platforms are ``PlatformInfo`` values or a simulated GPU runtime; vendor packages are ``None`` in ``sys.modules`` so
that their import fails. Plugin kernels reach the registry through a fixed set of backend specs, as in
``test_attention_selection.py``.
"""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest
import torch
from hwgraph_cuda.attention import FLASH_ATTN
from hwgraph_npu.attention import NPU
from hwgraph_rocm.attention import ROCM_AITER_FA

from hwgraph import registry
from hwgraph.attention import registry as attention_registry
from hwgraph.attention.registry import choose_attention
from hwgraph.capability import Capability
from hwgraph.platform import PlatformInfo, detect, platform_for
from hwgraph.registry import BackendSpec, SelectionError, choose_backend
from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

MI300X = PlatformInfo("rocm", "simulated rocm", "gfx942:sramecc+:xnack-", torch.__version__, "HIP", "6.2", 1)


@pytest.fixture
def plugin_kernels(monkeypatch):
    """The attention registry sees exactly the three plugins' kernels; no TRITON_INTERPRET, no HWGRAPH_ATTENTION."""
    specs = tuple(
        BackendSpec(name=name, class_path="unused:Backend", kinds=(name,), gate=lambda p: Capability.available(),
                    attention=(kernel,))
        for name, kernel in (("cuda", FLASH_ATTN), ("rocm", ROCM_AITER_FA), ("npu", NPU)))
    monkeypatch.setattr(attention_registry, "backend_specs", lambda: specs)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(attention_registry.ATTENTION_ENV, raising=False)


def test_the_attention_selection_error_names_every_refused_candidate_with_its_reasons(plugin_kernels, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(SelectionError) as failure:
        choose_attention(platform=MI300X, dtype=torch.float16, head_dim=300)
    message = str(failure.value)
    assert message.startswith("no attention kernel is available: ")
    assert "ROCM_AITER_FA: ROCM_AITER_FA needs the aiter package" in message
    assert "TRITON_ATTN: TRITON_ATTN needs the triton package" in message
    assert "TORCH_SDPA: TORCH_SDPA supports head_dim 1..256, got 300" in message
    # the kernels of other platforms are not candidates here
    assert "FLASH_ATTN" not in message and "NPU" not in message


@pytest.fixture
def fake_plugins(monkeypatch):
    """Replace the installed entry points by fake plugins (name -> probe); discovery is rerun for each test."""
    monkeypatch.delenv(registry.GRAPH_BACKEND_ENV, raising=False)

    def install(**probes):
        module = types.ModuleType("hwgraph_fake_selection_plugins")
        for name, probe in probes.items():
            setattr(module, name, probe)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        eps = [EntryPoint(name=name, value=f"{module.__name__}:{name}", group=registry.ENTRY_POINT_GROUP)
               for name in probes]
        monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
        registry.discovered.cache_clear()

    yield install
    registry.discovered.cache_clear()


def refused_spec(name: str, reason: str, priority: int) -> BackendSpec:
    return BackendSpec(name=name, class_path="hwgraph.graphs.cpu:CpuGraphBackend", kinds=("cuda",),
                       gate=lambda platform: Capability.unavailable(reason), priority=priority)


def test_the_graph_backend_fallback_names_every_refused_plugin(fake_plugins):
    fake_plugins(first=lambda: refused_spec("first", "the driver is too old", 90),
                 second=lambda: refused_spec("second", "the runtime is missing", 10))
    cuda = PlatformInfo("cuda", "simulated cuda", "sm_90", torch.__version__, "CUDA", "12.8", 1)
    selected = choose_backend(platform=cuda)
    assert selected.spec.name == "cpu"
    assert "first: the driver is too old" in selected.reason
    assert "second: the runtime is missing" in selected.reason


def test_a_cpu_tensor_on_a_gpu_machine_is_a_cpu_job(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    assert detect().kind == "cuda"
    for device in ("cpu", torch.device("cpu"), "meta"):
        info = platform_for(device)
        assert (info.kind, info.arch, info.device_count) == ("cpu", None, 0)
    assert platform_for("cuda:0").kind == "cuda"


def test_detection_asks_torch_cuda_before_torch_npu(monkeypatch):
    """A GPU machine that also has torch_npu installed is a GPU machine, and detection does not query the NPU."""
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))

    def asked():
        raise AssertionError("detect() queried torch_npu on a machine whose torch.cuda has a device")

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=asked), raising=False)
    info = detect()
    assert (info.kind, info.arch, info.notes) == ("cuda", "sm_90", ())
