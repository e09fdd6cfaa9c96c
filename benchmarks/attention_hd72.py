"""Candidate attention kernels for head_dim 72 on Hopper, at the tower's shapes (16 heads, bf16), against ATen flash.

Usage: python benchmarks/attention_hd72.py [--quick] [--tma | --split-v]
Each cell is the device time of one call (20 calls captured in one CUDA graph, replayed, divided by 20) and the
relative L2 error of its real rows against flash. Candidates:

- ``triton``: TRITON_ATTN as shipped (on Hopper its TMA kernel, which grew out of ``v2-tma`` below) and its
  pointer kernel (``use_tma=False``; the only kernel before session 5: q.k split 64 + 16, p.v in one 128-wide
  tile).
- ``v2``: the same maths written as Triton's Hopper tutorial writes its loop: k loaded already transposed, the
  second q.k part and p.v accumulated into the dot (``tl.dot(a, b, acc)``), the scale folded into the exponent,
  unmasked full blocks; p.v either one 128-wide tile or split 64 + 16 (``splitv``); tiles and pipeline stages swept.
- ``v2-tma``: ``v2`` with k and v read through host-built TMA descriptors.
- ``cudnn-dense``: cuDNN's dense kernel on the whole padded sequence, keys past the image's end masked by one extra
  head dimension (q gets 1, k gets 0 for real keys and -30000 for padding, head 72 -> 80: no bias tensor).
- ``flex``: torch.compile'd flex_attention on one exact sequence (no mask), as the ceiling of torch's own Triton
  template at this head dim.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from hwgraph.timing import graphed_ms

H, D = 16, 72
LOG2_E = 1.4426950408889634
DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _v2_block(q_a, q_b, m_i, l_i, acc_a, acc_b, k_ptr, v_ptr, kv_start, seqlen, stride_kt, stride_vt,
              qk_scale, offs_n, a_cols, b_cols, va_cols, vb_cols, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              SPLIT_V: tl.constexpr, DTYPE: tl.constexpr):
    cols = kv_start + offs_n
    k_rows = cols.to(tl.int64) * stride_kt
    v_rows = cols.to(tl.int64) * stride_vt
    if MASKED:
        valid = cols < seqlen
        k_a = tl.load(k_ptr + a_cols[:, None] + k_rows[None, :], mask=valid[None, :], other=0.0)
        k_b = tl.load(k_ptr + b_cols[:, None] + k_rows[None, :], mask=valid[None, :] & (b_cols < HEAD_DIM)[:, None],
                      other=0.0)
    else:
        k_a = tl.load(k_ptr + a_cols[:, None] + k_rows[None, :])
        k_b = tl.load(k_ptr + b_cols[:, None] + k_rows[None, :], mask=(b_cols < HEAD_DIM)[:, None], other=0.0)
    s = tl.dot(q_a, k_a)
    s = tl.dot(q_b, k_b, s)
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DTYPE)
    if MASKED:
        v_a = tl.load(v_ptr + v_rows[:, None] + va_cols[None, :], mask=valid[:, None] & (va_cols < HEAD_DIM)[None, :],
                      other=0.0)
    else:
        v_a = tl.load(v_ptr + v_rows[:, None] + va_cols[None, :], mask=(va_cols < HEAD_DIM)[None, :], other=0.0)
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
    if SPLIT_V:
        if MASKED:
            v_b = tl.load(v_ptr + v_rows[:, None] + vb_cols[None, :],
                          mask=valid[:, None] & (vb_cols < HEAD_DIM)[None, :], other=0.0)
        else:
            v_b = tl.load(v_ptr + v_rows[:, None] + vb_cols[None, :], mask=(vb_cols < HEAD_DIM)[None, :], other=0.0)
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
    return m_new, l_i, acc_a, acc_b


@triton.jit(do_not_specialize=["num_seqs"])
def v2_kernel(Q, K, V, Out, CU, num_seqs, qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
              stride_vh, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              D_A: tl.constexpr, D_B: tl.constexpr, D_VA: tl.constexpr, D_VB: tl.constexpr, SPLIT_V: tl.constexpr,
              DTYPE: tl.constexpr):
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq)
    seqlen = tl.load(CU + seq + 1) - start
    if block_m * BLOCK_M >= seqlen:
        return
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    a_cols = tl.arange(0, D_A)
    b_cols = D_A + tl.arange(0, D_B)
    va_cols = tl.arange(0, D_VA)
    vb_cols = D_VA + tl.arange(0, D_VB)
    row_ok = offs_m < seqlen
    q_rows = (start + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q_a = tl.load(Q + q_rows[:, None] + a_cols[None, :], mask=row_ok[:, None], other=0.0)
    q_b = tl.load(Q + q_rows[:, None] + b_cols[None, :], mask=row_ok[:, None] & (b_cols < HEAD_DIM)[None, :],
                  other=0.0)
    k_ptr = K + start.to(tl.int64) * stride_kt + head * stride_kh
    v_ptr = V + start.to(tl.int64) * stride_vt + head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_VA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, D_VB], tl.float32)
    full_end = seqlen // BLOCK_N * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc_a, acc_b = _v2_block(q_a, q_b, m_i, l_i, acc_a, acc_b, k_ptr, v_ptr, kv_start, seqlen,
                                           stride_kt, stride_vt, qk_scale, offs_n, a_cols, b_cols, va_cols, vb_cols,
                                           HEAD_DIM, False, SPLIT_V, DTYPE)
    if full_end < seqlen:
        m_i, l_i, acc_a, acc_b = _v2_block(q_a, q_b, m_i, l_i, acc_a, acc_b, k_ptr, v_ptr, full_end, seqlen,
                                           stride_kt, stride_vt, qk_scale, offs_n, a_cols, b_cols, va_cols, vb_cols,
                                           HEAD_DIM, True, SPLIT_V, DTYPE)
    inv_l = 1.0 / l_i
    o_rows = (start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(Out + o_rows[:, None] + va_cols[None, :], (acc_a * inv_l[:, None]).to(DTYPE),
             mask=row_ok[:, None] & (va_cols < HEAD_DIM)[None, :])
    if SPLIT_V:
        tl.store(Out + o_rows[:, None] + vb_cols[None, :], (acc_b * inv_l[:, None]).to(DTYPE),
                 mask=row_ok[:, None] & (vb_cols < HEAD_DIM)[None, :])


@triton.jit
def _tma_block(q_a, q_b, m_i, l_i, acc_a, acc_b, ka_desc, kb_desc, va_desc, vb_desc, row, col0, valid, qk_scale,
               D_A: tl.constexpr, D_VA: tl.constexpr, MASKED: tl.constexpr, SPLIT_V: tl.constexpr,
               DTYPE: tl.constexpr):
    k_a = ka_desc.load([row, col0])
    k_b = kb_desc.load([row, col0 + D_A])
    s = tl.dot(q_a, tl.trans(k_a))
    s = tl.dot(q_b, tl.trans(k_b), s)
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(DTYPE)
    v_a = va_desc.load([row, col0])
    if MASKED:  # rows of the next sequence, padding, or zeros past the tensor's end
        v_a = tl.where(valid[:, None], v_a, 0.0).to(DTYPE)
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
    if SPLIT_V:
        v_b = vb_desc.load([row, col0 + D_VA])
        if MASKED:
            v_b = tl.where(valid[:, None], v_b, 0.0).to(DTYPE)
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
    return m_new, l_i, acc_a, acc_b


@triton.jit(do_not_specialize=["num_seqs"])
def v2_tma_kernel(Q, ka_desc, kb_desc, va_desc, vb_desc, Out, CU, num_seqs, qk_scale, stride_qt, stride_qh,
                  stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  D_A: tl.constexpr, D_B: tl.constexpr, D_VA: tl.constexpr, D_VB: tl.constexpr,
                  SPLIT_V: tl.constexpr, DTYPE: tl.constexpr):
    """k and v through TMA descriptors over the [tokens, heads * head_dim] view (boxes [BLOCK_N, 64] and
    [BLOCK_N, 16] for k, [BLOCK_N, 128] or 64 + 16 for v, at column head * 72: the extra columns belong to the next
    head, or are zero past the row's end; q's padded lanes are zero and the output keeps 72 lanes). Full key
    blocks run unmasked; the last, partial one masks s and v."""
    block_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq)
    seqlen = tl.load(CU + seq + 1) - start
    if block_m * BLOCK_M >= seqlen:
        return
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    a_cols = tl.arange(0, D_A)
    b_cols = D_A + tl.arange(0, D_B)
    va_cols = tl.arange(0, D_VA)
    vb_cols = D_VA + tl.arange(0, D_VB)
    row_ok = offs_m < seqlen
    q_rows = (start + offs_m).to(tl.int64) * stride_qt + head * stride_qh
    q_a = tl.load(Q + q_rows[:, None] + a_cols[None, :], mask=row_ok[:, None], other=0.0)
    q_b = tl.load(Q + q_rows[:, None] + b_cols[None, :], mask=row_ok[:, None] & (b_cols < HEAD_DIM)[None, :],
                  other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_VA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, D_VB], tl.float32)
    col0 = head * HEAD_DIM
    full_end = seqlen // BLOCK_N * BLOCK_N
    for kv_start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc_a, acc_b = _tma_block(q_a, q_b, m_i, l_i, acc_a, acc_b, ka_desc, kb_desc, va_desc, vb_desc,
                                            start + kv_start, col0, offs_n, qk_scale, D_A, D_VA, False, SPLIT_V,
                                            DTYPE)
    if full_end < seqlen:
        valid = (full_end + offs_n) < seqlen
        m_i, l_i, acc_a, acc_b = _tma_block(q_a, q_b, m_i, l_i, acc_a, acc_b, ka_desc, kb_desc, va_desc, vb_desc,
                                            start + full_end, col0, valid, qk_scale, D_A, D_VA, True, SPLIT_V, DTYPE)
    inv_l = 1.0 / l_i
    o_rows = (start + offs_m).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(Out + o_rows[:, None] + va_cols[None, :], (acc_a * inv_l[:, None]).to(DTYPE),
             mask=row_ok[:, None] & (va_cols < HEAD_DIM)[None, :])
    if SPLIT_V:
        tl.store(Out + o_rows[:, None] + vb_cols[None, :], (acc_b * inv_l[:, None]).to(DTYPE),
                 mask=row_ok[:, None] & (vb_cols < HEAD_DIM)[None, :])


def v2(q, k, v, cu, max_seqlen, cfg):
    block_m, block_n, warps, stages, split_v = cfg
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_seqlen, block_m), H, cu.shape[0] - 1)
    v2_kernel[grid](q, k, v, out, cu, cu.shape[0] - 1, D**-0.5 * LOG2_E, q.stride(0), q.stride(1), k.stride(0),
                    k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), HEAD_DIM=D, BLOCK_M=block_m,
                    BLOCK_N=block_n, D_A=64, D_B=16, D_VA=64 if split_v else 128, D_VB=16, SPLIT_V=split_v,
                    DTYPE=DTYPES[q.dtype], num_warps=warps, num_stages=stages)
    return out


def v2_tma(qkv, cu, max_seqlen, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, warps, stages, split_v = cfg
    q = qkv[:, 0]
    flat_k = qkv[:, 1].flatten(1)
    flat_v = qkv[:, 2].flatten(1)
    assert flat_k.data_ptr() == qkv[:, 1].data_ptr() and flat_k.stride(0) == qkv.stride(0), "flatten copied"

    def desc(t, width):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [block_n, width])

    d_va = 64 if split_v else 128
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_seqlen, block_m), H, cu.shape[0] - 1)
    v2_tma_kernel[grid](q, desc(flat_k, 64), desc(flat_k, 16), desc(flat_v, d_va), desc(flat_v, 16), out, cu,
                        cu.shape[0] - 1, D**-0.5 * LOG2_E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, D_A=64, D_B=16, D_VA=d_va, D_VB=16,
                        SPLIT_V=split_v, DTYPE=DTYPES[q.dtype], num_warps=warps, num_stages=stages)
    return out


def flash(q, k, v, cu, max_seqlen):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False,
                                                   scale=D**-0.5)[0]


def cudnn_dense_extra_dim(q, k, v, cu, rows):
    """One sequence padded to ``rows``: keys past ``cu[1]`` pushed to -inf through a 73rd lane (q 1, k -30000),
    zero lanes up to 80; cuDNN's dense kernel, no bias tensor."""
    pad_q = q.new_zeros(rows, H, 8)
    pad_q[..., 0] = 1
    pad_k = q.new_zeros(rows, H, 8)
    far = (torch.arange(rows, device=q.device) >= cu[1]).to(q.dtype) * -30000.0
    pad_k[..., 0] = far[:, None]
    q80, k80, v80 = torch.cat([q, pad_q], -1), torch.cat([k, pad_k], -1), torch.cat([v, torch.zeros_like(pad_q)], -1)
    dense = [t.transpose(0, 1).unsqueeze(0) for t in (q80, k80, v80)]
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(*dense, None, False, 0.0, False, False,
                                                             scale=D**-0.5)[0]
    return out[0].transpose(0, 1)[..., :D]


