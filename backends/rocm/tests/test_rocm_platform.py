"""The rocm plugin's gate and selection, and the replay check that catches captures HIP did not refuse."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types

import pytest
import torch
from hwgraph_rocm.graphs import RocmGraphBackend, replay_disagreement
from hwgraph_rocm.platform import build_archs, gate, probe

from hwgraph.graphs import CaptureError
from hwgraph.graphs.torch_cuda import TorchCudaCapturedGraph
from hwgraph.platform import PlatformInfo, detect
from hwgraph.registry import SelectionError, choose_backend, create_backend
from hwgraph.testing.simulate import DeviceProperties, assert_refused_for_a_host_device, simulate_aiter, simulate_gpu


def simulate_rocm(monkeypatch, arch="gfx942:sramecc+:xnack-", count=1, build_archs=()):
    """A ROCm build of torch with ``count`` GPUs of ``arch``, compiled for ``build_archs`` (what
    ``torch.cuda.get_arch_list()`` returns; empty by default, as a build that lists none: the gate's fixed list decides,
    on any machine, whatever the real torch here was built for)."""
    simulate_gpu(monkeypatch, hip="6.2.41133", count=count, props=DeviceProperties("AMD Instinct", 9, 4, arch))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(build_archs))


@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                    reason="checks the reason given on a CPU-only torch build")
def test_refused_on_a_cpu_only_torch_build_with_what_to_install():
    cap = RocmGraphBackend.capability()
    assert cap.reasons == (f"torch {torch.__version__} is a CPU-only build; install a ROCm build of torch",)
    with pytest.raises(SelectionError, match="install a ROCm build of torch"):
        create_backend("rocm")


def test_refused_on_a_cuda_build_pointing_at_the_cuda_backend(monkeypatch):
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    (reason,) = gate(detect()).reasons
    assert "is a CUDA 12.8 build: use the cuda backend" in reason


def test_refused_on_an_ascend_machine_without_advice_to_replace_torch():
    # torch_npu runs on a CPU build of torch: "install a ROCm build of torch" would break it.
    ascend = PlatformInfo("npu", "Ascend910B3", "Ascend910B3", torch.__version__, "CANN", "8.3.RC1", 1)
    assert gate(ascend).reasons == (
        "this machine's accelerator is npu: the rocm backend serves AMD GPUs; use the npu backend",)


def test_refused_on_a_rocm_build_without_a_visible_gpu(monkeypatch):
    simulate_rocm(monkeypatch, count=0)
    (reason,) = gate(detect()).reasons
    assert "ROCm (HIP 6.2.41133) build but no AMD GPU is visible" in reason and "HIP_VISIBLE_DEVICES" in reason


def test_refused_when_hip_cannot_count_devices_naming_the_error(monkeypatch):
    simulate_rocm(monkeypatch)

    def device_count():
        raise RuntimeError("hipErrorNoBinaryForGpu: Unable to find code object for all current devices!")

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # a real torch_npu would answer npu
    assert gate(detect()).reasons == (
        "torch is a ROCm (HIP 6.2.41133) build but no AMD GPU is visible (torch.cuda failed to count devices "
        "(hipErrorNoBinaryForGpu: Unable to find code object for all current devices!)); check rocm-smi and "
        "HIP_VISIBLE_DEVICES",)


@pytest.mark.parametrize("arch", ["gfx942:sramecc+:xnack-", "gfx90a:sramecc+:xnack-", "gfx950", "gfx1100"])
def test_chosen_automatically_on_a_simulated_supported_gpu(monkeypatch, arch):
    simulate_rocm(monkeypatch, arch)
    selected = choose_backend()
    assert (selected.spec.name, selected.reason) == ("rocm", "best available for rocm")
    assert RocmGraphBackend.capability("cuda:0").ok


def test_an_unsupported_architecture_is_refused_naming_it(monkeypatch):
    simulate_rocm(monkeypatch, "gfx803")
    (reason,) = gate(detect()).reasons
    assert reason.endswith("this GPU is gfx803") and "gfx942" in reason
    assert choose_backend().spec.name == "cpu"


ROCM_BUILD = ("gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100")  # torch 2.5.1+rocm6.2's list


@pytest.mark.parametrize("arch", ["gfx906:sramecc+:xnack-", "gfx900:xnack-"])
def test_a_gpu_the_torch_build_targets_is_served_though_the_fixed_list_lacks_it(monkeypatch, arch):
    """``torch.cuda.get_arch_list()`` names the gfx targets torch has kernels for; the gate compared the GPU with a
    fixed list instead, refusing an MI50/MI60 (gfx906) or Vega (gfx900) that this build runs."""
    simulate_rocm(monkeypatch, arch, build_archs=ROCM_BUILD)
    assert gate(detect()).ok
    assert choose_backend().spec.name == "rocm"


def test_a_gpu_the_torch_build_does_not_target_is_refused_naming_it_and_the_builds_targets(monkeypatch):
    """An MI355 (gfx950) under a torch built before gfx950 was a target: the fixed list has gfx950, so the gate chose
    the rocm backend and the first kernel failed with hipErrorNoBinaryForGpu."""
    simulate_rocm(monkeypatch, "gfx950:sramecc+:xnack-", build_archs=ROCM_BUILD)
    assert gate(detect()).reasons == (
        f"this GPU is gfx950 (gfx950:sramecc+:xnack-), but torch {torch.__version__} was built for gfx900, gfx906, "
        f"gfx908, gfx90a, gfx942, gfx1030, gfx1100 only (torch.cuda.get_arch_list()); install a ROCm build of torch "
        f"that targets gfx950",)
    assert choose_backend().spec.name == "cpu"


def test_a_build_listing_features_with_its_targets_serves_a_gpu_with_those_settings(monkeypatch):
    """A build made with ``PYTORCH_ROCM_ARCH='gfx90a:xnack-;gfx942:sramecc+'`` lists the features with the targets."""
    simulate_rocm(monkeypatch, "gfx90a:sramecc+:xnack-", build_archs=("gfx90a:xnack-", "gfx942:sramecc+"))
    assert build_archs() == ("gfx90a:xnack-", "gfx942:sramecc+")
    assert gate(detect()).ok
    simulate_rocm(monkeypatch, "gfx1100", build_archs=("gfx90a:xnack-", "gfx942:sramecc+"))
    assert gate(detect()).reasons == (
        f"this GPU is gfx1100, but torch {torch.__version__} was built for gfx90a:xnack-, gfx942:sramecc+ only "
        f"(torch.cuda.get_arch_list()); install a ROCm build of torch that targets gfx1100",)


@pytest.mark.parametrize("arch, target", [
    ("gfx90a:sramecc+:xnack-", "gfx90a:xnack-"),  # the setting the target asks for
    ("gfx90a:sramecc+:xnack+", "gfx90a"),  # a target that names no feature runs with either setting
    ("gfx90a:sramecc+:xnack+", "gfx90a:sramecc+"),  # ... and one that names another feature, with this one's either
    ("gfx90a:xnack-", "gfx90a:xnack-"),
    ("gfx90a", "gfx90a:xnack-"),  # a GPU that reports no setting is "any"
])
def test_a_target_with_features_serves_a_gpu_with_the_same_settings(monkeypatch, arch, target):
    simulate_rocm(monkeypatch, arch, build_archs=(target,))
    assert gate(detect()).ok
    assert choose_backend().spec.name == "rocm"


def test_a_gpu_whose_xnack_setting_no_target_has_is_refused_naming_its_features_and_the_builds_targets(monkeypatch):
    """Code built for ``gfx90a:xnack-`` does not load on an MI250X running with XNACK on (HSA_XNACK=1): HIP fails
    with ``hipErrorNoBinaryForGpu`` at the first kernel. The gate judged the processor alone and chose the backend."""
    simulate_rocm(monkeypatch, "gfx90a:sramecc+:xnack+", build_archs=("gfx90a:xnack-", "gfx942"))
    assert gate(detect()).reasons == (
        f"this GPU is gfx90a (gfx90a:sramecc+:xnack+), but torch {torch.__version__} was built for gfx90a:xnack-, "
        f"gfx942 only (torch.cuda.get_arch_list()): its gfx90a code (gfx90a:xnack-) does not run with this GPU's "
        f"xnack+; install a ROCm build of torch that targets gfx90a or gfx90a:sramecc+:xnack+, or run with "
        f"HSA_XNACK=0",)
    assert choose_backend().spec.name == "cpu"
    simulate_rocm(monkeypatch, "gfx942:sramecc-:xnack-", build_archs=("gfx942:sramecc+",))
    (reason,) = gate(detect()).reasons
    assert "its gfx942 code (gfx942:sramecc+) does not run with this GPU's sramecc-;" in reason
    assert "HSA_XNACK" not in reason
    # xnack conflicts too, but flipping it leaves sramecc's: HSA_XNACK=0 would not help, so it is not offered
    simulate_rocm(monkeypatch, "gfx90a:sramecc+:xnack+", build_archs=("gfx90a:sramecc-:xnack-",))
    (reason,) = gate(detect()).reasons
    assert "does not run with this GPU's sramecc+, xnack+;" in reason and "HSA_XNACK" not in reason


@pytest.mark.parametrize("arch, generic", [("gfx940:sramecc+:xnack-", "gfx9-4-generic"),
                                           ("gfx941:sramecc+:xnack-", "gfx9-4-generic"),
                                           ("gfx1250", "gfx12-5-generic"), ("gfx1251", "gfx12-5-generic")])
def test_generic_targets_cover_the_members_llvm_lists(monkeypatch, arch, generic):
    """LLVM's generic processor table lists gfx940 and gfx941 under gfx9-4-generic, and gfx12-5-generic for
    gfx1250/gfx1251; the table here lacked them and refused these GPUs as untargeted."""
    simulate_rocm(monkeypatch, arch, build_archs=("gfx90a", generic))
    assert gate(detect()).ok


def test_a_generic_target_this_plugin_does_not_know_is_named_not_taken_as_no_target(monkeypatch):
    """A family newer than the table (``gfx11-7-generic``) was refused with "install a build that targets gfx1171",
    though the build may well serve it."""
    simulate_rocm(monkeypatch, "gfx1171", build_archs=("gfx942", "gfx11-7-generic"))
    (reason,) = gate(detect()).reasons
    assert reason.startswith(f"this GPU is gfx1171, but torch {torch.__version__} was built for gfx942, "
                             f"gfx11-7-generic only (torch.cuda.get_arch_list()); this plugin does not know which "
                             f"processors the generic target(s) gfx11-7-generic serve"), reason
    assert "update hwgraph-backend-rocm" in reason


@pytest.mark.parametrize("arch, generic", [
    ("gfx1101", "gfx11-generic"), ("gfx1100", "gfx11-generic"), ("gfx1151", "gfx11-generic"),
    ("gfx906:sramecc+:xnack-", "gfx9-generic"), ("gfx900:xnack-", "gfx9-generic"),
    ("gfx942:sramecc+:xnack-", "gfx9-4-generic"), ("gfx950:sramecc+:xnack-", "gfx9-4-generic"),
    ("gfx1012:xnack-", "gfx10-1-generic"), ("gfx1032", "gfx10-3-generic"), ("gfx1201", "gfx12-generic"),
])
def test_a_build_for_a_generic_target_serves_every_processor_of_its_family(monkeypatch, arch, generic):
    """Code for an LLVM generic target (``gfx11-generic``) runs on every processor of its family; the gate compared
    names and refused, say, a Radeon RX 7800 XT (gfx1101) under a build made for gfx11-generic alone."""
    simulate_rocm(monkeypatch, arch, build_archs=(generic,))
    assert build_archs() == (generic,)
    assert gate(detect()).ok
    assert choose_backend().spec.name == "rocm"


@pytest.mark.parametrize("arch, generic", [
    ("gfx90a:sramecc+:xnack-", "gfx11-generic"), ("gfx908:sramecc+:xnack-", "gfx9-generic"),  # CDNA 1-2: no generic
    ("gfx1100", "gfx12-generic"), ("gfx1030", "gfx10-1-generic"), ("gfx942:sramecc+:xnack-", "gfx9-generic"),
])
def test_a_gpu_outside_the_generic_targets_family_is_refused_naming_it_and_the_builds_targets(monkeypatch, arch,
                                                                                            generic):
    simulate_rocm(monkeypatch, arch, build_archs=(generic, "gfx1201"))
    name = arch.split(":")[0]
    full = f" ({arch})" if arch != name else ""
    assert gate(detect()).reasons == (
        f"this GPU is {name}{full}, but torch {torch.__version__} was built for {generic}, gfx1201 only "
        f"(torch.cuda.get_arch_list()); install a ROCm build of torch that targets {name}",)


def test_a_generic_target_with_features_runs_only_with_those_settings(monkeypatch):
    simulate_rocm(monkeypatch, "gfx942:sramecc+:xnack+", build_archs=("gfx9-4-generic:xnack-",))
    assert "its gfx942 code (gfx9-4-generic:xnack-) does not run with this GPU's xnack+" in gate(detect()).reasons[0]
    simulate_rocm(monkeypatch, "gfx942:sramecc+:xnack-", build_archs=("gfx9-4-generic:xnack-",))
    assert gate(detect()).ok


def test_each_gpu_is_judged_against_the_builds_targets(monkeypatch):
    simulate_two_rocm_gpus(monkeypatch, "gfx942:sramecc+", "gfx906:xnack-")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(ROCM_BUILD))
    assert RocmGraphBackend.capability("cuda:1").ok
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["gfx942"])
    assert RocmGraphBackend.capability("cuda:0").ok
    assert RocmGraphBackend.capability("cuda:1").reasons[0].startswith("this GPU is gfx906 (gfx906:xnack-), but torch")


@pytest.mark.parametrize("listed", [[], ["sm_80", "sm_90", "compute_90"]], ids=["none", "a CUDA build's"])
def test_the_fixed_list_decides_where_the_build_lists_no_gfx_targets(monkeypatch, listed):
    """An empty list (older torch lists none without a visible GPU), or one of ``sm_*`` entries (a CUDA machine
    simulating ROCm): no gfx target to judge by."""
    simulate_rocm(monkeypatch, "gfx906", build_archs=listed)
    assert gate(detect()).reasons[0].endswith("this GPU is gfx906")
    simulate_rocm(monkeypatch, "gfx942", build_archs=listed)
    assert gate(detect()).ok


def test_a_build_whose_targets_cannot_be_read_is_judged_by_the_fixed_list(monkeypatch):
    simulate_rocm(monkeypatch, "gfx942")

    def get_arch_list():
        raise RuntimeError("HIP error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "get_arch_list", get_arch_list)
    assert gate(detect()).ok


def test_the_gate_reads_the_builds_targets_only_for_a_rocm_platform(monkeypatch):
    """The probe's gate runs at discovery on every machine: off ROCm it asks torch nothing about the build."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: asked.append(1) or ["gfx942"])
    for kind, arch in (("cpu", None), ("cuda", "sm_90"), ("npu", "Ascend910B3")):
        assert not gate(dataclasses.replace(MI300X, kind=kind, arch=arch)).ok
    assert asked == []
    assert gate(MI300X).ok and asked == [1]


