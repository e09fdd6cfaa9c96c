"""What FP8 matrix products would do to the tower on Hopper: a measurement for issue 5's owner, not in the product.

Issue 5's 1024-token target (10 ms) is about 4% below what bf16 replay reaches, and the closing notes of sessions 25-28
name lower-precision products as one change of a different kind that could reach it. This script measures it, with
the tower's numerics changed only here:

Usage: python benchmarks/fp8_products.py [--products] [--kernels] [--replay] [TOKENS ...] [--rounds N]
(default: products and replay, 1024 256)

- ``--products``: per product shape of the tower (its weights, random activations) at the patch rows of a 256- and
  a 1024-token image (1024, 4096; the mergers at a quarter of those), µs per call (20 calls in one CUDA graph):
  ATen's bf16 call (fc1 with cuBLASLt's GELU epilogue, as the tower runs it), ``torch._scaled_mm`` on float8 e4m3
  with a scale per row of x and per output channel of the weight (rowwise; with and without ``use_fast_accum``),
  the same with one scale per tensor, and the Triton kernel that quantises x per row. Then each product's relative
  L2 error against the float64 product, bf16 and rowwise FP8.
- ``--kernels``: the elementwise kernels around the FP8 products at 4096 rows, by warps per program (``kernels``).
- ``--replay``: for each TOKENS, graphs of one TOKENS-token image (TRITON_ATTN, one slot,
  ``replay_gaps.one_image_graph``) with ATen's bf16 products, with the measured cuBLASLt products
  (``measure_products=True``, the best bf16 replay), with FP8 rowwise products (``Fp8Products`` as the active
  product chooser while capturing, fast accumulation: each product quantises its input in a kernel of its own, fc1's
  GELU is a kernel of its own), and ``fp8 fused``: the same products with the quantisations fused into the
  LayerNorm and GELU kernels (``fused_block_forward``). Then ``fp8 fused`` on parts of the block only
  (``FP8_SUBSETS``: qkv; fc1 and fc2; all three), with the other products and the mergers' as in ``bf16 measured``:
  what each part of the FP8 gain costs in accuracy. Replays timed side by side (``measure_interleaved``),
  ``--rounds`` times; each graph's merged embeddings against the transformers reference (same weights and pixels)
  in relative L2; and the kernels of one profiled replay of each FP8 graph. First ``check_kernels`` compares the
  fused quantisations with the unfused path.

The weights are the preset's random initialisation: a checkpoint's outliers could make per-row FP8 less accurate.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hwgraph import products as routed
from hwgraph.budget_capture import relative_error
from hwgraph.models.qwen3_omni.fused import add_layer_norm, rotary_qk

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


def row_parts(k: int) -> tuple[int, int]:
    """``(MAIN, TAIL)``: a row of ``k`` lanes as a power-of-two part and a power-of-two tail holding the rest (0 if
    none): 1152 = 1024 + 128, 4304 = 4096 + 256 (48 lanes masked) instead of one block of 2048 or 8192 lanes, which
    left the GELU kernel computing on 47% masked lanes."""
    main = 1 << (k.bit_length() - 1)
    return main, (triton.next_power_of_2(k - main) if k > main else 0)


@triton.jit
def store_quantized(Q, row_q, x0, x1, c1, m1, amax, TAIL: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store a row's two parts ``x0``, ``x1`` (float32) times ``FP8_MAX / amax`` in float8 (rounded to nearest,
    saturated) at ``row_q``; one reciprocal per row and a multiply per element, not a division per element."""
    amax = tl.maximum(amax, 1e-12)
    inv = FP8_MAX / amax
    c0 = tl.arange(0, x0.shape[0])
    tl.store(Q + row_q + c0, tl.clamp(x0 * inv, -FP8_MAX, FP8_MAX).to(Q.dtype.element_ty))
    if TAIL > 0:
        tl.store(Q + row_q + c1, tl.clamp(x1 * inv, -FP8_MAX, FP8_MAX).to(Q.dtype.element_ty), mask=m1)
    return amax / FP8_MAX


