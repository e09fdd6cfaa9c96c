"""TRITON_ATTN's Gluon kernel for Hopper, on a machine without a GPU: when it is taken, and that it compiles.

Gluon has no interpreter, so the kernel's results are checked on the H200 (``backends/cuda/tests``). Here Triton
compiles it for sm_90 (PTX, then ptxas) through an active driver that only names the target, at the tile choices
that ``gluon_tiles`` makes (the ping-pong kernel from 2048 rows, ``hopper_attention_kernel`` below or where the
ping-pong ring does not fit) and for the head widths of one and of two MMA parts.
"""

from __future__ import annotations

import re

import pytest
import torch

from hwgraph.attention.triton_attn import interpreter_enabled
from hwgraph.testing.reference import random_packed_batch

triton_kernel = pytest.importorskip("hwgraph.attention.triton_kernel")
gluon_kernel = pytest.importorskip("hwgraph.attention.gluon_kernel")
gluon_pingpong = pytest.importorskip("hwgraph.attention.gluon_pingpong")

needs_gluon = pytest.mark.skipif(gluon_kernel.gluon_available() is not None,
                                 reason=f"this Triton has no Gluon Hopper API: {gluon_kernel.gluon_available()}")


class Sm90Driver:
    """An active Triton driver that compiles for sm_90 and launches nothing (``warmup`` only compiles)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def sm90():
    from triton.runtime import driver

    previous = getattr(driver, "_active", None)  # None: the default driver (there is none on this machine)
    driver.set_active(Sm90Driver())
    try:
        yield
    finally:
        driver.set_active(previous)


@needs_gluon
@pytest.mark.skipif(interpreter_enabled(), reason="compiles for a GPU target: not under TRITON_INTERPRET=1")
@pytest.mark.parametrize(("head_dim", "max_seqlen", "slots"), [
    (72, 4096, 1), (72, 1024, 1), (72, 1024, 2), (72, 256, 1), (64, 4096, 1), (96, 2048, 1), (40, 4096, 1),
    (128, 4096, 1), (128, 256, 1), (96, 1024, 1)])
def test_gluon_kernel_compiles_for_hopper_and_its_programs_fit_shared_memory(sm90, head_dim, max_seqlen, slots):
    tokens, heads = 300, 2
    qkv = torch.zeros(tokens, 3, heads, head_dim, dtype=torch.bfloat16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    tiles = gluon_kernel.gluon_tiles(max_seqlen, head_dim, num_seqs=slots)
    cu_seqlens = torch.tensor([0] + [tokens] * slots, dtype=torch.int32)
    kernel, grid, args, kwargs = gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), cu_seqlens, max_seqlen, 0.1)
    compiled = kernel.warmup(*args, **kwargs, grid=grid)
    ptx = compiled.asm["ptx"]
    assert ptx.count("wgmma.mma_async") > 0 and "cp.async.bulk.tensor" in ptx  # Hopper MMAs fed by TMA
    if tiles.pingpong:
        # Two consumer warpgroups and a producer warp; the producer gives its registers to the consumers.
        assert kernel is gluon_pingpong.hopper_attention_pingpong_kernel
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
        assert re.search(r"\.maxnreg\s+168\b", ptx)
        assert compiled.metadata.shared <= 227 * 1024, f"{compiled.metadata.shared} bytes of shared memory"
    else:
        assert kernel is gluon_kernel.hopper_attention_kernel
        # gluon_tiles' reason for 128x64 tiles from 1024 rows: at the tower's head_dim 72 two programs fit in one
        # SM's 228 KB of shared memory (at 128 one does)
        per_sm = 2 if max_seqlen >= 1024 and head_dim == 72 else 1
        assert per_sm * compiled.metadata.shared <= 228 * 1024, f"{compiled.metadata.shared} bytes of shared memory"


WIDE = gluon_kernel.PINGPONG_WIDE_TILES


@pytest.mark.parametrize(("max_seqlen", "head_dim", "num_seqs", "expected"), [
    # the ping-pong kernel on 256-row q tiles from 4096 rows, up to 72 lanes a head (one sequence of 4096: 160.5
    # against 170.4 µs; at 96 lanes no faster)
    (4096, 72, None, WIDE), (4096, 72, 1, WIDE), (4096, 64, None, WIDE), (4096, 40, 2, WIDE),
    (4096, 96, None, gluon_kernel.PINGPONG_TILES), (4095, 72, 1, gluon_kernel.PINGPONG_TILES),
    (2048, 72, 4, gluon_kernel.PINGPONG_TILES), (2048, 96, None, gluon_kernel.PINGPONG_TILES),
    (2047, 72, 2, (128, 64, 8, 3)), (1024, 72, None, (128, 64, 8, 3)), (1024, 72, 4, (128, 64, 8, 3)),
    # one sequence slot: the ping-pong kernel from 1024 rows (0.016 against 0.021 ms for the TMA kernel), on 128-row
    # q tiles below 4096 (one of 1024 in 1024 rows: 16.9 against 28.8 µs on 256-row tiles)
    (1024, 72, 1, gluon_kernel.PINGPONG_TILES), (2047, 72, 1, gluon_kernel.PINGPONG_TILES),
    (1023, 72, 1, (64, 64, 4, 3)),
    (4096, 128, None, (128, 64, 8, 3)),  # the ping-pong ring of 128 lanes a head does not fit shared memory
    (1023, 72, None, (64, 64, 4, 3)), (256, 72, None, (64, 64, 4, 3))])
def test_gluon_tiles_follow_the_measured_choice(max_seqlen, head_dim, num_seqs, expected):
    tiles = gluon_kernel.gluon_tiles(max_seqlen, head_dim, num_seqs)
    assert tiles == gluon_kernel.GluonTiles(*expected)
    start = 1024 if num_seqs == 1 else 2048
    assert tiles.pingpong is (max_seqlen >= start and head_dim <= 96)
    assert tiles.stages == (4 if tiles.pingpong else 3)
    wide = tiles.pingpong and max_seqlen >= 4096 and head_dim <= 72
    assert (tiles.block_m, tiles.block_n) == ((256, 64) if wide else (128, 128) if tiles.pingpong else
                                              (tiles.block_m, tiles.block_n))


def test_the_wide_pingpong_tiles_fit_shared_memory_with_two_q_buffers():
    """256 q rows and four stages of 64 keys: 160 KB at 72 lanes a head with both q buffers."""
    for head_dim in (40, 64, 72):
        assert gluon_kernel.pingpong_fits(head_dim, WIDE, 2)
        assert gluon_kernel.q_buffers(head_dim, WIDE) == 2


def test_the_gluon_kernel_is_not_taken_for_cpu_tensors():
    batch = random_packed_batch([5], heads=2, head_dim=72, dtype=torch.bfloat16)
    assert not triton_kernel.uses_gluon(batch.q, batch.k, batch.v, 4096)


@pytest.mark.parametrize(("capability", "ready"), [((9, 0), True), ((8, 0), False), ((10, 0), False)])
def test_gluon_is_ready_only_on_hopper(monkeypatch, capability, ready):
    """Its warpgroup MMAs exist on compute capability 9.x only (Blackwell has other MMAs)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    triton_kernel.gluon_ready.cache_clear()
    try:
        expected = ready and gluon_kernel.gluon_available() is None
        assert triton_kernel.gluon_ready(0) is expected
    finally:
        triton_kernel.gluon_ready.cache_clear()


