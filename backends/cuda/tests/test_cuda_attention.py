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


@pytest.mark.parametrize("max_seqlen", [256, 4096])  # the two tile choices of the Gluon kernel
@pytest.mark.parametrize(("head_dim", "dtype"), [(72, torch.bfloat16), (72, torch.float16), (64, torch.bfloat16),
                                                 (96, torch.bfloat16), (128, torch.bfloat16), (40, torch.float16)])
def test_triton_attn_takes_the_gluon_kernel_on_hopper_and_it_matches_the_reference(max_seqlen, head_dim, dtype):
    """On Hopper TRITON_ATTN's automatic choice is the Gluon kernel (outside 1024-2047 rows): block edges, empty
    slots, padding rows of garbage (their outputs zero), head widths of one MMA part (64, 128) and of two (72 = 64 +
    16, 96 = 64 + 32, 40 = 32 + 16), and non-finite values in the padding rows of k and v that must not reach a
    real row (the last key block zeroes its rows past the sequence before p.v)."""
    from hwgraph.attention.gluon_kernel import gluon_available
    from hwgraph.attention.triton_kernel import launch_varlen_attention, uses_gluon

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the Gluon kernel needs compute capability 9.x, this GPU has {torch.cuda.get_device_capability()}")
    if gluon_available() is not None:
        pytest.skip(f"no Gluon Hopper API in this Triton: {gluon_available()}")
    lengths = [max_seqlen - 1, 1] if max_seqlen == 256 else [4096 - 200, 129, 64, 7]
    batch = random_packed_batch(lengths, HEADS, head_dim, zero_length=2, padding_rows=33, max_seqlen=max_seqlen,
                                dtype=dtype, device="cuda", seed=head_dim)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)  # [T, 3, H, D], as the tower's projection leaves them
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert uses_gluon(q, k, v, max_seqlen)
    out = launch_varlen_attention(q, k, v, batch.cu_seqlens, max_seqlen, batch.scale)
    assert_matches_reference(out, batch)
    qkv[batch.total:, 1] = float("inf")
    qkv[batch.total:, 2] = float("nan")
    poisoned = launch_varlen_attention(q, k, v, batch.cu_seqlens, max_seqlen, batch.scale)
    assert torch.equal(poisoned, out)


# The ping-pong kernel persistent (one program per SM, several tiles each) and with one program per tile, then the
# non-specialised kernel.
GLUON_TILES = [(256, 64, 4, 4, True, 168, 240, True), (128, 128, 4, 4, True, 168, 240, True),
               (128, 128, 4, 4, True, 168, 240, False), (128, 64, 8, 3), (64, 64, 4, 3)]


@pytest.mark.parametrize("tiles", GLUON_TILES,
                         ids=["pingpong-wide-persistent", "pingpong-persistent", "pingpong", "128x64", "64x64"])
@pytest.mark.parametrize(("head_dim", "dtype"), [(72, torch.bfloat16), (72, torch.float16), (64, torch.bfloat16),
                                                 (96, torch.bfloat16), (40, torch.float16)])
def test_each_gluon_kernel_matches_the_reference_in_a_long_budget(tiles, head_dim, dtype):
    """Both Gluon kernels at each tile choice, in a 4096-row budget: sequences of odd and even numbers of key blocks
    (the ping-pong consumers alternate at every block), q tiles whose second half is past the sequence (129, 64, 7:
    that consumer stores nothing but must keep taking turns), empty slots, padding rows (zero outputs) and
    non-finite values in the padding rows of k and v."""
    from hwgraph.attention.gluon_kernel import gluon_available, launch_gluon_attention

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the Gluon kernel needs compute capability 9.x, this GPU has {torch.cuda.get_device_capability()}")
    if gluon_available() is not None:
        pytest.skip(f"no Gluon Hopper API in this Triton: {gluon_available()}")
    batch = random_packed_batch([1930, 1600, 129, 64, 7], HEADS, head_dim, zero_length=2, padding_rows=45,
                                max_seqlen=4096, dtype=dtype, device="cuda", seed=head_dim + 1)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    out = launch_gluon_attention(q, k, v, batch.cu_seqlens, 4096, batch.scale, tiles=tiles)
    assert_matches_reference(out, batch)
    qkv[batch.total:, 1] = float("nan")
    qkv[batch.total:, 2] = float("inf")
    assert torch.equal(launch_gluon_attention(q, k, v, batch.cu_seqlens, 4096, batch.scale, tiles=tiles), out)


