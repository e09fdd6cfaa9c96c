"""TORCH_SDPA: varlen attention as one ``scaled_dot_product_attention`` call with a block-diagonal mask.

The mask is built on the device from ``cu_seqlens`` (a segment id per token), with no host read and no shape that
depends on the data, so the whole kernel is graph-capturable on every platform. It costs ``tokens**2`` bytes of
mask and attends over the full packed batch, so it is the fallback, not the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hwgraph.attention.base import ANY_HEAD_DIM, KernelSpec
from hwgraph.attention.varlen_inputs import register_varlen_kernel, valid_rows
from hwgraph.capability import Capability


def segment_ids(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[tokens]`` int64: the sequence each row belongs to; rows at or past ``cu_seqlens[-1]`` get ``num_seqs``.

    Zero-length sequences (repeated boundaries) own no row, so they never appear.
    """
    rows = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # right=True: a row equal to a sequence's end boundary already belongs to the next sequence.
    return torch.bucketize(rows, cu_seqlens[1:], right=True)


def block_diagonal_mask(seg: torch.Tensor) -> torch.Tensor:
    """Bool ``[tokens, tokens]`` from ``segment_ids``: True where query row and key row are in the same sequence.

    Padding rows form one block of their own, so no row is fully masked (which would give NaN); their output
    is zeroed afterwards.
    """
    return seg[:, None] == seg[None, :]


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float) -> torch.Tensor:
    """The kernel body (unchecked): ``[T, H, D]`` in, ``[T, H, D]`` out; padding rows attend among themselves
    (the public function zeroes them).

    A masked key still enters the product: its score is pushed to minus infinity and its softmax weight is 0, but
    0 times a NaN or infinite value is NaN. So k and v are zeroed in the padding rows first, as every other kernel
    never reads them: a graph's padding rows hold whatever an earlier, larger call left there, and one non-finite
    pixel there must not reach the real rows of a later call.
    """
    tokens = q.shape[0]
    seg = segment_ids(cu_seqlens, tokens)  # also counts each sequence's non-finite rows, below
    mask = block_diagonal_mask(seg)
    real = valid_rows(cu_seqlens, tokens)[:, None, None]  # on the device: no host read
    # The same holds between real sequences: a non-finite k or v row of one sequence would reach every other
    # sequence of the packed batch. So such rows are zeroed too, and the (sequence, head) pairs that held one
    # come out NaN, as they would attending alone; every other sequence is untouched.
    finite = torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1)  # [T, H]
    poisoned = torch.zeros(cu_seqlens.shape[0], q.shape[1], dtype=torch.int32, device=q.device)
    poisoned.index_add_(0, seg, (~finite).to(torch.int32))  # [slots + 1, H]: padding rows count in the last
    keep = real & finite[:, :, None]
    k, v = torch.where(keep, k, 0), torch.where(keep, v, 0)
    # [T, H, D] -> [1, H, T, D]: the packed batch is one SDPA "batch" whose mask keeps sequences apart.
    attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], attn_mask=mask, scale=scale)
    out = attn[0].transpose(0, 1)
    return torch.where((poisoned[seg] > 0)[:, :, None], float("nan"), out).contiguous()


# Varlen attention: ``q, k, v`` ``[T, H, D]``, ``cu_seqlens`` int32 ``[n + 1]`` -> ``[T, H, D]``; ``max_seqlen`` is
# accepted for the common signature (the mask covers every length).
SDPA_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
sdpa_varlen, sdpa_varlen_op = register_varlen_kernel(
    "TORCH_SDPA", "sdpa_varlen", lambda q, k, v, cu_seqlens, max_seqlen, scale: masked_sdpa(q, k, v, cu_seqlens, scale),
    dtypes=SDPA_DTYPES, differentiable=True)


TORCH_SDPA = KernelSpec(
    name="TORCH_SDPA",
    impl_path="hwgraph.attention.sdpa:sdpa_varlen",
    kinds=("cuda", "rocm", "npu", "cpu"),
    dtypes=SDPA_DTYPES,
    head_dims=ANY_HEAD_DIM,  # torch picks an SDPA backend that takes the head dim, its math one at worst
    graph_safe=True,
    gate=lambda platform: Capability.available(),
    priority=0,
    description="torch scaled_dot_product_attention with a block-diagonal mask built on device; any platform",
)
