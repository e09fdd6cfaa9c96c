"""Choosing an attention kernel: priorities, HWGRAPH_ATTENTION, and reasons, on simulated platforms.

Platforms are ``PlatformInfo`` values passed explicitly; vendor packages (aiter, torch_npu) are fake modules in
``sys.modules``, or ``None`` there to make their import fail. The plugin kernels reach the registry through a
fixed set of backend specs, so these tests do not depend on which plugins are installed; one test checks the
installed plugins bring the same kernels.
"""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
import torch
from hwgraph_cuda.attention import FLASH_ATTN
from hwgraph_npu.attention import NPU
from hwgraph_rocm.attention import ROCM_AITER_FA

from hwgraph.attention import registry
from hwgraph.attention.base import KernelSpec
from hwgraph.attention.registry import choose_attention, kernel_named, list_kernels
from hwgraph.capability import Capability
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower  # here, not under a fake torch_npu (see below)
from hwgraph.platform import PlatformInfo
from hwgraph.registry import BackendSpec, SelectionError
from hwgraph.testing.simulate import simulate_aiter


def platform(kind: str, arch: str | None, count: int = 1) -> PlatformInfo:
    runtime = {"cuda": "CUDA", "rocm": "HIP", "npu": "CANN"}.get(kind)
    return PlatformInfo(kind=kind, device_name=f"simulated {kind}", arch=arch, torch_version=torch.__version__,
                        runtime=runtime, runtime_version="1.0" if runtime else None, device_count=count)


CPU = platform("cpu", None, 0)
H200 = platform("cuda", "sm_90")
T4 = platform("cuda", "sm_75")
MI300X = platform("rocm", "gfx942:sramecc+:xnack-")
MI250X = platform("rocm", "gfx90a:sramecc+:xnack-")
ASCEND = platform("npu", "Ascend910B")


@pytest.fixture(autouse=True)
def plugin_kernels(monkeypatch):
    """The registry sees exactly the three plugins' kernels; no TRITON_INTERPRET and no HWGRAPH_ATTENTION."""
    specs = tuple(
        BackendSpec(name=name, class_path="unused:Backend", kinds=(name,), gate=lambda p: Capability.available(),
                    attention=(kernel,))
        for name, kernel in (("cuda", FLASH_ATTN), ("rocm", ROCM_AITER_FA), ("npu", NPU)))
    monkeypatch.setattr(registry, "backend_specs", lambda: specs)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(registry.ATTENTION_ENV, raising=False)


@pytest.fixture
def fake_aiter(monkeypatch):
    return simulate_aiter(monkeypatch)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """A fake torch_npu in sys.modules. Its ``__spec__`` is None, so ``importlib.util.find_spec("torch_npu")``
    raises ValueError while it is there: the tower's first import (transformers, triton) must not happen under it.
    Run alone on the H200 (transformers 5.17), the tower test below failed with ``ValueError: torch_npu.__spec__ is
    None`` when it imported the tower inside the test."""
    module = types.ModuleType("torch_npu")
    module.npu_fused_infer_attention_score = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def reasons(name: str, plat: PlatformInfo, **kwargs) -> tuple[str, ...]:
    return kernel_named(name).capability(plat, **kwargs).reasons


# ---------------------------------------------------------------- listing and the documented order


def test_listing_names_every_kernel_with_its_capability():
    listed = {spec.name: cap for spec, cap in list_kernels(platform=CPU)}
    assert set(listed) == {"TORCH_SDPA", "TRITON_ATTN", "FLASH_ATTN", "ROCM_AITER_FA", "NPU"}
    assert listed["TORCH_SDPA"].ok
    assert all(not cap.ok and cap.reasons for name, cap in listed.items() if name != "TORCH_SDPA")


def test_installed_plugins_bring_the_same_kernels():
    from importlib.metadata import entry_points

    from hwgraph.registry import ENTRY_POINT_GROUP, backend_specs  # the real discovery, entry points included

    plugin_kernels = {"cuda": FLASH_ATTN, "rocm": ROCM_AITER_FA, "npu": NPU}
    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} & plugin_kernels.keys()
    assert installed, "no backend plugin is installed (ci/env.sh installs all three)"
    brought = {spec.name: spec.attention for spec in backend_specs() if spec.name in installed}
    assert {name: tuple(k.name for k in kernels) for name, kernels in brought.items()} == {
        name: (plugin_kernels[name].name,) for name in installed}
    for name in installed:
        assert brought[name][0] is plugin_kernels[name]


