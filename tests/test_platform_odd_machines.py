"""Platform detection and the cuda/rocm gates on odd platforms, simulated on this CPU-only machine: an NPU torch_npu
cannot name, an Ascend machine whose NPU is not usable, a ROCm build of torch without an AMD GPU."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from hwgraph import cli
from hwgraph.platform import detect
from hwgraph.registry import GRAPH_BACKEND_ENV
from hwgraph.testing.simulate import DeviceProperties, simulate_broken_import, simulate_gpu

cuda_platform = pytest.importorskip("hwgraph_cuda.platform")
rocm_platform = pytest.importorskip("hwgraph_rocm.platform")

CANN_UNSET = "libascendcl.so: cannot open shared object file: No such file or directory"


def simulate_npu(monkeypatch, name, count: int = 1) -> None:
    """A fake ``torch_npu`` whose first NPU ``torch.npu.get_device_name`` calls ``name``, on a CPU build of torch."""
    simulate_gpu(monkeypatch, count=0)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu = types.SimpleNamespace(device_count=lambda: count, get_device_name=lambda index=0: name,
                                get_soc_version=lambda: 223, get_cann_version=lambda module="CANN": "8.3.RC1")
    monkeypatch.setattr(torch, "npu", npu, raising=False)


@pytest.mark.parametrize("name", [" ", "", None])
def test_an_npu_torch_npu_cannot_name_is_an_unnamed_npu_with_a_note_not_a_crash(monkeypatch, capsys, name):
    """torch_npu names an NPU " " where CANN reads no SoC name (aclrtGetSocName returns null): detect() raised
    IndexError (" ".split()[0]), taking `hwgraph info` and every backend choice down; None became the name 'None'."""
    simulate_npu(monkeypatch, name)
    info = detect()
    assert (info.kind, info.device_name, info.arch, info.device_count) == ("npu", None, None, 1)
    assert "torch_npu gives the first NPU no name (CANN could not read its SoC name)" in info.notes
    monkeypatch.delenv(GRAPH_BACKEND_ENV, raising=False)
    cli.main(["info", "--json"])
    platform = json.loads(capsys.readouterr().out)["platform"]
    assert (platform["kind"], platform["device_name"], platform["arch"]) == ("npu", None, None)


@pytest.mark.parametrize("torch_npu", ["does not import", "sees no NPU"])
def test_cuda_and_rocm_do_not_advise_replacing_torch_on_an_ascend_machine_whose_npu_is_not_usable(monkeypatch,
                                                                                                  torch_npu):
    """torch_npu runs on a CPU build of torch: where it is installed but its NPU not usable (the CANN environment not
    set, no NPU visible), the platform is cpu and both gates said to install a CUDA / ROCm build, which breaks it."""
    if torch_npu == "does not import":
        simulate_gpu(monkeypatch, count=0)
        simulate_broken_import(monkeypatch, "torch_npu", CANN_UNSET)
    else:
        simulate_npu(monkeypatch, "Ascend910B3", count=0)
    platform = detect()
    assert platform.kind == "cpu"
    (cuda,) = cuda_platform.gate(platform).reasons
    (rocm,) = rocm_platform.gate(platform).reasons
    for reason, vendor in ((cuda, "CUDA"), (rocm, "ROCm")):
        assert f"install a {vendor} build" not in reason, reason
        assert "as torch_npu needs" in reason and "use the npu backend" in reason, reason


def test_without_torch_npu_a_cpu_build_is_still_told_to_install_a_gpu_build(monkeypatch):
    simulate_gpu(monkeypatch, count=0)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not importable, whatever is installed here
    platform = detect()
    assert cuda_platform.gate(platform).reasons == (
        f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch",)
    assert rocm_platform.gate(platform).reasons == (
        f"torch {torch.__version__} is a CPU-only build; install a ROCm build of torch",)


def test_the_cuda_gate_on_a_rocm_build_without_an_amd_gpu_says_nvidia_gpus_need_a_cuda_build(monkeypatch):
    """An NVIDIA machine with a ROCm build of torch: the cuda gate said only "use the rocm backend", whose own reason
    is that no AMD GPU is visible, so neither said what the NVIDIA GPU needs (the rocm gate says so the other way)."""
    simulate_gpu(monkeypatch, hip="6.2.41133-dd7f95766", count=0)
    platform = detect()
    assert platform.kind == "cpu"
    assert cuda_platform.gate(platform).reasons == (
        "torch is a ROCm (HIP 6.2.41133-dd7f95766) build: use the rocm backend (NVIDIA GPUs need a CUDA build)",)
    simulate_gpu(monkeypatch, hip="6.2.41133-dd7f95766", props=DeviceProperties("MI300X", 9, 4, "gfx942"))
    assert cuda_platform.gate(detect()).reasons == (
        "torch is a ROCm (HIP 6.2.41133-dd7f95766) build: use the rocm backend",)
