"""Host-side choices of TRITON_ATTN's kernels on a machine without a GPU: which heads each Hopper kernel takes."""

from __future__ import annotations

import types

import pytest
import torch

from hwgraph.testing.reference import random_packed_batch

triton_kernel = pytest.importorskip("hwgraph.attention.triton_kernel")
gluon_kernel = pytest.importorskip("hwgraph.attention.gluon_kernel")

# Heads the TMA and Gluon kernels take in 16-bit dtypes (uses_tma): 32 to 128 lanes, multiples of 16 bytes.
FAST_HEAD_DIMS = range(triton_kernel.MIN_FAST_HEAD_DIM, 129, 8)


@pytest.mark.parametrize("num_seqs", [1, 4, None])
@pytest.mark.parametrize("max_seqlen", [1024, 2048, 4096])
def test_the_pingpong_kernel_takes_only_heads_that_fill_q_s_first_part(max_seqlen, num_seqs):
    """The ping-pong kernel loads q by TMA in boxes of its first part's width and stores that part by TMA: a head of
    56 lanes (one part of 64) would read the next head's first 8 lanes of q into its scores and overwrite them in
    the next head's output. Such heads take ``hopper_attention_kernel``, which masks q's loads and the stores."""
    for head_dim in FAST_HEAD_DIMS:
        tiles = gluon_kernel.gluon_tiles(max_seqlen, head_dim, num_seqs)
        if tiles.pingpong:
            assert triton_kernel.head_split(head_dim)[0] <= head_dim, (head_dim, tiles)
    assert triton_kernel.head_split(56) == (64, 0)
    assert not gluon_kernel.pingpong_head(56) and gluon_kernel.pingpong_head(72) and gluon_kernel.pingpong_head(64)
    assert gluon_kernel.gluon_tiles(4096, 56, 1) == gluon_kernel.GluonTiles(128, 64, 8, 3)
    assert gluon_kernel.gluon_tiles(4096, 64, 1).pingpong  # a head that fills its one part keeps the ping-pong kernel


def test_one_sequence_of_56_lanes_a_head_inside_tma_over_gluon_takes_the_tma_kernel(monkeypatch):
    """Inside ``TMA_OVER_GLUON`` only the ping-pong kernel is taken over the TMA kernel; at 56 lanes it is not."""
    monkeypatch.setattr(triton_kernel, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(triton_kernel, "gluon_ready", lambda index: True)
    batch = random_packed_batch([5], heads=2, head_dim=56, dtype=torch.bfloat16)
    assert not triton_kernel.uses_gluon(batch.q, batch.k, batch.v, 1024, 1)
    assert triton_kernel.uses_gluon(batch.q, batch.k, batch.v, 4096, 1)  # hopper_attention_kernel's 128x64 tiles


@pytest.mark.skipif(gluon_kernel.gluon_available() is not None, reason="this Triton has no Gluon Hopper API")
def test_pingpong_tiles_for_a_head_narrower_than_q_s_first_part_are_refused_by_name():
    qkv = torch.zeros(8, 3, 2, 56, dtype=torch.bfloat16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    with pytest.raises(ValueError, match="heads of 56 lanes: q's first part is 64 lanes wide"):
        gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), torch.tensor([0, 8], dtype=torch.int32), 4096, 0.1,
                                 tiles=gluon_kernel.PINGPONG_TILES)


@pytest.mark.parametrize(("capability", "tma"), [((9, 0), True), ((10, 0), True), ((10, 3), True), ((12, 0), False),
                                                 ((12, 1), False), ((8, 9), False), ((8, 0), False)])
def test_the_tma_kernel_is_taken_only_where_its_tiles_fit_shared_memory(monkeypatch, capability, tma):
    """Triton builds the TMA kernel's 128x128 tiles (from 1024 rows) with 124 KB of shared memory at 72 lanes a head
    for sm_120, whose programs may take 99 KB: consumer Blackwell (12.x) has TMA but takes the pointer kernel, as
    Ampere and Ada (no TMA) do; Hopper and datacenter Blackwell (227 KB) take the TMA kernel."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

    monkeypatch.setattr(triton_kernel, "has_tma", triton_kernel.has_tma.__wrapped__)  # uncached: the GPU changes
    monkeypatch.setattr(triton_kernel, "is_interpreted", lambda: False)
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("simulated GPU", *capability))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    assert triton_kernel.has_tma(0) is tma
    batch = random_packed_batch([5], heads=2, head_dim=72, dtype=torch.bfloat16)
    on_gpu = types.SimpleNamespace(is_cuda=True, dtype=batch.q.dtype, shape=batch.q.shape,
                                   element_size=batch.q.element_size, device=torch.device("cuda", 0))
    assert triton_kernel.uses_tma(on_gpu, batch.k, batch.v) is tma
