"""ROCM_AITER_FA against aiter's own signatures: the adapter's keywords exist in each release's
``flash_attn_varlen_func`` (a fake taking ``**kwargs`` accepts a misspelt one), and it takes the attention output from
what each returns (ROCm/aiter aiter/ops/mha.py: older releases return ``tuple(result)``, a 1-tuple without the LSE;
later ones ``result[0] if len(result) == 1 else tuple(result)``)."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch


def reference(q, k, v, cu_seqlens, scale):
    out = torch.zeros_like(q, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        out[a:b] = torch.softmax(qs @ ks.mT * scale, -1).matmul(vs).transpose(0, 1)
    return out


def older_release(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                  causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_lse=False,
                  return_attn_probs=False, block_table=None):
    assert not causal and dropout_p == 0.0 and max_seqlen_q >= 1 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    out = torch.full_like(q, float("nan"))  # padding rows unwritten
    total = int(cu_seqlens_q[-1])
    out[:total] = reference(q, k, v, cu_seqlens_q, softmax_scale)[:total].to(q.dtype)
    return (out,)


def later_release(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                  causal=False, window_size=(-1, -1), bias=None, alibi_slopes=None, deterministic=False,
                  return_lse=False, return_attn_probs=False, block_table=None):
    (out,) = older_release(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                           causal)
    return out


@pytest.mark.parametrize("release", [older_release, later_release], ids=["returns a 1-tuple", "returns the tensor"])
def test_aiter_adapter_calls_each_releases_signature_and_returns_the_attention(monkeypatch, release):
    from hwgraph_rocm.attention import aiter_varlen

    monkeypatch.setitem(sys.modules, "aiter", types.SimpleNamespace(flash_attn_varlen_func=release))
    gen = torch.Generator().manual_seed(60)
    q, k, v = (torch.randn(16, 2, 72, generator=gen).to(torch.float16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 5, 5, 12], dtype=torch.int32)  # an empty sequence, then 4 padding rows
    out = aiter_varlen(q, k, v, cu_seqlens, 7, 72 ** -0.5)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out[:12].float(), reference(q, k, v, cu_seqlens, 72 ** -0.5)[:12], atol=2e-3, rtol=2e-3)
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))
