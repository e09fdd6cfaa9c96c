"""Graph memory per budget of a process's first and second plain managers (the full Qwen3-Omni tower, bf16, CUDA).

A stream's first cuBLAS call gives it workspaces the process keeps (34 MiB on the H200). Before ``GraphBackend.prepare``
(c3a709e and the commit after it), the capture stream's and the DeepStack merger stream's were counted in the first
manager's budgets; ``--no-prepare`` turns ``prepare`` off to show that. Run each variant in a new process:

    python benchmarks/first_manager_memory.py --no-prepare
    python benchmarks/first_manager_memory.py
"""

from __future__ import annotations

import argparse

import torch

from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower


def mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-prepare", action="store_true", help="the code before GraphBackend.prepare")
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    args = p.parse_args()
    if args.no_prepare:
        TorchCudaGraphBackend.prepare = lambda self, fn, **options: None
        print("prepare() turned off")
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b").to("cuda", torch.bfloat16).eval()
    for which in ("first", "second"):
        with EncoderGraphManager(tower, budgets=args.budgets, max_images_per_graph=4) as m:
            m.capture()
            per = m.stats()["capture_bytes_per_budget"]
            print(f"{which} manager ({m.tower.attention_kernel}), graph memory per budget (MiB):",
                  {b: mib(n) for b, n in sorted(per.items())}, "total", mib(sum(per.values())))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
