"""Where does a small image's replay with TRITON_ATTN lose time between kernels?

Usage: python benchmarks/replay_gaps.py [--ab [GROUPS] | --overlap [GROUPS] | --mlp-pad [GROUPS] | --gluon [GROUPS] |
                                        --pingpong [GROUPS] | --census [TOKENS] [--measure-products] | --compiled |
                                        --order]
With TRITON_ATTN one 49-token image replays 3-10% slower than with FLASH_ATTN although its kernels sum to less
(bench-session6-a.md: 1.743 against 1.645 ms, kernels 1.497 against 1.531). This captures the budget-64 graph (one
sequence slot) for FLASH_ATTN and for TRITON_ATTN two ways (the TMA kernel as shipped, and the pointer kernel),
then per variant (session 6's run also had the TMA kernel as a programmatic dependent launch, from
``attention_hd72.py`` at commit f32b8d3: ``replay_gaps.log``):

- ``encode``: the manager's whole step (as ``hwgraph bench`` times it), interleaved with the others;
- ``replay``: the captured graph's replay alone, interleaved likewise;
- from one profiled replay: the kernels' summed time and the idle time before each kind of kernel (the gap between
  the previous kernel's end and its start), summed over the replay.

``--ab``: FLASH_ATTN against TRITON_ATTN as a caller gets them (managers with budgets 64-1024 and up to 4 images per
graph, as ``hwgraph bench`` builds them), each group's steps interleaved across the two kernels in the same rounds
(``hwgraph bench`` times one kernel's rows after the other's), twice over; GROUPS defaults to the bench's.
``--overlap``: the same with TRITON_ATTN, DeepStack mergers in line against overlapped on their own stream
(``Qwen3OmniVisionTower.merge_stream``).
``--mlp-pad``: the same with TRITON_ATTN, the MLP 4304 wide (the checkpoint's) against 4352 (zero-padded to a
multiple of 256: ``padded_mlp``), with the relative difference of the two outputs.
``--gluon``: the same with TRITON_ATTN as shipped (its Gluon kernel where ``uses_gluon`` takes it) against
TRITON_ATTN with the Triton TMA kernel only (``use_gluon=False``), with the relative difference of the outputs.
``--pingpong``: the same with TRITON_ATTN as shipped (the ping-pong Gluon kernel from 2048 patch rows, and from 1024
in a graph of one sequence slot) against TRITON_ATTN without it (``without_pingpong``: ``hopper_attention_kernel``
from 2048 rows, the Triton TMA kernel at 1024); GROUPS defaults to those whose budgets have 1024 or more rows.
``--census``: the kernels of one image's plain replay with TRITON_ATTN (TOKENS, default 1024, in the smallest
budget that holds it), by name: launches, summed ms and share of the replay's kernel time; with
``--measure-products``, the graph captured with measured products (``EncoderGraphManager(measure_products=True)``).
``--compiled``: plain against compiled replay (TRITON_ATTN, 49 and 256 tokens): replay times and the kernels
that differ between the two graphs.
``--order``: one manager's encode timed twice per round, right after an eager forward (or a host sleep, or a GPU
spin kernel) and right after itself, in a fixed order and in shuffled rounds (``order_effect``).
"""

from __future__ import annotations

import copy
import gc
import sys
import time
from collections import defaultdict

import torch

from hwgraph.attention import gluon_kernel, triton_kernel
from hwgraph.bench import eager_call, group_inputs, kernel_view, parse_groups, warm_device
from hwgraph.budgets import filling_grid
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.profiling import replay_activities
from hwgraph.timing import measure_interleaved

TOKENS, BUDGET = 49, 64
SHIPPED = triton_kernel.launch_varlen_attention


def pointer_kernel(q, k, v, cu, max_seqlen, scale, **kw):
    return SHIPPED(q, k, v, cu, max_seqlen, scale, use_tma=False)


def triton_only(q, k, v, cu, max_seqlen, scale, **kw):
    """TRITON_ATTN without its Gluon kernel (the Triton TMA kernel on Hopper)."""
    return SHIPPED(q, k, v, cu, max_seqlen, scale, use_gluon=False)