def test_cpu_chooses_torch_sdpa_and_says_why_triton_was_refused():
    chosen = choose_attention(platform=CPU, dtype=torch.bfloat16, head_dim=72)
    assert chosen.spec.name == "TORCH_SDPA" and callable(chosen.fn)
    assert "TRITON_ATTN: on CPU TRITON_ATTN runs only under the Triton interpreter (TRITON_INTERPRET=1)" \
        in chosen.reason


def test_cpu_under_the_triton_interpreter_prefers_triton_attn(monkeypatch):
    pytest.importorskip("triton")
    from hwgraph.attention import triton_attn

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_attn, "imported_interpreted", lambda: True)  # as where it was set before triton
    assert choose_attention(platform=CPU).spec.name == "TRITON_ATTN"


INTERPRETER_SET_LATE = """
import os
import triton  # another library imported it first: its @jit helpers are compiled ones
os.environ["TRITON_INTERPRET"] = "1"
from hwgraph.attention.registry import choose_attention
from hwgraph.platform import PlatformInfo
from hwgraph.testing.reference import random_packed_batch
chosen = choose_attention(platform=PlatformInfo("cpu", None, None, "", None, None, 0))
chosen.fn(*random_packed_batch([5, 7], heads=1, head_dim=72).args())  # it runs
print(chosen.spec.name, "|", chosen.reason)
"""


def test_an_interpreter_set_after_triton_was_imported_leaves_triton_attn_out_on_cpu():
    """TRITON_INTERPRET=1 set after triton's import: the gate said TRITON_ATTN ran, the automatic choice took it, and
    its first call failed (InterpreterError: Cannot call @triton.jit'd outside of the scope of a kernel)."""
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", INTERPRETER_SET_LATE], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    name, reason = done.stdout.strip().splitlines()[-1].split(" | ")
    assert name == "TORCH_SDPA"
    assert "TRITON_INTERPRET=1 was set after triton was imported in this process" in reason


INTERPRETER_SET_AFTER_AN_AUTOMATIC_CHOICE = """
import os, sys
from hwgraph.attention.registry import choose_attention
from hwgraph.platform import PlatformInfo
from hwgraph.testing.reference import random_packed_batch
cpu = PlatformInfo("cpu", None, None, "", None, None, 0)
first = choose_attention(platform=cpu)  # what a tower's first forward does
print(first.spec.name, "triton" in sys.modules)
os.environ["TRITON_INTERPRET"] = "1"  # the user's own triton use starts only now
chosen = choose_attention("TRITON_ATTN", platform=cpu)
chosen.fn(*random_packed_batch([5, 7], heads=1, head_dim=72).args())
print(chosen.spec.name)
"""


def test_an_automatic_choice_on_cpu_does_not_import_triton_so_the_interpreter_can_still_be_turned_on():
    """TRITON_ATTN's gate imported triton before it looked at TRITON_INTERPRET, so every automatic choice on CPU (a
    tower's first forward, ``hwgraph info``) imported it, and a TRITON_INTERPRET=1 set afterwards was refused as
    'set after triton was imported' though only hwgraph had imported it."""
    import subprocess

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", INTERPRETER_SET_AFTER_AN_AUTOMATIC_CHOICE], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["TORCH_SDPA", "False", "TRITON_ATTN"]


def test_h200_prefers_triton_attn_then_flash_then_sdpa():
    pytest.importorskip("triton.tools.tensor_descriptor")  # Triton 3.4+: the TMA kernel's host descriptors
    chosen = choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72)
    assert (chosen.spec.name, chosen.reason) == ("TRITON_ATTN", "best available for cuda")
    cuda_order = [spec.name for spec in sorted(registry.kernel_specs(), key=lambda k: -k.rank(H200))
                  if "cuda" in spec.kinds]
    assert cuda_order == ["TRITON_ATTN", "FLASH_ATTN", "TORCH_SDPA"]
    assert (kernel_named("TRITON_ATTN").rank(H200), FLASH_ATTN.rank(H200)) == (35, 30)


