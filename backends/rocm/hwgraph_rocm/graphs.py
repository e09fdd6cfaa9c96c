"""HIP graphs: the shared ``torch.cuda`` implementation (ROCm torch maps it to HIP), with ROCm's caveats.

- Creating a hipBLASLt handle during capture hangs (pytorch#196397): the shared warm-up runs on the capture
  stream itself, so per-stream handles and workspaces exist before capture begins; ROCm warms up one run more.
- A capture may record a broken graph without raising where CUDA would raise (pytorch#155684): every capture is
  replayed once and compared with an eager run, and a mismatch is a ``CaptureError`` (that budget stays eager).
- A capture can also crash the process where CUDA succeeds (pytorch#155720); no in-process check can catch that,
  which is why ``hwgraph validate`` runs the conformance suite before serving.
"""

from __future__ import annotations

import torch

from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.platform import detect, platform_for


class RocmGraphBackend(TorchCudaGraphBackend):
    name = "rocm"
    modes = ("full",)
    warmup_runs = 3
    check_replay_after_capture = True

    @classmethod
    def capability(cls, device=None) -> Capability:
        from hwgraph_rocm.platform import gate

        if device is not None and torch.device(device).type != cls.runtime_name:
            return cls.device_capability(device)  # its platform is not a GPU's: the gate would say no GPU is visible
        cap = gate(detect() if device is None else platform_for(device))  # that GPU's architecture, not device 0's
        return cls.device_capability(device) if cap.ok else cap