@triton.jit
def quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, MAIN: tl.constexpr, TAIL: tl.constexpr,
                         FP8_MAX: tl.constexpr):
    """One program per row of ``X`` ``[M, K]`` (``row_parts(K)``): its absolute maximum sets the row's scale
    ``S[row]`` = amax / FP8_MAX, and ``Q[row]`` = x * (FP8_MAX / amax) in float8."""
    row = tl.program_id(0).to(tl.int64)
    x0 = tl.load(X + row * stride_x + tl.arange(0, MAIN)).to(tl.float32)
    amax = tl.max(tl.abs(x0), 0)
    c1 = MAIN + tl.arange(0, TAIL if TAIL > 0 else 1)
    m1 = c1 < K
    x1 = tl.load(X + row * stride_x + c1, mask=m1, other=0.0).to(tl.float32)
    if TAIL > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(x1), 0))
    tl.store(S + row, store_quantized(Q, row * stride_q, x0, x1, c1, m1, amax, TAIL, FP8_MAX))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` ``[M, K]`` as float8 e4m3 ``[M, K]`` and its float32 scales ``[M, 1]``, x ≈ q * scale."""
    rows, k = x.shape
    q = torch.empty(rows, k, device=x.device, dtype=FP8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    main, tail = row_parts(k)
    quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), MAIN=main, TAIL=tail, FP8_MAX=FP8_MAX,
                                  num_warps=8 if main >= 4096 else 4)
    return q, scale


def reference_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in torch ops (several kernels): what the Triton kernel is checked against."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    return (x.float() * (FP8_MAX / amax)).clamp(-FP8_MAX, FP8_MAX).to(FP8), amax / FP8_MAX


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``weight`` ``[N, K]`` as float8 ``[N, K]`` with one float32 scale per output channel, as
    ``[1, N]`` (``_scaled_mm``'s ``scale_b``)."""
    q, scale = reference_quantize_rows(weight)
    return q, scale.reshape(1, -1).contiguous()


class Fp8Products:
    """A product chooser (``hwgraph.products.ProductChooser``) running every bf16 product whose dimensions are
    multiples of 16 as a rowwise-scaled FP8 ``torch._scaled_mm``: x quantised per row by ``quantize_rows`` at each
    call, the weight per output channel once (at its first call, which must come before any capture: a capture's
    warm-up), bias added by the product, output bf16. fc1's tanh-GELU runs as a separate kernel. Other inputs go to
    ATen's calls."""

    def __init__(self, fast_accum: bool):
        self.fast_accum = fast_accum
        self.seconds = 0.0
        self.weights: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.taken = 0
        self.passed = 0

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
                and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0)

    def weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride())
        if key not in self.weights:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"weight {tuple(weight.shape)} first met while capturing: its quantisation "
                                   "would be captured into the graph")
            self.weights[key] = quantize_weight(weight)
        return self.weights[key]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.takes(x, weight):
            self.passed += 1
            return F.linear(x, weight, bias)
        self.taken += 1
        wq, ws = self.weight(weight)
        xq, xs = quantize_rows(x.contiguous())
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=torch.bfloat16,
                                use_fast_accum=self.fast_accum)

    def linear_gelu_tanh(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.gelu(self.linear(x, weight, bias), approximate="tanh")

    def describe(self) -> str:
        accum = "fast accumulation" if self.fast_accum else "exact accumulation"
        return (f"FP8 e4m3 rowwise, {accum}: {self.taken} calls taken, {self.passed} passed to ATen, "
                f"{len(self.weights)} weights quantised")


@triton.jit
def add_layer_norm_fp8_kernel(x, delta, weight, bias, total, Q, S, stride_x, stride_d, eps, N: tl.constexpr,
                              MAIN: tl.constexpr, TAIL: tl.constexpr, FP8_MAX: tl.constexpr):
    """The tower's add + LayerNorm kernel (``fused_kernels.add_layer_norm_kernel``, the same float32 arithmetic) on a
    row in two parts (``row_parts(N)``), handing the normalised row to the next product in float8
    (``quantize_rows_kernel``'s recipe, on the row rounded to the activation dtype) instead of writing it in bf16:
    ``total[r] = x + delta``, ``Q[r]``, ``S[r]``."""
    r = tl.program_id(0).to(tl.int64)
    c0 = tl.arange(0, MAIN)
    c1 = MAIN + tl.arange(0, TAIL if TAIL > 0 else 1)
    m1 = c1 < N
    t0 = (tl.load(x + r * stride_x + c0).to(tl.float32)
          + tl.load(delta + r * stride_d + c0).to(tl.float32)).to(total.dtype.element_ty)
    t1 = (tl.load(x + r * stride_x + c1, mask=m1, other=0.0).to(tl.float32)
          + tl.load(delta + r * stride_d + c1, mask=m1, other=0.0).to(tl.float32)).to(total.dtype.element_ty)
    tl.store(total + r * N + c0, t0)
    tl.store(total + r * N + c1, t1, mask=m1)
    v0, v1 = t0.to(tl.float32), t1.to(tl.float32)
    mean = (tl.sum(v0, 0) + tl.sum(v1, 0)) / N
    d0, d1 = v0 - mean, tl.where(m1, v1 - mean, 0.0)
    rstd = 1.0 / tl.sqrt((tl.sum(d0 * d0, 0) + tl.sum(d1 * d1, 0)) / N + eps)
    n0 = (d0 * rstd * tl.load(weight + c0).to(tl.float32) + tl.load(bias + c0).to(tl.float32))
    n1 = (d1 * rstd * tl.load(weight + c1, mask=m1, other=0.0).to(tl.float32)
          + tl.load(bias + c1, mask=m1, other=0.0).to(tl.float32))
    n0 = n0.to(total.dtype.element_ty).to(tl.float32)
    n1 = tl.where(m1, n1.to(total.dtype.element_ty).to(tl.float32), 0.0)
    amax = tl.max(tl.abs(n0), 0)
    if TAIL > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(n1), 0))
    tl.store(S + r, store_quantized(Q, r * N, n0, n1, c1, m1, amax, TAIL, FP8_MAX))


@triton.jit
def gelu_tanh_rounded(h, dtype: tl.constexpr):
    """The tanh GELU of float32 ``h`` (the hardware's approximate tanh), rounded to ``dtype`` as ``F.gelu`` would
    leave it, back in float32."""
    inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2 / pi) (h + 0.044715 h^3)
    tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32, is_pure=True,
                                     pack=1)
    return (0.5 * h * (1.0 + tanh)).to(dtype).to(tl.float32)


@triton.jit
def gelu_quantize_rows_kernel(H, Q, S, K, stride_h, MAIN: tl.constexpr, TAIL: tl.constexpr, FP8_MAX: tl.constexpr):
    """fc1's output row ``H[r]`` (``row_parts(K)``) through the tanh GELU (``gelu_tanh_rounded``), then quantised as
    ``quantize_rows_kernel`` does, for fc2: one kernel instead of GELU and the quantisation."""
    r = tl.program_id(0).to(tl.int64)
    g0 = gelu_tanh_rounded(tl.load(H + r * stride_h + tl.arange(0, MAIN)).to(tl.float32), H.dtype.element_ty)
    amax = tl.max(tl.abs(g0), 0)
    c1 = MAIN + tl.arange(0, TAIL if TAIL > 0 else 1)
    m1 = c1 < K
    g1 = gelu_tanh_rounded(tl.load(H + r * stride_h + c1, mask=m1, other=0.0).to(tl.float32), H.dtype.element_ty)
    if TAIL > 0:
        amax = tl.maximum(amax, tl.max(tl.abs(g1), 0))
    tl.store(S + r, store_quantized(Q, r * K, g0, g1, c1, m1, amax, TAIL, FP8_MAX))


def add_layer_norm_fp8(x: torch.Tensor, delta: torch.Tensor, norm: torch.nn.LayerNorm, num_warps: int = 1):
    """``(x + delta, (q, scale))``: the residual sum in bf16 and its LayerNorm quantised per row. One warp per row
    measured fastest at 4096 rows (7.9 µs against 9.3 with 2 and 10.3 with 4; ``--kernels``)."""
    rows, n = x.shape
    total = torch.empty_like(x)
    q = torch.empty(rows, n, device=x.device, dtype=FP8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    main, tail = row_parts(n)
    add_layer_norm_fp8_kernel[(rows,)](x, delta, norm.weight, norm.bias, total, q, scale, x.stride(0),
                                       delta.stride(0), norm.eps, N=n, MAIN=main, TAIL=tail, FP8_MAX=FP8_MAX,
                                       num_warps=num_warps)
    return total, (q, scale)


def gelu_quantize_rows(h: torch.Tensor, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(F.gelu(h, approximate="tanh"))`` in one kernel (4 warps: 18.3 µs at 4096 x 4304 against 19.2
    with 8 and 25.3 with 16; ``--kernels``)."""
    rows, k = h.shape
    q = torch.empty(rows, k, device=h.device, dtype=FP8)
    scale = torch.empty(rows, 1, device=h.device, dtype=torch.float32)
    main, tail = row_parts(k)
    gelu_quantize_rows_kernel[(rows,)](h, q, scale, k, h.stride(0), MAIN=main, TAIL=tail, FP8_MAX=FP8_MAX,
                                       num_warps=num_warps)
    return q, scale


#: The block's products, in the order they run.
BLOCK_PRODUCTS = ("qkv", "proj", "fc1", "fc2")
#: The subsets of ``BLOCK_PRODUCTS`` that ``--replay`` runs in FP8 besides all four, with the other products in
#: bf16 through the measured cuBLASLt products: the products whose input a LayerNorm quantises for free (qkv), the
#: MLP (fc1 loses cuBLASLt's GELU epilogue in FP8, so it goes with fc2, whose quantisation takes the GELU's kernel),
#: and both. proj is left out of each: its input needs a quantisation kernel of its own, which at 4096 rows costs
#: more (4.8 µs) than FP8 saves on the product (18.2 against 15.4 µs; ``--products``).
FP8_SUBSETS = (("qkv",), ("fc1", "fc2"), ("qkv", "fc1", "fc2"))


def fused_block_forward(chooser: Fp8Products, fp8: tuple[str, ...] = BLOCK_PRODUCTS):
    """``VisionBlock.forward_fused`` with the products named in ``fp8`` in FP8 and the quantisations fused where the
    tower has a kernel to put them in: a LayerNorm before an FP8 product hands its rows over in float8
    (``add_layer_norm_fp8``; ``normed`` then passes between blocks as ``(q, scale)``), fc1's GELU and fc2's
    quantisation are one kernel (``gelu_quantize_rows``), and proj's input (the attention output) is quantised by a
    kernel of its own. FP8 weights come from ``chooser``; the other products run through ``hwgraph.products`` (the
    active chooser's)."""
    if unknown := set(fp8) - set(BLOCK_PRODUCTS):
        raise ValueError(f"fp8 names {sorted(unknown)}, expected some of {BLOCK_PRODUCTS}")
    if ("fc1" in fp8) != ("fc2" in fp8):
        raise ValueError(f"fp8 {fp8} has one of fc1 and fc2: they run in FP8 together (the GELU quantises fc2's input)")
    qkv_fp8, proj_fp8, mlp_fp8 = "qkv" in fp8, "proj" in fp8, "fc1" in fp8

    def product(pair, linear: torch.nn.Linear) -> torch.Tensor:
        wq, ws = chooser.weight(linear.weight)
        return torch._scaled_mm(pair[0], wq.t(), scale_a=pair[1], scale_b=ws, bias=linear.bias,
                                out_dtype=torch.bfloat16, use_fast_accum=chooser.fast_accum)

    def add_norm(x, delta, norm, quantized: bool):
        return add_layer_norm_fp8(x, delta, norm) if quantized else add_layer_norm(x, delta, norm)

    def forward(self, x, normed, next_norm, cos, sin, cu_seqlens, max_seqlen, attend):
        attn, mlp = self.attn, self.mlp
        tokens = x.shape[0]
        if not qkv_fp8:
            qkv = routed.linear(normed, attn.qkv.weight, attn.qkv.bias)
        else:
            if isinstance(normed, torch.Tensor):  # the first block's, from the tower's own LayerNorm
                normed = quantize_rows(normed)
            qkv = product(normed, attn.qkv)
        qkv = qkv.view(tokens, 3, attn.num_heads, attn.head_dim)
        q, k = rotary_qk(qkv, cos, sin)
        out = attend(q, k, qkv[:, 2], cu_seqlens, max_seqlen, attn.scale).reshape(tokens, -1)
        delta = product(quantize_rows(out), attn.proj) if proj_fp8 else routed.linear(out, attn.proj.weight,
                                                                                       attn.proj.bias)
        x, normed = add_norm(x, delta, self.norm2, mlp_fp8)
        if mlp_fp8:
            delta = product(gelu_quantize_rows(product(normed, mlp.linear_fc1)), mlp.linear_fc2)
        else:
            delta = mlp.forward(normed)
        if next_norm is None:
            return x + delta, None
        return add_norm(x, delta, next_norm, qkv_fp8)

    return forward


def product_shapes(tower, rows: int) -> dict[str, tuple[int, torch.nn.Linear, bool]]:
    """name -> (rows, linear, gelu) for the tower's products in a graph of ``rows`` patch rows."""
    block = tower.blocks[0]
    merger = tower.merger
    return {
        "qkv": (rows, block.attn.qkv, False),
        "proj": (rows, block.attn.proj, False),
        "fc1+gelu": (rows, block.mlp.linear_fc1, True),
        "fc2": (rows, block.mlp.linear_fc2, False),
        "merger fc1": (rows // 4, merger.mlp[0], False),
        "merger fc2": (rows // 4, merger.mlp[2], False),
    }


def products(tower, rows_list: list[int]) -> None:
    from hwgraph.timing import graphed_ms

    torch.manual_seed(0)
    for rows in rows_list:
        for name, (m, lin, gelu) in product_shapes(tower, rows).items():
            w, b = lin.weight, lin.bias
            x = torch.randn(m, w.shape[1], device=w.device, dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            rq, rs = reference_quantize_rows(x)
            mismatch = (xq.float() != rq.float()).float().mean().item()
            if mismatch > 1e-3 or not torch.allclose(xs, rs, rtol=1e-6):
                raise SystemExit(f"quantize_rows differs from torch's: {mismatch:.2e} of the codes, scales "
                                 f"{(xs - rs).abs().max().item():.2e}")
            wq, ws = quantize_weight(w)
            x_amax = x.float().abs().amax() / FP8_MAX
            w_amax = w.float().abs().amax() / FP8_MAX
            xtq = (x.float() / x_amax).to(FP8)
            wtq = (w.float() / w_amax).to(FP8)

            def rowwise(fast, xq=xq, xs=xs, wq=wq, ws=ws, b=b):
                return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, bias=b, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

            cases = {
                "bf16 ATen": (lambda x=x, w=w, b=b: routed.aten_linear_gelu_tanh(x, w, b)) if gelu else
                             (lambda x=x, w=w, b=b: F.linear(x, w, b)),
                "fp8 rowwise": lambda: rowwise(False),
                "fp8 rowwise fast": lambda: rowwise(True),
                "fp8 tensorwise fast": lambda xtq=xtq, wtq=wtq, b=b, xa=x_amax, wa=w_amax: torch._scaled_mm(
                    xtq, wtq.t(), scale_a=xa, scale_b=wa, bias=b, out_dtype=torch.bfloat16, use_fast_accum=True),
                "quantize x": lambda x=x: quantize_rows(x),
            }
            flop = 2 * m * w.shape[0] * w.shape[1]
            cells = []
            for case, fn in cases.items():
                try:
                    us = graphed_ms(fn) * 1e3
                except RuntimeError as exc:  # a scaling this torch build does not run: say so, go on
                    cells.append(f"{case} failed ({str(exc).splitlines()[0][:80]})")
                    continue
                rate = "" if case == "quantize x" else f" ({flop / us / 1e6:.0f} TFLOP/s)"
                cells.append(f"{case} {us:.1f} us{rate}")
            want = F.linear(x.double(), w.double(), b.double())
            errors = {"bf16": F.linear(x, w, b), "fp8 rowwise": rowwise(False), "fp8 rowwise fast": rowwise(True)}
            err = ", ".join(f"{k} {relative_error(v, want):.2e}" for k, v in errors.items())
            print(f"{name} [{m} x {w.shape[1]}] -> {w.shape[0]}: " + "; ".join(cells) + f"; error {err}",
                  flush=True)


def kernels(tower) -> None:
    """µs per call (20 calls in one CUDA graph) at 4096 rows of the elementwise kernels around the FP8 products, with
    the bytes each moves per µs: the tower's add + LayerNorm (bf16 out) against ``add_layer_norm_fp8`` by warps per
    program, and fc1's output through ``gelu_quantize_rows`` by warps against ``F.gelu`` then ``quantize_rows``."""
    from hwgraph.timing import graphed_ms

    block = tower.blocks[0]
    dev = block.norm2.weight.device
    x, delta = (torch.randn(4096, 1152, device=dev, dtype=torch.bfloat16) for _ in range(2))
    h = torch.randn(4096, 4304, device=dev, dtype=torch.bfloat16)
    plane, wide = x.numel(), h.numel()
    cases = {"add + LayerNorm, bf16 out (the tower's)": (lambda: add_layer_norm(x, delta, block.norm2), 8 * plane)}
    for warps in (1, 2, 4):
        cases[f"add + LayerNorm + quantize, {warps} warps"] = (
            lambda warps=warps: add_layer_norm_fp8(x, delta, block.norm2, warps), 7 * plane)
    for warps in (2, 4, 8):
        cases[f"GELU + quantize, {warps} warps"] = (lambda warps=warps: gelu_quantize_rows(h, warps), 3 * wide)
    cases["F.gelu, then quantize_rows"] = (lambda: quantize_rows(F.gelu(h, approximate="tanh")), 7 * wide)
    for name, (fn, nbytes) in cases.items():
        us = graphed_ms(fn) * 1e3
        print(f"{name}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)


def check_kernels(tower) -> None:
    """The fused quantisations against the unfused path on the tower's shapes (4096 rows): the share of float8
    codes that differ (a division rounded the other way) and the scales' largest difference. Stops on a mismatch."""
    torch.manual_seed(1)
    block = tower.blocks[0]
    dev = block.norm2.weight.device
    x, delta = (torch.randn(4096, 1152, device=dev, dtype=torch.bfloat16) for _ in range(2))
    h = torch.randn(4096, 4304, device=dev, dtype=torch.bfloat16)
    total, (q, scale) = add_layer_norm_fp8(x, delta, block.norm2)
    want_total, normed = add_layer_norm(x, delta, block.norm2)
    cases = {"add + LayerNorm + quantize": (q, scale, *reference_quantize_rows(normed)),
             "GELU + quantize": (*gelu_quantize_rows(h), *reference_quantize_rows(F.gelu(h, approximate="tanh")))}
    if not torch.equal(total, want_total):
        raise SystemExit("add_layer_norm_fp8's residual sum differs from the tower's add_layer_norm")
    for name, (got_q, got_s, want_q, want_s) in cases.items():
        codes = (got_q.float() != want_q.float()).float().mean().item()
        scales = ((got_s - want_s).abs() / want_s).max().item()
        print(f"{name}: {codes:.2e} of the codes differ from the unfused path, scales by {scales:.1e} at most",
              flush=True)
        if codes > 1e-2 or scales > 1e-2:
            raise SystemExit(f"{name} does not match the unfused path")


def replay(tower, token_counts: list[int], rounds: int) -> None:
    from replay_gaps import census, one_image_graph  # benchmarks/, the script's directory
    from replay_toggle import patched

    from hwgraph.bench import eager_call, kernel_view
    from hwgraph.budgets import filling_grid
    from hwgraph.models.qwen3_omni import layers
    from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference
    from hwgraph.timing import measure_interleaved

    check_kernels(tower)
    dev = torch.device("cuda")
    reference = reference_encoder(tower, attn_implementation="sdpa")
    for tokens in token_counts:
        pixels = torch.randn(tokens * 4, 1536, device=dev, dtype=torch.bfloat16)
        graphs = {"bf16 ATen": one_image_graph(tower, tokens, pixels),
                  "bf16 measured": one_image_graph(tower, tokens, pixels, measure_products=True)}
        # The choosers hold the quantised weights that the FP8 graphs read: alive as long as the graphs.
        choosers = {"fp8": Fp8Products(fast_accum=True), "fp8 fused": Fp8Products(fast_accum=True)}
        with routed.chosen_by(choosers["fp8"]):
            graphs["fp8"] = one_image_graph(tower, tokens, pixels)
        with routed.chosen_by(choosers["fp8 fused"]), \
                patched(layers.VisionBlock, "forward_fused", fused_block_forward(choosers["fp8 fused"])):
            graphs["fp8 fused"] = one_image_graph(tower, tokens, pixels)
        for name, chooser in choosers.items():
            print(f"1x{tokens} {name}: chooser {chooser.describe()}", flush=True)
        for subset in FP8_SUBSETS:  # the other products (and the mergers') measured, as in "bf16 measured"
            name = "fp8 fused " + "+".join(subset)
            choosers[name] = Fp8Products(fast_accum=True)  # its weights only: bf16 products take the measured ones
            with patched(layers.VisionBlock, "forward_fused", fused_block_forward(choosers[name], subset)):
                graphs[name] = one_image_graph(tower, tokens, pixels, measure_products=True)
            print(f"1x{tokens} {name}: {len(choosers[name].weights)} weights in FP8, "
                  f"products {graphs[name][0].stats()['products']}", flush=True)
        grid = [filling_grid(tokens, 2)]
        want = run_reference(reference, pixels, grid).embeds.float()
        with torch.inference_mode():
            flash = kernel_view(tower, "FLASH_ATTN").forward(pixels, grid).embeds
        budget = graphs["bf16 ATen"][1]
        eager = kernel_view(tower, "TRITON_ATTN")
        calls = {"transformers eager": lambda p=pixels, g=grid: run_reference(reference, p, g),
                 "hwgraph eager": lambda e=eager, p=pixels, g=grid: eager_call(e, p, g)}
        calls.update({name: g[2].replay for name, g in graphs.items()})
        for r in range(rounds):
            lat = measure_interleaved(calls, dev, seed=r)
            base = lat["bf16 measured"].median
            cells = " | ".join(f"{name} {x.median:.3f} / {x.p95:.3f} ({x.median / base:.3f}x)"
                               for name, x in lat.items())
            print(f"1x{tokens} (budget {budget}) round {r}, median / p95 ms (against bf16 measured): {cells}",
                  flush=True)
        errors = {name: relative_error(g[3].float(), want) for name, g in graphs.items()}
        errors["FLASH_ATTN eager (bf16)"] = relative_error(flash.float(), want)
        between = relative_error(graphs["fp8 fused"][3].float(), graphs["fp8"][3].float())
        print(f"1x{tokens}: relative L2 against transformers: "
              + ", ".join(f"{name} {err:.2e}" for name, err in errors.items())
              + f"; fp8 fused against fp8 {between:.2e}", flush=True)
        for name in (n for n in graphs if n.startswith("fp8")):
            kernels = census(graphs[name][2])
            total = sum(ms for _, ms in kernels.values())
            print(f"1x{tokens} {name}, one profiled replay: {total:.3f} ms of kernels in "
                  f"{sum(n for n, _ in kernels.values())} launches", flush=True)
            for kernel, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:14]:
                print(f"  {ms:7.3f} ms {n:4d}x  {kernel[:120]}", flush=True)
        del graphs, choosers


def main():
    from replay_gaps import preset_tower  # benchmarks/, the script's directory

    from hwgraph.bench import warm_device

    args = sys.argv[1:]
    rounds = 2
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    parts = {a for a in args if a.startswith("--")}
    tokens = [int(a) for a in args if not a.startswith("--")] or [1024, 256]
    if parts - {"--products", "--kernels", "--replay"}:
        raise SystemExit("usage: fp8_products.py [--products] [--kernels] [--replay] [TOKENS ...] [--rounds N]")
    parts = parts or {"--products", "--replay"}
    dev = torch.device("cuda")
    warm_device(dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    # weights without grads: the fused kernels and attention run only where autograd records nothing (records_grad)
    tower = preset_tower(dev).requires_grad_(False)
    if "--products" in parts:
        products(tower, [4 * t for t in tokens])
    if "--kernels" in parts:
        kernels(tower)
    if "--replay" in parts:
        replay(tower, tokens, rounds)


if __name__ == "__main__":
    main()