def without_pingpong(q, k, v, cu, max_seqlen, scale, **kw):
    """TRITON_ATTN without the ping-pong kernel: session 8's Gluon kernel where it would be taken from 2048 rows,
    the Triton TMA kernel where it would be taken for one sequence slot from 1024 (``gluon_tiles`` reads
    ``PINGPONG_FROM`` and ``PINGPONG_FROM_ONE_SEQUENCE`` at each call, so the captured launch is the other
    kernel's)."""
    shipped = gluon_kernel.PINGPONG_FROM, gluon_kernel.PINGPONG_FROM_ONE_SEQUENCE
    gluon_kernel.PINGPONG_FROM = gluon_kernel.PINGPONG_FROM_ONE_SEQUENCE = sys.maxsize
    try:
        return SHIPPED(q, k, v, cu, max_seqlen, scale)
    finally:
        gluon_kernel.PINGPONG_FROM, gluon_kernel.PINGPONG_FROM_ONE_SEQUENCE = shipped


VARIANTS = {"FLASH_ATTN": ("FLASH_ATTN", None), "TRITON_ATTN tma": ("TRITON_ATTN", None),
            "TRITON_ATTN pointer": ("TRITON_ATTN", pointer_kernel)}


def kind_of(name: str) -> str:
    for key, label in (("flash_fwd", "flash"), ("varlen_attention", "triton attention"),
                       ("hopper_attention", "triton attention"), ("nvjet", "cuBLAS GEMM"), ("gemm", "cuBLAS GEMM"),
                       ("add_layer_norm", "add+LayerNorm"), ("rotary", "rotary"), ("layer_norm", "LayerNorm")):
        if key in name:
            return label
    return "other"


def gap_profile(graph) -> tuple[float, int, dict]:
    """Summed kernel ms, kernel count, and {kernel kind: (summed idle ms before it, its summed ms)}."""
    kernels = [e for e in replay_activities(graph) if "Memcpy" not in e.name and "Memset" not in e.name]
    per_kind = defaultdict(lambda: [0.0, 0.0])
    total = 0.0
    for before, after in zip([None] + kernels[:-1], kernels, strict=True):
        span = (after.time_range.end - after.time_range.start) / 1000
        total += span
        per_kind[kind_of(after.name)][1] += span
        if before is not None:
            per_kind[kind_of(after.name)][0] += max(0.0, after.time_range.start - before.time_range.end) / 1000
    return total, len(kernels), dict(per_kind)


def census(graph) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, summed ms)} of one profiled replay."""
    out = defaultdict(lambda: [0, 0.0])
    for e in replay_activities(graph):
        out[e.name][0] += 1
        out[e.name][1] += (e.time_range.end - e.time_range.start) / 1000
    return {k: tuple(v) for k, v in out.items()}


def one_image_graph(tower, tokens: int, pixels: torch.Tensor, measure_products: bool = False
                    ) -> tuple[EncoderGraphManager, int, object, torch.Tensor]:
    """``(manager, budget, graph, embeds)``: a TRITON_ATTN manager with the smallest budget holding one
    ``tokens``-token image (one slot), captured and run once on ``pixels``; that budget, the image's graph and the
    merged embeddings of the run. Keep the manager while replaying the graph: it holds the graph's static inputs."""
    budget = next(b for b in (64, 128, 256, 512, 1024) if b >= tokens)
    m = EncoderGraphManager(kernel_view(tower, "TRITON_ATTN"), budgets=[budget], max_images_per_graph=1,
                            measure_products=measure_products)
    m.capture()
    embeds = m.encode(pixels, [filling_grid(tokens, 2)])[0].embeds
    return m, budget, m.graphs[budget].graph_for(1)[1], embeds


