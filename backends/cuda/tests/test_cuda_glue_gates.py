"""The CUDA plugin's glue, checked on the host: what the FLASH_ATTN gate accepts matches what its providers run."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from hwgraph.platform import PlatformInfo

attention = pytest.importorskip("hwgraph_cuda.attention")

JETSON_ORIN = PlatformInfo("cuda", "Orin", "sm_87", torch.__version__, "CUDA", "12.6", 1)


def test_flash_attn_is_refused_on_a_cuda_torch_built_without_its_flash_kernel(monkeypatch):
    """Such a build (some Windows and Jetson wheels) still has ATen's op and varlen_attn, which fail at the first call
    ("USE_FLASH_ATTENTION was not enabled for build"): the gate says so instead of choosing FLASH_ATTN."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # no flash-attn package: only torch's kernel is left
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    monkeypatch.setattr(attention, "flash_provider", attention.flash_provider.__wrapped__)  # uncached
    name, missing = attention.flash_provider()
    assert name is None and "built without its flash attention kernel" in missing[-1]
    cap = attention.FLASH_ATTN.capability(JETSON_ORIN, torch.bfloat16, 72)
    assert not cap.ok and "built without its flash attention kernel" in cap.describe()


def test_flash_attn_package_still_serves_a_torch_built_without_its_flash_kernel(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=lambda **kw: None))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert attention.flash_provider.__wrapped__() == ("flash_attn", ())


def test_a_cpu_build_keeps_torch_as_the_flash_provider_for_simulated_gpus(monkeypatch):
    # CPU builds report no flash kernel either; tests that simulate a GPU on them still see FLASH_ATTN's gate pass.
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert attention.flash_provider.__wrapped__()[0] in ("aten", "torch")
