"""TRITON_ATTN's Gluon kernel for long sequences on Hopper: ``hopper_attention_kernel`` warp-specialised, with
FlashAttention-3's ping-pong between two consumer warpgroups, and persistent.

One program holds a ``BLOCK_M``-row q tile as two halves, each owned by a consumer warpgroup (the default partition
and a worker), and a one-warp producer partition that fills the k/v ring by TMA: 128 rows over 128-key blocks
(``gluon_kernel.PINGPONG_TILES``), or from 4096 rows 256 over 64-key blocks (``PINGPONG_WIDE_TILES``, session 16),
where each key block loaded serves twice the q rows (one 4096-patch sequence 160.5 against 170.4 µs). A ring slot
is refilled once both consumers have released it (its ``empty`` mbarrier counts two arrivals), so the consumers
never wait for each other to reuse a slot. They do take turns to issue their MMAs (two ``turn`` mbarriers, one
arrival each): while one warpgroup's q.k and p.v run on the tensor cores, the other runs its softmax, so the softmax
of one half hides behind the other half's MMAs instead of only behind its own p.v. Each consumer runs the key loop
of ``hopper_attention_kernel`` (its helpers come from ``gluon_kernel.py``) on its half.

In bf16 from ``gluon_kernel.FIXED_SHIFT_FROM`` rows (``gluon_kernel.uses_fixed_shift``) the key loop keeps no
running maximum. Each row's softmax is shifted by its first key block's maximum for all its keys (``shifted_step``).
float32 sums and bf16 p hold p up to 2**127 with unchanged relative precision, so the accumulators are never
rescaled. A consumer whose rows left the finite range flags its half-tile (``overflow_flag``), and
``triton_kernel.overflow_fixup_kernel``, launched after every such call, recomputes exactly those blocks. Per call
for one 4096-patch sequence, fixup included: 0.174 against 0.191 ms with the online softmax (session 13,
``benchmarks/attention_ab.py``).

Since session 14 (``docs/benchmarks.md``):
- each row's softmax sum comes from the tensor cores: the producer sets lane 8 of v's 16-lane second part (past the
  72-lane head, computed but never stored) to ones once a key block has landed (``mark_ones``), so p.v sums p there
  (``gluon_kernel.mma_row_sum``) and the consumers no longer add p up (1x1024 replay 0.993-0.994x);
- the producer loads each tile's q by TMA into one of two buffers, before the tile's first key block, so a tile
  starts without the consumers loading q (``load_q``, ``mark_q``, which zeroes q's lanes past the head);
- a consumer stores its half-tile's first 64 output lanes by TMA through its q buffer (``gluon_kernel.OUT_TMA``;
  1x1024 replay 0.996-0.997x, 1x256 0.990-0.991x).
Per call against session 13's kernel (``benchmarks/attention_ab.py --base 4e62fe0``): four sequences of 784 in 4096
rows 52.1 -> 47.7 µs, two of 1024 in 2048 29.4 -> 28.8, one of 4096 within the spread (167.8 -> 170.1 without,
172.8 -> 168.9 with the padding slot). Head to head in whole replays of one image, which run at the GPU's power
limit, all three together measure 0.998-1.001x (``benchmarks/replay_toggle.py gluon-at:4e62fe0``). Issuing a tile's
last p.v with the next tile's first q.k (the tiles pipelined; ``docs/benchmarks.md``, session 14) measured slower
and is not kept.

The grid is one-dimensional over work tiles (q block, head, sequence slot; q block fastest). With
``GluonTiles.persistent`` (``PINGPONG_TILES``) there is one program per SM, each taking every SM-count-th tile;
the ring and the turns run on across a program's tiles, so the producer loads the next tile's first key blocks
while the consumers finish the current one, and a budget's empty tiles (q blocks past a short sequence, empty
slots) cost a few scalar loads instead of a program each.

Measured on the H200 (16 heads of 72, bf16, µs per call, the tower's calls without the padding slot;
``benchmarks/attention_ab.py --base 64cd2ec``, ``docs/benchmarks.md``, session 11), persistent against one program
per tile (session 10's grid): four sequences of 784 in 4096 rows 51.5 against 58.5, two of 1024 in 2048 30.0
against 31.9, one of 4096 190-191 against 192-194 (equal within spread), one of 1024 in 1024 rows 16.7 against 16.4
(one tile per program either way: the tile decode and loop cost).
Against the other kernels (session 10): 0.189 ms for one 4096-patch sequence against 0.221 for
``hopper_attention_kernel``'s 128x64 tiles, 0.050 against 0.062 for 2048 patches in 2048 rows, 0.016 for one
sequence of 1024 in 1024 rows against 0.021 for the Triton TMA kernel; slower for several short sequences in one
budget (four of 256 in 1024 rows: 0.013 against the TMA kernel's 0.012) and below 1024 rows, so
``gluon_kernel.gluon_tiles`` takes it from 2048 rows, or from 1024 in a call of one sequence slot. Three consumers on
192-row tiles (FlashAttention-3's choice for heads up to 96 lanes; commit 1d6dcea) measured slower: 0.212 ms at
4096 patches with 64-key blocks, 0.324 with 128-key blocks, whose consumers spill at 160 registers
(``attention_gluon-3wg.log``).

Arguments are those of ``hopper_attention_kernel`` plus the tile counts; ``gluon_kernel.kernel_call`` builds both
calls.
"""