def replay_census(device, tokens: int, measure_products: bool = False):
    """The kernels of one ``tokens`` image's plain replay (TRITON_ATTN), most time first."""
    pixels = torch.randn(tokens * 4, 1536, device=device, dtype=torch.bfloat16)
    manager, budget, graph, _ = one_image_graph(preset_tower(device), tokens, pixels, measure_products)
    if measure_products:
        print("products:", manager.stats()["products"])
    replay = measure_interleaved({"replay": graph.replay}, "cuda")["replay"]
    kernels = census(graph)
    total = sum(ms for _, ms in kernels.values())
    print(f"1x{tokens} in budget {budget}: replay {replay.median:.3f} / {replay.p95:.3f} ms, kernels {total:.3f} ms "
          f"in {sum(n for n, _ in kernels.values())} launches")
    for name, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"  {ms:7.3f} ms {100 * ms / total:5.1f}% {n:4d}x {ms / n * 1000:8.1f} us  {name[:110]}")


def compiled_census(device, tokens_list=(49, 256)):
    """Plain against compiled replay with TRITON_ATTN (one slot per budget): replay times interleaved, and the
    kernels each graph launches, by name, where the two differ."""
    base = preset_tower(device)
    for tokens in tokens_list:
        budget = 64 if tokens <= 64 else 256
        grid = [filling_grid(tokens, 2)]
        pixels = torch.randn(tokens * 4, 1536, device=device, dtype=torch.bfloat16)
        graphs, outs = {}, {}
        for label, compiled in (("plain", False), ("compiled", True)):
            m = EncoderGraphManager(kernel_view(base, "TRITON_ATTN"), budgets=[budget], max_images_per_graph=1,
                                    compile=compiled)
            m.capture()
            outs[label] = m.encode(pixels, grid)[0].embeds.float()
            graphs[label] = m.graphs[budget].graph_for(1)[1]
        diff = ((outs["plain"] - outs["compiled"]).norm() / outs["plain"].norm()).item()
        replay = measure_interleaved({k: g.replay for k, g in graphs.items()}, "cuda")
        print(f"1x{tokens} in budget {budget}: replay plain {replay['plain'].median:.3f} / compiled "
              f"{replay['compiled'].median:.3f} ms, relative difference {diff:.1e}", flush=True)
        plain, comp = census(graphs["plain"]), census(graphs["compiled"])
        for label, c in (("plain", plain), ("compiled", comp)):
            print(f"  {label}: {sum(n for n, _ in c.values())} kernels, {sum(t for _, t in c.values()):.3f} ms")
        for name in sorted(set(plain) | set(comp), key=lambda k: -(comp.get(k, (0, 0))[1] + plain.get(k, (0, 0))[1])):
            a, b = plain.get(name, (0, 0.0)), comp.get(name, (0, 0.0))
            if a[0] != b[0] or abs(a[1] - b[1]) > 0.005:
                print(f"    plain {a[0]:4d} x {a[1]:.3f} ms | compiled {b[0]:4d} x {b[1]:.3f} ms | {name[:110]}")


def order_effect(device, spec="1x49,1x256"):
    """One manager's encode timed twice per round, right after something else and right after itself: an eager
    forward in a fixed order, in shuffled rounds (``measure_interleaved``'s default), and in a fixed order with
    Python's garbage collector off; then with the eager forward replaced by 15 ms of host sleep (GPU idle) and by a
    15 ms GPU spin kernel (host idle), to tell host-side causes from an idle GPU's."""
    base = preset_tower(device)
    groups = parse_groups(spec)
    inputs = group_inputs(base, groups, seed=0)
    view = kernel_view(base, "TRITON_ATTN")
    manager = EncoderGraphManager(view, budgets=[64, 128, 256, 512, 1024], max_images_per_graph=4)
    manager.capture()
    spin_cycles = int(15e-3 * torch.cuda.get_device_properties(device).clock_rate * 1e3)  # clock_rate is in kHz
    for group in groups:
        pixels, grid = inputs[group.label]
        encode = {"encode A": lambda p=pixels, g=grid: manager.encode(p, g),
                  "encode B": lambda p=pixels, g=grid: manager.encode(p, g)}
        before = {"eager": lambda p=pixels, g=grid: eager_call(view, p, g),
                  "host sleep": lambda: time.sleep(15e-3),
                  "GPU spin": lambda: torch.cuda._sleep(spin_cycles)}
        runs = [("eager", None, True, "fixed order eager, A, B"), ("eager", 0, True, "shuffled rounds"),
                ("eager", None, False, "fixed order, garbage collector off"),
                ("host sleep", None, True, "fixed order 15 ms host sleep, A, B"),
                ("GPU spin", None, True, "fixed order 15 ms GPU spin, A, B")]
        for first, seed, collect, label in runs:
            gc.collect()
            if not collect:
                gc.disable()
            try:
                lat = measure_interleaved({first: before[first], **encode}, "cuda", seed=seed)
            finally:
                gc.enable()
            print(f"{group.label} {label}: " + ", ".join(f"{k} {v.median:.3f} / {v.p95:.3f}" for k, v in lat.items()),
                  flush=True)


