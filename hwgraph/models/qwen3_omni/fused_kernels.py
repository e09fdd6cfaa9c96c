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


@triton.jit
def gelu_tanh(x):
    """GELU, tanh approximation, in float32: tanh(y) written as 1 - 2 / (exp(2y) + 1)."""
    y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    y = tl.minimum(tl.maximum(y, -20.0), 20.0)  # tanh is +-1 in float32 there; keeps exp finite
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


@triton.jit
def linear_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, stride_split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """``out = x @ w.T (+ bias) (then tanh-GELU)`` for ``x`` ``[M, K]``, ``w`` ``[N, K]``, accumulated in float32.

    Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``. With ``SPLIT_K > 1`` each program sums one slice of K
    and writes float32 partials to ``out`` laid out ``[SPLIT_K, M, N]`` (``stride_split`` apart);
    ``split_k_reduce_kernel`` adds them in a fixed order, so results are deterministic."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_span
    x_rows = x + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_span, K), BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(x_rows + ks[None, :], mask=(offs_m[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GELU:
            acc = gelu_tanh(acc)
        tl.store(out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=mask)
    else:
        dst = out + pid_k * stride_split + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(dst, acc, mask=mask)


@triton.jit
def split_k_reduce_kernel(partials, bias, out, M, N, stride_split, stride_om,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """``out[m, n] = sum_s partials[s, m, n] (+ bias[n]) (then tanh-GELU)``, summed in order s = 0, 1, ..."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partials + s * stride_split + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        acc = gelu_tanh(acc)
    tl.store(out + (offs // N).to(tl.int64) * stride_om + n, acc.to(out.dtype.element_ty), mask=mask)