def test_h200_without_triton_attn_takes_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # triton not importable: TRITON_ATTN's gate refuses
    chosen = choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72)
    assert chosen.spec.name == "FLASH_ATTN"
    assert "TRITON_ATTN: TRITON_ATTN needs the triton package" in chosen.reason
    # FLASH_ATTN has no fp32 kernel and TRITON_ATTN is gone: the next in priority order takes fp32.
    chosen = choose_attention(platform=H200, dtype=torch.float32, head_dim=72)
    assert chosen.spec.name == "TORCH_SDPA"
    assert "FLASH_ATTN: FLASH_ATTN supports dtypes float16, bfloat16, got float32" in chosen.reason


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100", "sm_120"])
def test_other_nvidia_architectures_keep_flash_attn_first(arch):
    """TRITON_ATTN's TMA kernel is preferred only where it was measured to win (Hopper); elsewhere its pointer
    kernel is slower than FLASH_ATTN, and Blackwell was not measured."""
    pytest.importorskip("triton")
    plat = platform("cuda", arch)
    assert kernel_named("TRITON_ATTN").rank(plat) == 20
    assert choose_attention(platform=plat, dtype=torch.bfloat16, head_dim=72).spec.name == "FLASH_ATTN"


def test_hopper_with_a_triton_without_host_descriptors_keeps_flash_attn_first(monkeypatch):
    pytest.importorskip("triton")
    from hwgraph.attention import triton_attn

    real = triton_attn.importlib.util.find_spec
    monkeypatch.setattr(triton_attn.importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton.tools.tensor_descriptor" else real(name, *a))
    assert kernel_named("TRITON_ATTN").rank(H200) == 20
    assert choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72).spec.name == "FLASH_ATTN"


def test_a_triton_that_fails_to_import_with_another_error_is_ranked_without_crashing_automatic_choice(monkeypatch):
    # a triton built for another torch raises RuntimeError (undefined symbol) on import, not ImportError: the gate
    # said so, but ranking TRITON_ATTN raised it out of every automatic choice on Hopper
    from hwgraph.attention import triton_attn

    def broken(name, *args):
        raise RuntimeError("libtriton.so: undefined symbol _ZN4mlir")

    monkeypatch.setattr(triton_attn.importlib.util, "find_spec", broken)
    assert kernel_named("TRITON_ATTN").rank(H200) == 20  # raised RuntimeError
    chosen = choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72)  # so did this
    assert chosen.reason.startswith("best available for cuda")


def test_triton_attn_keeps_its_static_priority_off_cuda():
    for plat in (CPU, MI300X, ASCEND):
        assert kernel_named("TRITON_ATTN").rank(plat) == kernel_named("TRITON_ATTN").priority == 20


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100", "sm_120"])
def test_flash_attn_compares_compute_capability_as_numbers(arch):
    assert reasons("FLASH_ATTN", platform("cuda", arch), dtype=torch.float16, head_dim=72) == ()


# ---------------------------------------------------------------- refusals carry reasons


def test_sm75_refuses_flash_attn_with_the_compute_capability():
    assert reasons("FLASH_ATTN", T4) == ("FLASH_ATTN needs compute capability >= 8.0, found 7.5",)
    assert choose_attention(platform=T4, dtype=torch.float16).spec.name != "FLASH_ATTN"
    with pytest.raises(SelectionError, match=r"'FLASH_ATTN' is unavailable: .*>= 8\.0, found 7\.5"):
        choose_attention("FLASH_ATTN", platform=T4)


@pytest.mark.parametrize("arch", ["sm_75", "sm_70"])
def test_below_sm80_triton_attn_is_refused_bfloat16_only_and_the_automatic_choice_takes_sdpa(arch):
    """Triton builds no bf16 tensor-core products below sm_80 ("Feature '.bf16' requires .target sm_80"): automatic
    choice took TRITON_ATTN for a bf16 tower on a T4 (FLASH_ATTN refused there), which failed at its first launch."""
    gpu = platform("cuda", arch)
    cc = f"{arch[3]}.{arch[4]}"
    assert reasons("TRITON_ATTN", gpu, dtype=torch.bfloat16) == (
        f"TRITON_ATTN runs bfloat16 on compute capability >= 8.0, found {cc} (float16 runs there)",)
    assert reasons("TRITON_ATTN", gpu, dtype=torch.float16) == reasons("TRITON_ATTN", gpu) == ()
    assert choose_attention(platform=gpu, dtype=torch.bfloat16, head_dim=72).spec.name == "TORCH_SDPA"
    assert choose_attention(platform=gpu, dtype=torch.float16, head_dim=72).spec.name == "TRITON_ATTN"
    with pytest.raises(SelectionError, match=rf"'TRITON_ATTN' is unavailable: .*bfloat16 on compute capability "
                                             rf">= 8\.0, found {re.escape(cc)}"):
        choose_attention("TRITON_ATTN", platform=gpu, dtype=torch.bfloat16)
    for ok in ("sm_80", "sm_90"):  # Ampere and Hopper run it
        assert reasons("TRITON_ATTN", platform("cuda", ok), dtype=torch.bfloat16) == ()
    assert reasons("TRITON_ATTN", MI300X, dtype=torch.bfloat16) == ()  # no sm_ architecture: not judged


