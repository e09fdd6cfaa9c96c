"""The Triton varlen flash-attention kernel behind TRITON_ATTN, and its launcher.

Importing this module imports triton. Triton decides when it is imported whether ``@triton.jit`` compiles or
interprets (``TRITON_INTERPRET=1``; its own ``tl`` helpers are decorated then too), so running on CPU tensors needs
that variable set before triton is first imported in the process.

Grid: ``(cdiv(max_seqlen, BLOCK_M), heads, num_seqs + 1)``. Program ``(m, h, s)`` computes rows
``m*BLOCK_M ..`` of sequence ``s`` for head ``h`` with an online softmax over the sequence's keys; blocks past the
sequence's end do nothing. The extra last slot ``s == num_seqs`` zeroes the rows past ``cu_seqlens[-1]``. Only
``max_seqlen`` (a host int) and tensor shapes size the grid, so a captured launch stays valid for any
``cu_seqlens`` whose sequences fit in ``max_seqlen``.

Two kernels share that grid. ``varlen_attention_kernel`` loads k and v through pointers and runs everywhere Triton
does (ROCm, the interpreter, fp32, any strides). On Hopper (CUDA, compute capability 9.x or 10.x: ``has_tma``),
for fp16 and bf16 with TMA-aligned k and v, ``varlen_attention_tma_kernel`` loads them through TMA descriptors
instead. On the H200, one sequence of 4096 patches (16 heads of 72, bf16) takes 0.271 ms with it, 0.614 with the
pointer kernel and 0.351 with ATen's flash kernel (``benchmarks/attention_hd72.py``, ``docs/benchmarks.md``).

On Hopper itself (compute capability 9.x, Triton with Gluon) kernels written in Gluon serve the same calls outside
``TMA_OVER_GLUON``: they order their asynchronous MMAs around the softmax themselves. From 2048 rows (and from
1024 in a call of one sequence slot, inside that range) a warp-specialised kernel whose two consumer warpgroups take
turns on the tensor cores (``gluon_pingpong.py``) takes 0.194 ms for the 4096-patch sequence, below that
``gluon_kernel.py``'s (0.221 ms there; ``benchmarks/attention_gluon.py``, session 10).
``launch_varlen_attention`` picks among them (``uses_gluon``, ``uses_tma``, ``gluon_kernel.gluon_tiles``).

``overflow_fixup_kernel`` follows the ping-pong kernel where that kernel shifts each row by its first key block's
maximum (bf16, from 2048 rows). It recomputes, with this file's pointer loads and online softmax
(``attend_query_block``), the query blocks (each consumer's half-tile: 64 rows, or 128 with the ping-pong kernel's
256-row tiles) whose rows the fixed shift could not keep finite (``launch_overflow_fixup``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hwgraph.attention.varlen_inputs import launches_on_tensor_device, unit_stride_on_d

try:  # host-side TMA descriptors (Triton 3.4 and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

LOG2_E = 1.4426950408889634


@triton.jit
def load_tile(ptrs, mask, USE_MASK: tl.constexpr):
    if USE_MASK:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def attend_key_block(q_a, q_b, m_i, l_i, acc, K, V, start, kv_start, seqlen, head, qk_scale_log2,
                     stride_kt, stride_kh, stride_vt, stride_vh, offs_a, offs_b, offs_v, a_mask, b_mask, v_mask,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
                     D_V: tl.constexpr, HAS_B: tl.constexpr, MASKED: tl.constexpr, MASK_A: tl.constexpr,
                     MASK_V: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One online-softmax step over keys ``kv_start ..`` of the sequence: returns the updated ``(m, l, acc)``.
    ``MASKED``: the sequence's last, partial key block, whose columns past the end are masked; the full blocks
    before it load without masks. ``MASK_A`` / ``MASK_V``: mask the loads of k's part a / of v (set with ``MASKED``,
    and when that tile is wider than the head). The head offsets and their masks come from the caller."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = kv_start + offs_n
    col_mask = cols < seqlen
    kv_rows = (start + cols).to(tl.int64)
    k_ptr = K + kv_rows[:, None] * stride_kt + head * stride_kh
    v_ptr = V + kv_rows[:, None] * stride_vt + head * stride_vh
    if MASKED:
        ka_mask = col_mask[:, None] & a_mask[None, :]
        kb_mask = col_mask[:, None] & b_mask[None, :]
        kv_mask = col_mask[:, None] & v_mask[None, :]
    else:
        ka_mask = a_mask[None, :]
        kb_mask = b_mask[None, :]
        kv_mask = v_mask[None, :]
    k_a = load_tile(k_ptr + offs_a[None, :], ka_mask, MASK_A)
    # "ieee": fp32 inputs keep full fp32 products (not TF32); fp16/bf16 ignore it and still use the tensor cores;
    # and it is the one precision every Triton target accepts (AMD has tf32 only on gfx942).
    s = tl.dot(q_a, tl.trans(k_a.to(DOT_DTYPE)), input_precision="ieee")
    if HAS_B:
        k_b = tl.load(k_ptr + offs_b[None, :], mask=kb_mask, other=0.0)
        s += tl.dot(q_b, tl.trans(k_b.to(DOT_DTYPE)), input_precision="ieee")
    s = s * qk_scale_log2
    if MASKED:
        s = tl.where(col_mask[None, :], s, float("-inf"))
    # Every block has at least one valid key, so m_new is finite and exp2 never sees -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DOT_DTYPE)
    # p.v in one tile padded to a power of two: splitting it like q.k (two dots sharing p) compiles to wrong
    # results or an illegal address with Triton 3.6 on the H200 (bf16 and fp16; fp32 is right).
    v = load_tile(v_ptr + offs_v[None, :], kv_mask, MASK_V)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(DOT_DTYPE), input_precision="ieee")
    return m_new, l_i, acc


# num_seqs is the slot count of a graph (1, 2, 4, ...): unspecialised, so a graph with one slot does not compile a
# kernel of its own for the value 1.
@triton.jit(do_not_specialize=["num_seqs"])
def varlen_attention_kernel(
    Q, K, V, Out, CU_SEQLENS,
    tokens, num_seqs, qk_scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
    D_V: tl.constexpr, HAS_B: tl.constexpr, A_PADDED: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if seq < num_seqs:
        start = tl.load(CU_SEQLENS + seq)
        seqlen = tl.load(CU_SEQLENS + seq + 1) - start
        attend_query_block(Q, K, V, Out, start, seqlen, block_m, head, qk_scale_log2, stride_qt, stride_qh,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, HEAD_DIM, BLOCK_M,
                           BLOCK_N, D_A, D_B, D_V, HAS_B, A_PADDED, DOT_DTYPE)
    else:
        zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, block_m, head, stride_ot, stride_oh, HEAD_DIM, BLOCK_M,
                          D_V)


@triton.jit
def attend_query_block(Q, K, V, Out, start, seqlen, block_m, head, qk_scale_log2, stride_qt, stride_qh, stride_kt,
                       stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
                       D_V: tl.constexpr, HAS_B: tl.constexpr, A_PADDED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Rows ``block_m * BLOCK_M ..`` of the sequence at token ``start`` (``seqlen`` tokens) for one head, through
    pointer loads: ``varlen_attention_kernel``'s program, and ``overflow_fixup_kernel``'s recompute."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, D_A)
    # For q.k the head is split in two power-of-two parts (72 = 64 + 8 in a 16-wide tile) instead of one padded to
    # the next power of two (128): that matmul does 80/72 of the needed work, not 128/72. Without HAS_B the part-b
    # tiles are never loaded. p.v and the output use one tile of D_V (the head padded to a power of two).
    offs_b = D_A + tl.arange(0, D_B)
    offs_v = tl.arange(0, D_V)
    a_mask = offs_a < HEAD_DIM
    b_mask = offs_b < HEAD_DIM
    v_mask = offs_v < HEAD_DIM
    rows = block_m * BLOCK_M + offs_m
    row_mask = rows < seqlen
    q_rows = (start + rows).to(tl.int64)
    q_a, q_b = load_q_parts(Q, start, rows, row_mask, head, stride_qt, stride_qh, HEAD_DIM, BLOCK_M, D_A, D_B,
                            HAS_B, DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    # A query block wholly past this sequence's end (the grid is sized for max_seqlen) skips the key loop.
    kv_end = tl.where(block_m * BLOCK_M < seqlen, seqlen, 0)
    full_end = kv_end // BLOCK_N * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = attend_key_block(
            q_a, q_b, m_i, l_i, acc, K, V, start, kv_start, seqlen, head, qk_scale_log2,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_a, offs_b, offs_v, a_mask, b_mask, v_mask,
            HEAD_DIM, BLOCK_N, D_A, D_B, D_V, HAS_B, False, A_PADDED, D_V > HEAD_DIM, DOT_DTYPE)
    if full_end < kv_end:
        m_i, l_i, acc = attend_key_block(
            q_a, q_b, m_i, l_i, acc, K, V, start, full_end, seqlen, head, qk_scale_log2,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_a, offs_b, offs_v, a_mask, b_mask, v_mask,
            HEAD_DIM, BLOCK_N, D_A, D_B, D_V, HAS_B, True, True, True, DOT_DTYPE)
    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    out_ptr = Out + q_rows[:, None] * stride_ot + head * stride_oh
    tl.store(out_ptr + offs_v[None, :], (acc * inv_l[:, None]).to(Out.dtype.element_ty),
             mask=row_mask[:, None] & v_mask[None, :])


@triton.jit
def overflow_fixup_kernel(
    Q, K, V, Out, CU_SEQLENS, FLAGS,
    blocks, qk_scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
    D_V: tl.constexpr, HAS_B: tl.constexpr, A_PADDED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    FLAG_CHUNK: tl.constexpr,
):
    """Recompute the ``BLOCK_M``-row query blocks whose flag is set, with the exact online softmax
    (``attend_query_block``), over what the ping-pong Gluon kernel wrote. Grid ``(heads, num_seqs)``; the flags of
    sequence ``s``, head ``h`` are ``FLAGS[(s * heads + h) * blocks + b]`` for its blocks ``b``; only the blocks that
    hold rows of the sequence are read, so flags past them may hold anything. A program whose flags are all zero
    (every call whose scores stay in range) loads them ``FLAG_CHUNK`` at a time and ends."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    start = tl.load(CU_SEQLENS + seq)
    seqlen = tl.load(CU_SEQLENS + seq + 1) - start
    base = FLAGS + (seq * tl.num_programs(0) + head) * blocks
    n_real = tl.cdiv(seqlen, BLOCK_M)
    for chunk in range(0, n_real, FLAG_CHUNK):
        offs = chunk + tl.arange(0, FLAG_CHUNK)
        if tl.max(tl.load(base + offs, mask=offs < n_real, other=0), 0) != 0:
            for block_m in range(chunk, tl.minimum(chunk + FLAG_CHUNK, n_real)):
                if tl.load(base + block_m) != 0:
                    attend_query_block(Q, K, V, Out, start, seqlen, block_m, head, qk_scale_log2, stride_qt,
                                       stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                                       HEAD_DIM, BLOCK_M, BLOCK_N, D_A, D_B, D_V, HAS_B, A_PADDED, DOT_DTYPE)