def preset_tower(device):
    return Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to(device, torch.bfloat16).eval()


def padded_mlp(tower, width: int):
    """A copy of ``tower`` (sharing every other module and weight) whose MLPs are ``width`` wide: fc1 gets zero
    output features (zero bias) and fc2 zero input features, so every block computes the same function
    (tanh-GELU(0) = 0)."""
    def shallow(module):
        out = copy.copy(module)
        out._modules = dict(module._modules)  # its own child table: replacing a child leaves the original alone
        return out

    padded = shallow(tower)
    blocks = []
    for block in tower.blocks:
        block, mlp = shallow(block), shallow(block.mlp)
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        extra = width - fc1.out_features
        new1 = torch.nn.Linear(fc1.in_features, width, device=fc1.weight.device, dtype=fc1.weight.dtype)
        new2 = torch.nn.Linear(width, fc2.out_features, device=fc2.weight.device, dtype=fc2.weight.dtype)
        with torch.no_grad():
            new1.weight.copy_(torch.nn.functional.pad(fc1.weight, (0, 0, 0, extra)))
            new1.bias.copy_(torch.nn.functional.pad(fc1.bias, (0, extra)))
            new2.weight.copy_(torch.nn.functional.pad(fc2.weight, (0, extra)))
            new2.bias.copy_(fc2.bias)
        mlp.linear_fc1, mlp.linear_fc2 = new1, new2
        block.mlp = mlp
        blocks.append(block)
    padded.blocks = torch.nn.ModuleList(blocks)
    return padded


def ab(device, spec: str, variants: dict[str, tuple[str, bool]], transforms=None, launchers=None):
    """Managers per variant (label -> (attention kernel, DeepStack mergers overlapped)), each group's steps
    interleaved across them, two rounds. ``transforms``: label -> function of the tower giving that variant's.
    ``launchers``: label -> TRITON_ATTN launcher that variant's graphs capture."""
    groups = parse_groups(spec)
    base = preset_tower(device)
    inputs = group_inputs(base, groups, seed=0)
    managers = {}
    for label, (kernel, overlap) in variants.items():
        source = (transforms or {}).get(label, lambda t: t)(base)
        tower = kernel_view(source, kernel)  # the same weights, its own kernel and overlap choice
        tower.overlap_deepstack = overlap
        managers[label] = EncoderGraphManager(tower, budgets=[64, 128, 256, 512, 1024], max_images_per_graph=4)
        triton_kernel.launch_varlen_attention = (launchers or {}).get(label, SHIPPED)  # read at each call
        try:
            managers[label].capture()
        finally:
            triton_kernel.launch_varlen_attention = SHIPPED
    first, second = list(variants)
    for round_ in ("a", "b"):
        print(f"round {round_}: encode median / p95 ms, interleaved per group", flush=True)
        for group in groups:
            pixels, grid = inputs[group.label]
            lat = measure_interleaved({k: (lambda m=m, p=pixels, g=grid: m.encode(p, g)) for k, m in managers.items()},
                                      "cuda")
            a, b = lat[first], lat[second]
            print(f"  {group.label}: {first} {a.median:.3f} / {a.p95:.3f} | {second} {b.median:.3f} / {b.p95:.3f} | "
                  f"{first} over {second} {a.median / b.median:.3f}x", flush=True)
    print({k: m.stats()["replays_per_budget"] for k, m in managers.items()})
    if transforms or launchers:
        for group in groups:
            pixels, grid = inputs[group.label]
            a, b = (managers[k].encode(pixels, grid)[0].embeds.float() for k in (first, second))
            print(f"  {group.label}: relative difference {((a - b).norm() / a.norm()).item():.1e}")