def test_a_dtype_gate_that_raises_is_a_reason_naming_the_kernel():
    def broken(platform, dtype):
        raise RuntimeError("boom")

    spec = KernelSpec(name="TOY", impl_path="x:y", kinds=("cpu",), dtypes=(torch.float32,), head_dims=(1, 8),
                      graph_safe=True, gate=lambda p: Capability.available(), dtype_gate=broken)
    assert spec.capability(CPU).ok  # judged only for a dtype
    assert spec.capability(CPU, torch.float32).reasons == ("the TOY gate failed: RuntimeError: boom",)
    with pytest.raises(TypeError, match=r"KernelSpec 'TOY': dtype_gate is a function or None, got 'no'"):
        KernelSpec(name="TOY", impl_path="x:y", kinds=("cpu",), dtypes=(torch.float32,), head_dims=(1, 8),
                   graph_safe=True, gate=lambda p: Capability.available(), dtype_gate="no")


def test_flash_attn_is_for_nvidia_only():
    assert reasons("FLASH_ATTN", MI300X) == ("FLASH_ATTN runs on NVIDIA CUDA, this platform is rocm",)


def test_a_rocm_gpu_of_unknown_architecture_is_refused_saying_torch_reported_none(fake_aiter):
    """The reason read "found None"."""
    assert reasons("ROCM_AITER_FA", platform("rocm", None)) == (
        "ROCM_AITER_FA needs gfx942 or gfx950, found no architecture (torch reported no gcnArchName)",)


def test_gfx942_with_aiter_chooses_rocm_aiter_fa(fake_aiter):
    chosen = choose_attention(platform=MI300X, dtype=torch.bfloat16, head_dim=72)
    assert chosen.spec.name == "ROCM_AITER_FA" and chosen.reason == "best available for rocm"


def test_gfx90a_refuses_rocm_aiter_fa_naming_the_architecture(fake_aiter):
    assert reasons("ROCM_AITER_FA", MI250X) == ("ROCM_AITER_FA needs gfx942 or gfx950, found gfx90a",)
    chosen = choose_attention(platform=MI250X, dtype=torch.bfloat16, head_dim=72)
    assert chosen.spec.name in ("TRITON_ATTN", "TORCH_SDPA")
    assert "ROCM_AITER_FA: ROCM_AITER_FA needs gfx942 or gfx950, found gfx90a" in chosen.reason
    with pytest.raises(SelectionError, match="'ROCM_AITER_FA' is unavailable: .*found gfx90a"):
        choose_attention("ROCM_AITER_FA", platform=MI250X)


def test_missing_aiter_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter now raises ImportError
    (reason,) = reasons("ROCM_AITER_FA", MI300X)
    assert reason.startswith("ROCM_AITER_FA needs the aiter package")
    assert choose_attention(platform=MI300X, dtype=torch.float16).spec.name != "ROCM_AITER_FA"


def test_ascend_with_torch_npu_chooses_npu_attention(fake_torch_npu):
    chosen = choose_attention(platform=ASCEND, dtype=torch.float16, head_dim=72)
    assert chosen.spec.name == "NPU"
    assert reasons("TRITON_ATTN", ASCEND)[0].startswith("TRITON_ATTN runs on cuda/rocm")


def test_ascend_without_torch_npu_falls_back_to_sdpa_and_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    chosen = choose_attention(platform=ASCEND, dtype=torch.float16, head_dim=72)
    assert chosen.spec.name == "TORCH_SDPA"
    assert "NPU: NPU attention needs the torch_npu package" in chosen.reason


def test_graph_safe_automatic_choice_passes_over_npu_attention_and_says_why(fake_torch_npu):
    chosen = choose_attention(platform=ASCEND, dtype=torch.float16, head_dim=72, graph_safe=True)
    assert chosen.spec.name == "TORCH_SDPA" and "NPU: not graph-safe" in chosen.reason
    # an explicit choice is honoured: the graph manager then runs it eagerly and says why
    assert choose_attention("NPU", platform=ASCEND, dtype=torch.float16, head_dim=72, graph_safe=True).spec.name \
        == "NPU"