@triton.jit
def zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, block_m, head, stride_ot, stride_oh,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, D_V: tl.constexpr):
    """The extra grid slot: rows [cu_seqlens[-1], tokens) belong to no sequence; write zeros, shared over the m
    programs."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, D_V)
    first = tl.load(CU_SEQLENS + num_seqs)
    zeros = tl.zeros([BLOCK_M, D_V], Out.dtype.element_ty)
    for row_start in range(first + block_m * BLOCK_M, tokens, BLOCK_M * tl.num_programs(0)):
        rows = (row_start + offs_m).to(tl.int64)
        tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :], zeros,
                 mask=(rows < tokens)[:, None] & (offs_v < HEAD_DIM)[None, :])


@triton.jit
def qk_tma(q_a, q_b, ka_desc, kb_desc, row, col, D_A: tl.constexpr, HAS_B: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Raw scores of the q tile against the key rows ``row ..`` (absolute) of the head at lane ``col``, through TMA.

    The descriptors cover ``[tokens, heads * head_dim]``, and a box starts at the head's first lane ``col``: its
    lanes past the head belong to the next head (zeros past the last head and past the last token). q's lanes past
    the head are zero, so the next head's k lanes add nothing to s. The second q.k part accumulates into the
    first's dot."""
    k_a = ka_desc.load([row, col]).to(DOT_DTYPE)
    s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
    if HAS_B:
        k_b = kb_desc.load([row, col + D_A]).to(DOT_DTYPE)
        s = tl.dot(q_b, tl.trans(k_b), s, input_precision="ieee")
    return s


