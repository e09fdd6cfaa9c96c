"""Triton kernels behind ``fused.py`` (imported only when a fused path runs, so hwgraph imports without Triton)."""

import triton
import triton.language as tl


@triton.jit
def rotary_qk_kernel(qkv, cos, sin, out, stride_t, stride_s, stride_h, stride_cs, plane,
                     H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, q-or-k): every head of that row, rotated in float32, written contiguous."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)  # the other half of the head
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    row = qkv + t.to(tl.int64) * stride_t + s * stride_s + offs_h[:, None] * stride_h
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos + t.to(tl.int64) * stride_cs + offs_d, mask=offs_d < D, other=0.0)
    sn = tl.load(sin + t.to(tl.int64) * stride_cs + offs_d, mask=offs_d < D, other=0.0)
    y = x * c[None, :] + xp * sn[None, :]
    dst = out + s * plane + t.to(tl.int64) * (H * D) + offs_h[:, None] * D + offs_d[None, :]
    tl.store(dst, y.to(out.dtype.element_ty), mask=mask)


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
    v = total.to(tl.float32)
    mean = tl.sum(v, axis=0) / N
    diff = tl.where(m, v - mean, 0.0)
    var = tl.sum(diff * diff, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(weight + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(bias + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out + plane + r * N + offs, (diff * rstd * w + b).to(out.dtype.element_ty), mask=m)