def test_tower_remembers_that_a_graph_manager_wants_graph_safe_kernels(fake_torch_npu):
    tower = Qwen3OmniVisionTower.from_preset("tiny").to(torch.float16)
    assert tower.set_attention("auto", platform=ASCEND).spec.name == "NPU"
    assert tower.set_attention("auto", platform=ASCEND, graph_safe=True).spec.name == "TORCH_SDPA"
    assert tower.set_attention(platform=ASCEND).spec.name == "TORCH_SDPA"  # None keeps the setting
    assert tower.set_attention("NPU", platform=ASCEND).spec.name == "NPU"


def test_aiter_without_its_varlen_function_is_refused_with_the_reason(monkeypatch):
    module = types.ModuleType("aiter")
    module.__version__ = "0.0.1"
    monkeypatch.setitem(sys.modules, "aiter", module)
    assert reasons("ROCM_AITER_FA", MI300X) == (
        "ROCM_AITER_FA needs aiter.flash_attn_varlen_func, which aiter 0.0.1 lacks; install an aiter release that "
        "has it",)


def test_npu_attention_needs_a_device(fake_torch_npu):
    assert reasons("NPU", platform("npu", "Ascend910B", count=0)) == (
        "NPU attention needs an Ascend NPU device, torch_npu sees none",)


def test_missing_triton_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    (reason,) = reasons("TRITON_ATTN", H200)
    assert reason.startswith("TRITON_ATTN needs the triton package")


def test_dtype_and_head_dim_limits_are_reasons():
    assert reasons("TORCH_SDPA", CPU, dtype=torch.int8, head_dim=300) == (
        "TORCH_SDPA supports dtypes float32, float16, bfloat16, float64, got int8",)  # any head dim: below
    assert reasons("FLASH_ATTN", platform("cuda", "sm_80"), dtype=torch.int8, head_dim=300) == (
        "FLASH_ATTN supports dtypes float16, bfloat16, got int8", "FLASH_ATTN supports head_dim 1..256, got 300")
    with pytest.raises(SelectionError, match="no attention kernel is available: .*float64, got int8"):
        choose_attention(platform=CPU, dtype=torch.int8)


# Each platform's automatic choice, and the fixtures that make its first kernel available.
AUTOMATIC = {"H200": (H200, "TRITON_ATTN", ()), "sm_80": (platform("cuda", "sm_80"), "FLASH_ATTN", ()),
             "MI300X": (MI300X, "ROCM_AITER_FA", ("fake_aiter",)), "Ascend": (ASCEND, "NPU", ("fake_torch_npu",)),
             "CPU": (CPU, "TORCH_SDPA", ())}


@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
@pytest.mark.parametrize("name", list(AUTOMATIC))
def test_automatic_choice_keeps_each_platforms_fast_kernel_for_the_head_dims_it_takes(request, name, head_dim):
    """TORCH_SDPA takes any head dim now (below): it stays last wherever a faster kernel takes the head dim."""
    plat, want, fixtures = AUTOMATIC[name]
    if want == "TRITON_ATTN":
        pytest.importorskip("triton.tools.tensor_descriptor")  # Triton 3.4+: the TMA kernel's host descriptors
    for fixture in fixtures:
        request.getfixturevalue(fixture)
    dtype = torch.float16 if plat.kind == "npu" else torch.bfloat16
    assert choose_attention(platform=plat, dtype=dtype, head_dim=head_dim).spec.name == want
    assert choose_attention(platform=plat, dtype=dtype, head_dim=head_dim, graph_safe=True).spec.name == \
        ("TORCH_SDPA" if want == "NPU" else want)


@pytest.mark.parametrize("name", list(AUTOMATIC))
def test_a_head_dim_over_256_takes_torch_sdpa_whose_sdpa_call_takes_any_head_dim(request, name):
    """TORCH_SDPA declared head dims 1..256, though its body (one ``scaled_dot_product_attention`` call, where torch
    picks a backend that takes the head dim, its math one at worst) takes any: a tower of head_dim 288, which
    transformers runs, found no kernel at its first forward."""
    from hwgraph.attention.sdpa import sdpa_varlen
    from hwgraph.testing.reference import assert_matches_reference, random_packed_batch

    plat, fast, fixtures = AUTOMATIC[name]
    for fixture in fixtures:
        request.getfixturevalue(fixture)
    dtype = torch.float16 if plat.kind == "npu" else torch.bfloat16
    chosen = choose_attention(platform=plat, dtype=dtype, head_dim=288)
    assert chosen.spec.name == "TORCH_SDPA" and chosen.fn is sdpa_varlen
    if fast in ("FLASH_ATTN", "ROCM_AITER_FA", "NPU"):
        assert f"{fast}: {fast} supports head_dim 1..256, got 288" in chosen.reason
    for head_dim in (288, 512):
        batch = random_packed_batch([5, 7, 1], heads=2, head_dim=head_dim, zero_length=1, padding_rows=3)
        assert_matches_reference(chosen.fn(*batch.args()), batch)