@pytest.mark.parametrize(("max_seqlen", "num_seqs", "gluon"), [
    (256, None, True), (511, 2, True), (512, None, False), (1024, None, False), (2047, 4, False), (2048, None, True),
    (4096, 4, True),
    # one sequence slot: the ping-pong Gluon kernel from 1024 rows, inside TMA_OVER_GLUON
    (512, 1, False), (1023, 1, False), (1024, 1, True), (2047, 1, True)])
def test_gluon_is_taken_outside_the_range_where_the_tma_kernel_measured_faster(monkeypatch, max_seqlen, num_seqs,
                                                                               gluon):
    monkeypatch.setattr(triton_kernel, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(triton_kernel, "gluon_ready", lambda index: True)
    batch = random_packed_batch([5], heads=2, head_dim=72, dtype=torch.bfloat16)
    assert triton_kernel.uses_gluon(batch.q, batch.k, batch.v, max_seqlen, num_seqs) is gluon


def test_one_sequence_slot_takes_the_pingpong_kernel_only_where_its_ring_fits(monkeypatch):
    monkeypatch.setattr(triton_kernel, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(triton_kernel, "gluon_ready", lambda index: True)
    batch = random_packed_batch([5], heads=2, head_dim=128, dtype=torch.bfloat16)
    assert not triton_kernel.uses_gluon(batch.q, batch.k, batch.v, 1024, 1)  # 128 lanes: the TMA kernel


@pytest.mark.usefixtures("triton_kernel")  # conftest.py: its Triton kernels record instead of launching
def test_one_sequence_slot_from_1024_rows_takes_the_gluon_kernel(monkeypatch):
    """``gluon_tiles``' ping-pong kernel from 1024 rows holds for a call of one slot only; the launcher must pass the
    slot count, or one image's call inside TMA_OVER_GLUON takes the slower TMA kernel (0.021 against 0.016 ms)."""
    gluon_calls = []
    monkeypatch.setattr(triton_kernel, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(triton_kernel, "gluon_ready", lambda index: True)
    monkeypatch.setattr(gluon_kernel, "launch_gluon_attention", lambda *args, **kwargs: gluon_calls.append(args))
    batch = random_packed_batch([1000], heads=2, head_dim=72, dtype=torch.bfloat16, max_seqlen=1024)
    triton_kernel.launch_varlen_attention(*batch.args())
    assert len(gluon_calls) == 1 and triton_kernel.varlen_attention_tma_kernel.calls == []
    two = random_packed_batch([600, 400], heads=2, head_dim=72, dtype=torch.bfloat16, max_seqlen=1024)
    triton_kernel.launch_varlen_attention(*two.args())  # two slots: the TMA kernel measured faster here
    assert len(gluon_calls) == 1 and len(triton_kernel.varlen_attention_tma_kernel.calls) == 1


def test_a_head_too_wide_for_the_pingpong_ring_takes_gluon_from_2048_rows(monkeypatch):
    """TMA_OVER_GLUON ends before 2048 rows: there 128 lanes a head (no ping-pong ring fits) take the plain Gluon
    kernel, not the TMA kernel."""
    monkeypatch.setattr(triton_kernel, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(triton_kernel, "gluon_ready", lambda index: True)
    batch = random_packed_batch([5], heads=2, head_dim=128, dtype=torch.bfloat16)
    assert triton_kernel.uses_gluon(batch.q, batch.k, batch.v, 2048, 2)
    assert not triton_kernel.uses_gluon(batch.q, batch.k, batch.v, 2047, 2)


@pytest.mark.parametrize(("heads", "head_dim", "dtype", "row"), [
    (1, 20, torch.bfloat16, 24), (3, 20, torch.float16, 64), (16, 72, torch.bfloat16, 1152), (1, 6, torch.float32, 8)])
def test_rows_the_gluon_launcher_allocates_are_tma_addressable(heads, head_dim, dtype, row):
    """``tma_rows_like`` pads each token's ``heads * head_dim`` lanes to 16 bytes where they are not (20 bf16 lanes:
    40 bytes -> 48), so q's copy and the output pass ``tma_rows`` (a TMA descriptor needs 16-byte row strides)."""
    t = torch.zeros(5, heads, head_dim, dtype=dtype)
    like = gluon_kernel.tma_rows_like(t)
    assert like.shape == t.shape and like.dtype == dtype and like.stride() == (row, head_dim, 1)
    assert gluon_kernel.tma_rows(like)


def test_forcing_the_gluon_kernel_on_cpu_says_it_needs_hopper():
    batch = random_packed_batch([5], heads=2, head_dim=72, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Hopper"):
        triton_kernel.launch_varlen_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, 64, batch.scale,
                                              use_gluon=True)


def test_ping_pong_tiles_without_a_register_limit_are_refused_by_name():
    qkv = torch.zeros(8, 3, 2, 72, dtype=torch.bfloat16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    with pytest.raises(ValueError, match="maxnreg"):
        gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), torch.tensor([0, 8], dtype=torch.int32), 4096, 0.1,
                                 tiles=(128, 128, 4, 3, True))


@needs_gluon
@pytest.mark.parametrize(("seqs", "persistent", "programs"), [
    ((4096,), True, 132), ((4096,), False, 32 * 16), ((1024,), True, 8 * 16), ((784,) * 4, True, 132),
    ((784,) * 4, False, 32 * 16 * 4)])
def test_the_pingpong_grid_has_one_program_per_sm_when_persistent(monkeypatch, seqs, persistent, programs):
    """The ping-pong kernel's grid is one-dimensional over its work tiles (q blocks of the budget x heads x
    sequence slots): persistent, at most one program per SM, each taking every 132nd tile; else one per tile."""
    monkeypatch.setattr(gluon_kernel, "sm_count", lambda device: 132)
    heads, rows = 16, 4096
    q = k = v = torch.zeros(rows, heads, 72, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32)
    tiles = gluon_kernel.PINGPONG_TILES._replace(persistent=persistent)
    max_seqlen = 1024 if seqs == (1024,) else rows
    kernel, grid, _, kwargs = gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), cu_seqlens, max_seqlen, 0.1,
                                                       tiles, padding_slot=False)
    assert kernel is gluon_pingpong.hopper_attention_pingpong_kernel
    assert grid == (programs,)
    assert (kwargs["HEADS"], kwargs["M_BLOCKS"], kwargs["PADDING"]) == (heads, max_seqlen // 128, False)


def test_a_q_whose_heads_are_not_adjacent_is_copied_for_the_constexpr_head_stride(monkeypatch):
    """The kernels take q's and out's head strides as constexprs: a q seen through a transpose of ``[H, T, D]``
    (head stride T * D) is copied to adjacent heads first, so the kernel compiles once per head width, not once per
    token count; a one-head view passes the head width whatever its stride."""
    seen = []

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    def spy(q, k, v, out, *rest, **kwargs):
        seen.append((triton_kernel.head_stride(q), triton_kernel.head_stride(out), q.is_contiguous()))
        return NoLaunch(), (1, 1, 1), (), {}

    monkeypatch.setattr(gluon_kernel, "kernel_call", spy)
    heads_first = torch.randn(2, 5, 72, dtype=torch.bfloat16)
    q = heads_first.transpose(0, 1)  # [T, H, D] with head stride 5 * 72
    assert triton_kernel.head_stride(q) == 360
    kv = torch.zeros(5, 2, 2, 72, dtype=torch.bfloat16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    gluon_kernel.launch_gluon_attention(q, kv[:, 0], kv[:, 1], cu, 64, 0.1)
    qkv = torch.zeros(5, 3, 2, 72, dtype=torch.bfloat16)  # the tower's layout: a view, heads adjacent, not copied
    gluon_kernel.launch_gluon_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, 64, 0.1)
    assert seen == [(72, 72, True), (72, 72, False)]
    assert triton_kernel.head_stride(torch.randn(1, 5, 72).transpose(0, 1)) == 72


@needs_gluon
@pytest.mark.skipif(interpreter_enabled(), reason="compiles for a GPU target: not under TRITON_INTERPRET=1")
def test_pingpong_kernel_call_rejects_overflow_flags_too_short_and_ignores_them_without_fixed_shifts(sm90):
    """bf16 from 2048 rows reads the flags it is given and names the size it needs; fp16 (the online softmax) gets
    a placeholder instead, so its caller needs none."""
    qkv = torch.zeros(4096, 3, 16, 72, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 4096], dtype=torch.int32)
    short = torch.zeros(5, dtype=torch.int32)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    # 256-row q tiles at 4096 rows (PINGPONG_WIDE_TILES): 16 q blocks x 16 heads, two flags each
    with pytest.raises(ValueError, match=r"flags must be int32 with at least 512 entries \(two per work tile\), "
                                         r"got torch.int32 with 5"):
        gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), cu_seqlens, 4096, 0.1, flags=short)
    half = qkv.to(torch.float16)
    _, _, args, kwargs = gluon_kernel.kernel_call(half[:, 0], half[:, 1], half[:, 2], torch.empty_like(half[:, 0]),
                                                  cu_seqlens, 4096, 0.1, flags=short)
    assert args[gluon_kernel.FLAGS_ARG] is cu_seqlens and kwargs["FIXED_SHIFT"] is False
    _, _, args, kwargs = gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), cu_seqlens, 4096, 0.1)
    flags = args[gluon_kernel.FLAGS_ARG]
    assert flags.dtype == torch.int32 and flags.numel() == 512 and kwargs["FIXED_SHIFT"] is True
    assert kwargs["BLOCK_M"] == 256
    # One sequence in 1024 rows also runs the ping-pong kernel, below FIXED_SHIFT_FROM: the online softmax.
    short_cu = torch.tensor([0, 1000], dtype=torch.int32)
    kernel, _, args, kwargs = gluon_kernel.kernel_call(q, k, v, torch.empty_like(q), short_cu, 1024, 0.1)
    assert kernel is gluon_pingpong.hopper_attention_pingpong_kernel
    assert args[gluon_kernel.FLAGS_ARG] is short_cu and kwargs["FIXED_SHIFT"] is False