def test_an_unreadable_architecture_is_refused(monkeypatch):
    simulate_rocm(monkeypatch, "")
    assert "could not read the AMD GPU architecture" in gate(detect()).describe()


def simulate_two_rocm_gpus(monkeypatch, arch0: str, arch1: str) -> None:
    simulate_rocm(monkeypatch)
    props = {0: DeviceProperties("GPU 0", 9, 4, arch0), 1: DeviceProperties("GPU 1", 9, 0, arch1)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props[index])


def test_the_architecture_of_the_requested_device_is_checked(monkeypatch):
    simulate_two_rocm_gpus(monkeypatch, "gfx942:sramecc+", "gfx906:xnack-")
    assert RocmGraphBackend.capability("cuda:0").ok
    assert RocmGraphBackend.capability("cuda:1").reasons[0].endswith("this GPU is gfx906")


def test_a_supported_gpu_beside_an_unsupported_device_0_is_judged_by_its_own_architecture(monkeypatch):
    # the gate judged detect(), which describes device 0: a supported MI300X at cuda:1 was refused for device 0's arch
    simulate_two_rocm_gpus(monkeypatch, "gfx1036", "gfx942:sramecc+")
    assert RocmGraphBackend.capability("cuda:1").ok
    assert type(create_backend("rocm", device="cuda:1")) is RocmGraphBackend
    assert RocmGraphBackend.capability("cuda:0").reasons[0].endswith("this GPU is gfx1036")


