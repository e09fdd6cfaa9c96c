"""Kernel names in any case, and TORCH_SDPA on edge cases against a plain per-sequence reference."""

from __future__ import annotations

import logging
from itertools import pairwise

import pytest
import torch

from hwgraph.attention import registry
from hwgraph.attention.base import KernelSpec
from hwgraph.attention.registry import choose_attention, kernel_named, kernel_specs
from hwgraph.attention.sdpa import TORCH_SDPA, sdpa_varlen
from hwgraph.capability import Capability
from hwgraph.platform import PlatformInfo
from hwgraph.registry import BackendSpec

CPU = PlatformInfo(kind="cpu", device_name="simulated cpu", arch=None, torch_version=torch.__version__, runtime=None,
                   runtime_version=None, device_count=0)


def install_plugin_kernel(monkeypatch, name: str) -> KernelSpec:
    """The registry sees one plugin, ``toy``, whose one CPU kernel ``name`` ranks first."""
    kernel = KernelSpec(name=name, impl_path="hwgraph.attention.sdpa:sdpa_varlen", kinds=("cpu",),
                        dtypes=(torch.float32,), head_dims=(1, 256), graph_safe=True,
                        gate=lambda p: Capability.available(), priority=50)
    specs = (BackendSpec(name="toy", class_path="unused:Backend", kinds=("cpu",),
                         gate=lambda p: Capability.available(), attention=(kernel,)),)
    monkeypatch.setattr(registry, "backend_specs", lambda: specs)
    monkeypatch.delenv(registry.ATTENTION_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return kernel


@pytest.mark.parametrize("asked", ["Toy_Attn", "TOY_ATTN", "toy_attn", " toy_attn "])
def test_a_plugin_kernel_named_in_mixed_case_is_found_by_its_name_in_any_case(monkeypatch, asked):
    """A plugin's kernel whose name was not upper case was unknown even by its exact name ("unknown attention kernel
    'Toy_Attn'; known: TORCH_SDPA, TRITON_ATTN, Toy_Attn"): the asked name was upper-cased, the kernel's was not."""
    kernel = install_plugin_kernel(monkeypatch, "Toy_Attn")
    assert kernel_named(asked) is kernel
    assert choose_attention(asked, platform=CPU).spec is kernel
    monkeypatch.setenv(registry.ATTENTION_ENV, asked)
    chosen = choose_attention(platform=CPU)
    assert chosen.spec is kernel and chosen.reason == "explicit"


def test_a_plugin_kernel_that_repeats_a_known_name_in_another_case_is_ignored_with_a_warning(monkeypatch, caplog):
    """A plugin's "torch_sdpa" was kept beside TORCH_SDPA: two kernels answering to one name, the plugin's one
    unreachable by name yet chosen automatically by its priority."""
    install_plugin_kernel(monkeypatch, "torch_sdpa")
    monkeypatch.setattr(registry, "_REPEATS_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="hwgraph.attention.registry"):
        assert [k.name.upper() for k in kernel_specs()].count("TORCH_SDPA") == 1
    assert kernel_named("torch_sdpa") is TORCH_SDPA
    assert choose_attention(platform=CPU).spec is TORCH_SDPA
    assert caplog.messages == ["graph backend 'toy' brings an attention kernel named torch_sdpa, which "
                               "hwgraph.attention.sdpa:sdpa_varlen already has; ignored"]


# ---------------------------------------------------------------- TORCH_SDPA on edge cases


def per_sequence_reference(q, k, v, cu_seqlens, scale):
    """float64 softmax attention of each sequence alone; rows past ``cu_seqlens[-1]`` zero."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in pairwise(bounds):
        if end > start:
            qs, ks, vs = (t[start:end].double().transpose(0, 1) for t in (q, k, v))
            out[start:end] = (torch.softmax(qs @ ks.transpose(-1, -2) * scale, -1) @ vs).transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [1, 7, 72])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-qkv-views"])
@pytest.mark.parametrize("bounds, tokens", [
    ([0, 1], 1),  # one token
    ([0, 3, 3, 7, 7, 10], 12),  # empty sequences between real ones, then padding rows
    ([0, 4, 9, 9, 9], 14),  # trailing zero-length padding sequences
    ([0, 0, 0], 5),  # every row padding
    (list(range(0, 33)) + [40], 44),  # many one-token sequences, a longer one, padding
], ids=["one-token", "empty-middle", "trailing-empty", "all-padding", "many"])
def test_sdpa_matches_a_per_sequence_reference_on_edge_cases(bounds, tokens, strided, head_dim, dtype):
    g = torch.Generator().manual_seed(tokens * head_dim)
    heads = 3
    if strided:  # the tower's layout: q, k, v strided views of one qkv row, each without unit stride on tokens
        qkv = torch.randn(tokens, 3, heads, head_dim + 1, generator=g).to(dtype)
        q, k, v = (qkv[:, i, :, :head_dim] for i in range(3))
    else:
        q, k, v = (torch.randn(tokens, heads, head_dim, generator=g).to(dtype) for _ in range(3))
    k, v = k.clone(), v.clone()
    k[bounds[-1]:], v[bounds[-1]:] = float("nan"), float("inf")  # what a graph's padding rows may hold
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    scale = head_dim ** -0.5
    out = sdpa_varlen(q, k, v, cu_seqlens, max(b - a for a, b in pairwise(bounds)), scale)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    assert (out[bounds[-1]:] == 0).all()
    expected = per_sequence_reference(q, k, v, cu_seqlens, scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("path", ["hwgraph.attention.triton_attn:triton_varlen",
                                  "hwgraph_cuda.attention:flash_varlen", "hwgraph_rocm.attention:aiter_varlen",
                                  "hwgraph_npu.attention:npu_varlen"])
def test_a_kernel_called_directly_with_a_head_dim_outside_its_spec_is_refused_naming_it(path):
    """Automatic choice checks the head dim against the spec; a direct call went on to the kernel, which failed as it
    compiled (Triton: out of shared memory) or deep in a vendor library."""
    from hwgraph.registry import load_object

    fn = load_object(path)
    q = torch.zeros(4, 2, 300, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r": head_dim must be 1\.\.256, got 300 \(q \(4, 2, 300\)\)"):
        fn(q, q, q, cu_seqlens, 4, 1.0)
