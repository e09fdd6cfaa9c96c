"""The cuda plugin's gate and selection: refused here (CPU-only torch) with reasons, chosen on a simulated GPU; the
torch versions the shared ``torch.cuda`` backend accepts."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from hwgraph_cuda.graphs import CudaGraphBackend
from hwgraph_cuda.platform import attention_kernels, gate, probe

from hwgraph.graphs.torch_cuda import torch_build, torch_version_capability
from hwgraph.platform import PlatformInfo, detect
from hwgraph.registry import SelectionError, choose_backend, create_backend
from hwgraph.testing.simulate import DeviceProperties, assert_refused_for_a_host_device, simulate_gpu

H200 = DeviceProperties("NVIDIA H200", 9, 0)


def cuda_platform(torch_version: str) -> PlatformInfo:
    return PlatformInfo("cuda", "NVIDIA H200", "sm_90", torch_version, "CUDA", "12.8", 1)


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the reason given on a CPU-only torch build")
def test_refused_on_a_cpu_only_torch_build_with_what_to_install():
    cap = CudaGraphBackend.capability()
    assert not cap.ok
    assert cap.reasons == (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch",)
    with pytest.raises(SelectionError, match="install a CUDA build of torch"):
        create_backend("cuda")


def test_refused_on_a_rocm_build_pointing_at_the_rocm_backend(monkeypatch):
    simulate_gpu(monkeypatch, hip="6.2.41133", props=DeviceProperties("MI300X", 9, 4, "gfx942:sramecc+:xnack-"))
    assert gate(detect()).reasons == ("torch is a ROCm (HIP 6.2.41133) build: use the rocm backend",)


def test_a_rocm_build_that_also_names_a_cuda_version_is_rocm_to_the_cuda_gate(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", hip="6.4.0", props=DeviceProperties("MI250X", 9, 0, "gfx90a:sramecc+"))
    assert torch_build() == ("rocm", "6.4.0")
    assert gate(detect()).reasons == ("torch is a ROCm (HIP 6.4.0) build: use the rocm backend",)


def test_refused_on_an_ascend_machine_without_advice_to_replace_torch():
    # torch_npu runs on a CPU build of torch: "install a CUDA build of torch" would break it.
    ascend = PlatformInfo("npu", "Ascend910B3", "Ascend910B3", torch.__version__, "CANN", "8.3.RC1", 1)
    assert gate(ascend).reasons == (
        "this machine's accelerator is npu: the cuda backend serves NVIDIA GPUs; use the npu backend",)


def test_refused_on_a_cuda_build_without_a_visible_gpu(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", count=0)
    (reason,) = gate(detect()).reasons
    assert "CUDA 12.8 build but no NVIDIA GPU is visible" in reason
    assert "CUDA_VISIBLE_DEVICES" in reason


@pytest.mark.parametrize("version, ok", [("2.9.1", False), ("2.9", False), ("2.10.0", True), ("2.13.0+cu128", True),
                                         ("2.11.0a0+git1234", True)])
def test_torch_versions_compare_as_versions(version, ok):
    cap = gate(cuda_platform(version))
    assert cap.ok is ok
    if not ok:
        assert cap.reasons == (f"the cuda graph backend needs torch >= 2.10, found {version}; upgrade torch",)


@pytest.mark.parametrize("found", [None, "", "unknown"])
def test_an_unknown_torch_version_is_refused(found):
    cap = torch_version_capability("cuda", found)
    assert not cap.ok and "needs torch >= 2.10" in cap.describe()


@pytest.mark.parametrize(("found", "ok"), [("2.10.0a0+ecf3bae40a.nv25.11", True), ("2.10.0.dev20250901", True),
                                           ("2.10.1", True), ("2.9.1", False), ("2.9.0a0+git1234", False)])
def test_pre_releases_of_the_minimum_torch_count_as_it(found, ok):
    """NVIDIA's containers ship torch as ``2.10.0a0+<commit>.nv<yy.mm>``; vLLM's own check counts them as 2.10."""
    assert torch_version_capability("cuda", found).ok is ok


def test_chosen_automatically_on_a_simulated_cuda_gpu(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", props=H200)
    selected = choose_backend()
    assert (selected.spec.name, selected.reason) == ("cuda", "best available for cuda")
    assert CudaGraphBackend.capability("cuda:0").ok


def test_a_device_index_that_does_not_exist_is_refused(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", props=H200)
    assert CudaGraphBackend.capability("cuda:3").reasons == ("cuda:3 does not exist: 1 device(s) are visible",)
    assert "captures on cuda devices" in CudaGraphBackend.capability("cpu").describe()


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"], ids=str)
def test_the_cuda_backend_named_for_a_cpu_device_on_a_gpu_machine_says_it_captures_on_cuda_devices(monkeypatch,
                                                                                                  device):
    """A tower left on the CPU with the cuda backend named (or in $HWGRAPH_GRAPH_BACKEND): the gate judged the CPU
    job's platform and said no NVIDIA GPU was visible, to check nvidia-smi and CUDA_VISIBLE_DEVICES, on a machine
    whose H200 is visible. An automatic choice for that device is still the cpu reference backend."""
    simulate_gpu(monkeypatch, cuda="12.8", props=H200)
    assert_refused_for_a_host_device(monkeypatch, "cuda", device, "cuda")
    assert type(create_backend("cuda", device="cuda:0")) is CudaGraphBackend


def test_a_device_index_equal_to_the_device_count_does_not_exist(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", count=1, props=H200)
    assert CudaGraphBackend.capability("cuda:0").ok
    assert CudaGraphBackend.capability("cuda:1").reasons == ("cuda:1 does not exist: 1 device(s) are visible",)


def test_the_probe_describes_the_backend_without_loading_it():
    spec = probe()
    assert (spec.name, spec.kinds, spec.modes, spec.priority) == ("cuda", ("cuda",), ("full",), 100)
    assert spec.class_path == "hwgraph_cuda.graphs:CudaGraphBackend"
    assert spec.load() is CudaGraphBackend


def test_the_probe_brings_flash_attn_when_the_attention_module_exists():
    names = [kernel.name for kernel in probe().attention]
    expected = ["FLASH_ATTN"] if importlib.util.find_spec("hwgraph_cuda.attention") else []
    assert names == expected


def test_the_probe_still_works_without_the_attention_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "hwgraph_cuda.attention", None)  # makes the import fail
    assert attention_kernels() == ()
    assert probe().name == "cuda"
