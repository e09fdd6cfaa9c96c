"""What FP8 matrix products would do to the tower on Hopper: a measurement for issue 5's owner, not in the product.

Issue 5's 1024-token target (10 ms) is about 4% below what bf16 replay reaches, and the closing notes of sessions 25-28
name lower-precision products as one change of a different kind that could reach it. This script measures it, with
the tower's numerics changed only here:

Usage: python benchmarks/fp8_products.py [--products] [--replay] [TOKENS ...] [--rounds N]  (default: both, 1024 256)

- ``--products``: per product shape of the tower (its weights, random activations) at the patch rows of a 256- and
  a 1024-token image (1024, 4096; the mergers at a quarter of those), µs per call (20 calls in one CUDA graph):
  ATen's bf16 call (fc1 with cuBLASLt's GELU epilogue, as the tower runs it), ``torch._scaled_mm`` on float8 e4m3
  with a scale per row of x and per output channel of the weight (rowwise; with and without ``use_fast_accum``),
  the same with one scale per tensor, and the Triton kernel that quantises x per row. Then each product's relative
  L2 error against the float64 product, bf16 and rowwise FP8.
- ``--replay``: for each TOKENS, graphs of one TOKENS-token image (TRITON_ATTN, one slot,
  ``replay_gaps.one_image_graph``) with ATen's bf16 products, with the measured cuBLASLt products
  (``measure_products=True``, the best bf16 replay), and with FP8 rowwise products (``Fp8Products`` as the active
  product chooser while capturing; with fast accumulation, and without). Replays timed side by side
  (``measure_interleaved``), ``--rounds`` times; each graph's merged embeddings against the transformers reference
  (same weights and pixels) in relative L2; and the FP8 graph's kernels that quantise and apply GELU, which a real
  FP8 tower would fuse into its LayerNorm and fc1 kernels.

The weights are the preset's random initialisation: a checkpoint's outliers could make per-row FP8 less accurate.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


@triton.jit
def quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    """One program per row of ``X`` ``[M, K]``: its absolute maximum sets the row's scale ``S[row]`` = amax / FP8_MAX,
    and ``Q[row]`` = x / scale in float8 (rounded to nearest, saturated)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < K
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=inside)
    tl.store(S + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` ``[M, K]`` as float8 e4m3 ``[M, K]`` and its float32 scales ``[M, 1]``, x ≈ q * scale."""
    rows, k = x.shape
    q = torch.empty(rows, k, device=x.device, dtype=FP8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK=block, FP8_MAX=FP8_MAX,
                                  num_warps=8 if block >= 4096 else 4)
    return q, scale


def reference_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in torch ops (several kernels): what the Triton kernel is checked against."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


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


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


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
    from hwgraph.products import aten_linear_gelu_tanh
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
                "bf16 ATen": (lambda x=x, w=w, b=b: aten_linear_gelu_tanh(x, w, b)) if gelu else
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
            err = ", ".join(f"{k} {relative_l2(v, want):.2e}" for k, v in errors.items())
            print(f"{name} [{m} x {w.shape[1]}] -> {w.shape[0]}: " + "; ".join(cells) + f"; error {err}",
                  flush=True)


def replay(tower, token_counts: list[int], rounds: int) -> None:
    from replay_gaps import census, one_image_graph  # benchmarks/, the script's directory

    from hwgraph import products as product_routing
    from hwgraph.bench import kernel_view
    from hwgraph.budgets import filling_grid
    from hwgraph.manager import relative_error
    from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference
    from hwgraph.timing import measure_interleaved

    dev = torch.device("cuda")
    reference = reference_encoder(tower, attn_implementation="sdpa")
    for tokens in token_counts:
        pixels = torch.randn(tokens * 4, 1536, device=dev, dtype=torch.bfloat16)
        graphs = {"bf16 ATen": one_image_graph(tower, tokens, pixels),
                  "bf16 measured": one_image_graph(tower, tokens, pixels, measure_products=True)}
        choosers = []  # they hold the quantised weights that the FP8 graphs read: alive as long as the graphs
        for fast in (True, False):
            chooser = Fp8Products(fast_accum=fast)
            choosers.append(chooser)
            with product_routing.chosen_by(chooser):
                graphs["fp8 rowwise" + (" fast" if fast else "")] = one_image_graph(tower, tokens, pixels)
            print(f"1x{tokens}: {chooser.describe()}", flush=True)
        grid = [filling_grid(tokens, 2)]
        want = run_reference(reference, pixels, grid).embeds.float()
        with torch.inference_mode():
            flash = kernel_view(tower, "FLASH_ATTN").forward(pixels, grid).embeds
        budget = graphs["bf16 ATen"][1]
        for r in range(rounds):
            lat = measure_interleaved({name: g[2].replay for name, g in graphs.items()}, dev, seed=r)
            base = lat["bf16 measured"].median
            cells = " | ".join(f"{name} {x.median:.3f} / {x.p95:.3f} ({x.median / base:.3f}x)"
                               for name, x in lat.items())
            print(f"1x{tokens} (budget {budget}) round {r}, median / p95 ms (against bf16 measured): {cells}",
                  flush=True)
        errors = {name: relative_error(g[3].float(), want) for name, g in graphs.items()}
        errors["FLASH_ATTN eager (bf16)"] = relative_error(flash.float(), want)
        print(f"1x{tokens}: relative L2 against transformers: "
              + ", ".join(f"{name} {err:.2e}" for name, err in errors.items()), flush=True)
        kernels = census(graphs["fp8 rowwise fast"][2])
        total = sum(ms for _, ms in kernels.values())
        for label, pick in (("quantize", lambda k: "quantize_rows" in k),
                            ("GELU (elementwise)", lambda k: "gelu" in k.lower() and "gemm" not in k.lower()),
                            ("FP8 products", lambda k: "e4m3" in k.lower() or "f8" in k.lower() or "fp8" in k.lower())):
            hits = [(n, ms) for k, (n, ms) in kernels.items() if pick(k)]
            print(f"1x{tokens} fp8 rowwise fast, profiled replay: {label} {sum(ms for _, ms in hits):.3f} ms in "
                  f"{sum(n for n, _ in hits)} launches, of {total:.3f} ms of kernels", flush=True)
        for name, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"  {ms:7.3f} ms {n:4d}x  {name[:120]}", flush=True)
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
    if parts - {"--products", "--replay"}:
        raise SystemExit("usage: fp8_products.py [--products] [--replay] [TOKENS ...] [--rounds N]")
    parts = parts or {"--products", "--replay"}
    dev = torch.device("cuda")
    warm_device(dev)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    tower = preset_tower(dev)
    if "--products" in parts:
        products(tower, [4 * t for t in tokens])
    if "--replay" in parts:
        replay(tower, tokens, rounds)


if __name__ == "__main__":
    main()
