"""TRITON_ATTN's Gluon kernel for Hopper (``hwgraph/attention/gluon_kernel.py``) against its Triton TMA kernel and
ATen flash, at the tower's shapes (16 heads of 72, bf16).

Usage: python benchmarks/attention_gluon.py [--quick] [--tiles] [--tile BLOCK_M,BLOCK_N,WARPS,STAGES ...]
                                           [--ws BLOCK_M,BLOCK_N,STAGES,MAXNREG,CONSUMER_REGS ...]
``--ws``: the warp-specialised kernel (``hopper_attention_ws_kernel`` below) at those tiles and register limits.
Each cell is the device time of one call (20 calls captured in one CUDA graph, replayed, divided by 20) and the
relative L2 error of its real rows against flash, batches shaped as the manager builds them (q, k, v strided views
of one qkv tensor, max_seqlen the budget's patch count, padding rows after the last image). Every case also checks
the padding rows: the Gluon kernel's output there must be zeros, and NaN in the padding rows of k and v must not
reach the real rows.
"""

from __future__ import annotations

import sys

import torch
import triton
from attention_hd72 import D, err_of, flash, manager_batch  # benchmarks/, the script's directory
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma_wait,
)

from hwgraph.attention.gluon_kernel import (
    LOG2_E,
    cta_barrier,
    descriptor,
    issue_kv,
    launch_gluon_attention,
    load_q_part,
    loop_state,
    p_operands,
    pv_async,
    qk_async,
    rescale,
    softmax_step,
    store_out,
    wait_scores,
    zero_padding_rows,
    zero_tail,
)
from hwgraph.attention.triton_kernel import launch_varlen_attention
from hwgraph.timing import graphed_ms

# The warp-specialised variant (session 8; ``attention_gluon-ws.log``): not adopted. Against the shipped kernel it
# measured 3-5% faster on one long sequence (4096, 3600, 2048 patches) and 6% slower on 4x784, equal on 2x1024.


@gluon.jit
def ws_producer(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, empty, start, col, n_blocks,
                STAGES: gl.constexpr, D_A: gl.constexpr, HAS_B: gl.constexpr):
    """The load partition (one warp): fills each ring slot once both consumers have released it."""
    for j in range(n_blocks):
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase 1
        issue_kv(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, j, start, col, STAGES, D_A,
                 HAS_B)

@gluon.jit
def ws_consumer(HALF: gl.constexpr, Q, Out, qa_s, qb_s, ka_s, kb_s, va_s, vb_s, ready, empty, turn, start, seqlen,
                head, rows, n_blocks, qk_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
                HEAD_DIM: gl.constexpr, HALF_M: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr,
                HAS_B: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                PINGPONG: gl.constexpr):
    """One warpgroup's half of the q tile (rows ``rows + HALF * HALF_M ..``): the key loop of
    ``hopper_attention_kernel``, releasing each ring slot to the producer instead of a barrier."""
    WARPS: gl.constexpr = 4
    dtype: gl.constexpr = ka_s.dtype
    r0 = rows + HALF * HALF_M
    qa_h = qa_s.index(HALF)
    qb_h = qb_s.index(HALF)
    qa_h.store(load_q_part(Q, r0, seqlen, start, head, stride_qt, stride_qh, 0, D_A, HEAD_DIM, HALF_M, WARPS))
    qb_h.store(load_q_part(Q, r0, seqlen, start, head, stride_qt, stride_qh, D_A, D_B, HEAD_DIM, HALF_M, WARPS))
    fence_async_shared()
    cta_barrier()
    s_init, o_a, o_b, m_i, l_i = loop_state(HALF_M, BLOCK_N, D_A, D_B, WARPS)

    # With PINGPONG the consumers take turns to issue their MMAs, at n_blocks + 1 issue points each; consumer 0
    # goes first (a fresh mbarrier passes a wait for phase 1).
    mbarrier.wait(ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), 1 - HALF)
    s = qk_async(qa_h, qb_h, ka_s, kb_s, 0, s_init, HAS_B)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF), count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, 0, seqlen, qk_scale_log2, BLOCK_N)
    p_a, p_b = p_operands(p, o_a, o_b, dtype)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(HALF), (j & 1) ^ (1 - HALF))
        s = qk_async(qa_h, qb_h, ka_s, kb_s, slot, s_init, HAS_B)
        o_a, o_b = pv_async(p_a, p_b, va_s, vb_s, prev, o_a, o_b, HAS_B)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)
        s = wait_scores(s, HAS_B)
        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, j * BLOCK_N, seqlen, qk_scale_log2, BLOCK_N)
        o_a, o_b, p_a, p_b = warpgroup_mma_wait(0, deps=(o_a, o_b, p_a, p_b))
        mbarrier.arrive(empty.index(prev), count=1)
        o_a, o_b = rescale(o_a, o_b, alpha, HAS_B)
        p_a, p_b = p_operands(p, o_a, o_b, dtype)

    last = (n_blocks - 1) % STAGES
    # Both consumers zero the same rows of the last block; neither ever writes anything else there.
    zero_tail(va_s, vb_s, last, seqlen - (n_blocks - 1) * BLOCK_N, HAS_B, BLOCK_N, WARPS)
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), (n_blocks & 1) ^ (1 - HALF))
    o_a, o_b = pv_async(p_a, p_b, va_s, vb_s, last, o_a, o_b, HAS_B)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF), count=1)
    o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
    store_out(Out, o_a, o_b, l_i, r0, seqlen, start, head, stride_ot, stride_oh, D_A, HEAD_DIM, HAS_B)


