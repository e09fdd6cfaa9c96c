"""Registers the ping-pong attention kernels spill, and where their SASS touches local memory.

Usage: python benchmarks/attention_spills.py
Compiles ``gluon_pingpong.hopper_attention_pingpong_kernel`` as the tower calls it (16 heads of 72, bf16, one
sequence) on 256-row q tiles (``PINGPONG_WIDE_TILES``, 4096 rows) and on 128-row tiles (``PINGPONG_TILES``, 2048
rows), assembles its PTX again with Triton's ``ptxas -v`` (which prints what Triton does not: spilled bytes and
advisories such as serialised ``wgmma``), and disassembles the cubin Triton built with its ``cuobjdump``: every
``LDL``/``STL`` (local memory) with its line and address, and the lines of the branches, to place them in the loop.
Needs a CUDA GPU of compute capability 9.x (the kernel is compiled for the device it runs on).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch
import triton
from attention_hd72 import manager_batch  # benchmarks/, the script's directory

from hwgraph.attention.gluon_kernel import PINGPONG_TILES, PINGPONG_WIDE_TILES, kernel_call

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CASES = [("1x4096, 256-row tiles", 4096, PINGPONG_WIDE_TILES), ("1x2048, 128-row tiles", 2048, PINGPONG_TILES)]


def main():
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    for label, rows, tiles in CASES:
        qkv, cu, _, _ = manager_batch([rows], rows, 1, 72)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        kernel, grid, args, kwargs = kernel_call(q, k, v, torch.empty_like(q), cu, rows, 72**-0.5, tiles)
        compiled = kernel.warmup(*args, **kwargs, grid=grid)
        with tempfile.TemporaryDirectory() as folder:
            ptx, cubin = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
            with open(ptx, "w") as f:
                f.write(compiled.asm["ptx"])
            with open(cubin, "wb") as f:
                f.write(compiled.asm["cubin"])
            arch = "sm_{}{}a".format(*torch.cuda.get_device_capability())
            report = subprocess.run([os.path.join(BIN, "ptxas"), "-v", f"-arch={arch}", ptx, "-o",
                                     os.path.join(folder, "again.cubin")], capture_output=True, text=True)
            sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True, check=True).stdout.splitlines()
        print(f"{label}: ptxas -v", flush=True)
        if report.returncode:
            raise RuntimeError(f"ptxas failed ({report.returncode}): {report.stderr.strip()}")
        for line in report.stderr.splitlines():
            if "spill" in line or "Used" in line or "wgmma" in line or "Performance" in line:
                print("   ", line.strip(), flush=True)
        local = [i for i, line in enumerate(sass) if "LDL" in line or "STL" in line]
        print(f"{label}: {len(sass)} SASS lines, {len(local)} touch local memory", flush=True)
        for i in local:
            print(f"    line {i}: {sass[i].strip()[:80]}", flush=True)
        branches = [i for i, line in enumerate(sass) if " BRA" in line]
        print(f"{label}: branches at lines {branches}", flush=True)


if __name__ == "__main__":
    main()