def test_the_attention_selection_error_names_every_refused_candidate_with_its_reasons(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(SelectionError) as failure:
        choose_attention(platform=MI300X, dtype=torch.int8, head_dim=300)
    message = str(failure.value)
    assert message.startswith("no attention kernel is available: ")
    assert "ROCM_AITER_FA: ROCM_AITER_FA needs the aiter package" in message
    assert "TRITON_ATTN: TRITON_ATTN needs the triton package" in message
    assert "TORCH_SDPA: TORCH_SDPA supports dtypes float32, float16, bfloat16, float64, got int8" in message
    # the kernels of other platforms are not candidates here
    assert "FLASH_ATTN" not in message and "NPU" not in message


# ---------------------------------------------------------------- explicit choices


def test_env_var_names_the_kernel_case_insensitively(monkeypatch):
    monkeypatch.setenv(registry.ATTENTION_ENV, "torch_sdpa")
    chosen = choose_attention(platform=H200, dtype=torch.bfloat16)
    assert chosen.spec.name == "TORCH_SDPA" and chosen.reason == "explicit"


@pytest.mark.parametrize("value", ["", "  ", "\t"])
def test_env_var_set_blank_is_unset(monkeypatch, value):
    """Set empty it was automatic choice; set blank it was "unknown attention kernel '  '"."""
    monkeypatch.setenv(registry.ATTENTION_ENV, value)
    chosen = choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72)
    assert chosen.reason.startswith("best available for cuda")


@pytest.mark.parametrize("value", ["auto", "AUTO", " auto "])
def test_env_var_auto_asks_for_automatic_choice_as_a_tower_takes_it(monkeypatch, value):
    monkeypatch.setenv(registry.ATTENTION_ENV, value)  # was "unknown attention kernel 'auto'"
    chosen = choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72)
    assert chosen.reason.startswith("best available for cuda")
    assert chosen.spec.name == choose_attention(platform=H200, dtype=torch.bfloat16, head_dim=72).spec.name


def install_toy_kernel(monkeypatch, name: str, impl_path: str) -> None:
    """The registry sees one plugin, ``toy``, whose one CPU kernel ``name`` ranks first and loads from ``impl_path``."""
    kernel = KernelSpec(name=name, impl_path=impl_path, kinds=("cpu",), dtypes=(torch.float32,), head_dims=(1, 256),
                        graph_safe=True, gate=lambda p: Capability.available(), priority=50)
    specs = (BackendSpec(name="toy", class_path="unused:Backend", kinds=("cpu",),
                         gate=lambda p: Capability.available(), attention=(kernel,)),)
    monkeypatch.setattr(registry, "backend_specs", lambda: specs)


def test_a_plugin_kernel_that_repeats_a_known_name_is_ignored_with_a_warning(monkeypatch, caplog):
    from hwgraph.attention.triton_attn import TRITON_ATTN

    install_toy_kernel(monkeypatch, "TRITON_ATTN", "hwgraph_toy.attention:toy")
    monkeypatch.setattr(registry, "_REPEATS_WARNED", set())
    with caplog.at_level("WARNING", logger="hwgraph.attention.registry"):
        assert kernel_named("TRITON_ATTN") is TRITON_ATTN
        registry.kernel_specs()  # warned once, not at every lookup
    assert caplog.messages == ["graph backend 'toy' brings an attention kernel named TRITON_ATTN, which "
                               "hwgraph.attention.triton_attn:triton_varlen already has; ignored"]


def test_argument_overrides_env_var(monkeypatch):
    monkeypatch.setenv(registry.ATTENTION_ENV, "TORCH_SDPA")
    assert choose_attention("FLASH_ATTN", platform=H200, dtype=torch.bfloat16).spec.name == "FLASH_ATTN"


