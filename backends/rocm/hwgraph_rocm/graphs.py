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

#: A replayed row (the output read as rows over its last dimension, the hidden size) may be this many times the dtype's
#: whole-output ``VERIFY_TOLERANCE`` off in relative L2 (bf16: 0.12): rounding concentrates in the few rows where an
#: early rounding went the other way (27 bf16 blocks summed in another order: whole output 2e-3, worst row 1.6e-2),
#: while a stale row is off by far more (zeros: 1; another image's row: tens of percent even where images share most
#: of each row).
ROW_SLACK = 4.0

#: A row's error is relative to its own norm or to this fraction of the tensor's typical row norm (its RMS times
#: sqrt(hidden)), whichever is larger: a near-zero row (a residual that cancels) carries rounding at its inputs' scale.
ROW_FLOOR = 0.25

#: Rows narrower than this are judged only as a whole output: in a row of a few elements the relative error is one
#: element's, and rounding alone passed ``ROW_SLACK`` times the bound (54 bf16 blocks summed in another order, then a
#: product to one column: a row at 0.21 while the whole output was at 0.016).
MIN_ROW_WIDTH = 64


def row_name(row: int, leading: tuple[int, ...]) -> str:
    """Row ``row`` of the flattened leading dimensions ``leading``, named by its index: ``row 7``, ``row (1, 3)``."""
    if len(leading) <= 1:
        return f"row {row}"
    index = []
    for size in reversed(leading):
        row, i = divmod(row, size)
        index.append(i)
    return f"row {tuple(reversed(index))}"


def misplaced(got: torch.Tensor, want: torch.Tensor, what: str, leading: tuple[int, ...]) -> str | None:
    """Where the masks ``got`` and ``want`` (rows x hidden: NaN, +inf or -inf) differ: the first such row, or None."""
    rows = (got != want).any(dim=-1)
    if not bool(rows.any()):
        return None
    row = int(rows.nonzero()[0, 0])
    return (f"{what} in other places: {row_name(row, leading)} has {int(got[row].sum())} {what} replayed, "
            f"{int(want[row].sum())} from the eager run ({int(rows.sum())} of {rows.numel()} rows differ)")


def float_disagreement(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why floating-point ``got`` is not ``want`` up to rounding (same shape and dtype), or None.

    Read as rows over the last dimension (``[..., hidden]``; a 0-d tensor is one row of one): NaN and infinities in the
    same places; the whole output's relative L2 error within ``VERIFY_TOLERANCE[dtype]``; each row's, in rows of at
    least ``MIN_ROW_WIDTH`` elements, within ``ROW_SLACK`` times that, a row's norm floored at ``ROW_FLOOR`` of the
    typical row's. The whole-output bound alone let a few stale rows through: 4 rows of 4096 are 3% of the norm,
    bf16's bound is 3%. Compared in float64, whose range holds the squares of any narrower dtype's values (in float32,
    bf16 values near 1e20 made the norm inf, and values near 1e-25 made it 0), and which holds float8 too (torch has no
    ``isposinf`` for it)."""
    if want.numel() == 0:
        return None
    hidden = want.shape[-1] if want.dim() else 1
    leading = tuple(want.shape[:-1])
    dtype = want.dtype
    bound = VERIFY_TOLERANCE.get(dtype, 1e-4)
    got, want = got.reshape(-1, hidden).double(), want.reshape(-1, hidden).double()  # exact for every float dtype
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if (reason := misplaced(test(got), test(want), what, leading)) is not None:
            return reason
    same = (got == want) | want.isnan()  # NaN and infinities in the same places: equal there, their difference is NaN
    diff = torch.where(same, 0.0, got - want)
    scale = torch.where(want.isfinite(), want, 0.0)
    diff_rows = torch.linalg.vector_norm(diff, dim=-1)
    scale_rows = torch.linalg.vector_norm(scale, dim=-1)
    total = torch.linalg.vector_norm(scale_rows)
    typical_row = total / len(scale_rows) ** 0.5
    row_errors = diff_rows / torch.maximum(scale_rows, ROW_FLOOR * typical_row).clamp_min(1e-300)
    worst = int(row_errors.argmax())
    worst_error = float(row_errors[worst])
    error = float(torch.linalg.vector_norm(diff_rows) / total.clamp_min(1e-300))
    row_bound = ROW_SLACK * bound
    worst_row = f"{row_name(worst, leading)} of {len(row_errors)}"
    if not error <= bound:
        return (f"relative error {error:.3g} above {bound} for {dtype} (worst {worst_row}: relative error "
                f"{worst_error:.3g})")
    if hidden >= MIN_ROW_WIDTH and not worst_error <= row_bound:
        above = int((row_errors > row_bound).sum())
        return (f"{worst_row} has relative error {worst_error:.3g}, above the per-row bound {row_bound:.3g} for "
                f"{dtype} ({above} rows above it; a row replayed stale or unwritten, though the whole output's "
                f"{error:.3g} is within {bound})")
    return None


def replay_disagreement(replayed: list[torch.Tensor], eager: list[torch.Tensor]) -> str | None:
    """Why the replayed outputs are not the eager ones up to rounding, or None when they are. Per output: the same shape
    and dtype; a floating-point output within ``float_disagreement``'s bounds, the relative L2 error the manager's
    verification allows every backend's replay (``VERIFY_TOLERANCE``: bf16 3e-2, float32 1e-4) over the whole output
    and a few times that in every row (a stale or unwritten row is off by about 1); any other output exactly equal."""
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
        if (reason := float_disagreement(got, want)) is not None:
            return f"{where}: {reason}"
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