def test_aiter_is_judged_by_the_architecture_of_the_towers_gpu(monkeypatch, fake_aiter):
    from hwgraph.attention.registry import choose_attention
    from hwgraph.platform import platform_for

    simulate_two_rocm_gpus(monkeypatch, "gfx942:sramecc+", "gfx90a")
    chosen = choose_attention(platform=platform_for("cuda:1"), dtype=torch.bfloat16, head_dim=72, graph_safe=True)
    assert chosen.spec.name != "ROCM_AITER_FA"  # was chosen for gfx90a, which its gate refuses, from device 0's arch
    assert "ROCM_AITER_FA: ROCM_AITER_FA needs gfx942 or gfx950, found gfx90a" in chosen.reason
    assert choose_attention(platform=platform_for("cuda:0"), dtype=torch.bfloat16, head_dim=72).spec.name == \
        "ROCM_AITER_FA"


def test_the_rocm_backend_named_for_a_cpu_device_on_a_gpu_machine_says_it_captures_on_cuda_devices(monkeypatch):
    """A tower left on the CPU with the rocm backend named (or in $HWGRAPH_GRAPH_BACKEND): the gate judged the CPU
    job's platform and said no AMD GPU was visible, to check rocm-smi and HIP_VISIBLE_DEVICES, on a machine whose
    MI300X is visible; so did the class's own device check. An automatic choice for that device is still the cpu
    reference backend."""
    simulate_rocm(monkeypatch)
    assert_refused_for_a_host_device(monkeypatch, "rocm", torch.device("cpu"), "cuda")  # torch's name for AMD GPUs
    assert_refused_for_a_host_device(monkeypatch, "rocm", "cpu", "cuda")
    assert RocmGraphBackend.capability("cpu").reasons == ("the rocm graph backend captures on cuda devices, got cpu",)
    assert RocmGraphBackend.capability("cuda:0").ok