@needs_gluon
@pytest.mark.skipif(interpreter_enabled(), reason="compiles for a GPU target: not under TRITON_INTERPRET=1")
@pytest.mark.parametrize(("dtype", "max_seqlen", "fixup"), [(torch.bfloat16, 4096, True), (torch.bfloat16, 1024, False),
                                                             (torch.float16, 4096, False)])
def test_launch_gluon_attention_follows_fixed_shift_calls_with_the_fixup_on_their_flags(sm90, monkeypatch, dtype,
                                                                                        max_seqlen, fixup,
                                                                                        recording_kernel):
    """The ping-pong call's own flags go to ``launch_overflow_fixup``, with one flag per 64-row half of each 128-row q
    block, slot-major then head, exactly when the call uses the fixed shift."""
    kernel = recording_kernel
    real_call = gluon_kernel.kernel_call
    monkeypatch.setattr(gluon_kernel, "kernel_call", lambda *a, **kw: (kernel, *real_call(*a, **kw)[1:]))
    fixups = []
    monkeypatch.setattr(gluon_kernel, "launch_overflow_fixup", lambda *args: fixups.append(args))
    qkv = torch.zeros(max_seqlen, 3, 16, 72, dtype=dtype)
    cu_seqlens = torch.tensor([0, max_seqlen - 100, max_seqlen - 100], dtype=torch.int32)
    out = gluon_kernel.launch_gluon_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, 0.1,
                                              tiles=gluon_kernel.PINGPONG_TILES)
    ((_, args, kwargs),) = kernel.calls
    assert kwargs["FIXED_SHIFT"] is fixup
    if not fixup:
        assert fixups == []
        return
    ((_, _, _, fixed_out, fixed_cu, flags, blocks, block_m, scale),) = fixups
    assert fixed_out is out and fixed_cu is cu_seqlens and flags is args[gluon_kernel.FLAGS_ARG] and scale == 0.1
    assert (blocks, block_m) == (2 * max_seqlen // 128, 64) and flags.numel() == blocks * 16 * 2


@pytest.mark.parametrize(("head_dim", "lane", "buffers"), [(72, 8, 2), (40, 8, 2), (64, -1, 2), (80, -1, 2),
                                                           (96, -1, 1)])
def test_pingpong_row_sum_lane_and_q_buffers_follow_the_head_width(head_dim, lane, buffers):
    """p is summed on the tensor cores in the first lane of v's second part past the head, where there is one
    (72 = 64 + 16 leaves lanes 8-15); two q buffers where they fit beside the 4-stage ring (72 lanes: 200 KB),
    else one (96 lanes: 216 KB with one)."""
    assert gluon_kernel.sum_lane(head_dim) == lane
    assert gluon_kernel.q_buffers(head_dim, gluon_kernel.PINGPONG_TILES) == buffers
    assert gluon_kernel.pingpong_fits(head_dim, gluon_kernel.PINGPONG_TILES, buffers)


@needs_gluon
@pytest.mark.skipif(interpreter_enabled(), reason="compiles for a GPU target: not under TRITON_INTERPRET=1")
@pytest.mark.parametrize(("max_seqlen", "block_m"), [(4096, 256), (1024, 128)])  # PINGPONG_WIDE_TILES, PINGPONG_TILES
def test_pingpong_kernel_call_loads_q_and_stores_the_output_by_tma(sm90, max_seqlen, block_m):
    """The ping-pong call gets TMA descriptors for q's two parts (q-tile boxes, the producer's loads) and for the
    output's first part (half-tile boxes, each consumer's rows), the row-sum lane and the q buffers; it compiles
    for sm_90 with both, and without the output's TMA store (``OUT_TMA``)."""
    qkv = torch.zeros(max_seqlen, 3, 16, 72, dtype=torch.bfloat16)
    q, k, v = qkv[:, 0].contiguous(), qkv[:, 1], qkv[:, 2]
    out = torch.empty_like(q)
    cu_seqlens = torch.tensor([0, max_seqlen], dtype=torch.int32)
    kernel, grid, args, kwargs = gluon_kernel.kernel_call(q, k, v, out, cu_seqlens, max_seqlen, 0.1)
    assert kwargs["BLOCK_M"] == block_m
    qa_desc, qb_desc, oa_desc = args[-3:]
    assert qa_desc.base is q and qa_desc.block_shape == [block_m, 64] and qb_desc.block_shape == [block_m, 16]
    assert oa_desc.base is out and oa_desc.block_shape == [block_m // 2, 64]
    assert (kwargs["SUM_LANE"], kwargs["Q_BUFFERS"], kwargs["OUT_TMA"]) == (8, 2, True)
    for out_tma in (True, False):
        kernel.warmup(*args, **{**kwargs, "OUT_TMA": out_tma}, grid=grid)


@needs_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_descriptors_share_one_default_layout_per_box_and_dtype(dtype):
    """Every descriptor of a box and dtype carries the one cached layout, equal to the default that Triton builds for
    that box (the swizzle the kernels' shared buffers are allocated with); other boxes and dtypes get their own."""
    from triton.experimental.gluon import language as gl

    k = torch.zeros(256, 16, 72, dtype=dtype)
    first, second = gluon_kernel.descriptor(k, 64, 64), gluon_kernel.descriptor(k.clone(), 64, 64)
    triton_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    assert first.layout is second.layout
    assert first.layout == gl.NVMMASharedLayout.get_default_for([64, 64], triton_dtype)
    narrow = gluon_kernel.descriptor(k, 64, 16).layout
    assert narrow == gl.NVMMASharedLayout.get_default_for([64, 16], triton_dtype) and narrow != first.layout
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    assert gluon_kernel.descriptor(k.to(other), 64, 64).layout is not first.layout


@needs_gluon
@pytest.mark.skipif(interpreter_enabled(), reason="compiles for a GPU target: not under TRITON_INTERPRET=1")
def test_pingpong_q_and_output_that_tma_cannot_address_are_refused_by_kernel_call_and_copied_by_the_launcher(
        sm90, monkeypatch, recording_kernel):
    """q two bytes past 16-byte alignment: ``kernel_call`` names what TMA needs; ``launch_gluon_attention`` hands the
    kernel an aligned copy of q (same values) and an aligned output instead."""
    storage = torch.zeros(4096 * 16 * 72 + 1, dtype=torch.bfloat16)
    storage[1:] = torch.randn(4096 * 16 * 72).to(torch.bfloat16)
    q = storage[1:].view(4096, 16, 72)
    k = v = torch.zeros(4096, 16, 72, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 4096], dtype=torch.int32)
    assert q.data_ptr() % 16 == 2 and not gluon_kernel.tma_rows(q)
    with pytest.raises(ValueError, match=r"q needs unit stride on D, adjacent heads and a 16-byte aligned base and "
                                         r"row stride, got strides \(1152, 72, 1\) of 2-byte elements at address "
                                         r"\d+ \(2 past 16-byte alignment\)"):
        gluon_kernel.kernel_call(q, k, v, torch.empty_like(k), cu_seqlens, 4096, 0.1)
    kernel = recording_kernel
    real_call = gluon_kernel.kernel_call
    monkeypatch.setattr(gluon_kernel, "kernel_call", lambda *a, **kw: (kernel, *real_call(*a, **kw)[1:]))
    monkeypatch.setattr(gluon_kernel, "launch_overflow_fixup", lambda *args: None)
    out = gluon_kernel.launch_gluon_attention(q, k, v, cu_seqlens, 4096, 0.1, tiles=gluon_kernel.PINGPONG_TILES)
    ((_, args, _),) = kernel.calls
    copied = args[-3].base
    assert copied is not q and gluon_kernel.tma_rows(copied) and torch.equal(copied, q)
    assert args[-1].base is out and gluon_kernel.tma_rows(out)
