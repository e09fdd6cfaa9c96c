"""How fast a replay runs on a GPU at its power limit, against one that rested: the H200's clock under the tower.

Usage: python benchmarks/power_state.py [TOKENS]   (default 1024)
Captures the TRITON_ATTN tower's graph for one image of TOKENS tokens (the smallest budget holding it, one slot),
then:
- replays it back to back for 3 s while ``nvidia-smi`` samples the SM clock, the power draw and the active clock
  throttle reasons every 100 ms (every third sample printed; ``0x4`` is the software power cap);
- times 30 replays after 10 warm-ups, each synchronised (``hwgraph.timing.measure``: the GPU idles only for the host's
  turnaround between them), and profiles one: the span from the first kernel's start to the last one's end, the
  summed kernel time, the attention kernel's mean and the graph's memset nodes;
- times 15 replays each after 20 ms of host sleep (the GPU idle), median.
A digest of the replay's output goes to ``/tmp/out_$TAG.pt`` (``TAG`` from the environment), to compare runs made
under different settings (the weights and pixels are seeded).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch
from replay_gaps import one_image_graph, preset_tower  # benchmarks/, the script's directory

from hwgraph.bench import warm_device
from hwgraph.profiling import replay_activities
from hwgraph.timing import measure_interleaved


def poll(seconds, label, work=None):
    """Call ``work`` (if any) in a loop for ``seconds`` while ``nvidia-smi`` samples clock, power and throttle
    reasons; print how many calls were made and every third sample."""
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
                          "--format=csv,noheader", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        if work:
            work()
            n += 1
        else:
            time.sleep(0.01)
    torch.cuda.synchronize()
    p.terminate()
    lines = p.stdout.read().strip().splitlines()
    print(label, n, "calls;", " | ".join(lines[5:-1:3]), flush=True)


def after_idle(replay, count: int, idle_s: float, read_clock=None) -> tuple[list[float], list[int]]:
    """``count`` replays, each after ``idle_s`` of host sleep: each one's ms (CUDA events; the start event is
    recorded before the host submits the graph), and the readings of ``read_clock`` (if any), which the host polls
    until the replay's end event completes."""
    times, clocks = [], []
    for _ in range(count):
        time.sleep(idle_s)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        stop.record()
        if read_clock is None:
            stop.synchronize()
        while not stop.query():
            clocks.append(read_clock())
        times.append(start.elapsed_time(stop))
    return times, clocks


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    warm_device(dev)
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    tower = preset_tower(dev)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(tokens * 4, 1536, generator=gen).to(dev, torch.bfloat16)
    _manager, _, graph, out = one_image_graph(tower, tokens, pixels)
    tag = os.environ.get("TAG", "x")
    torch.save(out.float().cpu(), f"/tmp/out_{tag}.pt")

    poll(3, f"{tag} back-to-back replays", graph.replay)
    lat = measure_interleaved({"replay": graph.replay}, "cuda")
    ev = replay_activities(graph)
    kern = [e for e in ev if "Memset" not in e.name]
    att = [e for e in ev if "attention" in e.name]
    ksum = sum(e.time_range.end - e.time_range.start for e in kern) / 1000
    asum = sum(e.time_range.end - e.time_range.start for e in att) / 1000 / max(1, len(att))
    span = (ev[-1].time_range.end - ev[0].time_range.start) / 1000
    mem = sum("Memset" in e.name for e in ev)
    print(f"{tag}: replay {lat['replay'].median:.3f}/{lat['replay'].p95:.3f}; profiled: span {span:.3f} kernels "
          f"{ksum:.3f} attention {asum * 1000:.1f} us/call, memsets {mem}", flush=True)
    burst, _ = after_idle(graph.replay, count=15, idle_s=0.02)
    print(f"{tag}: replay after 20 ms idle, median {statistics.median(burst):.3f}", flush=True)


if __name__ == "__main__":
    main()
