"""cuBLASLt's workspace and the replayed tower: the memset before each dynamically scheduled matrix product.

Usage: python benchmarks/cublaslt_workspace.py [--groups 1x49,1x256,1x1024] [--rounds 2]

With a workspace, cuBLASLt takes kernels for the tower's larger products whose tile scheduler keeps a counter in the
workspace (``nvjet_..._v_bz_coopB_...``) and zeroes it with a memset before each launch. A captured graph keeps
those memsets as memset nodes, and on the H200 the product after one starts 3-4 µs after it, against 0.3-0.6 µs
after a kernel (``docs/benchmarks.md``, session 12). Without a workspace (``CUBLASLT_WORKSPACE_SIZE=0``) cuBLASLt
takes the statically scheduled variant of the same tiles (``..._v_ssched_bz_coopB_...``), and the graph has no
memsets.

PyTorch reads ``CUBLASLT_WORKSPACE_SIZE`` (KiB) once per process, so each setting runs in its own process: the
rounds alternate default, 0, default, 0, ... Each process captures the TRITON_ATTN tower's budgets for the groups
(as ``hwgraph bench`` builds them: budgets doubling from 64, up to 4 images a graph) and prints, per group, the
median and p95 of the replay of the graph that holds it (the groups' replays interleaved in shuffled rounds), the
memset nodes and kernels of one profiled replay, and a digest of the step's outputs (all images, DeepStack
included), so that the settings' outputs can be compared bit for bit. Last, per group, ``ENQUEUED`` steps
(``manager.encode``) called back to back without waiting for the GPU: the host's time per call, and the wait for
the GPU after the last. A host that can queue steps ahead spends its per-step cost in the calls and leaves the rest
to the wait; one that cannot waits in each call for the GPU to finish the previous replay.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

ENV = "CUBLASLT_WORKSPACE_SIZE"
SETTINGS = {"default": None, "workspace 0": "0"}
ENQUEUED = 10


def child(spec: str) -> dict:
    import torch
    from replay_gaps import preset_tower  # benchmarks/, the script's directory

    from hwgraph.bench import covering_budgets, group_inputs, kernel_view, parse_groups, warm_device
    from hwgraph.manager import EncoderGraphManager
    from hwgraph.profiling import replay_activities
    from hwgraph.timing import measure_interleaved

    torch.manual_seed(0)
    device = torch.device("cuda")
    warm_device(device)
    groups = parse_groups(spec)
    base = preset_tower(device)
    inputs = group_inputs(base, groups, seed=0)
    budgets = covering_budgets(groups)
    manager = EncoderGraphManager(kernel_view(base, "TRITON_ATTN"), budgets=budgets, max_images_per_graph=4)
    manager.capture()
    graphs, out = {}, {}
    for group in groups:
        pixels, grid = inputs[group.label]
        digest = hashlib.sha256()
        for image in manager.encode(pixels, grid):
            for t in (image.embeds, *image.deepstack):
                digest.update(t.contiguous().view(torch.int16).cpu().numpy().tobytes())
        entry, why = manager.select_graph(grid, group.total)
        if entry is None:
            raise SystemExit(f"{group.label} would not replay: {why}")
        graphs[group.label] = entry.graph_for(group.count)[1]
        events = replay_activities(graphs[group.label])
        out[group.label] = {"digest": digest.hexdigest()[:16], "budget": entry.budget,
                            "memsets": sum("Memset" in e.name for e in events),
                            "kernels": sum("Memset" not in e.name and "Memcpy" not in e.name for e in events)}
    replay = measure_interleaved({k: g.replay for k, g in graphs.items()}, device)
    for label, lat in replay.items():
        out[label].update(median=lat.median, p95=lat.p95)
    for group in groups:  # host time to enqueue ENQUEUED steps without waiting for any, then the wait for them
        pixels, grid = inputs[group.label]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(ENQUEUED):
            manager.encode(pixels, grid)
        queued = time.perf_counter()
        torch.cuda.synchronize()
        out[group.label].update(enqueue=(queued - start) * 1e3 / ENQUEUED, drain=(time.perf_counter() - queued) * 1e3)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", default="1x49,1x256,1x1024")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.groups)), flush=True)
        return
    runs = []
    for round_ in range(args.rounds):
        for label, value in SETTINGS.items():
            env = {k: v for k, v in os.environ.items() if k != ENV}
            if value is not None:
                env[ENV] = value
            proc = subprocess.run([sys.executable, __file__, "--child", "--groups", args.groups], env=env,
                                  capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{label} (round {round_}) failed with exit code {proc.returncode}:\n"
                                 f"{proc.stderr[-3000:]}")
            result = json.loads(lines[-1][len("RESULT "):])
            runs.append((label, result))
            print(f"round {round_}, {label}: " + "; ".join(
                f"{g} (budget {r['budget']}) replay {r['median']:.3f} / {r['p95']:.3f} ms, {r['memsets']} memsets, "
                f"{r['kernels']} kernels, outputs {r['digest']}, host {r['enqueue']:.3f} ms a call to enqueue "
                f"{ENQUEUED} steps, then {r['drain']:.3f} ms waiting for them" for g, r in result.items()), flush=True)
    for group in runs[0][1]:
        digests = {r[group]["digest"] for _, r in runs}
        medians = {label: [r[group]["median"] for lab, r in runs if lab == label] for label in SETTINGS}
        print(f"{group}: " + ", ".join(f"{k} {' / '.join(f'{m:.3f}' for m in v)}" for k, v in medians.items())
              + f"; outputs {'bit-identical' if len(digests) == 1 else 'DIFFER'} across all runs")


if __name__ == "__main__":
    main()
