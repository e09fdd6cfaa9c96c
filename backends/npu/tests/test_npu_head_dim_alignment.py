"""NPU attention gives the Ascend kernel only head dims it documents (fp16/bf16: multiples of 16), for every head dim
its KernelSpec admits (1..256), and the zero padding leaves the result exact."""

from __future__ import annotations

import pytest
import torch

ASCEND_ALIGN = 16  # as the conftest's fused_attention checks


@pytest.mark.parametrize("head_dim", [16, 40, 64, 72, 120, 128, 136, 200, 256])
def test_every_admitted_head_dim_reaches_the_kernel_aligned_and_comes_back_exact(fused_attention, head_dim):
    from hwgraph_npu.attention import NPU, host_cu_seqlens, npu_varlen

    lo, hi = NPU.head_dims
    assert lo <= head_dim <= hi  # the gate says NPU attention is available for it
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(13, 2, head_dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 9, 13], dtype=torch.int32)
    with host_cu_seqlens([0, 9, 13]):
        out = npu_varlen(q, k, v, cu_seqlens, 9, head_dim ** -0.5)
    assert fused_attention[-1] % ASCEND_ALIGN == 0
    assert out.shape == q.shape
    expected = torch.cat([torch.softmax(q[a:b].transpose(0, 1).float() @ k[a:b].transpose(0, 1).float().mT
                                        * head_dim ** -0.5, -1).matmul(v[a:b].transpose(0, 1).float()).transpose(0, 1)
                          for a, b in ((0, 9), (9, 13))])
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_padded_head_comes_back_with_the_layout_of_the_ops_fake(fused_attention):
    """72 lanes run padded to 128 and come back as a slice; torch.compile takes the output's strides from the fake."""
    from hwgraph_npu.attention import npu_varlen_op

    gen = torch.Generator().manual_seed(72)
    q, k, v = (torch.randn(13, 2, 72, generator=gen).to(torch.bfloat16) for _ in range(3))
    args = (q, k, v, torch.tensor([0, 9, 13], dtype=torch.int32), 9, 72 ** -0.5, [9, 13])
    torch.library.opcheck(npu_varlen_op, args, test_utils=("test_faketensor",))
    assert fused_attention[-1] == 128
