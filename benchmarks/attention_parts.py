"""Where the ping-pong attention kernel's time goes: variants that leave one part of its key loop out.

Usage: python benchmarks/attention_parts.py [--variants NAME,NAME,...] [--tile GLUONTILES] [--once]

Since session 13 the shipped kernel's bf16 loop at these rows shifts each row by its first key block's maximum
(``shifted_step``, what ``firstmax`` measured) and calls neither ``softmax_step`` after the first block nor
``rescale``: the variants that override those two were measured on the kernel before it (commit c418abe and
earlier; ``docs/benchmarks.md``). ``earlyrescale`` (the accumulators rescaled after q.k is issued, before p.v:
FlashAttention-3's order), which edited that loop's source, was measured there and is only in that commit.
One 4096-patch sequence (16 heads of 72, bf16; the 1024-token image's attention), 20 calls in one CUDA graph, ms
per call. Each variant is ``hwgraph/attention/gluon_pingpong.py``'s source with one helper overridden, loaded as its
own module. Variants other than ``shipped`` and ``poly*`` compute a wrong result on purpose: they time the kernel
without a part, and the difference to ``shipped`` bounds what making that part faster can gain.

- ``shipped``: the product kernel's source unchanged (a control for the module copy);
- ``noexp``: no exponentials (p is the scaled, shifted score itself);
- ``nomax``: no row maximum (a constant shift);
- ``nosum``: no row sum;
- ``nosoftmax``: p is the raw score: no maximum, exponentials, sum or rescale of the accumulators;
- ``nopvb``: p.v without its 16-lane second part (lanes 64-71);
- ``noload``: k and v loaded for the first ring's worth of key blocks only (no L2 traffic after);
  ``nosoftmax+noload`` both;
- ``noturn``: the consumers issue their MMAs without taking turns (no ping-pong);
- ``treemax`` / ``treemax+treesum``: the row maximum (and sum) as a tree in each thread's registers (``tree_reduce``)
  instead of one chain of dependent instructions per row; right results;
- ``poly50`` / ``poly25``: half / a quarter of the exponentials as a degree-3 polynomial on the FMA units
  (FlashAttention-4's split between the multi-function unit and the FMA units), the rest on the multi-function
  unit; these compute the right result, and their error against flash is printed.
- ``norescale``: the accumulators never rescaled (wrong result: bounds what skipping rescales can gain);
- ``lazyrescale``: a row's maximum moves only when a block's exceeds it by more than 8 (log2 units: p stays below
  256), so most blocks' correction is exactly 1, and the accumulators are rescaled only when some row of the
  warpgroup's needs it (FlashAttention-4's conditional rescaling); right result;
- ``firstmax``: each row's shift fixed at its first key block's maximum, no running maximum or rescale (right
  while later scores stay within ~100 of it in log2 units, as with random inputs);
- ``warprescale``: lazyrescale's rows, the skip decided per warp by a vote (no exchange between warps) and taken by
  a branch in PTX around each eight accumulators' multiplies; right result.

``--tile 128,128,4,4,1,168,240``: ``GluonTiles`` fields for every variant (default ``gluon_tiles``' choice for
this call, as shipped: ``PINGPONG_WIDE_TILES`` since session 16, ``PINGPONG_TILES`` before).
The row sums on the tensor cores as extra MMAs (p times a tile of ones, instead of adds) were measured with this
script and the kernel's ``SUM_BY_MMA`` constexpr at commit 00ee9ad (its ``--kw SUM_BY_MMA=1``): no faster, not kept.
Since session 14 the kernel sums p in a spare lane of v's second part instead (no extra MMA), so ``nosum`` leaves
nothing out at 72 lanes a head. ``noqload`` (q zeros, not loaded) and ``nostore`` (no output stores) were measured
at commit f309c58; since the producer loads q by TMA and full half-tiles leave by TMA (4595b58), the helpers they
replaced are no longer called, so they are only in that commit.
``--once``: run the product kernel three times and exit (for ``ncu``).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

import torch
import triton
from attention_hd72 import D, err_of, flash, manager_batch  # benchmarks/, the script's directory

from hwgraph.attention import gluon_kernel, gluon_pingpong
from hwgraph.attention.triton_kernel import launch_varlen_attention
from hwgraph.timing import graphed_ms

SOFTMAX_HEAD = '''
@gluon.jit
def softmax_step(s, m_i, l_i, kv_start, seqlen, qk_scale_log2, BLOCK_N: gl.constexpr, ROW_SUM: gl.constexpr):
    if kv_start + BLOCK_N > seqlen:
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(((kv_start + offs_n) < seqlen)[None, :], s, float("-inf"))
'''

POLY = '''
@gluon.jit
def exp2_poly(x):
    """2**x from a degree-3 polynomial of the fraction (relative error 1.0e-4) and the integer part added to the
    exponent bits: FMA and integer units only."""
    x = gl.maximum(x, -126.0)
    t = x + 12582912.0  # 1.5 * 2**23: t's low mantissa bits hold round(x)
    f = x - (t - 12582912.0)
    p = (0.05500813 * f + 0.24220925) * f + 0.69328282
    p = p * f + 1.0
    bits = p.to(gl.int32, bitcast=True) + (t.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def mixed_exp2(x, QUARTER: gl.constexpr):
    """exp2 of a [rows, cols] tile: the odd columns by exp2_poly, the rest by the multi-function unit (QUARTER:
    only the odd columns of the right half by exp2_poly). The splits keep each thread's values in its registers."""
    ROWS: gl.constexpr = x.shape[0]
    COLS: gl.constexpr = x.shape[1]
    if QUARTER:
        left, right = gl.split(gl.permute(gl.reshape(x, [ROWS, 2, COLS // 2]), [0, 2, 1]))
        right = mixed_exp2(right, False)
        y = gl.reshape(gl.permute(gl.join(gl.exp2(left), right), [0, 2, 1]), [ROWS, COLS])
    else:
        even, odd = gl.split(gl.reshape(x, [ROWS, COLS // 2, 2]))
        y = gl.reshape(gl.join(gl.exp2(even), exp2_poly(odd)), [ROWS, COLS])
    return gl.convert_layout(y, x.type.layout)
'''

NOLOAD = '''
@gluon.jit
def fill_slot(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, empty, block, row, col,
              STAGES: gl.constexpr, D_A: gl.constexpr, HAS_B: gl.constexpr):
    """Loads a program's first STAGES key blocks only; later blocks reuse what their slot holds (no L2 traffic)."""
    mbarrier.wait(empty.index(block % STAGES), ((block // STAGES) & 1) ^ 1)
    if block < STAGES:
        issue_kv(ka_desc, kb_desc, va_desc, vb_desc, ka_s, kb_s, va_s, vb_s, ready, block, row, col, D_A, HAS_B)
    else:
        mbarrier.arrive(ready.index(block % STAGES), count=1)
'''

TREE = '''
@gluon.jit
def halves(x, MAX: gl.constexpr):
    """Fold a [rows, cols] tile's right half of the columns onto its left half (max or sum) until each of a row's
    four threads holds one value: in each thread's registers, depth log2(cols) instead of a chain."""
    ROWS: gl.constexpr = x.shape[0]
    COLS: gl.constexpr = x.shape[1]
    if COLS > 4:
        a, b = gl.split(gl.permute(gl.reshape(x, [ROWS, 2, COLS // 2]), [0, 2, 1]))
        if MAX:
            y = halves(gl.maximum(a, b), MAX)
        else:
            y = halves(a + b, MAX)
    else:
        y = x
    return y


@gluon.jit
def tree_reduce(x, MAX: gl.constexpr):
    """Row max (MAX) or sum of an MMA-layout tile as a tree, in the layout of gl.max(x, 1)."""
    ROWS: gl.constexpr = x.shape[0]
    COLS: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.reshape(x, [ROWS, COLS // 2, 2]))
    if MAX:
        y = gl.max(halves(gl.maximum(a, b), MAX), 1)
    else:
        y = gl.sum(halves(a + b, MAX), 1)
    return gl.convert_layout(y, gl.SliceLayout(1, x.type.layout))
'''

def softmax(row_max="gl.max(s, 1)", m_new=None, exp_p="gl.exp2({})", exp_alpha="gl.exp2({})",
            row_sum="gl.sum(p, 1)") -> str:
    """``softmax_step`` with one of its parts replaced (each argument is source text; the exponentials' take the
    argument at ``{}``)."""
    m_new = m_new or f"gl.maximum(m_i, {row_max} * qk_scale_log2)"
    return SOFTMAX_HEAD + f"""
    m_new = {m_new}
    p = {exp_p.format("s * qk_scale_log2 - m_new[:, None]")}
    alpha = {exp_alpha.format("m_i - m_new")}
    if ROW_SUM:
        l_i = l_i * alpha + {row_sum}
    return p, m_new, l_i, alpha
"""


NO_SOFTMAX = '''
@gluon.jit
def softmax_step(s, m_i, l_i, kv_start, seqlen, qk_scale_log2, BLOCK_N: gl.constexpr, ROW_SUM: gl.constexpr):
    return s, m_i, l_i, m_i


@gluon.jit
def rescale(o_a, o_b, alpha, HAS_B: gl.constexpr):
    return o_a, o_b
'''

LAZY = softmax(m_new="gl.where(gl.max(s, 1) * qk_scale_log2 > m_i + 8.0, gl.max(s, 1) * qk_scale_log2, m_i)") + '''

@gluon.jit
def rescale(o_a, o_b, alpha, HAS_B: gl.constexpr):
    if gl.min(alpha, 0) < 1.0:
        o_a = o_a * gl.convert_layout(alpha, gl.SliceLayout(1, o_a.type.layout))[:, None]
        if HAS_B:
            o_b = o_b * gl.convert_layout(alpha, gl.SliceLayout(1, o_b.type.layout))[:, None]
    return o_a, o_b
'''

# lazyrescale's rows, with the skip decided per warp (a vote, no exchange between warps) and taken by a branch in
# PTX around each eight accumulators' multiplies.
WARP_VOTE = '''
@gluon.jit
def warp_needs(alpha):
    """1.0 in every row of a warp where some row's correction is below 1, else 0.0 (``vote.sync.any``)."""
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p, q; setp.lt.f32 p, $2, 0f3F800000; setp.lt.f32 q, $3, 0f3F800000; or.pred p, p, q; "
        "vote.sync.any.pred p, p, 0xffffffff; selp.f32 $0, 0f3F800000, 0f00000000, p; mov.b32 $1, $0; }",
        constraints="=r,=r,r,r", args=[alpha], dtype=gl.float32, is_pure=True, pack=2)


@gluon.jit
def scale_if(o, alpha, need):
    """o times alpha (per row) where the warp needs it; eight accumulators a branch."""
    layout: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    a = gl.convert_layout(alpha, layout)[:, None] + gl.zeros_like(o)
    n = gl.convert_layout(need, layout)[:, None] + gl.zeros_like(o)
    return gl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.eq.f32 p, $16, 0f00000000; "
        "mov.b32 $0, $8; mov.b32 $1, $9; mov.b32 $2, $10; mov.b32 $3, $11; "
        "mov.b32 $4, $12; mov.b32 $5, $13; mov.b32 $6, $14; mov.b32 $7, $15; "
        "@p bra.uni SKIP; "
        "mul.f32 $0, $8, $24; mul.f32 $1, $9, $25; mul.f32 $2, $10, $26; mul.f32 $3, $11, $27; "
        "mul.f32 $4, $12, $28; mul.f32 $5, $13, $29; mul.f32 $6, $14, $30; mul.f32 $7, $15, $31; "
        "SKIP: }",
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", args=[o, n, a],
        dtype=gl.float32, is_pure=True, pack=8)


@gluon.jit
def rescale(o_a, o_b, alpha, HAS_B: gl.constexpr):
    need = warp_needs(alpha)
    o_a = scale_if(o_a, alpha, need)
    if HAS_B:
        o_b = scale_if(o_b, alpha, need)
    return o_a, o_b
'''

# Each row's shift fixed at its first key block's maximum: no running maximum, no correction, no rescale. Exact
# while no later score exceeds that shift by ~100 (log2 units; p, l and o stay finite), which a product kernel
# would have to detect (l or o not finite) and recompute.
FIRST_MAX = SOFTMAX_HEAD + '''
    if kv_start == 0:
        m_i = gl.max(s, 1) * qk_scale_log2
    p = gl.exp2(s * qk_scale_log2 - m_i[:, None])
    if ROW_SUM:
        l_i = l_i + gl.sum(p, 1)
    return p, m_i, l_i, m_i
'''

NO_RESCALE = '''
@gluon.jit
def rescale(o_a, o_b, alpha, HAS_B: gl.constexpr):
    return o_a, o_b
'''

VARIANTS = {
    "shipped": "",
    "noexp": softmax(exp_p="{}", exp_alpha="{}"),
    "nomax": softmax(m_new="gl.full_like(m_i, 8.0)"),
    "nosum": softmax(row_sum="1.0"),
    "nosoftmax": NO_SOFTMAX,
    "nopvb": '''
@gluon.jit
def pv_async(p_a, p_b, va_s, vb_s, slot, o_a, o_b, HAS_B: gl.constexpr):
    o_a = warpgroup_mma(p_a, va_s.index(slot), o_a, is_async=True)
    return o_a, o_b


@gluon.jit
def wait_scores(s, HAS_B: gl.constexpr):
    return warpgroup_mma_wait(1, deps=(s,))
''',
    "noload": NOLOAD,
    "nosoftmax+noload": NOLOAD + NO_SOFTMAX,
    "noturn": '''
@gluon.jit
def take_turn(turn, HALF: gl.constexpr, issue):
    pass


@gluon.jit
def pass_turn(turn, HALF: gl.constexpr):
    pass
''',
    "treemax": TREE + softmax(row_max="tree_reduce(s, True)"),
    "treemax+treesum": TREE + softmax(row_max="tree_reduce(s, True)", row_sum="tree_reduce(p, False)"),
    "poly50": POLY + softmax(exp_p="mixed_exp2({}, False)"),
    "poly25": POLY + softmax(exp_p="mixed_exp2({}, True)"),
    "norescale": NO_RESCALE,
    "lazyrescale": LAZY,
    "warprescale": LAZY + WARP_VOTE,
    "firstmax": FIRST_MAX + NO_RESCALE,
}

IMPORTS = ("\nfrom triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma\n")


def variant_kernel(name: str, folder: Path):
    """The ping-pong kernel of a module made of gluon_pingpong.py's source and the variant's overrides (later
    definitions of the helpers' names, which the kernel's globals then resolve to)."""
    source = inspect.getsource(gluon_pingpong) + IMPORTS + VARIANTS[name]
    path = folder / f"pingpong_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"pingpong_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.hopper_attention_pingpong_kernel


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    qkv, cu, real, gflop = manager_batch([4096], 4096, 1)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    if "--once" in sys.argv:
        for _ in range(3):
            launch_varlen_attention(q, k, v, cu, 4096, D**-0.5)
        torch.cuda.synchronize()
        return
    names = list(VARIANTS)
    if "--variants" in sys.argv:
        names = sys.argv[sys.argv.index("--variants") + 1].split(",")
    tiles = gluon_kernel.gluon_tiles(4096, D, 1)  # as the shipped call runs
    if "--tile" in sys.argv:
        tiles = gluon_kernel.GluonTiles(*(int(x) for x in sys.argv[sys.argv.index("--tile") + 1].split(",")))
    print(f"variants with {tiles}", flush=True)
    want = flash(q, k, v, cu, 4096)[:real].float()
    product = graphed_ms(lambda: launch_varlen_attention(q, k, v, cu, 4096, D**-0.5))
    print(f"1x4096 ({gflop:.2f} GFLOP): TRITON_ATTN as shipped {product:.4f} ms {gflop / product:.0f} TFLOP/s",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                kernel = variant_kernel(name, Path(tmp))
                out = torch.empty_like(q)
                _, grid, args, kwargs = gluon_kernel.kernel_call(q, k, v, out, cu, 4096, D**-0.5, tiles)

                def call(kernel=kernel, grid=grid, args=args, kwargs=kwargs, out=out):
                    kernel[grid](*args, **kwargs)
                    return out

                err = err_of(call()[:real], want)
                ms = graphed_ms(call)
                print(f"  {name}: {ms:.4f} ms ({ms / product:.3f}x shipped) err {err:.1e}", flush=True)
            except Exception as exc:  # a variant that fails to compile is reported, not fatal
                print(f"  {name}: failed {type(exc).__name__}: {str(exc)[:400]}", flush=True)


if __name__ == "__main__":
    main()
