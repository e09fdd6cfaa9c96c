"""cuDNN attention for the tower's head_dim 72 on one GPU, against ATen's flash kernel (20 calls per CUDA graph).

Usage: python benchmarks/cudnn_varlen.py
Part 1: cuDNN's dense kernel on one sequence padded to a budget's rows, keys past its end masked by a bias built on
the device (graph-capturable for any length), and the same kernel unmasked on an exact-length sequence.
Part 2: the varlen entry point (ATen ``_cudnn_attention_forward`` with cumulative lengths). In torch 2.11 it rebuilds
its cuDNN graph on every call (pytorch/pytorch#191576: the nested path looks the plan cache up but never fills it),
about 45 ms of host time per call, so it cannot run eagerly; this checks whether a captured call replays exactly
(against flash on the manager's padded cu_seqlens: zero-length slots, padding rows after the last image) and fast.
"""

from __future__ import annotations

import time

import torch

from hwgraph.timing import graphed_ms

H, D = 16, 72
aten = torch.ops.aten


def flash(q, k, v, cu, max_seqlen):
    return aten._flash_attention_forward(q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False,
                                         scale=D**-0.5)[0]


def cudnn(q, k, v, cu, max_seqlen):
    return aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_seqlen, max_seqlen, False, 0.0, False, False,
                                         scale=D**-0.5)[0]


def case(seqs, budget_patches, slots):
    total = sum(seqs)
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + s)
    offsets += [offsets[-1]] * (slots + 1 - len(offsets))  # the manager's padding: empty trailing slots
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    qkv = torch.randn(budget_patches, 3, H, D, device="cuda", dtype=torch.bfloat16)  # the tower's qkv view
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    return q, k, v, cu, budget_patches, total


def dense_one_sequence(q, k, v, cu, rows):
    """cuDNN's dense kernel on one sequence padded to ``rows``: keys past ``cu[1]`` masked by a bias built on the
    device (no host read), so the call is graph-capturable for any length up to ``rows``."""
    keep = torch.arange(rows, device=q.device) < cu[1]
    bias = torch.zeros(rows, device=q.device, dtype=q.dtype).masked_fill_(~keep, float("-inf"))
    bias = bias.view(1, 1, 1, rows).expand(1, H, rows, rows)
    dense = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out = aten._scaled_dot_product_cudnn_attention(*dense, bias, False, 0.0, False, False, scale=D**-0.5)[0]
    return out[0].transpose(0, 1)


def dense_case(real, rows):
    q, k, v, cu, _, total = case([real], rows, 1)
    want = flash(q, k, v, cu, rows)[:total].float()
    try:
        got = dense_one_sequence(q, k, v, cu, rows)[:total].float()
        err = ((got - want).norm() / want.norm()).item()
        ms_dense = graphed_ms(lambda: dense_one_sequence(q, k, v, cu, rows))
        nobias = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        ms_nobias = graphed_ms(lambda: aten._scaled_dot_product_cudnn_attention(
            *nobias, None, False, 0.0, False, False, scale=D**-0.5)[0])
    except Exception as exc:
        print(f"dense {real} in {rows}: failed: {type(exc).__name__}: {str(exc)[:300]}")
        return
    ms_flash = graphed_ms(lambda: flash(q, k, v, cu, rows))
    flops = 4 * real * real * D * H
    print(f"dense cudnn, {real} real rows in {rows}: masked {ms_dense:.4f} ms ({flops / ms_dense / 1e9:.0f} TFLOP/s), "
          f"unmasked {ms_nobias:.4f}, flash varlen {ms_flash:.4f} ({flops / ms_flash / 1e9:.0f}); rel err {err:.1e}")


def main():
    print(torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    for real, rows in ((196, 256), (1024, 1024), (900, 1024), (2048, 2048), (4096, 4096), (3600, 4096)):
        dense_case(real, rows)
    for seqs, budget, slots in (([196], 256, 4), ([4096], 4096, 4)):
        if not run_case(seqs, budget, slots):
            break  # a failed capture leaves the CUDA context unusable for further captures


def run_case(seqs, budget, slots):
    q, k, v, cu, max_seqlen, total = case(seqs, budget, slots)
    want = flash(q, k, v, cu, max_seqlen)[:total].float()
    start = time.perf_counter()
    try:
        eager = cudnn(q, k, v, cu, max_seqlen)
        torch.cuda.synchronize()
    except Exception as exc:  # an entry point this build rejects for the shape
        print(f"{seqs} in {budget}: cudnn varlen failed eagerly: {type(exc).__name__}: {str(exc)[:300]}")
        return True
    host_ms = (time.perf_counter() - start) * 1e3
    err_eager = ((eager[:total].float() - want).norm() / want.norm()).item()
    try:
        out = torch.empty_like(eager)
        ms_cudnn = graphed_ms(lambda: out.copy_(cudnn(q, k, v, cu, max_seqlen)), calls=5, warmup=3, samples=10)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = cudnn(q, k, v, cu, max_seqlen)
        q.normal_()
        k.normal_()  # new data, same graph: replay must follow the buffers
        want = flash(q, k, v, cu, max_seqlen)[:total].float()
        graph.replay()
        torch.cuda.synchronize()
        err_graph = ((got[:total].float() - want).norm() / want.norm()).item()
        finite_pad = bool(torch.isfinite(got[total:]).all()) if total < budget else True
    except Exception as exc:
        print(f"{seqs} in {budget}: cudnn varlen failed in a graph: {type(exc).__name__}: {str(exc)[:300]}")
        return False
    ms_flash = graphed_ms(lambda: flash(q, k, v, cu, max_seqlen))
    flops = sum(4 * s * s * D * H for s in seqs)
    print(f"{seqs} in {budget} patches: eager call {host_ms:.1f} ms host | device ms cudnn {ms_cudnn:.4f} "
          f"({flops / ms_cudnn / 1e9:.0f} TFLOP/s) flash {ms_flash:.4f} ({flops / ms_flash / 1e9:.0f}) | rel err "
          f"eager {err_eager:.1e} graph {err_graph:.1e} | padding rows finite {finite_pad}")
    return True


if __name__ == "__main__":
    main()