def test_a_device_that_is_not_visible_is_refused_without_reading_its_properties(monkeypatch):
    simulate_rocm(monkeypatch)

    def get_device_properties(index=0):
        if index >= torch.cuda.device_count():
            raise AssertionError("Invalid device id")  # what torch raises
        return DeviceProperties("AMD Instinct MI300X", 9, 4, "gfx942:sramecc+:xnack-")

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    assert RocmGraphBackend.capability("cuda:0").ok
    assert RocmGraphBackend.capability("cuda:1").reasons == ("cuda:1 does not exist: 1 device(s) are visible",)


def test_the_probe_describes_the_backend():
    spec = probe()
    assert (spec.name, spec.kinds, spec.priority, spec.class_path) == (
        "rocm", ("rocm",), 100, "hwgraph_rocm.graphs:RocmGraphBackend")
    assert spec.modes == RocmGraphBackend.modes  # what selection offers is what the class accepts
    expected = ["ROCM_AITER_FA"] if importlib.util.find_spec("hwgraph_rocm.attention") else []
    assert [kernel.name for kernel in spec.attention] == expected


def test_rocm_warms_up_on_the_capture_stream_and_checks_every_replay():
    assert RocmGraphBackend.check_replay_after_capture
    assert RocmGraphBackend.warmup_runs >= 2


