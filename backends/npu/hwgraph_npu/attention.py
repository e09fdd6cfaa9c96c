"""NPU: Ascend fused attention (``torch_npu.npu_fused_infer_attention_score``, layout TND).

The Ascend kernel takes the sequence boundaries as HOST lists (``actual_seq_lengths``: cumulative ends, the last
equal to the token count), while the common signature passes ``cu_seqlens`` on the device. Callers that have the
host boundaries hand them over with ``hwgraph.attention.base.host_cu_seqlens(...)`` (the tower does, from its host
metadata: ``NPU.reads_host_boundaries``); only without them does
the kernel read ``cu_seqlens`` back to the host, a device sync that is logged once. Rows past ``cu_seqlens[-1]``
are zeroed on the device (except through ``npu_varlen.padding_unspecified``, which the tower uses).

Not graph-safe (``NPU.graph_safe`` is False). A captured call keeps the host lists it was captured with, so a replay
for other images would attend across their boundaries. The fix that ARCHITECTURE.md and VENDOR_APIS.md describe
(capture each call in a task group, rewrite its lists before every replay with ``torch.npu.graph_task_update_*``) is
not built: it cannot be tested without an Ascend NPU. So a graph manager's automatic choice on NPU takes the best
graph-safe kernel (TORCH_SDPA), and a manager given ``attention="NPU"`` runs every call eagerly, saying why.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

from hwgraph.attention.base import KernelSpec, given_host_cu_seqlens, host_cu_seqlens  # noqa: F401 (re-exported)
from hwgraph.attention.varlen_inputs import (
    check_varlen_inputs,
    differentiable_attention,
    eager_or_op,
    records_grad,
    zero_padding_rows,
)
from hwgraph.capability import Capability, require_module
from hwgraph.platform import PlatformInfo

log = logging.getLogger(__name__)

PADDED_HEAD_DIM = 128
#: npu_fused_infer_attention_score with fp16/bf16 inputs and more than one query row per sequence needs D "16对齐"
#: (a multiple of 16): op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md, 约束说明, Q_S大于1.
HEAD_DIM_ALIGN = 16


def kernel_head_dim(head_dim: int) -> int:
    """The head dim the Ascend kernel is given: 65..127 padded to 128 (the kernel tiles 64 and 128), any other dim
    that is not a multiple of 16 padded up to one. Zero lanes leave q.k and the kept slice of p.v unchanged."""
    if 64 < head_dim < PADDED_HEAD_DIM:
        return PADDED_HEAD_DIM
    return -(-head_dim // HEAD_DIM_ALIGN) * HEAD_DIM_ALIGN


def sequence_ends(cu_seqlens: Sequence[int], tokens: int) -> list[int]:
    """``actual_seq_lengths`` for TND: cumulative ends without zero-length sequences, closed at ``tokens``.

    The kernel requires the last end to equal the token count, so padding rows become one trailing sequence
    (its output is zeroed afterwards). Repeated boundaries (empty sequences) are dropped: they own no row.
    """
    ends = [end for start, end in pairwise(cu_seqlens) if end > start]
    if not ends or ends[-1] < tokens:
        ends.append(tokens)
    return ends


def check_host_cu_seqlens(values: Sequence[int], cu_seqlens: torch.Tensor, tokens: int) -> None:
    if len(values) != cu_seqlens.shape[0]:
        raise ValueError(f"NPU: host cu_seqlens has {len(values)} entries, the device cu_seqlens "
                         f"{cu_seqlens.shape[0]}")
    if values[0] != 0 or any(b < a for a, b in pairwise(values)) or values[-1] > tokens:
        raise ValueError(f"NPU: host cu_seqlens must start at 0, not decrease and end at most at {tokens} "
                         f"tokens, got {list(values)}")


@functools.lru_cache(maxsize=1)
def scale_keyword() -> str:
    # torch_npu renamed scale_value to scale; read the installed op's schema instead of guessing by version.
    try:
        schema = torch.ops.npu.npu_fused_infer_attention_score.default._schema
        names = {arg.name for arg in schema.arguments}
    except Exception:
        return "scale"
    return "scale" if "scale" in names or "scale_value" not in names else "scale_value"


#: SoC versions (``torch_npu.npu.get_soc_version()``) of chips whose torch_npu lacks this kernel in layout TND: its API
#: reference lists Atlas A2 (Ascend910B1-B4, 220-225) and Atlas A3 (250-255) only. Others, newer ones included,
#: are not refused. torch_npu's SocVersion numbers the 310P from 200 up: 310P5 is 204, 310P7 205 or 206 (by release).
UNSERVED_SOCS = ((range(100, 105), "a first-generation Ascend 910"), (range(200, 207), "an Ascend 310P"),
                 (range(240, 244), "an Ascend 310B"))


def soc_refusal(torch_npu) -> str | None:
    """Why this machine's NPU cannot run the kernel, from its SoC version; None where it may (or torch_npu cannot
    say: an unreadable version is not a refusal)."""
    get = getattr(getattr(torch_npu, "npu", None), "get_soc_version", None)
    try:
        soc = int(get()) if callable(get) else None
    except Exception:  # a runtime that cannot say
        soc = None
    for versions, chip in UNSERVED_SOCS:
        if soc in versions:
            return (f"NPU attention (npu_fused_infer_attention_score, layout TND) runs on Atlas A2 and A3 NPUs; "
                    f"this one is {chip} (SoC version {soc})")
    return None


def npu_gate(platform: PlatformInfo) -> Capability:
    if platform.kind != "npu":
        return Capability.unavailable(f"NPU attention runs on Ascend NPUs, this platform is {platform.kind}")
    found = require_module("torch_npu", "NPU attention")
    if not found.ok:
        return found
    import torch_npu

    reasons = []
    if not callable(getattr(torch_npu, "npu_fused_infer_attention_score", None)):
        reasons.append(f"NPU attention needs torch_npu.npu_fused_infer_attention_score, which torch_npu "
                       f"{getattr(torch_npu, '__version__', '(unknown version)')} lacks")
    if platform.device_count < 1:
        reasons.append("NPU attention needs an Ascend NPU device, torch_npu sees none")
    elif (refusal := soc_refusal(torch_npu)) is not None:
        reasons.append(refusal)
    return Capability(tuple(reasons))


@functools.lru_cache(maxsize=1)
def warn_host_read() -> None:
    log.warning("NPU attention read cu_seqlens back to the host (a device sync); pass the host values "
                "with hwgraph.attention.base.host_cu_seqlens(...) to avoid it")


def npu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  scale: float, seq_ends: list[int]) -> torch.Tensor:
    """The kernel body (unchecked): ``[T, H, D]`` in, ``[T, H, D]`` out; ``seq_ends`` from ``sequence_ends``.
    Padding rows (the trailing sequence the kernel is given) come back as the kernel computed them."""
    import torch_npu

    tokens, heads, head_dim = q.shape
    padded = kernel_head_dim(head_dim)
    if padded != head_dim:
        q, k, v = (F.pad(t, (0, padded - head_dim)) for t in (q, k, v))
    else:
        q, k, v = (t.contiguous() for t in (q, k, v))  # the kernel takes no strided views (the tower's v is one)
    out = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=heads, input_layout="TND", actual_seq_lengths=seq_ends, actual_seq_lengths_kv=seq_ends,
        **{scale_keyword(): scale})
    if isinstance(out, (tuple, list)):  # (attention_out, softmax_lse)
        out = out[0]
    # A padded head comes back as a slice: contiguous, the layout the op's fake gives (torch.compile trusts it)
    return out[..., :head_dim].contiguous()


NPU_DTYPES = (torch.float16, torch.bfloat16)
NPU_HEAD_DIMS = (1, 256)
npu_varlen_op = torch.library.custom_op("hwgraph::npu_varlen", npu_attention, mutates_args=())


@npu_varlen_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, seq_ends):
    return q.new_empty(q.shape)


def npu_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               max_seqlen: int, scale: float) -> torch.Tensor:
    """Varlen attention: ``q, k, v`` ``[T, H, D]`` fp16/bf16 on an NPU, ``cu_seqlens`` int32 ``[n + 1]``; rows
    past ``cu_seqlens[-1]`` come back zero.

    Host boundaries come from ``host_cu_seqlens(...)``; without it this reads ``cu_seqlens`` to the host.
    """
    return zero_padding_rows(npu_varlen_padding_unspecified(q, k, v, cu_seqlens, max_seqlen, scale), cu_seqlens)


def npu_varlen_padding_unspecified(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                   max_seqlen: int, scale: float) -> torch.Tensor:
    """``npu_varlen`` without zeroing the padding rows (what the tower uses: its padding rows never mix into real
    ones; the same split as ``hwgraph.attention.varlen_inputs.register_varlen_kernel``'s)."""
    check_varlen_inputs("NPU", q, k, v, cu_seqlens, max_seqlen, scale, NPU_DTYPES, NPU_HEAD_DIMS)
    if records_grad(q, k, v):  # the op has no backward
        return differentiable_attention("NPU", q, k, v, cu_seqlens, scale)
    tokens = q.shape[0]
    host = given_host_cu_seqlens()
    if host is None:
        # Last resort: a device-to-host read (a sync, and not capturable). Supply host_cu_seqlens to avoid it.
        warn_host_read()
        host = tuple(cu_seqlens.tolist())
    check_host_cu_seqlens(host, cu_seqlens, tokens)
    args = (q, k, v, cu_seqlens, int(max_seqlen), float(scale), sequence_ends(host, tokens))
    return eager_or_op(npu_varlen_op, npu_attention)(*args)


npu_varlen.padding_unspecified = npu_varlen_padding_unspecified
# What NPU says, for a tower or manager given the function itself (they read a callable's own attributes): captured,
# it read cu_seqlens back at every replay, and on an NPU would keep the host lengths of its capture; and without host
# boundaries every block of an eager forward read them back.
npu_varlen.graph_safe = False
npu_varlen.reads_host_boundaries = True


NPU = KernelSpec(
    name="NPU",
    impl_path="hwgraph_npu.attention:npu_varlen",
    kinds=("npu",),
    dtypes=NPU_DTYPES,
    head_dims=NPU_HEAD_DIMS,
    graph_safe=False,  # see the module docstring: the per-replay update of its host lists is not built
    reads_host_boundaries=True,
    gate=npu_gate,
    priority=30,
    description="torch_npu.npu_fused_infer_attention_score (TND, host sequence lengths; head dims 65..127 "
                "padded to 128; eager only: a capture would keep its host sequence lengths)",
)
