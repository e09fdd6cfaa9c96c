"""An attention kernel named by $HWGRAPH_ATTENTION says so when it fails; a ``hip`` device is refused
pointing at the cuda device that ROCm builds of torch use."""

from __future__ import annotations

import re

import pytest
import torch

from hwgraph.attention import registry
from hwgraph.attention.registry import choose_attention
from hwgraph.platform import PlatformInfo, checked_device
from hwgraph.registry import SelectionError
from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

CPU = PlatformInfo("cpu", "cpu", None, torch.__version__, None, None, 0)


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(registry.ATTENTION_ENV, raising=False)


def test_an_unknown_kernel_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv(registry.ATTENTION_ENV, "TORCH_SPDA")
    with pytest.raises(SelectionError, match=r"^\$HWGRAPH_ATTENTION: unknown attention kernel 'TORCH_SPDA'; known: "):
        choose_attention(platform=CPU)


def test_a_kernel_named_by_the_caller_is_refused_without_the_variable(monkeypatch):
    monkeypatch.setenv(registry.ATTENTION_ENV, "TORCH_SDPA")  # the argument wins, and the error is about it alone
    with pytest.raises(SelectionError, match=r"^attention kernel 'TRITON_ATTN' is unavailable: "):
        choose_attention("TRITON_ATTN", platform=CPU)
    with pytest.raises(SelectionError, match=r"^unknown attention kernel 'NOPE'"):
        choose_attention("NOPE", platform=CPU)


@pytest.mark.parametrize(("spec", "expected"), [("hip", "cuda"), ("hip:1", "cuda:1")])
def test_a_hip_device_on_a_rocm_machine_is_refused_pointing_at_the_cuda_device(monkeypatch, spec, expected):
    # was "cannot run a graph manager: expected an accelerator device (cuda, npu, ...) or cpu": hip is a torch device
    # type and an AMD GPU is an accelerator, so the message contradicted itself
    simulate_gpu(monkeypatch, hip="6.4.0", count=2, props=DeviceProperties("AMD Instinct MI300X", 9, 4,
                                                                           "gfx942:sramecc+:xnack-"))
    message = (f"device {spec!r}: ROCm builds of torch address AMD GPUs as cuda devices; expected {expected!r}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        checked_device(spec, "device", "a graph manager")
    assert checked_device(expected) == torch.device(expected)