@triton.jit
def softmax_pv_tma(s, m_i, l_i, acc, v_desc, row, col, valid, qk_scale_log2, MASKED: tl.constexpr,
                   DOT_DTYPE: tl.constexpr):
    """One online-softmax step with the raw scores ``s`` of the key rows ``row ..``: returns ``(m, l, acc)``.
    ``MASKED``: the sequence's last, partial block, whose rows past its end (the next sequence's, or padding) are
    masked out of s and zeroed in v; full blocks use no masks, so their tiles go from TMA to the tensor cores
    untouched. p.v's lanes past the head (the next head's v) are never stored; p.v accumulates into its dot."""
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([row, col])
    if MASKED:
        v = tl.where(valid[:, None], v, 0.0)
    acc = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def load_q_parts(Q, start, rows, row_mask, head, stride_qt, stride_qh, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, HAS_B: tl.constexpr,
                 DOT_DTYPE: tl.constexpr):
    """The q tile's two parts (lanes ``0 .. D_A`` and ``D_A .. D_A + D_B``), zero past the head and past the
    sequence's rows."""
    offs_a = tl.arange(0, D_A)
    offs_b = D_A + tl.arange(0, D_B)
    q_ptr = Q + (start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh
    q_a = tl.load(q_ptr + offs_a[None, :], mask=row_mask[:, None] & (offs_a < HEAD_DIM)[None, :],
                  other=0.0).to(DOT_DTYPE)
    q_b = tl.zeros([BLOCK_M, D_B], DOT_DTYPE)
    if HAS_B:
        q_b = tl.load(q_ptr + offs_b[None, :], mask=row_mask[:, None] & (offs_b < HEAD_DIM)[None, :],
                      other=0.0).to(DOT_DTYPE)
    return q_a, q_b


@triton.jit(do_not_specialize=["num_seqs"])
def varlen_attention_tma_kernel(
    Q, ka_desc, kb_desc, v_desc, Out, CU_SEQLENS,
    tokens, num_seqs, qk_scale_log2,
    stride_qt, STRIDE_QH: tl.constexpr, stride_ot, STRIDE_OH: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
    D_V: tl.constexpr, HAS_B: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """``varlen_attention_kernel`` with k and v read through TMA descriptors (same grid, same padding slot). Early
    returns rather than nested branches keep the key loop at the top level. The head strides of q and out are
    constexprs: as runtime values (72, not a multiple of 16) Triton would load q and store out 2 bytes at a time."""
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    if seq >= num_seqs:
        zero_padding_rows(Out, CU_SEQLENS, tokens, num_seqs, block_m, head, stride_ot, STRIDE_OH, HEAD_DIM, BLOCK_M,
                          D_V)
        return
    start = tl.load(CU_SEQLENS + seq)
    seqlen = tl.load(CU_SEQLENS + seq + 1) - start
    if block_m * BLOCK_M >= seqlen:
        return
    offs_n = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, D_V)
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < seqlen
    q_a, q_b = load_q_parts(Q, start, rows, row_mask, head, stride_qt, STRIDE_QH, HEAD_DIM, BLOCK_M, D_A, D_B, HAS_B,
                            DOT_DTYPE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_V], tl.float32)
    col = head * HEAD_DIM
    full_end = seqlen // BLOCK_N * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        s = qk_tma(q_a, q_b, ka_desc, kb_desc, start + kv_start, col, D_A, HAS_B, DOT_DTYPE)
        m_i, l_i, acc = softmax_pv_tma(s, m_i, l_i, acc, v_desc, start + kv_start, col, offs_n, qk_scale_log2, False,
                                       DOT_DTYPE)
    if full_end < seqlen:
        s = qk_tma(q_a, q_b, ka_desc, kb_desc, start + full_end, col, D_A, HAS_B, DOT_DTYPE)
        m_i, l_i, acc = softmax_pv_tma(s, m_i, l_i, acc, v_desc, start + full_end, col, full_end + offs_n < seqlen,
                                       qk_scale_log2, True, DOT_DTYPE)
    inv_l = 1.0 / l_i
    out_ptr = Out + (start + rows).to(tl.int64)[:, None] * stride_ot + head * STRIDE_OH
    tl.store(out_ptr + offs_v[None, :], (acc * inv_l[:, None]).to(Out.dtype.element_ty),
             mask=row_mask[:, None] & (offs_v < HEAD_DIM)[None, :])