@gluon.jit(do_not_specialize=["num_seqs"])
def hopper_attention_ws_kernel(
    Q, ka_desc, kb_desc, va_desc, vb_desc, Out, CU_SEQLENS,
    tokens, num_seqs, qk_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, HAS_B: gl.constexpr,
    D_V: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``hopper_attention_kernel`` warp-specialised: two consumer warpgroups (the default partition and a
    worker) take half of the q tile each and share the k/v ring, which a one-warp producer fills as slots are
    released (an mbarrier per slot with two arrivals), so the consumers need no barrier with each other."""
    BLOCK_N: gl.constexpr = ka_desc.block_type.shape[0]
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = ka_desc.dtype
    block_m = gl.program_id(0)
    head = gl.program_id(1)
    seq = gl.program_id(2)
    if seq >= num_seqs:
        zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, block_m, head, stride_ot, stride_oh, HEAD_DIM,
                          BLOCK_M, D_V, num_warps)
        return
    start = gl.load(CU_SEQLENS + seq)
    seqlen = gl.load(CU_SEQLENS + seq + 1) - start
    rows = block_m * BLOCK_M
    if rows >= seqlen:
        return
    qa_s = gl.allocate_shared_memory(dtype, [2, HALF_M, D_A], ka_desc.layout)
    qb_s = gl.allocate_shared_memory(dtype, [2, HALF_M, D_B], kb_desc.layout)
    ka_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_A], ka_desc.layout)
    kb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_B], kb_desc.layout)
    va_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_A], va_desc.layout)
    vb_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_B], vb_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    col = head * HEAD_DIM
    n_blocks = (seqlen + BLOCK_N - 1) // BLOCK_N
    gl.warp_specialize([  # the argument tuples are written out: a tuple variable loses its constexprs
        (ws_consumer, (0, Q, Out, qa_s, qb_s, ka_s, kb_s, va_s, vb_s, ready, empty, turn, start, seqlen, head,
                       rows, n_blocks, qk_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, HEAD_DIM, HALF_M,
                       D_A, D_B, HAS_B, STAGES, BLOCK_N, PINGPONG)),
        (ws_consumer, (1, Q, Out, qa_s, qb_s, ka_s, kb_s, va_s, vb_s, ready, empty, turn, start, seqlen, head,
                       rows, n_blocks, qk_scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, HEAD_DIM, HALF_M,
                       D_A, D_B, HAS_B, STAGES, BLOCK_N, PINGPONG)),
        (ws_producer, (ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, empty, start, col,
                       n_blocks, STAGES, D_A, HAS_B)),
    ], [4, 1], [CONSUMER_REGS, 24])


def launch_ws(q, k, v, cu, max_seqlen, tiles, maxnreg, consumer_regs, pingpong):
    """``hopper_attention_ws_kernel`` with ``launch_gluon_attention``'s arguments (head_dim 72: parts 64 + 16)."""
    tokens, heads, head_dim = q.shape
    block_m, block_n, stages = tiles
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_seqlen, block_m), heads, cu.shape[0])
    hopper_attention_ws_kernel[grid](
        q, descriptor(k, block_n, 64), descriptor(k, block_n, 16), descriptor(v, block_n, 64),
        descriptor(v, block_n, 16), out, cu, tokens, cu.shape[0] - 1, D**-0.5 * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_M=block_m, D_A=64, D_B=16, HAS_B=True, D_V=128, STAGES=stages,
        CONSUMER_REGS=consumer_regs, PINGPONG=bool(pingpong), num_warps=4, maxnreg=maxnreg)
    return out


