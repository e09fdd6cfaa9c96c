"""Varlen attention for Hopper in Gluon (Triton's explicit-layout dialect): TRITON_ATTN's kernel on sm_90.

The Triton kernels (``triton_kernel.py``) leave the order of the two matmuls and the softmax to the compiler, and
Triton 3.6 runs them one after the other: the tensor cores wait while the softmax runs. Here the key loop issues
its matmuls as asynchronous warpgroup MMAs (``wgmma``) and orders them itself, as FlashAttention-3 does within a
warpgroup: block j's q.k and block j-1's p.v are in flight while block j's softmax runs, and p.v's lanes past the
head are 16 wide instead of a 128-wide tile (72 = 64 + 16). k and v arrive through TMA into a ring of
``STAGES`` shared-memory buffers, each with its mbarrier.

Layout of the arguments is that of ``varlen_attention_tma_kernel``: q, k, v ``[T, H, D]`` with heads adjacent,
descriptors over ``[T, H * D]`` whose boxes start at a head's first lane (their lanes past the head belong to the
next head, or are zeros past the last one); q's lanes past the head are zero, so they add nothing to q.k, and p.v's
lanes past the head are never stored. Same grid: ``(m blocks, heads, sequences + 1)``, the last slot zeroing the
rows past ``cu_seqlens[-1]``.

From 2048 rows (from 1024 in a call of one sequence slot) ``gluon_tiles`` takes a warp-specialised, persistent
form of this kernel instead (``gluon_pingpong.py``, built from the helpers here), on 256-row q tiles from 4096 rows;
``kernel_call`` builds the call of either.

Importing this module imports ``triton.experimental.gluon``; ``gluon_available()`` says whether that worked.
Gluon has no interpreter: the kernel runs on NVIDIA GPUs of compute capability 9.x only (its MMAs are Hopper's).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from hwgraph.attention.triton_kernel import (
    LOG2_E,
    head_split,
    head_stride,
    head_width,
    launch_overflow_fixup,
    tma_rows,
)
from hwgraph.attention.varlen_inputs import launches_on_tensor_device

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError as exc:  # an older Triton, or none
    GLUON_IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
    gluon = None
else:
    GLUON_IMPORT_ERROR = None


def gluon_available() -> str | None:
    """None when Gluon's Hopper API imports, else why not."""
    return GLUON_IMPORT_ERROR


