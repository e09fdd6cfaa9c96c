"""The row-wise part of each block in row chunks on two streams, so that one chunk's kernels fill the SMs that the
other chunk's kernels leave idle in their last wave (not adopted; ``docs/benchmarks.md``, session 12).

Usage: python benchmarks/row_split.py [GROUPS]   (default 1x1024,2x512)
Everything in a block except attention works per row: the output projection, the residual add + LayerNorm, the MLP,
the second add + LayerNorm and the next block's qkv product. From ``min_rows`` patch rows the variants run those
per chunk of rows, alternating between the current stream and a second one, and join before the next attention
(``split2``: two chunks; ``split2-noqkv``: the next qkv product after the join; ``split4``: four chunks;
``split2-from1024``: from 1024 rows). The TRITON_ATTN managers (budget 1024, up to 2 images a graph) of the shipped
tower and of each variant run interleaved, two rounds; printed: the relative difference of each variant's outputs
from the shipped tower's, the encode medians / p95 in ms, and the summed kernel time of one profiled replay of the
one-image graph (kernels on two streams overlap, so that sum can exceed the replay).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from replay_gaps import census, preset_tower  # benchmarks/, the script's directory

from hwgraph.bench import group_inputs, kernel_view, parse_groups, warm_device
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni.fused import add_layer_norm_launch, rotary_qk
from hwgraph.timing import measure_interleaved

SIDE = {}


def side_stream(dev):
    """The second stream of device ``dev`` (one per device, kept across captures)."""
    if dev not in SIDE:
        SIDE[dev] = torch.cuda.Stream(dev)
    return SIDE[dev]


def make_split(tower, parts, split_qkv, min_rows=2048):
    """A block forward (``VisionBlock.forward_fused``'s signature) running the rows in ``parts`` chunks from
    ``min_rows`` rows; with ``split_qkv`` the chunks also compute the next block's qkv product, which that block
    then takes instead of computing it."""
    nxt = {id(b.norm1): b for b in tower.blocks}
    pending = {}

    def forward(block, x, normed, next_norm, cos, sin, cu, max_seqlen, attend):
        attn = block.attn
        T, C = x.shape
        if T < min_rows:
            pending.clear()
            return type(block).forward_fused(block, x, normed, next_norm, cos, sin, cu, max_seqlen, attend)
        H, D = attn.num_heads, attn.head_dim
        qkv = pending.pop(id(block), None)
        if qkv is None:
            qkv = F.linear(normed, attn.qkv.weight, attn.qkv.bias)
        qkv = qkv.view(T, 3, H, D)
        q, k = rotary_qk(qkv, cos, sin)
        out = attend(q, k, qkv[:, 2], cu, max_seqlen, attn.scale).reshape(T, -1)
        main = torch.cuda.current_stream(x.device)
        side = side_stream(x.device)
        side.wait_stream(main)
        step = T // parts
        bounds = [(i * step, T if i == parts - 1 else (i + 1) * step) for i in range(parts)]
        buf1 = torch.empty(2, T, C, device=x.device, dtype=x.dtype)
        buf2 = torch.empty(2, T, C, device=x.device, dtype=x.dtype)
        nb = nxt.get(id(next_norm)) if next_norm is not None else None
        next_qkv = torch.empty(T, 3 * C, device=x.device, dtype=x.dtype) if (nb is not None and split_qkv) else None
        for i, (a, b) in enumerate(bounds):
            with torch.cuda.stream(main if i % 2 == 0 else side):
                p = F.linear(out[a:b], attn.proj.weight, attn.proj.bias)
                add_layer_norm_launch(x[a:b], p, block.norm2.weight, block.norm2.bias, block.norm2.eps, buf1[:, a:b])
                d = block.mlp.forward(buf1[1, a:b])
                if next_norm is None:
                    torch.add(buf1[0, a:b], d, out=buf2[0, a:b])
                else:
                    add_layer_norm_launch(buf1[0, a:b], d, next_norm.weight, next_norm.bias, next_norm.eps,
                                          buf2[:, a:b])
                    if next_qkv is not None:
                        torch.addmm(nb.attn.qkv.bias, buf2[1, a:b], nb.attn.qkv.weight.t(), out=next_qkv[a:b])
        main.wait_stream(side)
        if next_qkv is not None:
            pending[id(nb)] = next_qkv
        return buf2[0], (buf2[1] if next_norm is not None else None)

    return forward


def variant(base, parts, split_qkv, min_rows=2048):
    """A TRITON_ATTN view of ``base`` whose blocks run ``make_split``'s forward."""
    t = kernel_view(base, "TRITON_ATTN")
    fwd = make_split(base, parts, split_qkv, min_rows)
    t.block_forward = lambda: fwd
    return t


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    warm_device(dev)
    base = preset_tower(dev)
    spec = sys.argv[1] if len(sys.argv) > 1 else "1x1024,2x512"
    groups = parse_groups(spec)
    inputs = group_inputs(base, groups, seed=0)
    towers = {"shipped": kernel_view(base, "TRITON_ATTN"), "split2": variant(base, 2, True),
              "split2-noqkv": variant(base, 2, False), "split4": variant(base, 4, True),
              "split2-from1024": variant(base, 2, True, 1024)}
    managers = {k: EncoderGraphManager(t, budgets=[1024], max_images_per_graph=2) for k, t in towers.items()}
    for m in managers.values():
        m.capture()
    for g in groups:
        pixels, grid = inputs[g.label]
        ref = managers["shipped"].encode(pixels, grid)[0].embeds.float()
        for k, m in managers.items():
            got = m.encode(pixels, grid)[0].embeds.float()
            print(g.label, k, "rel diff", ((got - ref).norm() / ref.norm()).item(), flush=True)
    for rnd in "ab":
        for g in groups:
            pixels, grid = inputs[g.label]
            calls = {k: (lambda m=m, p=pixels, gr=grid: m.encode(p, gr)) for k, m in managers.items()}
            lat = measure_interleaved(calls, "cuda")
            print(rnd, g.label, " | ".join(f"{k} {v.median:.3f}/{v.p95:.3f}" for k, v in lat.items()), flush=True)
    # kernel sums of one replay at 1024
    for k, m in managers.items():
        budget = 1024
        graph = m.graphs[budget].graph_for(1)[1]
        c = census(graph)
        tot = sum(ms for _, ms in c.values())
        print(k, "1024 graph kernels sum", round(tot, 3), "launches", sum(n for n, _ in c.values()))


if __name__ == "__main__":
    main()