def row(label, seqs, rows, slots, tiles, ws=()):
    qkv, cu, real, gflop = manager_batch(seqs, rows, slots)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    want = flash(q, k, v, cu, rows)[:real].float()
    ms = graphed_ms(lambda: flash(q, k, v, cu, rows))
    print(f"{label} ({gflop:.2f} GFLOP): flash {ms:.4f} ms {gflop / ms:.0f} TFLOP/s", flush=True)

    def report(name, fn, check_padding=False):
        try:
            got = fn()
            err = err_of(got[:real], want)
            extra = ""
            if check_padding:
                pad_zero = bool((got[real:] == 0).all()) if real < rows else True
                if real < rows:
                    saved = qkv[real:].clone()
                    qkv[real:, 1:] = float("nan")
                    nan_err = err_of(fn()[:real], want)
                    qkv[real:] = saved
                    extra = f" padding zero {pad_zero} err with NaN padding {nan_err:.1e}"
            t = graphed_ms(fn)
            print(f"  {name}: {t:.4f} ms {gflop / t:.0f} TFLOP/s err {err:.1e}{extra}", flush=True)
        except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
            print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    report("TRITON_ATTN automatic", lambda: launch_varlen_attention(q, k, v, cu, rows, D**-0.5))
    report("triton TMA kernel", lambda: launch_varlen_attention(q, k, v, cu, rows, D**-0.5, use_gluon=False))
    for cfg in tiles:
        report(f"gluon {cfg}", lambda c=cfg: launch_gluon_attention(q, k, v, cu, rows, D**-0.5, tiles=c),
               check_padding=True)
    for bm, bn, stages, maxnreg, regs, pp in ws:
        report(f"gluon warp-specialized {bm}x{bn}, {stages} stages, maxnreg {maxnreg}, consumers {regs}, "
               f"ping-pong {pp}",
               lambda c=(bm, bn, stages), m=maxnreg, r=regs, pp=pp: launch_ws(q, k, v, cu, rows, c, m, r, pp),
               check_padding=True)


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    tiles = [None]  # gluon_tiles' choice
    if "--tiles" in sys.argv:
        tiles += [(128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 4), (64, 128, 4, 3),
                  (64, 64, 4, 3), (64, 64, 4, 4)]
    tiles += [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--tile"]
    ws = [tuple(int(x) for x in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--ws"]
    cases = [("1x4096 in 4096", [4096], 4096, 1), ("1x3600 in 4096", [3600], 4096, 1),
             ("4x784 in 4096", [784] * 4, 4096, 4), ("1x1024 in 1024", [1024], 1024, 1),
             ("4x256 in 1024", [256] * 4, 1024, 4), ("1x2048 in 2048", [2048], 2048, 1),
             ("2x1024 in 2048", [1024] * 2, 2048, 2), ("1x392 in 512", [392], 512, 1), ("1x196 in 256", [196], 256, 1),
             ("2x196 in 512", [196] * 2, 512, 2), ("1x33 in 64", [33], 64, 1)]
    if "--quick" in sys.argv:
        cases = cases[:1]
    for label, seqs, rows, slots in cases:
        row(label, seqs, rows, slots, tiles, ws)


if __name__ == "__main__":
    main()
