"""HIP graphs: the shared ``torch.cuda`` implementation (ROCm torch maps it to HIP), with ROCm's caveats.

- Creating a hipBLASLt handle during capture hangs (pytorch#196397): the shared warm-up runs on the capture
  stream itself, so per-stream handles and workspaces exist before capture begins; ROCm warms up one run more.
- A capture may record a broken graph without raising where CUDA would raise (pytorch#155684): every capture is
  replayed once and compared with an eager run, and a mismatch beyond rounding is a ``CaptureError`` (that budget
  stays eager). Rounding, not bits: ROCm's math libraries do not promise the same bits from run to run.
- A capture can also crash the process where CUDA succeeds (pytorch#155720); no in-process check can catch that,
  which is why ``hwgraph validate`` runs the conformance suite before serving.
"""

from __future__ import annotations

import torch

from hwgraph.budget_capture import VERIFY_TOLERANCE
from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend
from hwgraph.platform import detect, platform_for


def replay_disagreement(replayed: list[torch.Tensor], eager: list[torch.Tensor]) -> str | None:
    """Why the replayed outputs are not the eager ones up to rounding, or None when they are. Per output: the same shape
    and dtype; NaN in the same places (as ``assert_close(equal_nan=True)``); a floating-point output within its dtype's
    ``VERIFY_TOLERANCE``, the relative L2 error the manager's verification allows every backend's replay (rounding:
    bf16 3e-2, float32 1e-4; a stale or unwritten output is off by about 1); any other output exactly equal."""
    if len(replayed) != len(eager):
        return f"{len(replayed)} outputs replayed, {len(eager)} from the eager run"
    for i, (got, want) in enumerate(zip(replayed, eager, strict=True)):
        where = f"output {i} of {len(eager)}"
        if got.shape != want.shape or got.dtype != want.dtype:
            return (f"{where} is {tuple(got.shape)} {got.dtype} replayed, {tuple(want.shape)} {want.dtype} from the "
                    f"eager run")
        if not want.is_floating_point():
            if not torch.equal(got, want):
                return f"{where}: {int((got != want).sum())} of {want.numel()} {want.dtype} elements differ"
            continue
        if not torch.equal(got.isnan(), want.isnan()):
            return f"{where}: NaN in other places"
        same = (got == want) | want.isnan()  # equal infinities too, whose difference would be NaN
        diff = torch.where(same, 0.0, got.float() - want.float())
        scale = torch.where(want.isfinite(), want.float(), 0.0)
        error = float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(scale).clamp_min(1e-30))
        bound = VERIFY_TOLERANCE.get(want.dtype, 1e-4)
        if not error <= bound:
            return f"{where}: relative error {error:.3g} above {bound} for {want.dtype}"
    return None


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

    def compare_replay(self, replayed: list[torch.Tensor], eager: list[torch.Tensor]) -> None:
        """``AssertionError`` where the replay disagrees with the eager run beyond rounding (``replay_disagreement``);
        that capture then fails its ``check_replay`` and the budget stays eager.

        Rounding, not bits: PyTorch lets rocBLAS use atomics unless deterministic algorithms are on, and rocBLAS
        promises the same bits only with atomics off and one stream per handle (the eager run is on the current
        stream, the graph was captured on the capture stream). Partial sums added in another order move outputs of the
        tower's 27 bf16 blocks by far more than ``torch.testing``'s elementwise bound (atol 1e-5), which would refuse
        good captures; a broken one (kernels not recorded, outputs stale) is off by about 1 in relative terms."""
        disagreement = replay_disagreement(replayed, eager)
        if disagreement is not None:
            raise AssertionError(disagreement)