BENCH_GROUPS = "1x49,2x49,1x98,1x256,4x64,1x1024"
# The A/B runs: flag -> (default GROUPS, variants, transforms, launchers), ``ab``'s arguments.
AB_RUNS = {
    "--ab": (BENCH_GROUPS, {"FLASH_ATTN": ("FLASH_ATTN", True), "TRITON_ATTN": ("TRITON_ATTN", True)}, None, None),
    "--overlap": (BENCH_GROUPS, {"in line": ("TRITON_ATTN", False), "overlapped": ("TRITON_ATTN", True)}, None, None),
    "--gluon": (BENCH_GROUPS, {"Gluon": ("TRITON_ATTN", True), "Triton TMA": ("TRITON_ATTN", True)}, None,
                {"Triton TMA": triton_only}),
    "--pingpong": ("1x1024,2x512,4x256,1x512,1x256,4x64",
                   {"ping-pong": ("TRITON_ATTN", True), "without": ("TRITON_ATTN", True)}, None,
                   {"without": without_pingpong}),
    "--mlp-pad": (BENCH_GROUPS, {"MLP 4304": ("TRITON_ATTN", True), "MLP 4352": ("TRITON_ATTN", True)},
                  {"MLP 4352": lambda t: padded_mlp(t, 4352)}, None),
}


def flag_value(flag: str, default: str) -> str:
    """The argument after ``flag`` on the command line, or ``default``."""
    rest = sys.argv[sys.argv.index(flag) + 1:]
    return rest[0] if rest and not rest[0].startswith("--") else default


def main():
    torch.manual_seed(0)
    device = torch.device("cuda")
    warm_device(device)
    for flag, (groups, variants, transforms, launchers) in AB_RUNS.items():
        if flag in sys.argv:
            return ab(device, flag_value(flag, groups), variants, transforms, launchers)
    if "--order" in sys.argv:
        return order_effect(device)
    if "--compiled" in sys.argv:
        return compiled_census(device)
    if "--census" in sys.argv:
        return replay_census(device, int(flag_value("--census", "1024")), "--measure-products" in sys.argv)
    base = preset_tower(device)
    grid = [filling_grid(TOKENS, 2)]
    pixels = torch.randn(TOKENS * 4, 1536, device=device, dtype=torch.bfloat16)
    managers = {}
    for label, (kernel, launcher) in VARIANTS.items():
        triton_kernel.launch_varlen_attention = launcher or SHIPPED  # read at each call: patches the capture
        try:
            m = EncoderGraphManager(kernel_view(base, kernel), budgets=[BUDGET], max_images_per_graph=1)
            m.capture()
            m.encode(pixels, grid)
        finally:
            triton_kernel.launch_varlen_attention = SHIPPED
        managers[label] = m
    want = managers["FLASH_ATTN"].encode(pixels, grid)[0].embeds.float()
    graphs = {}
    for label, m in managers.items():
        got = m.encode(pixels, grid)[0].embeds.float()
        print(f"{label}: relative error against FLASH_ATTN {((got - want).norm() / want.norm()).item():.1e}")
        graphs[label] = m.graphs[BUDGET].graph_for(1)[1]
    encode = measure_interleaved({k: (lambda m=m: m.encode(pixels, grid)) for k, m in managers.items()}, "cuda")
    replay = measure_interleaved({k: g.replay for k, g in graphs.items()}, "cuda")
    print(f"\n1x{TOKENS} in budget {BUDGET}, one slot (median / p95 ms)")
    for label in VARIANTS:
        total, count, kinds = gap_profile(graphs[label])
        idle = sum(v[0] for v in kinds.values())
        print(f"{label}: encode {encode[label].median:.3f} / {encode[label].p95:.3f}, replay {replay[label].median:.3f}"
              f" / {replay[label].p95:.3f}; profiled replay: {count} kernels, {total:.3f} ms of kernels, {idle:.3f}"
              " ms idle between them")
        for kind, (gap, span) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            print(f"    before {kind}: idle {gap:.3f} ms, kernels {span:.3f} ms")


if __name__ == "__main__":
    main()