from __future__ import annotations

from hwgraph.attention.gluon_kernel import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

    from hwgraph.attention.gluon_kernel import (
        cta_barrier,
        issue_kv,
        kv_ring,
        loop_state,
        mask_past_end,
        mma_row_sum,
        p_operands,
        pv_async,
        qk_async,
        rescale,
        sequence_rows,
        softmax_step,
        store_out,
        store_out_part,
        times_rows,
        tma_load,
        wait_scores,
        zero_padding_rows,
        zero_tail,
    )

    CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup: the unit of Hopper's MMAs
    # The TMA store (tma.async_store after Triton 3.6).
    tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    PRODUCER_REGS = gl.constexpr(24)  # the producer only issues TMA loads; its registers go to the consumers

    @gluon.jit
    def tile_rows(CU_SEQLENS, tile, HEADS: gl.constexpr, M_BLOCKS: gl.constexpr, BLOCK_M: gl.constexpr):
        """``(start, seqlen, rows, head)`` of work tile ``tile``: tiles run m block fastest, then head, then
        sequence, so the tiles in flight at once share a few heads' k and v in L2. The counts are constexprs: a
        division by a runtime value costs the producer and consumers about 0.4 µs a tile before their first load
        (``docs/benchmarks.md``, session 11)."""
        start, seqlen, rows = sequence_rows(CU_SEQLENS, tile // (M_BLOCKS * HEADS), tile % M_BLOCKS, BLOCK_M)
        return start, seqlen, rows, (tile // M_BLOCKS) % HEADS

    @gluon.jit
    def fill_slot(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, empty, block, row, col,
                  STAGES: gl.constexpr, D_A: gl.constexpr, HAS_B: gl.constexpr):
        """Wait until both consumers have released the ring slot of this program's key block ``block``, then
        start loading the key block at token ``row`` into it."""
        mbarrier.wait(empty.index(block % STAGES), ((block // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase 1
        issue_kv(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, block % STAGES, row, col, D_A,
                 HAS_B)

    @gluon.jit
    def set_lanes(buf, LO: gl.constexpr, HI: gl.constexpr, value: gl.constexpr):
        """Lanes ``LO .. HI`` of every row of a ``[rows, cols]`` tile in shared memory set to ``value``, by one warp,
        32 rows at a time (the producer's 24 registers). The caller fences before the MMAs read it."""
        ROWS: gl.constexpr = buf.shape[0]
        COLS: gl.constexpr = buf.shape[1]
        CHUNK: gl.constexpr = 32
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (COLS // 8), COLS // 8], [1, 1], [1, 0])
        lanes = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
        inside = ((lanes >= LO) & (lanes < HI))[None, :]
        for r in gl.static_range(0, ROWS, CHUNK):
            part = buf.slice(r, CHUNK)
            tile = part.load(layout)
            part.store(gl.where(inside, gl.full_like(tile, value), tile))

    @gluon.jit
    def mark_ones(vb_s, ready, marked, block, STAGES: gl.constexpr, LANE: gl.constexpr):
        """Once key block ``block``'s loads have landed, set lane ``LANE`` of its v tile's second part to ones
        (a lane past the head, which p.v computes but nothing stores), so that p.v sums each row's p there
        (``gluon_kernel.mma_row_sum``) instead of the consumers' adds; then hand the slot to the consumers
        (``marked``)."""
        slot = block % STAGES
        mbarrier.wait(ready.index(slot), (block // STAGES) & 1)
        set_lanes(vb_s.index(slot), LANE, LANE + 1, 1.0)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(marked.index(slot), count=1)

    @gluon.jit
    def load_q(qa_desc, qb_desc, qa_s, qb_s, q_ready, q_empty, n, row, col, Q_BUFFERS: gl.constexpr,
               D_A: gl.constexpr, HAS_B: gl.constexpr):
        """Wait until both consumers are done with q buffer ``n % Q_BUFFERS`` (this program's q tile
        ``n - Q_BUFFERS``), then start loading the ``BLOCK_M``-row q tile at token ``row`` (lanes from ``col``)
        into it."""
        buf = n % Q_BUFFERS
        mbarrier.wait(q_empty.index(buf), ((n // Q_BUFFERS) & 1) ^ 1)  # a fresh mbarrier passes phase 1
        bar = q_ready.index(buf)
        if HAS_B:
            mbarrier.expect(bar, qa_desc.block_type.nbytes + qb_desc.block_type.nbytes)
            tma_load(qa_desc, [row, col], bar, qa_s.index(buf))
            tma_load(qb_desc, [row, col + D_A], bar, qb_s.index(buf))
        else:
            mbarrier.expect(bar, qa_desc.block_type.nbytes)
            tma_load(qa_desc, [row, col], bar, qa_s.index(buf))

    @gluon.jit
    def mark_q(qb_s, q_ready, q_marked, n, Q_BUFFERS: gl.constexpr, ZERO_FROM: gl.constexpr,
               HAS_B: gl.constexpr):
        """Once q tile ``n``'s loads have landed, zero its second part's lanes from ``ZERO_FROM`` (past the head:
        the next head's lanes, which k's second part holds too, so q.k must not add them), then hand the buffer to
        the consumers (``q_marked``)."""
        buf = n % Q_BUFFERS
        mbarrier.wait(q_ready.index(buf), (n // Q_BUFFERS) & 1)
        if HAS_B and ZERO_FROM < qb_s.shape[2]:
            set_lanes(qb_s.index(buf), ZERO_FROM, qb_s.shape[2], 0.0)
            fence_async_shared()
            cta_barrier()
        mbarrier.arrive(q_marked.index(buf), count=1)

    @gluon.jit
    def load_partition(ka_desc, kb_desc, va_desc, vb_desc, qa_desc, qb_desc, ka_s, kb_s, va_s, vb_s, qa_s, qb_s,
                       ready, empty, marked, q_ready, q_empty, q_marked, CU_SEQLENS,
                       HEADS: gl.constexpr, M_BLOCKS: gl.constexpr, n_tiles, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr, D_A: gl.constexpr, HAS_B: gl.constexpr,
                       SUM_LANE: gl.constexpr, Q_BUFFERS: gl.constexpr):
        """The producer (one warp): for each of this program's tiles, fills each ring slot once both consumers
        have released it. The ring runs on across tiles, so the next tile's first key blocks load while the
        consumers finish this one. With ``SUM_LANE`` >= 0 it also marks each block's ones lane (``mark_ones``),
        one block behind its loads: the consumers waiting for block j have released block j - 2, which the fill
        of block j + 1 waits for with 4 stages (the marks may lag at most ``STAGES - 2`` blocks).

        It also loads each tile's q (``load_q``, into one of ``Q_BUFFERS`` buffers) before the tile's first key
        block, and marks it (``mark_q``) after that block's fill: with two buffers, while the consumers still
        work on the previous tile, so that a tile starts without waiting for q."""
        BLOCK_N: gl.constexpr = ka_desc.block_type.shape[0]
        block = 0  # key blocks loaded so far by this program: the ring position
        n = 0  # q tiles loaded so far by this program
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            start, seqlen, rows, head = tile_rows(CU_SEQLENS, tile, HEADS, M_BLOCKS, BLOCK_M)
            if rows < seqlen:
                load_q(qa_desc, qb_desc, qa_s, qb_s, q_ready, q_empty, n, start + rows, head * HEAD_DIM, Q_BUFFERS,
                       D_A, HAS_B)
                n_blocks = gl.cdiv(seqlen, BLOCK_N)
                for j in range(n_blocks):
                    fill_slot(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, empty, block + j,
                              start + j * BLOCK_N, head * HEAD_DIM, STAGES, D_A, HAS_B)
                    if SUM_LANE >= 0:
                        if block + j > 0:
                            mark_ones(vb_s, ready, marked, block + j - 1, STAGES, SUM_LANE)
                    if j == 0:
                        mark_q(qb_s, q_ready, q_marked, n, Q_BUFFERS, HEAD_DIM - D_A, HAS_B)
                block += n_blocks
                n += 1
        if SUM_LANE >= 0:
            if block > 0:
                mark_ones(vb_s, ready, marked, block - 1, STAGES, SUM_LANE)

    @gluon.jit
    def take_turn(turn, HALF: gl.constexpr, issue):
        """Wait until this consumer may issue its MMAs at issue point ``issue`` (0, 1, ..): consumer 0 issues at
        every point first, consumer 1 after it. A fresh mbarrier passes a wait for phase 1, so consumer 0's first
        wait passes at once."""
        mbarrier.wait(turn.index(HALF), (issue & 1) ^ (1 - HALF))

    @gluon.jit
    def pass_turn(turn, HALF: gl.constexpr):
        """This consumer has issued its MMAs: the other one's turn."""
        mbarrier.arrive(turn.index(1 - HALF), count=1)

    @gluon.jit
    def shifted_step(s, shift, l_i, kv_start, seqlen, qk_scale_log2, BLOCK_N: gl.constexpr, ROW_SUM: gl.constexpr):
        """The softmax of the raw scores of keys ``kv_start ..`` against each row's fixed ``shift`` (its first key
        block's maximum): ``(p, l)``. No running maximum, so no correction and no rescale of the accumulators; p
        may exceed 1, which float32 and bfloat16 hold up to 2**127 with the same relative precision.
        ``overflow_flag`` catches a row whose scores rise that far above its shift. The keys past the sequence's
        end are masked (``mask_past_end``). Without ``ROW_SUM``, l as it came (``mma_row_sum``)."""
        s = mask_past_end(s, kv_start, seqlen, BLOCK_N)
        p = gl.exp2(s * qk_scale_log2 - shift[:, None])
        if ROW_SUM:
            l_i = l_i + gl.sum(p, 1)
        return p, l_i

    @gluon.jit
    def not_finite(x):
        """1 where ``x`` is infinite or NaN (NaN compares false), else 0."""
        return gl.where(gl.abs(x) < float("inf"), 0, 1)

    @gluon.jit
    def valid_not_finite(per_row, valid_rows):
        """1 where one of the first ``valid_rows`` entries of the per-row ``per_row`` (0 or 1) is 1, else 0."""
        rows = gl.arange(0, per_row.shape[0], layout=per_row.type.layout)
        return gl.max(gl.where(rows < valid_rows, per_row, 0), 0)

    @gluon.jit
    def overflow_flag(o_a, o_b, l_i, valid_rows, HAS_B: gl.constexpr):
        """1 when one of the first ``valid_rows`` rows' sum or accumulators left the finite range (a score more than
        about 2**7 above its row's shift, in log2 units), else 0: the half-tile goes to
        ``triton_kernel.overflow_fixup_kernel``. Finite results are right: p's magnitude costs no relative
        precision. Rows past the sequence (another sequence's q, or padding) are never stored and flag nothing."""
        flag = valid_not_finite(not_finite(l_i), valid_rows)
        flag = gl.maximum(flag, valid_not_finite(gl.max(not_finite(o_a), 1), valid_rows))
        if HAS_B:
            flag = gl.maximum(flag, valid_not_finite(gl.max(not_finite(o_b), 1), valid_rows))
        return flag

    @gluon.jit
    def consumer_partition(HALF: gl.constexpr, Out, oa_desc, FLAGS, qa_s, qb_s, ka_s, kb_s, va_s, vb_s, ready, empty,
                           turn, q_marked, q_empty, CU_SEQLENS, HEADS: gl.constexpr, M_BLOCKS: gl.constexpr,
                           n_tiles, qk_scale_log2, stride_ot, stride_oh: gl.constexpr,
                           HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr,
                           HAS_B: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                           FIXED_SHIFT: gl.constexpr, SUM_LANE: gl.constexpr, Q_BUFFERS: gl.constexpr,
                           OUT_TMA: gl.constexpr):
        """One consumer warpgroup: for each of this program's tiles, q rows ``rows + HALF * BLOCK_M // 2 ..``, the
        key loop of ``hopper_attention_kernel`` with the MMAs of each of its ``n_blocks + 1`` issue points in turn
        with the other consumer, and each ring slot released to the producer once its p.v is done. Both consumers
        pass every issue point, even one whose rows are all past the sequence (it stores nothing), or the other
        would wait forever. q comes from the producer (``load_q``, ``mark_q``); rows past the sequence hold the
        next sequence's q or TMA's zeros, and their results are never stored.

        ``FIXED_SHIFT`` (``gluon_kernel.uses_fixed_shift``): each row's softmax shift is its first key block's
        maximum for all its keys (``shifted_step``), with no running maximum and no rescale of the accumulators,
        and the consumer writes its half-tile's ``overflow_flag`` to ``FLAGS[2 * tile + HALF]``. Without it, the
        online softmax of ``hopper_attention_kernel``, and FLAGS is not touched.

        ``SUM_LANE`` >= 0: the rows' sums come from that lane of the second p.v part (``mma_row_sum``), and
        ``ready`` is the producer's ``marked`` (the loads have landed and the ones are in place).

        ``OUT_TMA``: a half-tile whose rows all belong to the sequence stores its first ``D_A`` lanes through its
        q buffer (free once its MMAs are done) and a TMA store (``oa_desc``), the rest by pointer stores; else
        every lane by pointer stores (``store_out``). The q buffer goes back to the producer (``q_empty``) at the
        next tile's start (with two buffers) or once the store has read it (one)."""
        ROW_SUM: gl.constexpr = SUM_LANE < 0
        HALF_M: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = ka_s.dtype
        block = 0  # key blocks consumed so far by this program: the ring position
        issue = 0  # issue points passed so far: the turn barriers' phase
        n = 0  # q tiles consumed so far by this program
        for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            start, seqlen, rows, head = tile_rows(CU_SEQLENS, tile, HEADS, M_BLOCKS, BLOCK_M)
            if rows < seqlen:
                r0 = rows + HALF * HALF_M
                buf = n % Q_BUFFERS
                mbarrier.wait(q_marked.index(buf), (n // Q_BUFFERS) & 1)
                if Q_BUFFERS > 1:
                    if n > 0:  # the previous tile's output store has read its q buffer: the producer may refill it
                        tma.store_wait(0)
                        mbarrier.arrive(q_empty.index((n - 1) % Q_BUFFERS), count=1)
                qa_h = qa_s.index(buf).slice(HALF * HALF_M, HALF_M)
                qb_h = qb_s.index(buf).slice(HALF * HALF_M, HALF_M)
                s_init, o_a, o_b, m_i, l_i = loop_state(HALF_M, BLOCK_N, D_A, D_B, CONSUMER_WARPS)
                n_blocks = gl.cdiv(seqlen, BLOCK_N)

                mbarrier.wait(ready.index(block % STAGES), (block // STAGES) & 1)
                take_turn(turn, HALF, issue)
                s = qk_async(qa_h, qb_h, ka_s, kb_s, block % STAGES, s_init, HAS_B)
                pass_turn(turn, HALF)
                s = warpgroup_mma_wait(0, deps=(s,))
                # FIXED_SHIFT: the first key block's row maxima stay the rows' shifts (shifted_step).
                p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, 0, seqlen, qk_scale_log2, BLOCK_N, ROW_SUM)
                p_a, p_b = p_operands(p, o_a, o_b, dtype)
                for j in range(1, n_blocks):
                    g = block + j
                    slot = g % STAGES
                    prev = (g - 1) % STAGES
                    mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
                    take_turn(turn, HALF, issue + j)
                    s = qk_async(qa_h, qb_h, ka_s, kb_s, slot, s_init, HAS_B)
                    o_a, o_b = pv_async(p_a, p_b, va_s, vb_s, prev, o_a, o_b, HAS_B)
                    pass_turn(turn, HALF)
                    s = wait_scores(s, HAS_B)
                    if FIXED_SHIFT:
                        p, l_i = shifted_step(s, m_i, l_i, j * BLOCK_N, seqlen, qk_scale_log2, BLOCK_N, ROW_SUM)
                    else:
                        p, m_i, l_i, alpha = softmax_step(s, m_i, l_i, j * BLOCK_N, seqlen, qk_scale_log2, BLOCK_N,
                                                          ROW_SUM)
                    o_a, o_b, p_a, p_b = warpgroup_mma_wait(0, deps=(o_a, o_b, p_a, p_b))
                    mbarrier.arrive(empty.index(prev), count=1)
                    if not FIXED_SHIFT:
                        o_a, o_b = rescale(o_a, o_b, alpha, HAS_B)
                    p_a, p_b = p_operands(p, o_a, o_b, dtype)

                last = (block + n_blocks - 1) % STAGES
                # Both consumers zero the same v rows of the last block (to the same zeros); neither writes anything
                # else in shared memory that the other reads.
                zero_tail(va_s, vb_s, last, seqlen - (n_blocks - 1) * BLOCK_N, HAS_B, BLOCK_N, CONSUMER_WARPS)
                take_turn(turn, HALF, issue + n_blocks)
                o_a, o_b = pv_async(p_a, p_b, va_s, vb_s, last, o_a, o_b, HAS_B)
                pass_turn(turn, HALF)
                o_a, o_b = warpgroup_mma_wait(0, deps=(o_a, o_b))
                mbarrier.arrive(empty.index(last), count=1)
                if not ROW_SUM:
                    l_i = mma_row_sum(o_b, SUM_LANE)
                if FIXED_SHIFT:  # this half-tile's flag: (slot * HEADS + head) * 2 * M_BLOCKS + 2 * m + HALF
                    gl.store(FLAGS + 2 * tile + HALF, overflow_flag(o_a, o_b, l_i, seqlen - r0, HAS_B))
                if OUT_TMA and r0 + HALF_M <= seqlen:
                    inv_l = 1.0 / l_i
                    qa_h.store(times_rows(o_a, inv_l).to(dtype))
                    fence_async_shared()
                    cta_barrier()
                    tma_store(oa_desc, [start + r0, head * HEAD_DIM], qa_h)
                    if HAS_B:
                        store_out_part(Out, o_b, inv_l, r0, seqlen, start, head, stride_ot, stride_oh, D_A, HEAD_DIM)
                else:
                    store_out(Out, o_a, o_b, l_i, r0, seqlen, start, head, stride_ot, stride_oh, D_A, HEAD_DIM,
                              HAS_B)
                if Q_BUFFERS == 1:
                    tma.store_wait(0)
                    mbarrier.arrive(q_empty.index(0), count=1)
                block += n_blocks
                issue += n_blocks + 1
                n += 1
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["num_seqs"])
    def hopper_attention_pingpong_kernel(
        Q, ka_desc, kb_desc, va_desc, vb_desc, Out, CU_SEQLENS, FLAGS,
        tokens, num_seqs, qk_scale_log2,
        stride_qt, STRIDE_QH: gl.constexpr, stride_ot, STRIDE_OH: gl.constexpr, qa_desc, qb_desc, oa_desc,
        HEADS: gl.constexpr, M_BLOCKS: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, D_A: gl.constexpr, D_B: gl.constexpr, HAS_B: gl.constexpr,
        D_V: gl.constexpr, STAGES: gl.constexpr, PADDING: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        FIXED_SHIFT: gl.constexpr, SUM_LANE: gl.constexpr, Q_BUFFERS: gl.constexpr, OUT_TMA: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """``hopper_attention_kernel``'s arguments (the head strides constexprs, as there), but a one-dimensional
        grid over work tiles: ``M_BLOCKS`` q blocks of ``BLOCK_M`` rows per sequence slot, ``HEADS`` heads and
        ``num_seqs`` slots; program ``i`` of ``P`` takes tiles ``i, i + P, ..`` (persistent when ``P`` is the
        number of SMs). ``PADDING``: the programs also zero the rows past ``cu_seqlens[-1]`` (the padding slot of
        ``hopper_attention_kernel``'s grid). ``num_warps`` (4) is the default partition's, the first consumer.
        ``CONSUMER_REGS``: registers per thread of each consumer once the producer gave its up. ``FLAGS``: int32, two
        per work tile (``consumer_partition``); ``FIXED_SHIFT``, ``SUM_LANE``: as there (``SUM_LANE`` needs
        ``HAS_B`` and a lane of the second part past the head). ``qa_desc``, ``qb_desc``: q's two parts by
        ``BLOCK_M``-row boxes, loaded by the producer into ``Q_BUFFERS`` buffers (``Q``, ``stride_qt`` and
        ``STRIDE_QH`` are ``hopper_attention_kernel``'s, unused here); ``oa_desc``: the output's first part by
        ``BLOCK_M // 2``-row boxes, for ``OUT_TMA`` (``consumer_partition``)."""
        BLOCK_N: gl.constexpr = ka_desc.block_type.shape[0]
        dtype: gl.constexpr = ka_desc.dtype
        if PADDING:
            zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, gl.program_id(0), gl.num_programs(0), HEADS,
                              stride_ot, STRIDE_OH, HEAD_DIM, BLOCK_M, D_V, num_warps)
        n_tiles = M_BLOCKS * HEADS * num_seqs
        qa_s = gl.allocate_shared_memory(dtype, [Q_BUFFERS, BLOCK_M, D_A], qa_desc.layout)
        qb_s = gl.allocate_shared_memory(dtype, [Q_BUFFERS, BLOCK_M, D_B], qb_desc.layout)
        ka_s, kb_s, va_s, vb_s = kv_ring(ka_desc, kb_desc, va_desc, vb_desc, STAGES)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        marked = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(marked.index(i), count=1)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        q_ready = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        q_marked = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(Q_BUFFERS):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_marked.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        if SUM_LANE >= 0:
            gl.static_assert(HAS_B and SUM_LANE + D_A >= HEAD_DIM and SUM_LANE < D_B,
                             "SUM_LANE must be a lane of v's second part past the head")
            consumed = marked  # the consumers wait for the producer's ones, after the loads
        else:
            consumed = ready
        gl.warp_specialize([  # the argument tuples are written out: a tuple variable loses its constexprs
            (consumer_partition, (0, Out, oa_desc, FLAGS, qa_s, qb_s, ka_s, kb_s, va_s, vb_s, consumed, empty, turn,
                                  q_marked, q_empty, CU_SEQLENS, HEADS, M_BLOCKS, n_tiles, qk_scale_log2, stride_ot,
                                  STRIDE_OH, HEAD_DIM, BLOCK_M, D_A, D_B, HAS_B, STAGES, BLOCK_N, FIXED_SHIFT,
                                  SUM_LANE, Q_BUFFERS, OUT_TMA)),
            (consumer_partition, (1, Out, oa_desc, FLAGS, qa_s, qb_s, ka_s, kb_s, va_s, vb_s, consumed, empty, turn,
                                  q_marked, q_empty, CU_SEQLENS, HEADS, M_BLOCKS, n_tiles, qk_scale_log2, stride_ot,
                                  STRIDE_OH, HEAD_DIM, BLOCK_M, D_A, D_B, HAS_B, STAGES, BLOCK_N, FIXED_SHIFT,
                                  SUM_LANE, Q_BUFFERS, OUT_TMA)),
            (load_partition, (ka_desc, kb_desc, va_desc, vb_desc, qa_desc, qb_desc, ka_s, kb_s, va_s, vb_s, qa_s,
                              qb_s, ready, empty, marked, q_ready, q_empty, q_marked, CU_SEQLENS, HEADS, M_BLOCKS,
                              n_tiles, HEAD_DIM, BLOCK_M, STAGES, D_A, HAS_B, SUM_LANE, Q_BUFFERS)),
        ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])