if gluon is not None:
    # Names that changed after Triton 3.6: the barrier over the program's threads (gl.thread_barrier, now
    # gl.barrier) and the TMA load (tma.async_copy_global_to_shared, now tma.async_load).
    cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

    @gluon.jit
    def issue_kv(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, bars, slot, row, col,
                 D_A: gl.constexpr, HAS_B: gl.constexpr):
        """Start the TMA loads of the key block at token ``row`` (lanes from ``col``) into ring slot ``slot``."""
        bar = bars.index(slot)
        if HAS_B:
            mbarrier.expect(bar, 2 * ka_desc.block_type.nbytes + 2 * kb_desc.block_type.nbytes)
            tma_load(ka_desc, [row, col], bar, ka_s.index(slot))
            tma_load(kb_desc, [row, col + D_A], bar, kb_s.index(slot))
            tma_load(va_desc, [row, col], bar, va_s.index(slot))
            tma_load(vb_desc, [row, col + D_A], bar, vb_s.index(slot))
        else:
            mbarrier.expect(bar, 2 * ka_desc.block_type.nbytes)
            tma_load(ka_desc, [row, col], bar, ka_s.index(slot))
            tma_load(va_desc, [row, col], bar, va_s.index(slot))

    @gluon.jit
    def qk_async(qa_s, qb_s, ka_s, kb_s, slot, s_init, HAS_B: gl.constexpr):
        """q.k of one key block as one or two asynchronous MMAs (two commit groups with HAS_B)."""
        s = warpgroup_mma(qa_s, ka_s.index(slot).permute((1, 0)), s_init, use_acc=False, is_async=True)
        if HAS_B:
            s = warpgroup_mma(qb_s, kb_s.index(slot).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def mask_past_end(s, kv_start, seqlen, BLOCK_N: gl.constexpr):
        """The raw scores of keys ``kv_start ..`` with the keys past the sequence's end at -inf; only a block that
        runs past the end pays for the mask."""
        if kv_start + BLOCK_N > seqlen:
            offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            s = gl.where(((kv_start + offs_n) < seqlen)[None, :], s, float("-inf"))
        return s

    @gluon.jit
    def softmax_step(s, m_i, l_i, kv_start, seqlen, qk_scale_log2, BLOCK_N: gl.constexpr, ROW_SUM: gl.constexpr):
        """Online softmax of the raw scores of keys ``kv_start ..``: ``(p, m, l, alpha)``, the keys past the
        sequence's end masked (``mask_past_end``). Without ``ROW_SUM`` l is returned as it came: the caller sums
        p on the tensor cores (``mma_row_sum``)."""
        s = mask_past_end(s, kv_start, seqlen, BLOCK_N)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale_log2)
        p = gl.exp2(s * qk_scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        if ROW_SUM:
            l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def times_rows(o, per_row):
        """``o`` with each row multiplied by its entry of ``per_row`` (a row vector in any layout)."""
        return o * gl.convert_layout(per_row, gl.SliceLayout(1, o.type.layout))[:, None]

    @gluon.jit
    def mma_row_sum(o_b, LANE: gl.constexpr):
        """Each row's softmax sum, read from lane ``LANE`` of the second p.v part's accumulator, where v's tile held
        ones (``gluon_pingpong.mark_ones``): p.v summed p there, rescaled with the other lanes."""
        lanes = gl.arange(0, o_b.shape[1], layout=gl.SliceLayout(0, o_b.type.layout))
        return gl.sum(gl.where((lanes == LANE)[None, :], o_b, 0.0), 1)

    @gluon.jit
    def zero_tail_rows(buf, valid_rows, num_warps: gl.constexpr):
        """Zero the rows ``valid_rows ..`` of a v tile in shared memory (the rows past the sequence's end: the
        next sequence's values, or whatever the padding rows hold), so that 0-weighted rows add exact zeros."""
        ROWS: gl.constexpr = buf.shape[0]
        COLS: gl.constexpr = buf.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (COLS // 8), COLS // 8], [num_warps, 1], [1, 0])
        tile = buf.load(layout)
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        buf.store(gl.where((rows < valid_rows)[:, None], tile, gl.zeros_like(tile)))

    @gluon.jit
    def load_q_part(Q, rows, seqlen, start, head, stride_qt, stride_qh, lane0: gl.constexpr, WIDTH: gl.constexpr,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
        """Lanes ``lane0 .. lane0 + WIDTH`` of the q tile, zero past the head and past the sequence."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (WIDTH // 8), WIDTH // 8], [num_warps, 1], [1, 0])
        r = rows + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        c = lane0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        ptr = Q + ((start + r).to(gl.int64) * stride_qt + head * stride_qh)[:, None] + c[None, :]
        return gl.load(ptr, mask=(r < seqlen)[:, None] & (c < HEAD_DIM)[None, :], other=0.0)

    @gluon.jit
    def store_out_part(Out, o, inv_l, rows, seqlen, start, head, stride_ot, stride_oh, lane0: gl.constexpr,
                       HEAD_DIM: gl.constexpr):
        layout: gl.constexpr = o.type.layout
        BLOCK_M: gl.constexpr = o.shape[0]
        WIDTH: gl.constexpr = o.shape[1]
        o = times_rows(o, inv_l)
        r = rows + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        c = lane0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        ptr = Out + ((start + r).to(gl.int64) * stride_ot + head * stride_oh)[:, None] + c[None, :]
        gl.store(ptr, o.to(Out.dtype.element_ty), mask=(r < seqlen)[:, None] & (c < HEAD_DIM)[None, :])

    @gluon.jit
    def loop_state(ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr,
                   WARPS: gl.constexpr):
        """``(s_init, o_a, o_b, m, l)`` for ``ROWS`` q rows on ``WARPS`` warps: zero scores (the q.k MMAs'
        accumulator), the two p.v parts' accumulators and the online softmax's row maximum and sum."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        oa_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, D_A, 16])
        ob_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                            instr_shape=[16, D_B, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        return (gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), gl.zeros([ROWS, D_A], gl.float32, oa_layout),
                gl.zeros([ROWS, D_B], gl.float32, ob_layout), gl.full([ROWS], float("-inf"), gl.float32, row_layout),
                gl.zeros([ROWS], gl.float32, row_layout))

    @gluon.jit
    def p_operands(p, o_a, o_b, dtype: gl.constexpr):
        """p in ``dtype`` as the register A operand of each p.v part's MMA."""
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_a.type.layout, k_width=2)
        pb_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_b.type.layout, k_width=2)
        p = p.to(dtype)
        return gl.convert_layout(p, pa_layout), gl.convert_layout(p, pb_layout)

    @gluon.jit
    def pv_async(p_a, p_b, va_s, vb_s, slot, o_a, o_b, HAS_B: gl.constexpr):
        """p.v of the key block in ring slot ``slot``, issued asynchronously (one commit group per part)."""
        o_a = warpgroup_mma(p_a, va_s.index(slot), o_a, is_async=True)
        if HAS_B:
            o_b = warpgroup_mma(p_b, vb_s.index(slot), o_b, is_async=True)
        return o_a, o_b

    @gluon.jit
    def wait_scores(s, HAS_B: gl.constexpr):
        """Wait for q.k alone: the p.v parts issued after it stay in flight."""
        if HAS_B:
            s = warpgroup_mma_wait(2, deps=(s,))
        else:
            s = warpgroup_mma_wait(1, deps=(s,))
        return s

    @gluon.jit
    def rescale(o_a, o_b, alpha, HAS_B: gl.constexpr):
        """The accumulators times the online softmax's correction ``alpha`` (per row)."""
        o_a = times_rows(o_a, alpha)
        if HAS_B:
            o_b = times_rows(o_b, alpha)
        return o_a, o_b

    @gluon.jit
    def zero_tail(va_s, vb_s, slot, tail, HAS_B: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """When the last key block (ring slot ``slot``) has only ``tail`` rows of the sequence, zero its v rows
        past them (``zero_tail_rows``) and make that visible to the MMAs."""
        if tail < BLOCK_N:
            zero_tail_rows(va_s.index(slot), tail, WARPS)
            if HAS_B:
                zero_tail_rows(vb_s.index(slot), tail, WARPS)
            fence_async_shared()
            cta_barrier()

    @gluon.jit
    def store_out(Out, o_a, o_b, l_i, rows, seqlen, start, head, stride_ot, stride_oh, D_A: gl.constexpr,
                  HEAD_DIM: gl.constexpr, HAS_B: gl.constexpr):
        inv_l = 1.0 / l_i
        store_out_part(Out, o_a, inv_l, rows, seqlen, start, head, stride_ot, stride_oh, 0, HEAD_DIM)
        if HAS_B:
            store_out_part(Out, o_b, inv_l, rows, seqlen, start, head, stride_ot, stride_oh, D_A, HEAD_DIM)

    @gluon.jit
    def zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, unit, units_step, heads, stride_ot, stride_oh,
                          HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, D_V: gl.constexpr, num_warps: gl.constexpr):
        """Rows ``[cu_seqlens[-1], tokens)`` belong to no sequence; write zeros there. The work comes in units of
        ``BLOCK_M`` rows of one head (unit ``u``: row block ``u // heads``, head ``u % heads``); this program writes
        units ``unit, unit + units_step, ..``."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (D_V // 8), D_V // 8], [num_warps, 1], [1, 0])
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_v = gl.arange(0, D_V, layout=gl.SliceLayout(0, layout))
        first = gl.load(CU_SEQLENS + num_seqs)
        zeros = gl.zeros([BLOCK_M, D_V], Out.dtype.element_ty, layout)
        for u in range(unit, gl.cdiv(tokens - first, BLOCK_M) * heads, units_step):
            rows = (first + (u // heads) * BLOCK_M + offs_m).to(gl.int64)
            gl.store(Out + rows[:, None] * stride_ot + (u % heads) * stride_oh + offs_v[None, :], zeros,
                     mask=(rows < tokens)[:, None] & (offs_v < HEAD_DIM)[None, :])

    @gluon.jit
    def sequence_rows(CU_SEQLENS, seq, block_m, BLOCK_M: gl.constexpr):
        """``(start, seqlen, rows)``: sequence ``seq``'s first token and length, and the first q row (within it) of
        m block ``block_m``."""
        start = gl.load(CU_SEQLENS + seq)
        seqlen = gl.load(CU_SEQLENS + seq + 1) - start
        return start, seqlen, block_m * BLOCK_M

    @gluon.jit
    def kv_ring(ka_desc, kb_desc, va_desc, vb_desc, STAGES: gl.constexpr):
        """The k/v ring in shared memory: ``STAGES`` slots of each part of k and v, in their descriptors' layouts."""
        BLOCK_N: gl.constexpr = ka_desc.block_type.shape[0]
        D_A: gl.constexpr = ka_desc.block_type.shape[1]
        D_B: gl.constexpr = kb_desc.block_type.shape[1]
        dtype: gl.constexpr = ka_desc.dtype
        return (gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_A], ka_desc.layout),
                gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_B], kb_desc.layout),
                gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_A], va_desc.layout),
                gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_B], vb_desc.layout))

    @gluon.jit(do_not_specialize=["num_seqs"])
    def hopper_attention_kernel(
        Q, ka_desc, kb_desc, va_desc, vb_desc, Out, CU_SEQLENS,
        tokens, num_seqs, qk_scale_log2,
        stride_qt, STRIDE_QH: gl.constexpr, stride_ot, STRIDE_OH: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, HAS_B: gl.constexpr,
        D_V: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Head strides of q and out are constexprs: 72 lanes a head is not a multiple of 16, so as runtime values
        Triton could not prove a head's first lane 16-byte aligned and would load q and store out 2 bytes at a
        time."""
        BLOCK_N: gl.constexpr = ka_desc.block_type.shape[0]
        dtype: gl.constexpr = ka_desc.dtype
        block_m = gl.program_id(0)
        head = gl.program_id(1)
        seq = gl.program_id(2)
        if seq >= num_seqs:
            heads = gl.num_programs(1)
            zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, block_m * heads + head, gl.num_programs(0) * heads,
                              heads, stride_ot, STRIDE_OH, HEAD_DIM, BLOCK_M, D_V, num_warps)
            return
        start, seqlen, rows = sequence_rows(CU_SEQLENS, seq, block_m, BLOCK_M)
        if rows >= seqlen:
            return

        # q: pointer loads (zero past the head and the sequence) into shared memory, the MMAs' A operand.
        qa_s = gl.allocate_shared_memory(dtype, [BLOCK_M, D_A], ka_desc.layout,
                                         load_q_part(Q, rows, seqlen, start, head, stride_qt, STRIDE_QH, 0, D_A,
                                                     HEAD_DIM, BLOCK_M, num_warps))
        qb_s = gl.allocate_shared_memory(dtype, [BLOCK_M, D_B], kb_desc.layout,
                                         load_q_part(Q, rows, seqlen, start, head, stride_qt, STRIDE_QH, D_A, D_B,
                                                     HEAD_DIM, BLOCK_M, num_warps))
        ka_s, kb_s, va_s, vb_s = kv_ring(ka_desc, kb_desc, va_desc, vb_desc, STAGES)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        cta_barrier()

        col = head * HEAD_DIM
        n_blocks = (seqlen + BLOCK_N - 1) // BLOCK_N
        for i in gl.static_range(STAGES):
            if i < n_blocks:
                issue_kv(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, bars, i, start + i * BLOCK_N,
                         col, D_A, HAS_B)

        s_init, o_a, o_b, m_i, l_i = loop_state(BLOCK_M, BLOCK_N, D_A, D_B, num_warps)

        # Block 0: q.k and its softmax; its p.v waits for the loop (or the end).
        mbarrier.wait(bars.index(0), 0)
        s = qk_async(qa_s, qb_s, ka_s, kb_s, 0, s_init, HAS_B)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, 0, seqlen, qk_scale_log2, BLOCK_N, True)
        p_a, p_b = p_operands(p, o_a, o_b, dtype)

        for j in range(1, n_blocks):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
            s = qk_async(qa_s, qb_s, ka_s, kb_s, slot, s_init, HAS_B)
            o_a, o_b = pv_async(p_a, p_b, va_s, vb_s, prev, o_a, o_b, HAS_B)
            s = wait_scores(s, HAS_B)
            p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, j * BLOCK_N, seqlen, qk_scale_log2, BLOCK_N, True)
            o_a, o_b, p_a, p_b = warpgroup_mma_wait(0, deps=(o_a, o_b, p_a, p_b))
            o_a, o_b = rescale(o_a, o_b, alpha, HAS_B)
            p_a, p_b = p_operands(p, o_a, o_b, dtype)
            # Block j-1's slot is free once every warp is past its p.v: refill it.
            cta_barrier()
            if j - 1 + STAGES < n_blocks:
                issue_kv(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, bars, prev,
                         start + (j - 1 + STAGES) * BLOCK_N, col, D_A, HAS_B)

        last = (n_blocks - 1) % STAGES
        zero_tail(va_s, vb_s, last, seqlen - (n_blocks - 1) * BLOCK_N, HAS_B, BLOCK_N, num_warps)
        o_a, o_b = pv_async(p_a, p_b, va_s, vb_s, last, o_a, o_b, HAS_B)
        o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        store_out(Out, o_a, o_b, l_i, rows, seqlen, start, head, stride_ot, STRIDE_OH, D_A, HEAD_DIM, HAS_B)


GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Shared memory one program may take on the H200 (227 KB), less a margin for the compiler's scratch (layout
# conversions) and the mbarriers.
SHARED_BYTES = 216 * 1024


class GluonTiles(NamedTuple):
    """How ``kernel_call`` runs a call. ``pingpong``: ``gluon_pingpong.hopper_attention_pingpong_kernel``, whose
    ``warps`` (4) are one consumer warpgroup's, with ``maxnreg`` registers per thread at launch and
    ``consumer_regs`` per consumer thread once the producer warp gave its registers up, and with ``persistent`` one
    program per SM (else one per work tile); else ``hopper_attention_kernel`` with ``warps`` warps."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    pingpong: bool = False
    maxnreg: int | None = None
    consumer_regs: int = 240
    persistent: bool = False


# Device time per call on the H200 (16 heads of 72, bf16, ms; benchmarks/attention_gluon.py, docs/benchmarks.md,
# session 10): one sequence of 4096 0.194 against 0.221 for 128x64 tiles (3600 patches in 4096 rows: 0.170 / 0.196),
# 2048 in 2048 0.052 / 0.062, 2x1024 in 2048 0.032 / 0.035, 4x784 in 4096 0.059 / 0.057; one sequence of 1024 in
# 1024 rows 0.016 against 0.021 for the Triton TMA kernel, but four of 256 in 1024 0.013 / 0.012. 128x128 tiles with
# 4 stages (3 stages: 0.196 / 0.052 / 0.032 / 0.059 in the same runs). Persistent since session 11
# (benchmarks/attention_ab.py): 4x784 in 4096 0.0515, 2x1024 in 2048 0.030, one sequence of 4096 unchanged, one of
# 1024 in 1024 rows 0.0167 against 0.0164.
PINGPONG_TILES = GluonTiles(128, 128, 4, 4, pingpong=True, maxnreg=168, consumer_regs=240, persistent=True)
PINGPONG_FROM = 2048  # rows of a call with several sequence slots
PINGPONG_FROM_ONE_SEQUENCE = 1024  # rows of a call with one sequence slot
# From PINGPONG_WIDE_FROM rows, 256-row q tiles (two consumers of 128 rows) over 64-key blocks: each key block that
# the producer loads serves twice the q rows, so k and v cross from L2 half as often, and the consumers' registers
# hold 128x64 scores instead of 64x128. On the H200 (16 heads, bf16; docs/benchmarks.md, session 16), µs per call
# against PINGPONG_TILES (benchmarks/attention_gluon.py --tile 256,64,4,4,1,168,240,1, attention_wide.py): at 72 lanes
# one sequence of 4096 159.2-160.5 against 167.7-170.4, 3600 in 4096 rows 141.1 / 148.8, four of 784 in 4096 44.6-44.9
# / 49.2-49.8; at 64 lanes 132.0 / 137.1 and 36.2 / 41.7; at 96 lanes no faster (183.2 / 181.8, 6 bytes spilled).
# Whole replays of one 1024-token image (4096 rows), interleaved: 0.995-0.998x (replay_toggle.py wide-tiles). At 2048
# rows the call gains 1-2% but one 512-token image's replay measured 1% slower, and one sequence of 1024 in 1024 rows
# takes 28.8 against 16.9 (64 tiles for 132 SMs): so from 4096 rows only.
PINGPONG_WIDE_TILES = GluonTiles(256, 64, 4, 4, pingpong=True, maxnreg=168, consumer_regs=240, persistent=True)
PINGPONG_WIDE_FROM = 4096
PINGPONG_WIDE_MAX_HEAD_DIM = 72  # the widest head measured faster with them


def gluon_tiles(max_seqlen: int, head_dim: int, num_seqs: int | None = None) -> GluonTiles:
    """The tiles and kernel for a call of ``num_seqs`` sequence slots (None: not known, taken as several).
    Device time per call on the H200 (16 heads of 72, bf16, ms; ``benchmarks/attention_gluon.py --tiles``,
    ``docs/benchmarks.md``): the ping-pong kernel (``PINGPONG_TILES``) from ``PINGPONG_FROM`` rows, or from
    ``PINGPONG_FROM_ONE_SEQUENCE`` with one slot, where its ring fits shared memory (``pingpong_fits``: up to 96
    lanes a head) and q's first part ends within the head (``pingpong_head``: not at 56 lanes); on 256-row q tiles
    (``PINGPONG_WIDE_TILES``) from ``PINGPONG_WIDE_FROM`` rows. Else from 1024 rows 128x64 tiles with 8 warps and 3
    stages, 0.229 for one sequence of 4096 (128x128: 0.309 with 4 stages; the Triton TMA kernel 0.269), 0.066 for
    4x784 and 2048 in 2048 (session 8). They
    take 114 registers a thread and 82 KB of shared memory, so two programs fit on one SM (128x128: 164 registers,
    143 KB, one program). Below, 64x64 tiles with 4 warps and 3 stages: 0.0088 for 196 patches in 256 rows (the TMA
    kernel 0.0098)."""
    start = PINGPONG_FROM_ONE_SEQUENCE if num_seqs == 1 else PINGPONG_FROM
    if max_seqlen >= start and pingpong_head(head_dim) and pingpong_fits(head_dim, PINGPONG_TILES):
        if max_seqlen >= PINGPONG_WIDE_FROM and head_dim <= PINGPONG_WIDE_MAX_HEAD_DIM \
                and pingpong_fits(head_dim, PINGPONG_WIDE_TILES):
            return PINGPONG_WIDE_TILES
        return PINGPONG_TILES
    return GluonTiles(128, 64, 8, 3) if max_seqlen >= 1024 else GluonTiles(64, 64, 4, 3)


def pingpong_head(head_dim: int) -> bool:
    """Whether the ping-pong kernel takes heads of ``head_dim`` lanes: q's first part (``head_split``) no wider than
    the head. Its producer loads q by TMA in boxes of that width and zeroes only the second part's lanes past the
    head (``mark_q``), and its consumers store the first part's lanes by TMA: with one part wider than the head (56
    lanes in a part of 64; 24 in 32, whose outputs were wrong on the H100 in session 56) q.k would add the next
    head's first lanes and the store would overwrite them in the next head's output."""
    return head_split(head_dim)[0] <= head_dim


def pingpong_fits(head_dim: int, tiles: GluonTiles, q_buffers: int = 1) -> bool:
    """Whether the ping-pong kernel's ``q_buffers`` q tiles and k/v ring fit ``SHARED_BYTES`` (bf16/fp16): with
    ``PINGPONG_TILES`` and one q buffer 72 lanes a head take 180 KB, 96 lanes 216 KB, 128 lanes 288 KB; with two,
    72 lanes 200 KB."""
    d_a, d_b = head_split(head_dim)
    width = d_a + max(d_b, 16)  # the second part's buffers exist (16 wide) even when the head has one part
    return 2 * width * (q_buffers * tiles.block_m + 2 * tiles.stages * tiles.block_n) <= SHARED_BYTES


def q_buffers(head_dim: int, tiles: GluonTiles) -> int:
    """The ping-pong kernel's q buffers: two where they fit (its producer loads a tile's q while the consumers
    finish the previous tile), else one."""
    return 2 if pingpong_fits(head_dim, tiles, 2) else 1


def descriptor(t: torch.Tensor, block_n: int, width: int):
    """A Gluon TMA descriptor over ``t`` ``[T, H, D]`` seen as ``[T, H * D]`` (heads adjacent), box
    ``[block_n, width]`` in the default swizzled shared layout (``shared_layout``)."""
    tokens, heads, head_dim = t.shape
    return GluonDescriptor(t, [tokens, heads * head_dim], [t.stride(0), 1], [block_n, width],
                           shared_layout(block_n, width, t.dtype))


@functools.cache
def shared_layout(block_n: int, width: int, dtype: torch.dtype):
    """The default swizzled shared layout of a ``[block_n, width]`` TMA box of ``dtype``: one frozen Triton object
    per box, built once. Eager calls build their descriptors anew (each holds its tensor), and building the layout
    took about a sixth of a ping-pong call's host time on the H200's host under cProfile (seven descriptors a
    call; ``benchmarks/eager_host.py --parts``, session 17)."""
    return gl.NVMMASharedLayout.get_default_for([block_n, width], getattr(gl, GL_DTYPES[dtype]))


FLAGS_ARG = 7  # the ping-pong kernel's FLAGS among kernel_call's positional args


def tma_rows_like(t: torch.Tensor) -> torch.Tensor:
    """A new tensor shaped like ``t`` ``[T, H, D]`` that ``tma_rows`` accepts: heads adjacent, rows padded to 16
    bytes where ``H * D`` lanes are not."""
    per_16_bytes = 16 // t.element_size()
    row = -(-t.shape[1] * t.shape[2] // per_16_bytes) * per_16_bytes
    return torch.empty_strided(t.shape, (row, t.shape[2], 1), dtype=t.dtype, device=t.device)


def kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, scale: float, tiles: tuple | None = None, padding_slot: bool = True,
                flags: torch.Tensor | None = None) -> tuple[object, tuple[int, int, int], tuple, dict]:
    """``(kernel, grid, args, kwargs)`` writing ``out``: what ``launch_gluon_attention`` launches as
    ``kernel[grid](*args, **kwargs)`` (the CPU tests compile it with ``kernel.warmup(*args, **kwargs, grid=grid)``).
    ``tiles``: a ``GluonTiles`` or its leading fields, ``gluon_tiles``' choice by default. ``flags``: the ping-pong
    kernel's int32 overflow flags (``overflow_blocks`` per slot and head; ``args[FLAGS_ARG]``), read where
    ``uses_fixed_shift``; a new buffer when None. Without ``triton_kernel.launch_overflow_fixup`` after it, such a
    call is right only where its flags are zero (``launch_gluon_attention`` launches both)."""
    tokens, heads, head_dim = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    tiles = GluonTiles(*tiles) if tiles is not None else gluon_tiles(max_seqlen, head_dim, num_seqs)
    d_a, d_b = head_split(head_dim)
    kb_width = max(d_b, 16)  # with d_b == 0 the second descriptors are built but never read
    grid = (max(1, triton.cdiv(max_seqlen, tiles.block_m)), heads, num_seqs + int(padding_slot))
    args = (q, descriptor(k, tiles.block_n, d_a), descriptor(k, tiles.block_n, kb_width),
            descriptor(v, tiles.block_n, d_a), descriptor(v, tiles.block_n, kb_width), out, cu_seqlens, tokens,
            num_seqs, scale * LOG2_E, q.stride(0), head_stride(q), out.stride(0), head_stride(out))
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, D_A=d_a, D_B=kb_width, HAS_B=d_b > 0,
                  D_V=head_width(head_dim), STAGES=tiles.stages, num_warps=tiles.warps)
    if not tiles.pingpong:
        return hopper_attention_kernel, grid, args, kwargs
    if tiles.maxnreg is None:
        raise ValueError(f"the ping-pong kernel needs maxnreg (registers per thread at launch, e.g. 168 for its 12 "
                         f"warps), got tiles {tiles}")
    if not pingpong_head(head_dim):
        raise ValueError(f"the ping-pong kernel cannot take heads of {head_dim} lanes: q's first part is {d_a} lanes "
                         f"wide, past the head (pingpong_head); use the tiles of hopper_attention_kernel")
    from hwgraph.attention.gluon_pingpong import hopper_attention_pingpong_kernel

    for name, t in (("q", q), ("out", out)):
        if not tma_rows(t):
            raise ValueError(f"the ping-pong kernel loads q and stores its output by TMA: {name} needs unit stride "
                             f"on D, adjacent heads and a 16-byte aligned base and row stride, got strides "
                             f"{tuple(t.stride())} of {t.element_size()}-byte elements at address {t.data_ptr()} "
                             f"({t.data_ptr() % 16} past 16-byte alignment)")
    n_tiles = grid[0] * heads * num_seqs
    fixed_shift = uses_fixed_shift(q.dtype, max_seqlen)
    if not fixed_shift:
        flags = cu_seqlens  # a placeholder pointer: the kernel compiled without FIXED_SHIFT writes no flags
    elif flags is None:
        flags = torch.empty(2 * n_tiles, dtype=torch.int32, device=q.device)  # overflow_blocks per slot and head
    elif flags.dtype != torch.int32 or flags.numel() < 2 * n_tiles:
        raise ValueError(f"the ping-pong kernel's flags must be int32 with at least {2 * n_tiles} entries (two per "
                         f"work tile), got {flags.dtype} with {flags.numel()}")
    args = args[:FLAGS_ARG] + (flags,) + args[FLAGS_ARG:]
    sms = sm_count(q.device)
    programs = min(n_tiles, sms) if tiles.persistent and sms is not None else n_tiles
    # q by TMA (the producer loads it), the output's first part by TMA from the q buffer (gluon_pingpong).
    args += (descriptor(q, tiles.block_m, d_a), descriptor(q, tiles.block_m, kb_width),
             descriptor(out, tiles.block_m // 2, d_a))
    kwargs.update(HEADS=heads, M_BLOCKS=grid[0], PADDING=padding_slot, CONSUMER_REGS=tiles.consumer_regs,
                  FIXED_SHIFT=fixed_shift, SUM_LANE=sum_lane(head_dim), Q_BUFFERS=q_buffers(head_dim, tiles),
                  OUT_TMA=OUT_TMA, maxnreg=tiles.maxnreg)
    return hopper_attention_pingpong_kernel, (max(1, programs),), args, kwargs


# The ping-pong kernel stores each full half-tile's first 64 lanes by TMA, through its q buffer, instead of by pointer
# stores from the MMA layout (gluon_pingpong.consumer_partition).
OUT_TMA = True


def sum_lane(head_dim: int) -> int:
    """The lane of v's second part (16 wide) where the ping-pong kernel sums p on the tensor cores
    (``gluon_pingpong.mark_ones``): the first past the head, when the head's second part leaves one (72 lanes:
    64 + 16, lane 8); else -1 (64, 80, 96, 128 lanes), and the consumers add p up themselves."""
    d_a, d_b = head_split(head_dim)
    return head_dim - d_a if d_b and head_dim < d_a + d_b else -1


@functools.cache
def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (a persistent kernel's programs); None off CUDA (the CPU compile
    tests, which launch nothing)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


@launches_on_tensor_device
def launch_gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, scale: float, tiles: tuple | None = None,
                           padding_slot: bool = True) -> torch.Tensor:
    """Run the kernel: ``q, k, v`` ``[T, H, D]`` (fp16/bf16, unit stride on D, k and v addressable by TMA as
    ``triton_kernel.uses_tma`` checks) -> a new ``[T, H, D]``. ``tiles``: as ``kernel_call``'s. ``padding_slot``:
    as ``launch_varlen_attention``'s. A q that TMA cannot address (``tma_rows``) is copied into one it can, and the
    output is allocated so (rows padded to 16 bytes where ``H * D`` lanes are not)."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"the Gluon attention kernel needs triton.experimental.gluon: {GLUON_IMPORT_ERROR}")
    # q's head stride is a constexpr (one compile per head width), and the ping-pong kernel loads q and stores its
    # output by TMA: q is copied unless its heads are adjacent and its rows TMA-addressable (the tower's q is).
    if not tma_rows(q):
        q = tma_rows_like(q).copy_(q)
    out = tma_rows_like(q)
    if q.shape[0] == 0:
        return out
    kernel, grid, args, kwargs = kernel_call(q, k, v, out, cu_seqlens, max_seqlen, scale, tiles, padding_slot)
    kernel[grid](*args, **kwargs)
    if kwargs.get("FIXED_SHIFT"):  # recompute the q blocks whose rows the fixed shifts could not hold
        block_m = kwargs["BLOCK_M"]
        launch_overflow_fixup(q, k, v, out, cu_seqlens, args[FLAGS_ARG], overflow_blocks(max_seqlen, block_m),
                              block_m // 2, scale)
    return out


# The ping-pong kernel's fixed softmax shifts from this many rows of a call (bf16). Per call on the H200 (16 heads
# of 72, ``benchmarks/attention_ab.py --base``, session 13, µs, online softmax -> fixed shifts with the fixup
# launch): one sequence of 4096 191-192 -> 174, of 3600 in 4096 rows 168 -> 154.5, of 2048 in 2048 50.5 -> 47.5;
# four of 784 in 4096 and two of 1024 in 2048 equal; one of 1024 in 1024 rows 16.5 -> 17.3-17.6 (the fixup's launch
# outweighs eight key blocks' savings).
FIXED_SHIFT_FROM = 2048


def uses_fixed_shift(dtype: torch.dtype, max_seqlen: int) -> bool:
    """Whether a ping-pong call shifts each row's softmax by its first key block's maximum (``gluon_pingpong``'s
    ``FIXED_SHIFT``; flagged blocks recomputed by ``triton_kernel.launch_overflow_fixup``): bf16, whose p.v operand
    holds p up to 2**127, from ``FIXED_SHIFT_FROM`` rows. fp16 would overflow at 2**16 and keeps the online
    softmax."""
    return dtype == torch.bfloat16 and max_seqlen >= FIXED_SHIFT_FROM


def overflow_blocks(max_seqlen: int, block_m: int) -> int:
    """The ping-pong kernel's overflow flags per sequence slot and head: one per half of each ``block_m``-row q
    block (each consumer's rows)."""
    return 2 * max(1, triton.cdiv(max_seqlen, block_m))