@functools.cache  # pure; asked several times by every launch (eager calls pay host time for each)
def head_split(head_dim: int) -> tuple[int, int]:
    """(D_A, D_B): the head as a power-of-two part and a second power-of-two part (0: none), each at least 16 wide
    (tl.dot's minimum), when that is narrower than one part padded to the next power of two: 72 -> (64, 16),
    96 -> (64, 32), 128 -> (128, 0), 20 -> (32, 0)."""
    whole = head_width(head_dim)
    if head_dim <= 16 or whole == head_dim:
        return whole, 0
    first = whole // 2
    second = max(16, triton.next_power_of_2(head_dim - first))
    return (first, second) if first + second < whole else (whole, 0)


@functools.cache
def head_width(head_dim: int) -> int:
    """The head padded to a power of two, at least 16: the width of the v tile, the accumulator and the output."""
    return max(16, triton.next_power_of_2(head_dim))


def block_sizes(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, D_A, D_B): tl.dot needs every side >= 16; wide or fp32 tiles shrink to fit shared memory."""
    d_a, d_b = head_split(head_dim)
    width = head_width(head_dim)
    if width > 128:
        return 32, 16 if dtype == torch.float32 else 32, d_a, d_b
    if dtype == torch.float32 and width > 64:
        return 64, 32, d_a, d_b
    return 64, 64, d_a, d_b


def dot_dtype_for(dtype: torch.dtype):
    """The dtype the two matmuls take their operands in: the input dtype, except bf16 under the interpreter.

    The Triton interpreter stores bf16 as raw 16-bit integers and its ``tl.dot`` multiplies those bit patterns
    (triton-lang/triton#11584, not supported upstream), so interpreted bf16 runs its matmuls in fp32.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if is_interpreted() else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def is_interpreted() -> bool:
    """Whether the kernel was built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(varlen_attention_kernel, triton.runtime.JITFunction)


MIN_FAST_HEAD_DIM = 32  # the narrowest head the TMA and Gluon kernels take (uses_tma)


def uses_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call takes the TMA kernel (and with it, where ``gluon_fits``, the Gluon kernels): NVIDIA Hopper or
    datacenter Blackwell (``has_tma``), fp16/bf16, a head of at least 32 lanes and a multiple of 16 bytes, and k and v
    addressable by TMA descriptors (16-byte aligned base and token stride, heads adjacent: one row of
    ``heads * head_dim`` lanes).
    Other heads take the pointer kernel. On an H100 (session 56) the TMA and Gluon kernels crashed ("an illegal
    instruction", which leaves the process's CUDA context unusable) at head dims 4, 12, 20 and 36 in bf16, and the
    ping-pong kernel gave wrong outputs at head dim 24 in a 4096-row budget; the CUDA tests check them at head dims
    40 to 128, and the pointer kernel at 4 to 36."""
    if not q.is_cuda or torch.version.hip or q.dtype not in (torch.float16, torch.bfloat16) or is_interpreted():
        return False
    if q.shape[-1] < MIN_FAST_HEAD_DIM or (q.shape[-1] * q.element_size()) % 16:
        return False
    if head_width(q.shape[-1]) > 128:  # the wider tiles do not fit shared memory with 3 stages
        return False
    if TensorDescriptor is None or not has_tma(q.device.index):  # a CUDA tensor's device always has its index
        return False
    return all(tma_rows(t) and t.shape[1] * t.shape[2] * t.element_size() >= 16 for t in (k, v))


def tma_rows(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t`` ``[T, H, D]`` as ``[T, H * D]`` rows: unit stride on D, heads adjacent, base
    and row stride 16-byte aligned."""
    return (t.stride(-1) == 1 and t.stride(1) == t.shape[-1] and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


@functools.cache
def has_tma(device_index: int) -> bool:
    """Compute capability 9.x or 10.x (asked once per device: the launcher runs on every eager call): TMA, and the
    227 KB of shared memory a program may take that the TMA kernel's tiles need (Triton 3.9 builds its 128x128 tiles,
    from 1024 rows, with 176 KB at 72 lanes a head for sm_90 and 124 KB for sm_120). Compute capability 12.x
    (consumer Blackwell) has TMA but 99 KB a program: Triton would refuse those launches ("out of resource: shared
    memory"), so it takes the pointer kernel, as do the unmeasured others."""
    return 9 <= torch.cuda.get_device_capability(device_index)[0] <= 10


# max_seqlen in [low, high): the Triton TMA kernel measured faster than the Gluon one on the H200 (ms per call,
# ``benchmarks/attention_gluon.py --tiles``, best Gluon tile against the TMA kernel): 1x392 in 512 rows 0.0119 /
# 0.0120, 2x196 in 512 0.0096 / 0.0098, 1x1024 in 1024 0.0245 / 0.0225, 4x256 in 1024 0.0136 / 0.0131. Outside it
# the Gluon kernel wins: 196 in 256 rows 0.0089 / 0.0098, 2048 in 2048 0.0657 / 0.0735, 4096 0.229 / 0.270. Inside
# it, a call of one sequence slot from 1024 rows takes the ping-pong Gluon kernel (``gluon_kernel.gluon_tiles``):
# 1x1024 in 1024 0.016 / 0.021 (session 10).
TMA_OVER_GLUON = (512, 2048)


def uses_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen: int,
               num_seqs: int | None = None) -> bool:
    """Whether a call of ``num_seqs`` sequence slots takes the Gluon kernel (``gluon_kernel.py``): where the TMA
    kernel may run (``uses_tma``), on compute capability 9.x (its warpgroup MMAs are Hopper's only), with Triton's
    Gluon importable, outside ``TMA_OVER_GLUON`` or where ``gluon_tiles`` takes the ping-pong kernel."""
    return uses_tma(q, k, v) and gluon_fits(q.device.index, max_seqlen, q.shape[-1], num_seqs)


def gluon_fits(device_index: int, max_seqlen: int, head_dim: int, num_seqs: int | None = None) -> bool:
    """``uses_gluon`` once ``uses_tma`` holds: Gluon ready on the device, and ``max_seqlen`` outside
    ``TMA_OVER_GLUON``, or inside it where ``gluon_tiles(max_seqlen, head_dim, num_seqs)`` takes the ping-pong kernel
    (one sequence slot, from 1024 rows)."""
    if not gluon_ready(device_index):
        return False
    if not TMA_OVER_GLUON[0] <= max_seqlen < TMA_OVER_GLUON[1]:
        return True
    from hwgraph.attention.gluon_kernel import gluon_tiles

    return gluon_tiles(max_seqlen, head_dim, num_seqs).pingpong


@functools.cache
def gluon_ready(device_index: int) -> bool:
    """Hopper (compute capability 9.x) with ``triton.experimental.gluon``'s Hopper API (asked once per device)."""
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    from hwgraph.attention.gluon_kernel import gluon_available

    return gluon_available() is None


def head_descriptor(t: torch.Tensor, block_n: int, width: int):
    """A TMA descriptor over ``t`` ``[T, H, D]`` seen as ``[T, H * D]`` (heads adjacent), box ``[block_n, width]``.
    A 3-d ``[H, T, D]`` view, whose boxes end at the head, measured the same on the H200 (0.272 against 0.270 ms at
    4096 patches) and needs a reshape of every box; this is the layout the tile sweep measured."""
    tokens, heads, head_dim = t.shape
    return TensorDescriptor(t, [tokens, heads * head_dim], [t.stride(0), 1], [block_n, width])


def head_stride(t: torch.Tensor) -> int:
    """``t``'s stride between heads as the TMA and Gluon kernels take it, a constexpr (so that Triton knows a head's
    alignment): one head has only head 0, so any value serves, and it passes the head width, compiling no kernel of
    its own for whatever stride a one-head view has."""
    return t.stride(1) if t.shape[1] > 1 else t.shape[-1]


def heads_adjacent_q(q: torch.Tensor) -> torch.Tensor:
    """``q`` with its heads adjacent (head stride = head width), copied only when they are not: the kernels that take
    the head stride as a constexpr then compile once per head width, not once per token count of a ``[H, T, D]``
    layout seen through a transpose."""
    return q if head_stride(q) == q.shape[-1] else q.contiguous()


def tma_tiles(max_seqlen: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the TMA kernel. Device time per call on the H200 (16 heads of
    72, bf16, ms; ``benchmarks/attention_hd72.py --tiles`` and ``--small``, ``docs/benchmarks.md``): 128x128 tiles
    with 3 stages are best for one sequence of 4096 (0.267 against 0.298 for 128x64), of 3600 in 4096 rows
    (0.250 / 0.271), of 2048 (0.0741 / 0.0814; 64x64: 0.0825) and of 1024 (0.0226 / 0.0241; 64x64: 0.0261), and
    for 4x784 in 4096 rows (0.0863 / 0.0870). Below max_seqlen 1024 more, smaller programs win: 64x64 tiles with 4
    warps and 3 stages take 0.0095 for 196 patches in 256 rows, 0.0100 for 2x196 and 0.0118 for 392 in 512,
    against 0.0124 / 0.0123 / 0.0158 with 128x64 (ATen flash: 0.0113 / 0.0115 / 0.0168). 4 stages of 128x128 do
    not fit shared memory. Only max_seqlen, a host int, picks them."""
    return (128, 128, 8, 3) if max_seqlen >= 1024 else (64, 64, 4, 3)


FIXUP_FLAG_CHUNK = 64  # flags an overflow_fixup_kernel program loads at once


@launches_on_tensor_device
def launch_overflow_fixup(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          cu_seqlens: torch.Tensor, flags: torch.Tensor, blocks: int, block_m: int,
                          scale: float) -> None:
    """Recompute in ``out`` every ``block_m``-row query block whose int32 flag in ``flags`` is set
    (``overflow_fixup_kernel``): ``blocks`` flags per sequence slot and head, slot-major, then head. Launched
    after every call of the ping-pong Gluon kernel that shifts rows by their first key block's maximum
    (``gluon_kernel.uses_fixed_shift``), whose flags mark the blocks it could not keep finite; no host read decides
    whether it runs."""
    tokens, heads, head_dim = q.shape
    num_seqs = cu_seqlens.shape[0] - 1
    if flags.dtype != torch.int32 or flags.numel() < blocks * heads * num_seqs:
        raise ValueError(f"flags must be int32 with at least blocks * heads * slots = {blocks} * {heads} * "
                         f"{num_seqs} entries, got {flags.dtype} with {flags.numel()}")
    if num_seqs == 0 or tokens == 0:
        return
    _, block_n, d_a, d_b = block_sizes(head_dim, q.dtype)
    overflow_fixup_kernel[(heads, num_seqs)](
        q, k, v, out, cu_seqlens, flags, blocks, scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, D_A=d_a, D_B=max(d_b, 16), D_V=head_width(head_dim),
        HAS_B=d_b > 0, A_PADDED=d_a > head_dim, DOT_DTYPE=dot_dtype_for(q.dtype), FLAG_CHUNK=FIXUP_FLAG_CHUNK,
        num_warps=4, num_stages=2,
    )


@launches_on_tensor_device
def launch_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float, tiles: tuple[int, int, int, int] | None = None,
                            use_tma: bool | None = None, padding_slot: bool = True,
                            use_gluon: bool | None = None) -> torch.Tensor:
    """Run the kernel: ``q, k, v`` ``[T, H, D]`` with unit stride on D -> a new ``[T, H, D]`` in q's dtype.
    ``use_gluon``: None takes the Gluon kernel where ``uses_gluon`` allows it, unless ``use_tma`` or ``tiles`` ask
    for a Triton kernel; True forces it (Hopper only), False never takes it. ``use_tma``: None picks the TMA kernel
    where ``uses_tma`` allows it; True forces it (tests run it under the interpreter), False the pointer kernel.
    ``padding_slot``: run the grid's extra slot that zeroes the rows past ``cu_seqlens[-1]``; without it they are
    left unwritten."""
    if use_gluon and (not q.is_cuda or torch.version.hip or is_interpreted()):
        raise RuntimeError(f"the Gluon attention kernel runs on NVIDIA Hopper GPUs only, not on {q.device} tensors"
                           f"{' under the Triton interpreter' if is_interpreted() else ''}")
    if q.device.type == "cpu" and not is_interpreted():
        raise RuntimeError("TRITON_ATTN on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported in this process")
    q, k, v = unit_stride_on_d(q, k, v)
    tma = uses_tma(q, k, v) if use_tma is None else use_tma
    if use_gluon is None:  # uses_gluon, with uses_tma asked once per call
        use_gluon = (use_tma is None and tiles is None and tma
                     and gluon_fits(q.device.index, max_seqlen, q.shape[-1], cu_seqlens.shape[0] - 1))
    if use_gluon:
        from hwgraph.attention.gluon_kernel import launch_gluon_attention

        return launch_gluon_attention(q, k, v, cu_seqlens, max_seqlen, scale, tiles=tiles, padding_slot=padding_slot)
    if tma:  # its head stride is a constexpr (launch_gluon_attention does the same for the Gluon kernels)
        q = heads_adjacent_q(q)
    tokens, heads, head_dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    block_m, block_n, d_a, d_b = block_sizes(head_dim, q.dtype)
    warps, stages = 4, 2
    if tma:
        block_m, block_n, warps, stages = tma_tiles(max_seqlen)
    elif q.is_cuda and not torch.version.hip and head_width(head_dim) <= 128 and q.dtype != torch.float32:
        # NVIDIA before Hopper, or k/v that TMA cannot address. ROCm keeps block_sizes' 64x64 tiles, which fit the
        # 64 KB of LDS of its GPUs (these do not). Device time per call on the H200 (benchmarks/triton_tiles.py: 20
        # calls in a CUDA graph, 16 heads of 72, bf16, ms): 128x64 tiles with 8 warps are best or within 8% for
        # every batch up to max_seqlen 1024 (196 patches 0.0154, 4x256 0.0313, 1x1024 0.0544 against 0.0501 for
        # 128x128), and 128x128 is best for one 4096-patch image (0.613 against 0.754; 4x784 in that budget: 0.206
        # against 0.187). Only max_seqlen, a host int, picks them.
        block_m, block_n, warps = (128, 128, 8) if max_seqlen >= 2048 else (128, 64, 8)
    if tiles is not None:  # (BLOCK_M, BLOCK_N, num_warps, num_stages), for tuning (benchmarks/triton_tiles.py)
        block_m, block_n, warps, stages = tiles
    num_seqs = cu_seqlens.shape[0] - 1
    dot_dtype = dot_dtype_for(q.dtype)
    d_v = head_width(head_dim)
    # At least one m program, so the padding slot runs even when every sequence is empty.
    grid = (max(1, triton.cdiv(max_seqlen, block_m)), heads, num_seqs + int(padding_slot))
    if tma:
        kb_width = max(d_b, 16)
        varlen_attention_tma_kernel[grid](
            q, head_descriptor(k, block_n, d_a), head_descriptor(k, block_n, kb_width),
            head_descriptor(v, block_n, d_v), out, cu_seqlens,
            tokens, num_seqs, scale * LOG2_E,
            q.stride(0), head_stride(q), out.stride(0), head_stride(out),
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, D_A=d_a, D_B=kb_width, D_V=d_v, HAS_B=d_b > 0,
            DOT_DTYPE=dot_dtype, num_warps=warps, num_stages=stages,
        )
        return out
    varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens,
        tokens, num_seqs, scale * LOG2_E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, D_A=d_a, D_B=max(d_b, 16), D_V=d_v,
        HAS_B=d_b > 0,
        A_PADDED=d_a > head_dim,
        DOT_DTYPE=dot_dtype,
        num_warps=warps, num_stages=stages,
    )
    return out