def test_explicit_unavailable_choice_raises_naming_the_reasons(monkeypatch):
    monkeypatch.setenv(registry.ATTENTION_ENV, "TRITON_ATTN")
    # named by the environment: the error says so (the caller may have named no kernel)
    with pytest.raises(SelectionError, match=r"^\$HWGRAPH_ATTENTION: attention kernel 'TRITON_ATTN' is unavailable: "
                                             r"on CPU TRITON_ATTN runs only under the Triton interpreter "
                                             r"\(TRITON_INTERPRET=1\)"):
        choose_attention(platform=CPU)


def test_a_plugin_kernel_that_does_not_import_is_passed_over_automatically_and_named_when_chosen(monkeypatch):
    """A plugin's kernel ranked first whose impl_path does not import made every automatic choice on its platform
    raise (found with the graph backends' twin in a plugin author's walkthrough)."""
    install_toy_kernel(monkeypatch, "TOY_ATTN", "hwgraph_toy_missing.attention:toy_attention")
    chosen = choose_attention(platform=CPU, dtype=torch.float32, head_dim=72)
    assert chosen.spec.name == "TORCH_SDPA"
    assert ("TOY_ATTN: attention kernel 'TOY_ATTN' declares impl_path 'hwgraph_toy_missing.attention:toy_attention', "
            "which does not load: ModuleNotFoundError") in chosen.reason
    with pytest.raises(ImportError, match=r"attention kernel 'TOY_ATTN' declares impl_path"):
        choose_attention("TOY_ATTN", platform=CPU, dtype=torch.float32, head_dim=72)


def test_a_plugin_kernel_whose_impl_path_is_not_a_function_is_passed_over_and_named_when_chosen(monkeypatch):
    """An impl_path naming the kernel's spec instead of its function (``...attention:TOY_ATTN``) was chosen: the
    tower's first forward then raised "'KernelSpec' object is not callable", naming neither the kernel nor its
    impl_path, instead of automatic choice passing it over with the reason."""
    install_toy_kernel(monkeypatch, "TOY_ATTN", "hwgraph.attention.sdpa:TORCH_SDPA")
    chosen = choose_attention(platform=CPU, dtype=torch.float32, head_dim=72)
    assert chosen.spec.name == "TORCH_SDPA" and callable(chosen.fn)
    assert ("TOY_ATTN: attention kernel 'TOY_ATTN' declares impl_path 'hwgraph.attention.sdpa:TORCH_SDPA', which "
            "does not load: TypeError: it names a KernelSpec, not a function") in chosen.reason
    with pytest.raises(ImportError, match=r"attention kernel 'TOY_ATTN' declares impl_path .* not a function"):
        choose_attention("TOY_ATTN", platform=CPU, dtype=torch.float32, head_dim=72)


@pytest.mark.parametrize("name", [torch.bfloat16, 72, print])
def test_a_kernel_name_that_is_not_a_string_is_refused_naming_it(name):
    """choose_attention(torch.bfloat16) (name is the first argument) raised AttributeError: 'torch.dtype' object has
    no attribute 'strip', naming neither the argument nor what it takes."""
    with pytest.raises(TypeError, match=rf"an attention kernel name must be a string \(or 'auto'\), got "
                                        rf"{re.escape(repr(name))} \({type(name).__name__}\)"):
        choose_attention(name, platform=CPU)
    with pytest.raises(TypeError, match="an attention kernel name must be a string"):
        kernel_named(name)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "bfloat16", "head_dim": 72}, r"dtype must be a torch\.dtype \(e\.g\. torch\.bfloat16\), got 'bfloat16' "
                                            r"\(str\)"),
    ({"dtype": torch.bfloat16, "head_dim": "72"}, r"head_dim must be an int, got '72' \(str\)"),
    ({"dtype": torch.bfloat16, "head_dim": 72.0}, r"head_dim must be an int, got 72\.0 \(float\)"),
])
def test_a_dtype_or_head_dim_of_the_wrong_type_is_refused_naming_it(kwargs, match):
    """A dtype's name was refused by every kernel as "TORCH_SDPA supports dtypes float32, float16, bfloat16, float64,
    got bfloat16", and a head dim given as a string raised "'<=' not supported between instances of 'int' and 'str'"."""
    with pytest.raises(TypeError, match=match):
        choose_attention(platform=CPU, **kwargs)
    with pytest.raises(TypeError, match=match):
        choose_attention("TORCH_SDPA", platform=CPU, **kwargs)
    with pytest.raises(TypeError, match=match):
        list_kernels(platform=CPU, **kwargs)
    np = pytest.importorskip("numpy")  # a numpy int is an int here, as everywhere else
    assert choose_attention(platform=CPU, dtype=torch.bfloat16, head_dim=np.int64(72)).spec.name == "TORCH_SDPA"


