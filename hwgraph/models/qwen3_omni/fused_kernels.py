"""Triton kernels behind ``fused.py`` (imported only when a fused path runs, so hwgraph imports without Triton)."""

import triton
import triton.language as tl


@triton.jit
def rotary_qk_kernel(qkv, cos, sin, out, stride_t, stride_s, stride_cs, plane,
                     H: tl.constexpr, D: tl.constexpr, STRIDE_H: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
    """One program per token: q and k of every head, rotated in float32, written contiguous. Each head is loaded as
    its two halves ``x1, x2``, so the rotation needs no gather: ``x1 * cos1 + x2 * sin1`` and ``x2 * cos2 + x1 *
    sin2`` (the sign is in ``sin``). ``STRIDE_H`` is a constexpr so that Triton knows the halves' alignment and
    loads them in vectors (8 bytes for head_dim 72)."""
    HALF: tl.constexpr = D // 2
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    lanes = offs_d < HALF
    mask = (offs_h[:, None] < H) & lanes[None, :]
    angle = t * stride_cs + offs_d
    c1 = tl.load(cos + angle, mask=lanes, other=0.0)[None, :]
    c2 = tl.load(cos + angle + HALF, mask=lanes, other=0.0)[None, :]
    s1 = tl.load(sin + angle, mask=lanes, other=0.0)[None, :]
    s2 = tl.load(sin + angle + HALF, mask=lanes, other=0.0)[None, :]
    src = qkv + t * stride_t + offs_h[:, None] * STRIDE_H + offs_d[None, :]
    dst = out + t * (H * D) + offs_h[:, None] * D + offs_d[None, :]
    for part in tl.static_range(2):  # q, then k
        x1 = tl.load(src + part * stride_s, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + part * stride_s + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + part * plane, (x1 * c1 + x2 * s1).to(out.dtype.element_ty), mask=mask)
        tl.store(dst + part * plane + HALF, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=mask)


@triton.jit
def add_layer_norm_kernel(x, delta, weight, bias, out, stride_x, stride_d, plane, eps,
                          N: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``sum = x + delta`` (rounded to the activation dtype, as the unfused add is), then
    LayerNorm of that sum in float32. ``out[0]`` holds the sums, ``out[1]`` the normalised rows."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(x + r * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    d = tl.load(delta + r * stride_d + offs, mask=m, other=0.0).to(tl.float32)
    total = (a + d).to(out.dtype.element_ty)
    tl.store(out + r * N + offs, total, mask=m)
    normed = layer_norm_row(total.to(tl.float32), m, offs, weight, bias, eps, N)
    tl.store(out + plane + r * N + offs, normed.to(out.dtype.element_ty), mask=m)


@triton.jit
def layer_norm_row(v, m, offs, weight, bias, eps, N: tl.constexpr):
    """LayerNorm of one float32 row ``v`` (``m``: its lanes below ``N``) in float32, scaled by ``weight`` and
    shifted by ``bias`` at ``offs``."""
    mean = tl.sum(v, axis=0) / N
    diff = tl.where(m, v - mean, 0.0)
    var = tl.sum(diff * diff, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(weight + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(bias + offs, mask=m, other=0.0).to(tl.float32)
    return diff * rstd * w + b


@triton.jit
def add_position_embedding_kernel(x, table, indices, weights, out, stride_x, stride_t, stride_i, stride_w,
                                  N: tl.constexpr, CORNERS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: ``pos = sum_c table[indices[c, r]] * weights[c, r]`` in float32 (corners in order, as
    the unfused sum adds them), rounded to the activation dtype, then ``out = x + pos`` rounded again."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    pos = tl.zeros([BLOCK], tl.float32)
    for c in tl.static_range(CORNERS):
        row = tl.load(indices + c * stride_i + r)
        w = tl.load(weights + c * stride_w + r)
        pos = pos + tl.load(table + row * stride_t + offs, mask=m, other=0.0).to(tl.float32) * w
    pos = pos.to(out.dtype.element_ty).to(tl.float32)
    a = tl.load(x + r * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out + r * N + offs, (a + pos).to(out.dtype.element_ty), mask=m)
