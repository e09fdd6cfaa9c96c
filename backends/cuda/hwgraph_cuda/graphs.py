"""CUDA graphs: the shared ``torch.cuda`` implementation, gated by this plugin's probe."""

from __future__ import annotations

from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.platform import detect


class CudaGraphBackend(TorchCudaGraphBackend):
    name = "cuda"
    modes = ("full",)

    @classmethod
    def capability(cls, device=None) -> Capability:
        from hwgraph_cuda.platform import gate

        cap = gate(detect())
        return cls.device_capability(device) if cap.ok else cap
