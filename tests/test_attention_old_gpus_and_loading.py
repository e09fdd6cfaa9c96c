"""TRITON_ATTN on NVIDIA GPUs Triton does not compile for, and a kernel named by $HWGRAPH_ATTENTION that does not
load, on simulated platforms (PlatformInfo values passed explicitly)."""

from __future__ import annotations

import pytest
import torch

from hwgraph.attention import registry
from hwgraph.attention.registry import choose_attention, kernel_named
from hwgraph.platform import PlatformInfo
from hwgraph.registry import SelectionError


def platform(kind: str, arch: str | None, count: int = 1) -> PlatformInfo:
    runtime = {"cuda": "CUDA", "rocm": "HIP", "npu": "CANN"}.get(kind)
    return PlatformInfo(kind=kind, device_name=f"simulated {kind}", arch=arch, torch_version=torch.__version__,
                        runtime=runtime, runtime_version="1.0" if runtime else None, device_count=count)


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(registry.ATTENTION_ENV, raising=False)


@pytest.mark.parametrize("arch", ["sm_60", "sm_61", "sm_52"])
def test_triton_attn_is_refused_below_compute_capability_7_where_triton_builds_no_kernels(arch):
    """Triton compiles for NVIDIA GPUs of compute capability 7.0 and newer (torch's own ``has_triton`` says no below,
    "Triton only supports devices of CUDA Capability >= 7.0"). The gate passed a P100 or a GTX 1080, and automatic
    choice took TRITON_ATTN there (FLASH_ATTN refused below 8.0) in every dtype, float16 included: the first forward
    failed as the kernel compiled, instead of running TORCH_SDPA."""
    pytest.importorskip("triton")
    gpu = platform("cuda", arch)
    cc = f"{arch[3]}.{arch[4]}"
    assert kernel_named("TRITON_ATTN").capability(gpu).reasons == (
        f"TRITON_ATTN needs compute capability >= 7.0 (the oldest NVIDIA GPUs Triton compiles for), found {cc}",)
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        assert choose_attention(platform=gpu, dtype=dtype, head_dim=72).spec.name == "TORCH_SDPA"
    with pytest.raises(SelectionError, match=rf"'TRITON_ATTN' is unavailable: .*>= 7\.0 .*found {cc}"):
        choose_attention("TRITON_ATTN", platform=gpu, dtype=torch.float16)
    # Volta and newer keep it (float16; bfloat16 from 8.0, the dtype gate's)
    for ok in ("sm_70", "sm_75", "sm_80"):
        assert kernel_named("TRITON_ATTN").capability(platform("cuda", ok), dtype=torch.float16).ok


def test_a_kernel_named_by_the_environment_that_does_not_load_says_the_variable_named_it(monkeypatch):
    """An unknown or unavailable kernel named by ``$HWGRAPH_ATTENTION`` says so (the caller may have named none), as
    a graph backend named by ``$HWGRAPH_GRAPH_BACKEND`` does for both its SelectionError and its ImportError; a kernel
    from the variable whose impl_path did not load raised an ImportError that did not say where its name came from."""
    from hwgraph.attention.base import KernelSpec
    from hwgraph.capability import Capability
    from hwgraph.registry import BackendSpec

    kernel = KernelSpec(name="TOY_ATTN", impl_path="hwgraph_toy_missing.attention:toy", kinds=("cpu",),
                        dtypes=(torch.float32,), head_dims=(1, 256), graph_safe=True,
                        gate=lambda p: Capability.available())
    specs = (BackendSpec(name="toy", class_path="unused:Backend", kinds=("cpu",),
                         gate=lambda p: Capability.available(), attention=(kernel,)),)
    monkeypatch.setattr(registry, "backend_specs", lambda: specs)
    cpu = platform("cpu", None, 0)
    monkeypatch.setenv(registry.ATTENTION_ENV, "toy_attn")
    with pytest.raises(ImportError, match=r"^\$HWGRAPH_ATTENTION: attention kernel 'TOY_ATTN' declares impl_path "
                                          r"'hwgraph_toy_missing.attention:toy', which does not load: "
                                          r"ModuleNotFoundError"):
        choose_attention(platform=cpu, dtype=torch.float32, head_dim=72)
    # named as an argument: the variable is not the source
    with pytest.raises(ImportError, match=r"^attention kernel 'TOY_ATTN' declares impl_path"):
        choose_attention("TOY_ATTN", platform=cpu, dtype=torch.float32, head_dim=72)


@pytest.mark.parametrize("kind, arch", [("cuda", "sm_90"), ("cuda", "sm_80"), ("rocm", "gfx942")])
@pytest.mark.parametrize("value", ["1", "true"])  # Triton's knobs take "true" (and "on") as well as "1"
def test_triton_attn_is_refused_on_gpus_while_the_triton_interpreter_is_on(monkeypatch, kind, arch, value):
    """Under TRITON_INTERPRET the kernel runs on the host (Triton copies the GPU tensors there and back), so graph
    capture failed and the manager ran eagerly at every budget: the gate offered TRITON_ATTN on CUDA and ROCm all
    the same, and on Hopper automatic choice took it. It is refused there now, naming the variable to unset."""
    pytest.importorskip("triton")
    gpu = platform(kind, arch)
    assert kernel_named("TRITON_ATTN").capability(gpu, dtype=torch.float16).ok  # without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", value)
    reason = (f"TRITON_INTERPRET is set: Triton's interpreter runs TRITON_ATTN on the host, not the {kind} GPU, so "
              "graphs cannot capture it; unset TRITON_INTERPRET to run it on the GPU")
    assert kernel_named("TRITON_ATTN").capability(gpu, dtype=torch.float16).reasons == (reason,)
    assert choose_attention(platform=gpu, dtype=torch.float16, head_dim=72).spec.name != "TRITON_ATTN"
    with pytest.raises(SelectionError, match=r"'TRITON_ATTN' is unavailable: TRITON_INTERPRET is set: .* unset "
                                             r"TRITON_INTERPRET to run it on the GPU"):
        choose_attention("TRITON_ATTN", platform=gpu, dtype=torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # set, but off: the kernel runs on the GPU
    assert kernel_named("TRITON_ATTN").capability(gpu, dtype=torch.float16).ok