def test_a_kernel_name_with_surrounding_blanks_is_found_as_auto_is(monkeypatch):
    # " auto " asked for automatic choice while " torch_sdpa " was an unknown kernel
    assert choose_attention(" torch_sdpa ", platform=CPU).spec.name == "TORCH_SDPA"
    monkeypatch.setenv(registry.ATTENTION_ENV, "TORCH_SDPA\n")
    assert choose_attention(platform=H200, dtype=torch.bfloat16).spec.name == "TORCH_SDPA"


@pytest.mark.parametrize("variable", [None, "TORCH_SDPA"])
def test_an_empty_kernel_name_is_refused_naming_it_as_an_empty_graph_backend_is(monkeypatch, variable):
    """``choose_attention("")`` (``attention=os.environ.get("KERNEL", "")``, a script's unset variable) silently
    became ``$HWGRAPH_ATTENTION``'s kernel, else the automatic choice, as ``graph_backend=""`` once did (now refused):
    only None asks for those. It is an unknown kernel, as a blank one is, and the error lists the known ones."""
    if variable is not None:
        monkeypatch.setenv(registry.ATTENTION_ENV, variable)
    with pytest.raises(SelectionError, match=r"^unknown attention kernel ''; known: TORCH_SDPA, TRITON_ATTN"):
        choose_attention("", platform=CPU)
    assert choose_attention(None, platform=CPU).spec.name == "TORCH_SDPA"


def test_unknown_kernel_name_lists_the_known_ones():
    with pytest.raises(SelectionError, match="unknown attention kernel 'FLASH3'; known: TORCH_SDPA, TRITON_ATTN"):
        choose_attention("FLASH3", platform=H200)


@pytest.mark.parametrize("soc, refused", [(223, None), (252, None), (202, "an Ascend 310P (SoC version 202)"),
                                          (102, "a first-generation Ascend 910 (SoC version 102)"),
                                          (241, "an Ascend 310B (SoC version 241)")])
def test_npu_attention_is_refused_on_chips_without_the_tnd_kernel_naming_the_chip(fake_torch_npu, soc, refused):
    """torch_npu's reference lists npu_fused_infer_attention_score for Atlas A2 and A3 only: on a 310P or a first
    Ascend 910 the kernel was offered, and chosen automatically, where it cannot run."""
    fake_torch_npu.npu = types.SimpleNamespace(get_soc_version=lambda: soc)
    found = reasons("NPU", ASCEND)
    if refused is None:
        assert found == () and choose_attention(platform=ASCEND, dtype=torch.float16, head_dim=72).spec.name == "NPU"
    else:
        (reason,) = found
        assert reason.startswith("NPU attention (npu_fused_infer_attention_score, layout TND) runs on Atlas A2 and A3")
        assert reason.endswith(refused), reason
        chosen = choose_attention(platform=ASCEND, dtype=torch.float16, head_dim=72)
        assert chosen.spec.name == "TORCH_SDPA" and refused in chosen.reason


def test_npu_attention_is_offered_where_torch_npu_cannot_say_its_soc_version(fake_torch_npu):
    def broken():
        raise RuntimeError("no soc")
    fake_torch_npu.npu = types.SimpleNamespace(get_soc_version=broken)
    assert reasons("NPU", ASCEND) == ()


def test_a_plugin_kernel_whose_module_raises_another_error_on_import_is_passed_over_too(monkeypatch):
    """Only ImportError and AttributeError were reasons: a vendor runtime raising OSError as its module imported
    took every automatic choice on the platform down."""
    module = types.ModuleType("hwgraph_toy_failing")

    def __getattr__(name):
        raise OSError(f"libtoy.so: cannot open shared object file (asked for {name})")

    module.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    install_toy_kernel(monkeypatch, "TOY_ATTN", "hwgraph_toy_failing:toy_attention")
    chosen = choose_attention(platform=CPU, dtype=torch.float32, head_dim=72)
    assert chosen.spec.name == "TORCH_SDPA"
    assert ("TOY_ATTN: attention kernel 'TOY_ATTN' declares impl_path 'hwgraph_toy_failing:toy_attention', which does "
            "not load: OSError: libtoy.so: cannot open shared object file") in chosen.reason
