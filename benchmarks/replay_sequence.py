"""One image's replay (TRITON_ATTN), its profiled kernel and memset sequence, and the time between them.

Usage: python benchmarks/replay_sequence.py [TOKENS] [--show]   (default 1024)
Captures the graph of the smallest budget holding one TOKENS-token image (one slot), times its replay (30 samples
after 10 warm-ups) and profiles one: the span from the first activity's start to the last one's end, the summed
kernel time, and the memset nodes (count, summed time). ``--show``: 30 activities from the 42nd on (about one block
at 1024 tokens), each with its duration and the idle time before it, in µs. The weights are not seeded: compare
runs by their timings, not their outputs (saved to ``/tmp/out_$TAG.pt``).
"""

from __future__ import annotations

import os
import sys

import torch
from replay_gaps import one_image_graph, preset_tower  # benchmarks/, the script's directory

from hwgraph.bench import warm_device
from hwgraph.profiling import replay_activities
from hwgraph.timing import measure_interleaved

dev = torch.device("cuda")
warm_device(dev)
tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
show = "--show" in sys.argv
pixels = torch.randn(tokens * 4, 1536, device=dev, dtype=torch.bfloat16)
_manager, _, graph, out = one_image_graph(preset_tower(dev), tokens, pixels)
torch.save(out.float().cpu(), f"/tmp/out_{os.environ.get('TAG','x')}.pt")
lat = measure_interleaved({"replay": graph.replay}, "cuda")
ev = replay_activities(graph)
memsets = [e for e in ev if "Memset" in e.name]
kern = [e for e in ev if "Memset" not in e.name and "Memcpy" not in e.name]
ksum = sum((e.time_range.end - e.time_range.start) for e in kern) / 1000
msum = sum((e.time_range.end - e.time_range.start) for e in memsets) / 1000
span = (ev[-1].time_range.end - ev[0].time_range.start) / 1000
print(f"{os.environ.get('TAG')}: replay {lat['replay'].median:.3f}/{lat['replay'].p95:.3f} span {span:.3f} kernels "
      f"{ksum:.3f} in {len(kern)}, memsets {len(memsets)} {msum:.3f} ms", flush=True)
if show:
    for a, b in zip(ev[40:70], ev[41:71], strict=True):
        print(f"  {(b.time_range.end - b.time_range.start):8.1f} us  gap {(b.time_range.start - a.time_range.end):6.1f}"
              f"  {b.name[:90]}")