@pytest.mark.parametrize("wide", [True, False], ids=["256-row-tiles", "128-row-tiles"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pingpong_kernel_flags_and_recomputes_rows_whose_scores_outgrow_their_shift(dtype, wide):
    """In bf16 (from 2048 rows) the ping-pong kernel shifts each row's softmax by its first key block's maximum.
    Rows 0-99 here score one late key (3000) about 2**7 above that in log2 units, which overflows float32: the
    kernel flags exactly the half-tiles that hold them in every head (two of 64 rows with 128-row q tiles, one of
    128 with 256-row tiles), and ``launch_gluon_attention``'s fixup recomputes them, also when replayed from a CUDA
    graph, so every row matches the reference. fp16 keeps the online softmax and leaves the flags untouched."""
    from hwgraph.attention.gluon_kernel import (
        PINGPONG_TILES,
        PINGPONG_WIDE_TILES,
        gluon_available,
        kernel_call,
        launch_gluon_attention,
        overflow_blocks,
        uses_fixed_shift,
    )

    if torch.cuda.get_device_capability()[0] != 9 or gluon_available() is not None:
        pytest.skip(f"the Gluon kernel needs compute capability 9.x and Gluon (capability "
                    f"{torch.cuda.get_device_capability()}, Gluon: {gluon_available() or 'ok'})")
    assert uses_fixed_shift(dtype, 4096) == (dtype == torch.bfloat16)
    batch = random_packed_batch([3896, 129], HEADS, HEAD_DIM, padding_rows=71, max_seqlen=4096, dtype=dtype,
                                device="cuda", seed=5)
    batch.q[:100] = 4.0
    batch.k[3000] = 4.0  # q.k = 1152, times the scale 1/sqrt(72) and log2(e): 196 above zero
    tiles = PINGPONG_WIDE_TILES if wide else PINGPONG_TILES
    half = tiles.block_m // 2  # each consumer's rows: one flag each
    blocks = overflow_blocks(4096, tiles.block_m)
    flags = torch.full((2 * HEADS * blocks,), -1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(batch.q)
    kernel, grid, args, kwargs = kernel_call(batch.q, batch.k, batch.v, out, batch.cu_seqlens, 4096, batch.scale,
                                             tiles, flags=flags)
    kernel[grid](*args, **kwargs)
    written = flags.view(2, HEADS, blocks).cpu()
    if dtype == torch.bfloat16:
        real_blocks = [-(-3896 // half), -(-129 // half)]
        hot = -(-100 // half)  # the half-tiles of rows 0-99
        assert torch.equal(written[0, :, :hot], torch.ones(HEADS, hot, dtype=torch.int32))
        assert torch.equal(written[0, :, hot:real_blocks[0]],
                           torch.zeros(HEADS, real_blocks[0] - hot, dtype=torch.int32))
        assert torch.equal(written[1, :, :real_blocks[1]], torch.zeros(HEADS, real_blocks[1], dtype=torch.int32))
    else:
        assert torch.equal(written, torch.full_like(written, -1))
    assert_matches_reference(launch_gluon_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, 4096, batch.scale,
                                                    tiles=tiles), batch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = launch_gluon_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, 4096, batch.scale,
                                          tiles=tiles)
    graph.replay()
    assert_matches_reference(replayed, batch)


def test_triton_attn_takes_the_pingpong_kernel_from_2048_rows_in_a_cuda_graph():
    """The tower's 1024-token budget (4096 patch rows) replays the ping-pong kernel from a CUDA graph, with new
    sequence boundaries copied into the captured buffers between replays."""
    from hwgraph.attention.gluon_kernel import PINGPONG_WIDE_TILES, gluon_available, gluon_tiles
    from hwgraph.attention.triton_kernel import launch_varlen_attention, uses_gluon

    if torch.cuda.get_device_capability()[0] != 9 or gluon_available() is not None:
        pytest.skip(f"the Gluon kernel needs compute capability 9.x and Gluon (capability "
                    f"{torch.cuda.get_device_capability()}, Gluon: {gluon_available() or 'ok'})")
    assert gluon_tiles(4096, HEAD_DIM) == PINGPONG_WIDE_TILES
    first = random_packed_batch([4096], HEADS, HEAD_DIM, max_seqlen=4096, dtype=torch.bfloat16, device="cuda", seed=3)
    second = random_packed_batch([2000, 1500, 300], HEADS, HEAD_DIM, padding_rows=4096 - 3800, max_seqlen=4096,
                                 dtype=torch.bfloat16, device="cuda", seed=4)
    q, k, v = (t.clone() for t in (first.q, first.k, first.v))
    cu = torch.zeros(4, dtype=torch.int32, device="cuda")
    cu[1:] = 4096
    assert uses_gluon(q, k, v, 4096)
    launch_varlen_attention(q, k, v, cu, 4096, first.scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch_varlen_attention(q, k, v, cu, 4096, first.scale)
    for batch in (first, second):
        for static, new in ((q, batch.q), (k, batch.k), (v, batch.v)):
            static.copy_(new)
        cu.copy_(torch.nn.functional.pad(batch.cu_seqlens, (0, 4 - batch.cu_seqlens.numel()),
                                         value=int(batch.cu_seqlens[-1])))
        graph.replay()
        assert_matches_reference(out, batch)


def test_one_sequence_in_a_1024_row_budget_takes_the_pingpong_kernel(monkeypatch):
    """The 256-token budget's graph with one sequence slot (1024 patch rows) runs the ping-pong kernel (0.016
    against 0.021 ms for the TMA kernel), which must match the reference with padding rows of garbage; with four
    slots it stays on the TMA kernel."""
    from hwgraph.attention import gluon_kernel
    from hwgraph.attention.triton_kernel import launch_varlen_attention, uses_gluon

    if torch.cuda.get_device_capability()[0] != 9 or gluon_kernel.gluon_available() is not None:
        pytest.skip(f"the Gluon kernel needs compute capability 9.x and Gluon (capability "
                    f"{torch.cuda.get_device_capability()}, Gluon: {gluon_kernel.gluon_available() or 'ok'})")
    batch = random_packed_batch([1000], HEADS, HEAD_DIM, padding_rows=24, max_seqlen=1024, dtype=torch.bfloat16,
                                device="cuda", seed=5)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert uses_gluon(q, k, v, 1024, num_seqs=1) and not uses_gluon(q, k, v, 1024, num_seqs=4)
    kernels = []
    kernel_call = gluon_kernel.kernel_call

    def spy(*args, **kwargs):
        call = kernel_call(*args, **kwargs)
        kernels.append(call[0])
        return call

    monkeypatch.setattr(gluon_kernel, "kernel_call", spy)
    out = launch_varlen_attention(q, k, v, batch.cu_seqlens, 1024, batch.scale)
    from hwgraph.attention.gluon_pingpong import hopper_attention_pingpong_kernel

    assert kernels == [hopper_attention_pingpong_kernel]
    assert_matches_reference(out, batch)
    qkv[batch.total:, 1] = float("nan")
    qkv[batch.total:, 2] = float("inf")
    assert torch.equal(launch_varlen_attention(q, k, v, batch.cu_seqlens, 1024, batch.scale), out)


@pytest.mark.parametrize(("max_seqlen", "use_gluon"), [(1024, False), (256, True), (4096, True)])
def test_a_q_whose_heads_are_not_adjacent_gives_the_same_result(max_seqlen, use_gluon):
    """The TMA and Gluon kernels take q's head stride as a constexpr, so a q stored head-major ([H, T, D] seen as
    [T, H, D]) is copied to adjacent heads first: the result equals that of the adjacent q, bit for bit."""
    from hwgraph.attention import gluon_kernel
    from hwgraph.attention.triton_kernel import launch_varlen_attention, uses_tma

    if torch.cuda.get_device_capability()[0] != 9 or gluon_kernel.gluon_available() is not None:
        pytest.skip(f"the TMA and Gluon kernels need compute capability 9.x and Gluon (capability "
                    f"{torch.cuda.get_device_capability()}, Gluon: {gluon_kernel.gluon_available() or 'ok'})")
    batch = random_packed_batch([max_seqlen - 40, 17], HEADS, HEAD_DIM, padding_rows=23, max_seqlen=max_seqlen,
                                dtype=torch.bfloat16, device="cuda", seed=max_seqlen)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    head_major = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(head_major, q) and head_major.stride(1) != HEAD_DIM and uses_tma(head_major, k, v)
    got = launch_varlen_attention(head_major, k, v, batch.cu_seqlens, max_seqlen, batch.scale, use_gluon=use_gluon)
    assert_matches_reference(got, batch)
    assert got.stride(1) == HEAD_DIM  # the kernel ran on the copy (empty_like keeps a head-major q's layout)
    want = launch_varlen_attention(q, k, v, batch.cu_seqlens, max_seqlen, batch.scale, use_gluon=use_gluon)
    assert torch.equal(got, want)


def test_triton_attn_keeps_the_tma_kernel_where_it_measured_faster():
    from hwgraph.attention.triton_kernel import TMA_OVER_GLUON, uses_gluon, uses_tma

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the TMA kernels need compute capability 9.x, this GPU has {torch.cuda.get_device_capability()}")
    batch = random_packed_batch([1000, 24], HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    assert uses_tma(batch.q, batch.k, batch.v)
    assert not uses_gluon(batch.q, batch.k, batch.v, TMA_OVER_GLUON[0])


@pytest.mark.parametrize("head_dim", [288, 512])
def test_torch_sdpa_takes_a_head_dim_over_256_on_the_gpu_and_the_tower_chooses_it(head_dim):
    """TORCH_SDPA admits any head dim (torch picks an SDPA backend that takes it); the GPU's fast kernels stop at 256,
    so a tower of head_dim 288 chooses TORCH_SDPA automatically and equals transformers on the GPU."""
    from hwgraph.attention.registry import choose_attention
    from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
    from hwgraph.models.qwen3_omni.config import preset_config
    from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference

    batch = random_packed_batch([300, 49, 1], 2, head_dim, zero_length=1, padding_rows=7, dtype=torch.bfloat16,
                                device="cuda")
    assert choose_attention(platform=detect(), dtype=torch.bfloat16, head_dim=head_dim).spec.name == "TORCH_SDPA"
    assert_matches_reference(TORCH_SDPA.load()(*batch.args()), batch)
    torch.manual_seed(0)
    config = preset_config("tiny", hidden_size=2 * head_dim, num_heads=2, intermediate_size=64)
    tower = Qwen3OmniVisionTower(config).to("cuda", torch.bfloat16).eval()
    grid = [(1, 8, 6), (2, 4, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, device="cuda",
                         dtype=torch.bfloat16)
    with torch.no_grad():
        got = tower(pixels, grid)
    want = run_reference(reference_encoder(tower), pixels, grid)
    assert tower.attention_kernel == "TORCH_SDPA"
    for g, w in zip((got.embeds, *got.deepstack), (want.embeds, *want.deepstack), strict=True):
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 2e-2  # bf16 against bf16, two op orders


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [4, 12, 20, 36, 24, 32, 56, 104])
def test_triton_attn_serves_narrow_heads_and_heads_that_are_not_a_multiple_of_16_bytes(head_dim, dtype):
    """At head dims 4, 12, 20 and 36 in 16-bit dtypes the TMA and Gluon kernels crashed the H100 ("an illegal
    instruction"), and at 24 the ping-pong kernel's outputs were wrong in a 4096-row budget (session 56); ``uses_tma``
    sends heads below 32 lanes, and those not a multiple of 16 bytes, to the pointer kernel. Every budget size
    matches the reference, 32 lanes (the narrowest head of the fast kernels) included, and 56 and 104 lanes, whose
    first MMA part is wider than the head (``pingpong_head``: the ping-pong kernel no longer takes 56)."""
    from hwgraph.attention.triton_kernel import MIN_FAST_HEAD_DIM, uses_tma

    for max_seqlen, lengths in ((256, [200, 49, 1]), (1024, [1000, 24]), (4096, [3000, 700, 9])):
        batch = random_packed_batch(lengths, HEADS, head_dim, zero_length=1, padding_rows=17, max_seqlen=max_seqlen,
                                    dtype=dtype, device="cuda", seed=head_dim)
        fast = head_dim >= MIN_FAST_HEAD_DIM and head_dim % 8 == 0 and 9 <= torch.cuda.get_device_capability()[0] <= 10
        assert uses_tma(batch.q, batch.k, batch.v) is fast
        assert_matches_reference(TRITON_ATTN.load()(*batch.args()), batch)
        torch.cuda.synchronize()
