"""The varlen attention interface every kernel implements, and its spec.

Signature of every kernel: ``fn(q, k, v, cu_seqlens, max_seqlen, scale) -> out`` where ``q, k, v`` are packed
``[tokens, heads, head_dim]`` tensors, ``cu_seqlens`` is an int32 device tensor of cumulative sequence starts
(``[num_seqs + 1]``, first entry 0, non-decreasing; trailing repeats are zero-length padding sequences),
``max_seqlen`` a host int (a captured graph keeps the value it was captured with) and ``scale`` a float.
``out`` is ``[tokens, heads, head_dim]`` in q's dtype. Rows at or past ``cu_seqlens[-1]`` belong to no sequence:
their output is zero. A sequence's non-finite k or v reaches no other sequence.

The caller guarantees, and no kernel checks on the device (that would read it back): ``cu_seqlens`` starts at 0
and never decreases, ``cu_seqlens[-1] <= tokens``, and ``max_seqlen`` is at least the longest sequence. Otherwise
the output is unspecified, and a Triton kernel may read and write past the tensors (the tower's metadata always
holds all three).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from hwgraph import spec_fields
from hwgraph.budgets import is_int
from hwgraph.capability import Capability
from hwgraph.platform import PlatformInfo

log = logging.getLogger(__name__)

VarlenAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


# ``KernelSpec.head_dims`` of a kernel that takes any head dim (torch's SDPA, whose math backend takes any).
ANY_HEAD_DIM = (1, 1 << 16)


@dataclass(frozen=True)
class KernelSpec:
    name: str  # "TORCH_SDPA", "FLASH_ATTN", ...
    impl_path: str  # "package.module:function", a VarlenAttention; imported only when chosen
    kinds: tuple[str, ...]  # platform kinds it runs on
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, int]  # inclusive range of supported head dims
    graph_safe: bool
    gate: Callable[[PlatformInfo], Capability]
    priority: int = 0  # higher is preferred when chosen automatically
    description: str = ""
    # The kernel launches blocks for every cu_seqlens slot, empty ones included, so a graph captured with room for
    # more sequences than a call has runs slower (ATen's flash kernel: grid (query blocks, slots, heads), whose
    # empty-slot blocks pack the real ones two to an SM). The manager then captures each budget once per slot
    # count (``EncoderGraphManager(slot_counts=...)``) and replays the one with the fewest slots that fit.
    slot_bound: bool = False
    # A priority that depends on the platform (a kernel with a faster path on some architectures), or None for
    # ``priority`` everywhere. Automatic choice orders kernels by ``rank(platform)``.
    priority_on: Callable[[PlatformInfo], int] | None = None
    # The kernel needs the sequence boundaries as host values (NPU's fused attention takes host lists): it reads
    # ``given_host_cu_seqlens()``, which the tower sets from its host metadata, and only without it reads
    # ``cu_seqlens`` back from the device.
    reads_host_boundaries: bool = False
    # A gate that also depends on the dtype, for a dtype in ``dtypes`` that some of the kernel's platforms cannot run
    # (TRITON_ATTN's bf16 products below sm_80), or None. Judged, as ``gate`` is, only once the platform passes.
    dtype_gate: Callable[[PlatformInfo, torch.dtype], Capability] | None = None

    def __post_init__(self):
        name = f"KernelSpec {self.name!r}"
        spec_fields.text("KernelSpec", "name", self.name)
        spec_fields.text(name, "impl_path", self.impl_path, empty=True)  # empty: a callable given to the tower
        object.__setattr__(self, "kinds", spec_fields.names(name, "kinds", self.kinds))
        object.__setattr__(self, "dtypes", spec_fields.items(name, "dtypes", self.dtypes, torch.dtype))
        head_dims = self.head_dims
        if not (isinstance(head_dims, (tuple, list)) and len(head_dims) == 2 and all(map(is_int, head_dims))
                and 1 <= head_dims[0] <= head_dims[1]):
            raise TypeError(f"{name}: head_dims is (lowest, highest), ints with 1 <= lowest <= highest, "
                            f"got {head_dims!r}")
        object.__setattr__(self, "head_dims", tuple(int(d) for d in head_dims))
        for field in ("graph_safe", "slot_bound", "reads_host_boundaries"):
            spec_fields.flag(name, field, getattr(self, field))
        spec_fields.function(name, "gate", self.gate)
        spec_fields.integer(name, "priority", self.priority)
        spec_fields.text(name, "description", self.description, empty=True)
        spec_fields.function(name, "priority_on", self.priority_on, optional=True)
        spec_fields.function(name, "dtype_gate", self.dtype_gate, optional=True)

    def rank(self, platform: PlatformInfo) -> int:
        """The kernel's priority on ``platform``: ``priority_on(platform)`` where given, else ``priority``, which a
        ``priority_on`` that raises (or returns no int) falls back to, logged: as with a gate, a plugin's error must
        not take automatic selection and ``hwgraph info`` down with it."""
        if self.priority_on is None:
            return self.priority
        try:
            return int(self.priority_on(platform))
        except Exception as exc:
            log.warning("%s's priority_on failed (%s: %s); ranking it by its priority, %d", self.name,
                        type(exc).__name__, exc, self.priority)
            return self.priority

    def capability(self, platform: PlatformInfo, dtype: torch.dtype | None = None,
                   head_dim: int | None = None) -> Capability:
        """Whether the kernel runs on ``platform`` for ``dtype`` (a ``torch.dtype``) and ``head_dim`` (an int), each
        judged when given; ``TypeError`` naming either when it is of another type (a dtype's name, "bfloat16", was
        refused as "supports dtypes ..., bfloat16, ..., got bfloat16")."""
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16), got {dtype!r} "
                            f"({type(dtype).__name__})")
        if head_dim is not None and not is_int(head_dim):
            raise TypeError(f"head_dim must be an int, got {head_dim!r} ({type(head_dim).__name__})")
        from hwgraph.registry import gate_capability

        reasons = list(gate_capability(self.name, self.gate, platform).reasons)
        if not reasons and platform.kind not in self.kinds:
            reasons.append(f"{self.name} runs on {'/'.join(self.kinds)}, this platform is {platform.kind}")
        if dtype is not None and dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"{self.name} supports dtypes {names}, got {str(dtype).removeprefix('torch.')}")
        elif dtype is not None and self.dtype_gate is not None and not reasons:
            dtype_gate = self.dtype_gate
            reasons.extend(gate_capability(self.name, lambda p: dtype_gate(p, dtype), platform).reasons)
        lo, hi = self.head_dims
        if head_dim is not None and not lo <= head_dim <= hi:
            reasons.append(f"{self.name} supports head_dim {lo}..{hi}, got {head_dim}")
        return Capability(tuple(reasons))

    def load(self) -> VarlenAttention:
        """The kernel's function. An ``impl_path`` that does not import, or names no callable, is named in an
        ``ImportError``, whatever the import raised: a vendor runtime may raise RuntimeError or OSError as it
        initialises, and that took automatic choice down instead of passing the kernel over (as ``BackendSpec.load``
        does for a backend)."""
        from hwgraph.registry import load_object

        try:
            fn = load_object(self.impl_path)
            if not callable(fn):  # the spec named instead of its function: chosen, it failed at the first forward
                raise TypeError(f"it names a {type(fn).__name__}, not a function")
            return fn
        except Exception as exc:
            raise ImportError(f"attention kernel {self.name!r} declares impl_path {self.impl_path!r}, which does not "
                              f"load: {type(exc).__name__}: {exc}") from exc


_host_cu_seqlens: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "hwgraph_host_cu_seqlens", default=None)


@contextlib.contextmanager
def host_cu_seqlens(values: Sequence[int]) -> Iterator[None]:
    """Within this block, kernels that read their boundaries on the host (``KernelSpec.reads_host_boundaries``)
    take them from ``values`` (host ints equal to the ``cu_seqlens`` they are given) instead of reading the device
    tensor back."""
    token = _host_cu_seqlens.set(tuple(int(x) for x in values))
    try:
        yield
    finally:
        _host_cu_seqlens.reset(token)


def given_host_cu_seqlens() -> tuple[int, ...] | None:
    """The values of the innermost ``host_cu_seqlens`` block, or None outside one."""
    return _host_cu_seqlens.get()


def check_attention_request(request) -> None:
    """``TypeError`` naming ``request`` unless it is what a tower takes as its attention: a kernel name, ``"auto"``,
    a callable, or None (keep the current one)."""
    if request is not None and not isinstance(request, str) and not callable(request):
        raise TypeError(f"attention must be a kernel name, 'auto', a callable or None, got {request!r}")
