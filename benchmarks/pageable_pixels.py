"""Does ``encode()`` of pixels in pageable host memory wait for work queued before it? (CUDA; a 2-block tower.)

The replay path stages host pixels in pinned memory (``pinned_copy``), as the eager path does. ``--old`` turns that
off, as before session 39, so the copy comes from pageable memory and the driver stages it. Each of five rounds
queues about 200 ms of device work, records an event, encodes one 49-token image (600 KB of bf16 pixels) and prints
whether the event was still pending when ``encode()`` returned (True: it did not wait).

    python benchmarks/pageable_pixels.py --old
    python benchmarks/pageable_pixels.py
"""

from __future__ import annotations

import argparse

import torch

import hwgraph.manager as manager_module
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", action="store_true", help="copy from pageable memory (no pinned staging)")
    args = p.parse_args()
    if args.old:
        manager_module.pinned_copy = lambda tensor: tensor
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", depth=2, deepstack_visual_indexes=[0, 1]).to(
        "cuda", torch.bfloat16).eval()
    grid = [(1, 14, 14)]
    host = torch.randn(196, tower.patch_row_width, dtype=torch.bfloat16)
    with EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, attention="auto") as m:
        m.capture()
        m.encode(host, grid)
        torch.cuda.synchronize()
        pending = []
        for _ in range(5):
            torch.cuda._sleep(400_000_000)
            slept = torch.cuda.Event()
            slept.record()
            m.encode(host, grid)
            pending.append(not slept.query())
            torch.cuda.synchronize()
    print("old (pageable)" if args.old else "new (pinned)", "encode returned before the earlier work ended:", pending)


if __name__ == "__main__":
    main()
