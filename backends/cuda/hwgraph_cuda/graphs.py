"""CUDA graphs: the shared ``torch.cuda`` implementation, gated by this plugin's probe."""

from __future__ import annotations

import torch

from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.platform import detect


class CudaGraphBackend(TorchCudaGraphBackend):
    """CUDA graphs. The capture itself (not its warm-up) runs with ``CUBLASLT_WORKSPACE_SIZE=0`` unless the process
    sets that variable itself.

    With a workspace, cuBLASLt runs the larger products (the tower's qkv and fc1 at 4096 rows on the H200) with a
    dynamically scheduled kernel that zeroes a counter in its workspace before each launch. A captured graph keeps
    those memsets as memset nodes. Each one delays its product by about 4.5 µs, and launching the graph costs the
    host about 0.95 ms instead of 0.17 (54 memsets in the 1024-token graph; ``benchmarks/cublaslt_workspace.py``,
    ``docs/benchmarks.md``, session 12).

    Without a workspace, cuBLASLt takes the statically scheduled variant of the same tiles, with the same results
    bit for bit. PyTorch reads the variable at each cuBLASLt call, so it only applies while the graph is captured;
    eager calls keep the process's workspace.

    The warm-up runs first, with the workspace as the process has it. PyTorch allocates a stream's workspace at that
    stream's first cuBLAS call, with the size read then, so every stream the captured function uses already holds a
    full-size workspace when the capture asks for none.
    """

    name = "cuda"
    modes = ("full",)
    capture_environment = {"CUBLASLT_WORKSPACE_SIZE": "0"}

    @classmethod
    def capability(cls, device=None) -> Capability:
        from hwgraph_cuda.platform import gate

        cap = gate(detect())
        return cls.device_capability(device) if cap.ok else cap

    def products_support(self) -> Capability:
        from hwgraph_cuda.products import products_support

        return products_support(self.device)

    def product_chooser(self):
        """The process's ``MeasuredProducts`` for this GPU: the fastest cuBLASLt configuration per shape, measured
        once (and cached between processes, ``hwgraph_cuda.product_cache.cache_path``)."""
        from hwgraph_cuda.products import measured_products

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return measured_products(index)
