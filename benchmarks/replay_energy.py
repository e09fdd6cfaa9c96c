"""Energy per replay at the GPU's power limit, and replay time after idle, for the shipped tower against toggles.

Usage: python benchmarks/replay_energy.py [TOGGLE ...] [--tokens N] [--rounds R] [--seconds S]
(default toggles ``fc1-row-split`` and ``wide-tiles``, 1024 tokens, 2 rounds, 2 s).

Session 16 found that kernel changes which make a call faster by filling idle SMs move a 1024-token replay by a
tenth of what they save in the call (fc1 split in two: 7% a call, 0.4% a replay; 256-row attention tiles: 5-6% a
call, 0.2-0.5% a replay), and guessed why: the replay runs at the 700 W power cap, so the same work done in fewer
cycles draws more power and the clock comes down. This measures that guess. For each TOGGLE of
``replay_toggle.TOGGLES`` it captures the shipped graph and the graph with the toggle off (one TOKENS-token image,
TRITON_ATTN, ``replay_gaps.one_image_graph``), then, alternating the two graphs, ``--rounds`` times:

- ``back to back``: 1 s of back-to-back replays to reach the power limit (at 1024 tokens), then ``--seconds``
  more, timed with CUDA events and metered with NVML's energy counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ
  since the driver loaded): ms and J per replay, mean W, and the SM clock and power sampled every 16 replays
  (median);
- ``after idle``: 20 replays, each after 30 ms of host sleep; median ms, and the SM clock read while they run.

At the cap, time per replay is energy per replay over the power limit: a change saves time there only if it saves
energy. NVML is read through ctypes (``libnvidia-ml.so.1``, which ``nvidia-smi`` uses); device index 0, so run it
on a machine of one GPU.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch
from power_state import after_idle  # benchmarks/, the script's directory
from replay_gaps import one_image_graph, preset_tower
from replay_toggle import TOGGLES

from hwgraph.bench import warm_device
from hwgraph.budget_capture import relative_error

NVML_CLOCK_SM = 1


class Nvml:
    """The three NVML readings used here, for device index 0; a non-zero NVML return code raises, naming the call."""

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.check("nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self.check("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(0), ctypes.byref(self.handle))

    def check(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} returned NVML error {code}")

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        self.check("nvmlDeviceGetTotalEnergyConsumption", self.handle, ctypes.byref(value))
        return value.value

    def sm_mhz(self) -> int:
        value = ctypes.c_uint()
        self.check("nvmlDeviceGetClockInfo", self.handle, ctypes.c_uint(NVML_CLOCK_SM), ctypes.byref(value))
        return value.value

    def power_w(self) -> float:
        value = ctypes.c_uint()
        self.check("nvmlDeviceGetPowerUsage", self.handle, ctypes.byref(value))
        return value.value / 1000


def back_to_back(nvml: Nvml, replay, seconds: float) -> dict:
    """Replays back to back for 1 s, then for ``seconds`` metered: ms, J and W per replay, median clock and power."""
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        replay()
    torch.cuda.synchronize()
    clocks, powers, n = [], [], 0
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0 = nvml.energy_mj()
    start.record()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(16):
            replay()
        n += 16
        torch.cuda.synchronize()  # a few µs of idle every 16 replays; keeps the host from queueing far ahead
        clocks.append(nvml.sm_mhz())
        powers.append(nvml.power_w())
    stop.record()
    stop.synchronize()
    joules = (nvml.energy_mj() - e0) / 1000
    ms = start.elapsed_time(stop)
    return {"ms": ms / n, "J": joules / n, "W": joules / (ms / 1000), "MHz": statistics.median(clocks),
            "sampled W": statistics.median(powers), "replays": n}


def rested(nvml: Nvml, replay, count: int = 20) -> dict:
    """``count`` replays, each after 30 ms of host sleep (``power_state.after_idle``): median ms, and the lowest and
    median SM clock read while they run."""
    times, clocks = after_idle(replay, count, 0.03, nvml.sm_mhz)
    return {"ms": statistics.median(times), "MHz": statistics.median(clocks) if clocks else None,
            "min MHz": min(clocks, default=None), "readings": len(clocks)}


def main():
    args = sys.argv[1:]
    opts = {"--tokens": 1024, "--rounds": 2, "--seconds": 2.0}
    for name in list(opts):
        if name in args:
            i = args.index(name)
            opts[name] = type(opts[name])(args[i + 1])
            del args[i:i + 2]
    toggles = args or ["fc1-row-split", "wide-tiles"]
    unknown = [t for t in toggles if t not in TOGGLES]
    if unknown:
        raise SystemExit(f"unknown toggles {unknown}; known: {', '.join(TOGGLES)}")
    tokens, rounds, seconds = opts["--tokens"], opts["--rounds"], opts["--seconds"]
    dev = torch.device("cuda")
    warm_device(dev)
    nvml = Nvml()
    print(torch.cuda.get_device_name(), f"1x{tokens}, {rounds} rounds, {seconds} s metered back to back", flush=True)
    tower = preset_tower(dev)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(tokens * 4, 1536, generator=gen).to(dev, torch.bfloat16)
    for toggle in toggles:
        shipped_name, other_name, switched_off = TOGGLES[toggle]
        shipped = one_image_graph(tower, tokens, pixels)
        with switched_off():
            other = one_image_graph(tower, tokens, pixels)
        graphs = {shipped_name: shipped[2].replay, other_name: other[2].replay}
        print(f"{toggle}: {shipped_name} against {other_name} (outputs differ by "
              f"{relative_error(shipped[3].float(), other[3].float()):.2e})", flush=True)
        for r in range(rounds):
            order = list(graphs) if r % 2 == 0 else list(reversed(graphs))
            for name in order:
                cap = back_to_back(nvml, graphs[name], seconds)
                idle = rested(nvml, graphs[name])
                print(f"  round {r} {name}: back to back {cap['ms']:.3f} ms, {cap['J']:.3f} J, {cap['W']:.0f} W "
                      f"({cap['replays']} replays; sampled {cap['MHz']} MHz, {cap['sampled W']:.0f} W) | after idle "
                      f"{idle['ms']:.3f} ms (during the replays {idle['MHz']} MHz, lowest {idle['min MHz']}, "
                      f"{idle['readings']} readings)", flush=True)
        del shipped, other, graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
