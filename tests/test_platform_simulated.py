"""Platform detection under simulated runtimes (this machine is CPU-only), and import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from hwgraph.platform import checked_device, detect, platform_for
from hwgraph.testing.simulate import DeviceProperties, simulate_broken_import, simulate_gpu


def simulate_npu(monkeypatch, count: int = 1) -> types.SimpleNamespace:
    """A fake ``torch_npu`` in sys.modules and the ``torch.npu`` namespace it would register, on a torch that is
    neither a CUDA nor a ROCm build (detection asks torch.cuda first, so a real GPU would otherwise win)."""
    simulate_gpu(monkeypatch, count=0)
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.13.0.post1"
    fake.version = types.SimpleNamespace(__version__=fake.__version__, git_version="abc1234")  # torch_npu's own
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    npu = types.SimpleNamespace(device_count=lambda: count, get_device_name=lambda index=0: "Ascend910B3",
                                get_soc_version=lambda: 223, get_cann_version=lambda module="CANN": "8.3.RC1")
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu


def test_a_rocm_build_with_a_gpu_is_rocm_with_the_full_gcn_arch_name(monkeypatch):
    simulate_gpu(monkeypatch, hip="6.2.41133", props=DeviceProperties("AMD Instinct MI300X", 9, 4,
                                                                      "gfx942:sramecc+:xnack-"))
    info = detect()
    assert (info.kind, info.arch, info.runtime, info.runtime_version) == ("rocm", "gfx942:sramecc+:xnack-", "HIP",
                                                                          "6.2.41133")
    assert info.device_name == "AMD Instinct MI300X" and info.device_count == 1


def test_a_rocm_build_wins_even_though_torch_version_cuda_is_set(monkeypatch):
    # Some ROCm wheels also carry a CUDA version string; torch.version.hip decides.
    simulate_gpu(monkeypatch, cuda="12.8", hip="6.4.0", props=DeviceProperties("MI250X", 9, 0, "gfx90a:sramecc+"))
    assert detect().kind == "rocm"


def test_a_cuda_build_with_a_gpu_is_cuda_with_an_sm_arch(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", count=2, props=DeviceProperties("NVIDIA H200", 9, 0))
    info = detect()
    assert (info.kind, info.arch, info.runtime, info.runtime_version, info.device_count) == ("cuda", "sm_90", "CUDA",
                                                                                              "12.8", 2)


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


def test_a_cuda_build_without_a_visible_device_is_cpu_with_a_note(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", count=0)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # a real torch_npu (an Ascend machine) would answer npu
    info = detect()
    assert info.kind == "cpu"
    assert any("no device is visible" in note for note in info.notes)


def test_a_fake_torch_npu_with_a_device_is_npu(monkeypatch):
    simulate_npu(monkeypatch)
    info = detect()
    assert (info.kind, info.device_name, info.arch, info.runtime, info.runtime_version) == (
        "npu", "Ascend910B3", "Ascend910B3", "CANN", "8.3.RC1")


def test_torch_npu_without_a_device_is_cpu_with_a_note(monkeypatch):
    simulate_npu(monkeypatch, count=0)
    info = detect()
    assert info.kind == "cpu"
    assert any("sees no NPU" in note for note in info.notes)


def test_an_npu_that_cannot_be_named_is_cpu_with_a_note(monkeypatch):
    simulate_npu(monkeypatch)

    def broken(index=0):
        raise RuntimeError("ACL stream synchronize failed, error code 507035")

    monkeypatch.setattr(torch.npu, "get_device_name", broken)
    info = detect()  # raised the runtime's error, where a failed device count is a note
    assert info.kind == "cpu"
    assert info.notes == ("torch_npu counts 1 NPU(s) but cannot name the first (ACL stream synchronize failed, "
                          "error code 507035)",)


def test_a_gpu_whose_properties_cannot_be_read_is_cpu_with_a_note(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", count=1)

    def broken(index=0):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    info = detect()
    assert info.kind == "cpu" and info.notes == (
        "torch.cuda counts 1 device(s) but cannot read the first one's properties (CUDA error: unspecified launch "
        "failure)",)


def test_a_gpu_named_by_index_is_described_by_its_own_architecture(monkeypatch):
    # detect() describes device 0; a host may mix GPUs, and the gates judge the architecture of the one in use
    simulate_gpu(monkeypatch, cuda="12.8", count=2)
    props = {0: DeviceProperties("NVIDIA H200", 9, 0, None), 1: DeviceProperties("Tesla T4", 7, 5, None)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props[index])
    assert (platform_for("cuda:1").device_name, platform_for("cuda:1").arch) == ("Tesla T4", "sm_75")
    assert platform_for("cuda:0").arch == platform_for("cuda").arch == detect().arch == "sm_90"


def test_a_gpu_named_without_index_is_described_as_the_current_one(monkeypatch):
    # "cuda" is the current GPU: with cuda:1 current (torch.cuda.set_device(1)) the gates judged device 0's
    # architecture, so a T4 was offered Hopper's kernels and FLASH_ATTN
    simulate_gpu(monkeypatch, cuda="12.8", count=2)
    props = {0: DeviceProperties("NVIDIA H200", 9, 0, None), 1: DeviceProperties("Tesla T4", 7, 5, None)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert (platform_for("cuda").device_name, platform_for("cuda").arch) == ("Tesla T4", "sm_75")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert platform_for("cuda").arch == "sm_90"


@pytest.mark.cpu_machine
def test_this_machine_is_cpu():
    info = detect()
    assert (info.kind, info.arch, info.device_count) == ("cpu", None, 0)


VENDOR_SDKS = ("torch_npu", "aiter", "flash_attn", "triton", "torchair", "vllm")

HYGIENE = """
import json, sys
vendor = {vendor!r}
def loaded(prefixes):
    return sorted(m for m in sys.modules if m.split(".")[0] in prefixes)