class SilentlyBrokenGraph:
    """A HIP graph that captured nothing without raising: replay leaves the outputs as they were."""

    def __init__(self):
        self.was_reset = False

    def replay(self):
        pass

    def reset(self):
        self.was_reset = True


@pytest.fixture
def rocm_backend(monkeypatch):
    backend = RocmGraphBackend(device="cuda:0")  # an explicit index touches no device
    monkeypatch.setattr(backend, "synchronize", lambda: None)
    return backend


def test_a_replay_that_disagrees_with_eager_is_a_capture_error(rocm_backend):
    x = torch.arange(4.0)
    graph = SilentlyBrokenGraph()
    captured = TorchCudaCapturedGraph(graph, torch.zeros(4))
    with pytest.raises(CaptureError, match="pytorch#155684"):
        rocm_backend.check_replay(captured, lambda: x * 2)
    assert graph.was_reset and captured.outputs is None


def test_a_replay_that_agrees_with_eager_passes_the_check(rocm_backend):
    x = torch.arange(4.0)
    captured = TorchCudaCapturedGraph(SilentlyBrokenGraph(), x * 2)  # outputs already hold the right answer
    rocm_backend.check_replay(captured, lambda: x * 2)
    torch.testing.assert_close(captured.outputs, x * 2)


def bf16_block_stack(split_k: bool, blocks: int = 27, hidden: int = 128, tokens: int = 64) -> torch.Tensor:
    """The output of ``blocks`` pre-norm MLP blocks in bfloat16 (products accumulated in float32, as on the GPU).
    ``split_k``: each product's two halves of the reduction are added in the other order, as a GEMM whose partial sums
    land by atomics (rocBLAS's, which PyTorch allows unless deterministic algorithms are on) may add them."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator).bfloat16()

    def product(a, w):
        if not split_k:
            return (a.float() @ w.float()).bfloat16()
        k = w.shape[0] // 2
        return (a[:, k:].float() @ w[k:].float() + a[:, :k].float() @ w[:k].float()).bfloat16()

    for _ in range(blocks):
        up = (torch.randn(hidden, 4 * hidden, generator=generator) / hidden ** 0.5).bfloat16()
        down = (torch.randn(4 * hidden, hidden, generator=generator) / (4 * hidden) ** 0.5).bfloat16()
        h = torch.nn.functional.layer_norm(x, (hidden,))
        x = x + product(torch.nn.functional.gelu(product(h, up)), down)
    return x


def test_a_replay_that_differs_from_eager_by_summation_order_alone_passes_the_check(rocm_backend):
    """The check compared at ``assert_close``'s bf16 defaults (atol 1e-5 elementwise): outputs of 27 bf16 blocks whose
    products only added their partial sums in another order failed it, so a good HIP graph was refused as broken
    and its budget ran eagerly. Rounding is within the dtype's bound the manager's verification uses."""
    replayed, eager = bf16_block_stack(split_k=True), bf16_block_stack(split_k=False)
    assert not torch.equal(replayed, eager)  # the other order rounds some outputs differently
    captured = TorchCudaCapturedGraph(SilentlyBrokenGraph(), replayed)
    rocm_backend.check_replay(captured, lambda: eager)
    assert captured.graph is not None and captured.outputs is replayed  # kept, not released


def test_a_replay_with_stale_rows_is_refused_naming_its_error_and_the_bound(rocm_backend):
    eager = bf16_block_stack(split_k=False)
    stale = eager.clone()
    stale[48:] = 0  # a quarter of the rows never written by the replay
    graph = SilentlyBrokenGraph()
    captured = TorchCudaCapturedGraph(graph, (eager.clone(), stale))
    with pytest.raises(CaptureError, match=r"pytorch#155684.*AssertionError: output 1 of 2: relative error 0\.\d+ "
                                           r"above 0\.03 for torch\.bfloat16"):
        rocm_backend.check_replay(captured, lambda: (eager, eager))
    assert graph.was_reset and captured.outputs is None


def test_the_replay_check_wants_nan_in_the_same_places_and_exact_integers(rocm_backend):
    values = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    rocm_backend.check_replay(TorchCudaCapturedGraph(SilentlyBrokenGraph(), values.clone()), lambda: values)
    moved = torch.tensor([float("nan"), 1.0, float("inf"), -2.0])
    with pytest.raises(CaptureError, match="output 0 of 1: NaN in other places"):
        rocm_backend.check_replay(TorchCudaCapturedGraph(SilentlyBrokenGraph(), moved), lambda: values)
    lengths = torch.tensor([0, 4, 9], dtype=torch.int32)
    with pytest.raises(CaptureError, match="output 0 of 1: 1 of 3 torch.int32 elements differ"):
        rocm_backend.check_replay(TorchCudaCapturedGraph(SilentlyBrokenGraph(), lengths + (lengths == 9)),
                                  lambda: lengths)


@pytest.mark.rocm
def test_a_bf16_block_stack_captures_on_an_amd_gpu_and_passes_the_replay_check():
    """On the GPU itself: the replay of 27 bf16 blocks checked against an eager run on another stream, where rocBLAS
    and hipBLASLt may sum in another order."""
    generator = torch.Generator().manual_seed(0)
    weights = [((torch.randn(256, 1024, generator=generator) / 16).bfloat16().cuda(),
                (torch.randn(1024, 256, generator=generator) / 32).bfloat16().cuda()) for _ in range(27)]
    x = torch.randn(512, 256, generator=generator).bfloat16().cuda()

    def blocks():
        h = x
        for up, down in weights:
            h = h + torch.nn.functional.gelu(torch.nn.functional.layer_norm(h, (256,)) @ up) @ down
        return h

    backend = RocmGraphBackend(device="cuda:0")
    captured = backend.capture(blocks)  # raises CaptureError where the check refuses it
    captured.replay()
    backend.synchronize()
    assert replay_disagreement([captured.outputs], [blocks()]) is None
    captured.release()


def test_refused_on_a_supported_gpu_with_a_torch_older_than_the_backend_supports():
    mi300x = PlatformInfo("rocm", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-", "2.4.1+rocm6.1", "HIP", "6.1", 1)
    assert gate(mi300x).reasons == ("the rocm graph backend needs torch >= 2.10, found 2.4.1+rocm6.1; upgrade torch",)
    assert gate(dataclasses.replace(mi300x, torch_version="2.10.0+rocm7.0")).ok


def test_aiter_adapter_gives_an_all_padding_batch_a_valid_grid_and_zero_rows(monkeypatch):
    from hwgraph_rocm.attention import aiter_varlen

    calls = []

    def flash_attn_varlen_func(**kwargs):
        calls.append(kwargs)
        return torch.full_like(kwargs["q"], float("nan"))  # rows the kernel never writes

    monkeypatch.setitem(sys.modules, "aiter", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    q = torch.randn(5, 2, 72, dtype=torch.float16)
    out = aiter_varlen(q, q, q, torch.zeros(3, dtype=torch.int32), 0, 72 ** -0.5)  # two empty sequences, 5 padding rows
    assert (calls[0]["max_seqlen_q"], calls[0]["max_seqlen_k"]) == (1, 1)
    assert torch.equal(out, torch.zeros_like(out))


MI300X = PlatformInfo("rocm", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-", torch.__version__, "HIP", "6.2", 1)


@pytest.fixture
def fake_aiter(monkeypatch):
    return simulate_aiter(monkeypatch)


def test_aiter_attention_is_refused_off_rocm_naming_the_platform(fake_aiter):
    from hwgraph_rocm.attention import ROCM_AITER_FA

    assert ROCM_AITER_FA.capability(MI300X).ok
    for kind, arch in (("cuda", "sm_90"), ("npu", "Ascend910B3"), ("cpu", None)):
        elsewhere = dataclasses.replace(MI300X, kind=kind, arch=arch)
        assert ROCM_AITER_FA.capability(elsewhere).reasons == (
            f"ROCM_AITER_FA runs on AMD ROCm, this platform is {kind}",)


def test_aiter_attention_names_every_missing_piece_at_once(monkeypatch):
    from hwgraph_rocm.attention import ROCM_AITER_FA

    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter now fails
    mi250x = dataclasses.replace(MI300X, device_name="AMD Instinct MI250X", arch="gfx90a:sramecc+:xnack-")
    arch, package = ROCM_AITER_FA.capability(mi250x).reasons
    assert arch == "ROCM_AITER_FA needs gfx942 or gfx950, found gfx90a"
    assert package.startswith("ROCM_AITER_FA needs the aiter package (")


def test_aiter_attention_takes_half_precision_only(fake_aiter):
    from hwgraph_rocm.attention import ROCM_AITER_FA

    for dtype in (torch.float16, torch.bfloat16):
        assert ROCM_AITER_FA.capability(MI300X, dtype=dtype, head_dim=72).ok
    assert ROCM_AITER_FA.capability(MI300X, dtype=torch.float32, head_dim=72).reasons == (
        "ROCM_AITER_FA supports dtypes float16, bfloat16, got float32",)