def err_of(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def row(label, seqs, rows, slots, cfgs_v2, cfgs_tma, extras):
    torch.manual_seed(0)
    qkv = torch.randn(rows, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    bounds = [0]
    for n in seqs:
        bounds.append(bounds[-1] + n)
    bounds += [bounds[-1]] * (slots + 1 - len(bounds))
    cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    real = bounds[-1]
    max_seqlen = rows
    gflop = sum(4 * n * n * H * D for n in seqs) / 1e9
    want = flash(q, k, v, cu, max_seqlen)[:real].float()
    ms = graphed_ms(lambda: flash(q, k, v, cu, max_seqlen))
    print(f"{label} ({gflop:.1f} GFLOP): flash {ms:.4f} ms {gflop / ms:.0f} TFLOP/s", flush=True)

    def report(name, fn):
        try:
            err = err_of(fn()[:real], want)
            t = graphed_ms(fn)
            print(f"  {name}: {t:.4f} ms {gflop / t:.0f} TFLOP/s err {err:.1e}", flush=True)
        except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
            print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:200]}", flush=True)

    from hwgraph.attention.triton_kernel import launch_varlen_attention
    report("triton (shipped: TMA on Hopper)", lambda: launch_varlen_attention(q, k, v, cu, max_seqlen, D**-0.5))
    report("triton pointer kernel", lambda: launch_varlen_attention(q, k, v, cu, max_seqlen, D**-0.5, use_tma=False))
    for cfg in cfgs_tma:
        report(f"v2-tma {cfg}", lambda c=cfg: v2_tma(qkv, cu, max_seqlen, c))
    if "cudnn" in extras and len(seqs) == 1:
        report("cudnn-dense (extra dim)", lambda: cudnn_dense_extra_dim(q, k, v, cu, rows))
        exact = [t[: seqs[0]].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        report("cudnn-dense exact length hd72", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            *exact, None, False, 0.0, False, False, scale=D**-0.5)[0][0].transpose(0, 1))
    if "flex" in extras and len(seqs) == 1 and seqs[0] == rows:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        dense = [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
        report("flex (compiled, exact)", lambda: flex(*dense, scale=D**-0.5)[0].transpose(0, 1))
    for cfg in cfgs_v2:
        report(f"v2 {cfg}", lambda c=cfg: v2(q, k, v, cu, max_seqlen, c))


def main():
    quick = "--quick" in sys.argv
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    # Three modes, each run in a process of its own: the default (the pointer-based v2 tiles, cuDNN, flex), --tma
    # (the TMA variant's tiles) and --split-v (TMA with p.v split 64 + 16; the pointer-based split compiled to an
    # illegal memory access with Triton 3.6 on the H200, which poisons the CUDA context for what follows).
    cfgs_v2 = [(128, 64, 8, 2, False), (128, 64, 8, 3, False), (128, 128, 8, 2, False), (128, 128, 8, 3, False),
               (128, 64, 4, 3, False), (64, 64, 4, 3, False)]
    cfgs_tma, extras = [], ("cudnn",)
    if "--tma" in sys.argv:
        cfgs_v2, extras = [], ()
        cfgs_tma = [(128, 128, 8, 3, False), (128, 128, 8, 4, False), (128, 64, 8, 3, False),
                    (128, 64, 8, 4, False), (128, 64, 8, 5, False), (128, 128, 8, 2, False)]
    if "--split-v" in sys.argv:
        cfgs_v2, extras = [], ()
        cfgs_tma = [(128, 128, 8, 3, True), (128, 64, 8, 4, True)]
    cases = [("1x4096 in 4096", [4096], 4096, 1), ("1x3600 in 4096", [3600], 4096, 1),
             ("4x784 in 4096", [784] * 4, 4096, 4), ("1x1024 in 1024", [1024], 1024, 1),
             ("1x196 in 256", [196], 256, 1)]
    if quick:
        cases = cases[:1]
    for i, (label, seqs, rows, slots) in enumerate(cases):
        row(label, seqs, rows, slots, cfgs_v2, cfgs_tma, extras + ("flex",) if i == 0 and extras else extras)


if __name__ == "__main__":
    main()