import hwgraph, hwgraph.registry, hwgraph.attention.registry
after_import = loaded(vendor)
listed = [spec.name for spec, cap in hwgraph.registry.list_backends()]
graph_modules = sorted(m for m in sys.modules if m.startswith("hwgraph_") and m.endswith(".graphs"))
print(json.dumps({{"after_import": after_import, "after_listing": loaded(vendor), "listed": listed,
                  "graph_modules": graph_modules}}))
"""


def test_importing_hwgraph_and_listing_backends_imports_no_vendor_sdk():
    result = subprocess.run([sys.executable, "-c", HYGIENE.format(vendor=VENDOR_SDKS)], capture_output=True,
                            text=True, check=True, timeout=120)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["after_import"] == []
    # Listing detects the platform; on an Ascend machine that needs torch_npu (importing it registers the device).
    allowed = {"torch_npu"} if detect().kind == "npu" else set()
    assert {m.split(".")[0] for m in seen["after_listing"]} <= allowed, seen["after_listing"]
    assert {"cpu", "cuda", "rocm", "npu"} <= set(seen["listed"])
    assert seen["graph_modules"] == [], "backend classes load only when chosen"


@pytest.mark.cpu_machine
def test_detect_touches_no_device_on_a_cpu_build(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("detect() queried device properties without a visible device")

    monkeypatch.setattr(torch.cuda, "get_device_properties", fail)
    assert detect().kind == "cpu"


def test_the_npu_runtime_version_is_canns_not_torch_npus(monkeypatch):
    simulate_npu(monkeypatch)  # torch_npu.version holds only torch_npu's own version, as the real one does
    info = detect()
    assert (info.kind, info.runtime) == ("npu", "CANN")
    assert info.runtime_version == "8.3.RC1"


def test_an_npu_soc_version_that_cannot_be_read_is_a_note_not_a_crash(monkeypatch):
    npu = simulate_npu(monkeypatch)

    def broken():
        raise RuntimeError("aclrtGetSocName failed")

    monkeypatch.setattr(npu, "get_soc_version", broken)
    info = detect()
    assert info.kind == "npu"
    assert any("aclrtGetSocName failed" in note for note in info.notes), info.notes


CANN_UNSET = "libascendcl.so: cannot open shared object file: No such file or directory"


def test_a_device_on_an_npu_whose_torch_npu_does_not_import_names_the_import_error(monkeypatch):
    simulate_gpu(monkeypatch, count=0)  # a CPU build of torch, as torch_npu uses
    simulate_broken_import(monkeypatch, "torch_npu", CANN_UNSET)  # the CANN toolkit's set_env.sh not sourced
    with pytest.raises(ValueError) as raised:
        checked_device("npu:0", "device", "from_pretrained")
    message = str(raised.value)
    assert "torch_npu is installed but does not import" in message and CANN_UNSET in message, message
    assert "is not a torch device" not in message  # it is one, once torch_npu imports


def test_detect_notes_why_an_installed_torch_npu_was_not_used(monkeypatch):
    simulate_gpu(monkeypatch, count=0)
    simulate_broken_import(monkeypatch, "torch_npu", CANN_UNSET)
    info = detect()
    assert info.kind == "cpu"
    assert any(CANN_UNSET in note for note in info.notes), info.notes
