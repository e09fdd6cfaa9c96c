"""TRITON_ATTN's Gluon kernels as of an earlier commit against the working tree's, interleaved in one process.

Usage: python benchmarks/attention_ab.py --base REV [--rounds N]
``gluon_kernel.py`` and ``gluon_pingpong.py`` of commit ``REV`` (read with ``git show``) are loaded as modules of
their own, each importing the other, and their ``launch_gluon_attention`` is timed against the working tree's at
the manager's shapes (16 heads of 72, bf16), with and without the padding slot (the tower runs without it). Each
cell is the device time of one call (20 calls in one CUDA graph), µs, one figure per round; every round times each
callable once, in the same order. ``maxdiff``: the largest absolute difference of the real rows against the
working tree's output with the padding slot.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from attention_hd72 import D, manager_batch  # benchmarks/, the script's directory

from hwgraph.attention import gluon_kernel
from hwgraph.timing import graphed_ms

CASES = [("1x4096 in 4096", [4096], 4096, 1), ("1x3600 in 4096", [3600], 4096, 1),
         ("4x784 in 4096", [784] * 4, 4096, 4), ("2x1024 in 2048", [1024] * 2, 2048, 2),
         ("1x1024 in 1024", [1024], 1024, 1), ("1x2048 in 2048", [2048], 2048, 1)]


def base_module(rev: str, folder: Path):
    """``gluon_kernel`` of commit ``rev``, its imports of ``gluon_pingpong`` (and back) pointing at that commit's."""
    names = {"gluon_kernel": "base_gluon_kernel", "gluon_pingpong": "base_gluon_pingpong"}
    for name, alias in names.items():
        source = subprocess.run(["git", "show", f"{rev}:hwgraph/attention/{name}.py"], check=True,
                                capture_output=True, text=True).stdout
        for other, other_alias in names.items():
            source = source.replace(f"hwgraph.attention.{other}", other_alias)
        (folder / f"{alias}.py").write_text(source)
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("base_gluon_kernel", folder / "base_gluon_kernel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_gluon_kernel"] = module
    spec.loader.exec_module(module)
    return module


def main():
    rev = sys.argv[sys.argv.index("--base") + 1]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    print(torch.cuda.get_device_name(), f"base {rev} against the working tree", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = base_module(rev, Path(tmp))
        for label, seqs, rows, slots in CASES:
            qkv, cu, real, _ = manager_batch(seqs, rows, slots)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            fns = {}
            for pad in (False, True):
                for name, module in ((rev, base), ("now", gluon_kernel)):
                    fns[f"{name} pad={pad}"] = lambda m=module, pad=pad, args=(q, k, v, cu, rows, D**-0.5): \
                        m.launch_gluon_attention(*args, padding_slot=pad)
            ref = fns["now pad=True"]()[:real].clone()
            diffs = {n: (f()[:real] - ref).abs().max().item() for n, f in fns.items()}
            times = {n: [] for n in fns}
            for _ in range(rounds):
                for n, f in fns.items():
                    times[n].append(graphed_ms(f) * 1e3)
            print(label, " | ".join(f"{n} {' / '.join(f'{t:.1f}' for t in ts)} µs (maxdiff {diffs[n]:.1e})"
                                    for n, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
