"""The CUDA attention kernels on a real NVIDIA GPU: bf16 against the float64 reference, free of host syncs, and
captured in a CUDA graph that is replayed with new sequence boundaries copied into its static buffers."""

from __future__ import annotations

import random

import pytest
import torch
from hwgraph_cuda.attention import FLASH_ATTN

from hwgraph.attention.sdpa import TORCH_SDPA
from hwgraph.attention.triton_attn import TRITON_ATTN
from hwgraph.platform import detect
from hwgraph.testing.reference import assert_matches_reference, random_packed_batch, random_seqlens

pytestmark = pytest.mark.cuda

HEADS, HEAD_DIM = 16, 72  # the Qwen3-Omni image tower


@pytest.fixture(params=[FLASH_ATTN, TRITON_ATTN, TORCH_SDPA], ids=lambda spec: spec.name)
def kernel(request):
    spec = request.param
    cap = spec.capability(detect(), torch.bfloat16, HEAD_DIM)
    if not cap.ok:
        pytest.skip(f"{spec.name} is unavailable here: {cap.describe()}")
    return spec.load()


@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_reference_in_bf16(kernel, seed):
    rng = random.Random(seed)
    batch = random_packed_batch(random_seqlens(rng, max_seqs=6, max_len=700), HEADS, HEAD_DIM,
                                zero_length=rng.randint(0, 2), padding_rows=rng.randint(0, 40),
                                dtype=torch.bfloat16, device="cuda", seed=seed)
    out = kernel(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == torch.bfloat16 and out.is_cuda
    assert_matches_reference(out, batch)


def test_kernel_reads_no_device_memory_on_the_host(kernel):
    batch = random_packed_batch([300, 49, 1], HEADS, HEAD_DIM, zero_length=1, padding_rows=7,
                                dtype=torch.bfloat16, device="cuda")
    kernel(*batch.args())  # first call compiles/loads outside the guard
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = kernel(*batch.args())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_matches_reference(out, batch)


def test_kernel_replays_in_a_cuda_graph_with_new_cu_seqlens(kernel):
    budget, slots = 1024, 8  # static tokens and sequence slots; max_seqlen is fixed to the budget at capture
    batches = [
        random_packed_batch(lengths, HEADS, HEAD_DIM, zero_length=slots - len(lengths),
                            padding_rows=budget - sum(lengths), max_seqlen=budget, dtype=torch.bfloat16,
                            device="cuda", seed=i)
        for i, lengths in enumerate([[300, 200, 64], [700, 1, 100, 49], [16] * 8, [1024]])
    ]
    first = batches[0]
    static = [t.clone() for t in (first.q, first.k, first.v, first.cu_seqlens)]

    def step():
        return kernel(*static, budget, first.scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles, flash picks kernels) outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for batch in batches[1:] + batches[:1]:
        for buffer, fresh in zip(static, (batch.q, batch.k, batch.v, batch.cu_seqlens), strict=True):
            buffer.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, batch)


@pytest.mark.parametrize("max_seqlen", [256, 4096])  # the two tile choices of the TMA kernel
def test_triton_attn_takes_the_tma_kernel_on_hopper_and_both_kernels_match_the_reference(max_seqlen):
    """On Hopper TRITON_ATTN reads k and v through TMA descriptors; on the tower's strided qkv views it must take
    that kernel, and it and the pointer kernel both match the reference (block edges, empty slots, padding)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip(f"the TMA kernel needs compute capability 9.0, this GPU has {torch.cuda.get_device_capability()}")
    from hwgraph.attention.triton_kernel import launch_varlen_attention, uses_tma

    lengths = [max_seqlen - 1, 1] if max_seqlen == 256 else [4096 - 200, 129, 64, 7]
    batch = random_packed_batch(lengths, HEADS, HEAD_DIM, zero_length=2, padding_rows=33, max_seqlen=max_seqlen,
                                dtype=torch.bfloat16, device="cuda")
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)  # [T, 3, H, D], as the tower's projection leaves them
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert uses_tma(q, k, v)
    for use_tma in (True, False):
        out = launch_varlen_attention(q, k, v, batch.cu_seqlens, max_seqlen, batch.scale, use_tma=use_tma)
        assert_matches_reference(out, batch)
