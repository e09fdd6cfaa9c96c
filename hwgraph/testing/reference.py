"""Reference varlen attention in float64 and random packed batches, for the kernel conformance tests.

The reference is deliberately simple (a host loop over sequences, on the CPU): it is the definition every kernel
is compared with, not something to run on the replay path.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import torch

# (atol, rtol) of a kernel's output against the float64 reference, by input dtype. Low-precision kernels round
# the softmax weights to the input dtype before the second matmul, hence the looser bounds than torch.testing's.
ATTENTION_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class PackedBatch:
    """One packed varlen batch: ``q, k, v`` ``[tokens, heads, head_dim]`` and int32 ``cu_seqlens``.

    ``seqlens`` lists the real sequences; ``zero_length`` empty sequences repeat the last boundary and
    ``padding_rows`` rows past ``cu_seqlens[-1]`` belong to no sequence.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    scale: float
    seqlens: tuple[int, ...]
    zero_length: int
    padding_rows: int

    @property
    def total(self) -> int:
        return sum(self.seqlens)

    def args(self) -> tuple:
        """The common kernel arguments ``(q, k, v, cu_seqlens, max_seqlen, scale)``."""
        return self.q, self.k, self.v, self.cu_seqlens, self.max_seqlen, self.scale


def random_seqlens(rng: random.Random, max_seqs: int = 6, max_len: int = 700, min_len: int = 1) -> list[int]:
    """1 to ``max_seqs`` lengths, each in ``min_len..max_len``; one long sequence is drawn often on purpose."""
    n = rng.randint(1, max_seqs)
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    if rng.random() < 0.3:
        lengths[rng.randrange(n)] = max_len
    return lengths


def random_packed_batch(seqlens, heads: int, head_dim: int, *, zero_length: int = 0, padding_rows: int = 0,
                        max_seqlen: int | None = None, dtype: torch.dtype = torch.float32, device="cpu",
                        seed: int = 0, scale: float | None = None) -> PackedBatch:
    """A packed batch of ``seqlens`` with random ``q, k, v``; padding rows hold large garbage values so that a
    kernel letting them leak into real rows, or copying them out, fails the comparison."""
    seqlens = tuple(int(n) for n in seqlens)
    total = sum(seqlens)
    tokens = total + padding_rows
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=gen, dtype=torch.float32) for _ in range(3))
    for t in (q, k, v):
        t[total:] = 1e3
    bounds = [0]
    for n in seqlens:
        bounds.append(bounds[-1] + n)
    bounds += [total] * zero_length
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return PackedBatch(
        q=q.to(device=device, dtype=dtype), k=k.to(device=device, dtype=dtype), v=v.to(device=device, dtype=dtype),
        cu_seqlens=cu_seqlens, max_seqlen=max(seqlens, default=0) if max_seqlen is None else max_seqlen,
        scale=head_dim ** -0.5 if scale is None else scale, seqlens=seqlens, zero_length=zero_length,
        padding_rows=padding_rows,
    )


def as_the_tower_passes(batch: PackedBatch, fill: float = 1e3) -> PackedBatch:
    """``batch`` with ``q, k, v`` laid out as the tower passes them: views with three different token strides (v a
    slice of the ``[T, 3, H, D]`` qkv product; q and k slices of a rotary output, ``[T, 2, H, D]`` or
    ``[2, T, H, D]``), the elements between them ``fill``. A kernel that reads them as contiguous, or reads one with
    another's strides, reads ``fill``."""
    q, k, v = batch.q, batch.k, batch.v

    def view(t: torch.Tensor, parts: int, dim: int, index: int) -> torch.Tensor:
        shape = list(t.shape)
        shape.insert(dim, parts)
        whole = torch.full(shape, fill, dtype=t.dtype, device=t.device)
        part = whole.select(dim, index)
        part.copy_(t)
        return part

    return replace(batch, q=view(q, 2, 1, 0), k=view(k, 2, 0, 1), v=view(v, 3, 1, 2))


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int],
                     scale: float) -> torch.Tensor:
    """float64 CPU ``[T, H, D]``: softmax(q k^T * scale) v within each sequence; rows past the last one are zero.

    ``cu_seqlens`` may be host ints, so that fake vendor kernels can call this inside a sync guard (on CPU tensors
    it makes no host copy, which the CPU backend's guard would reject as one).
    """
    q, k, v = ((t if t.device.type == "cpu" else t.cpu()).detach().to(torch.float64) for t in (q, k, v))
    bounds = cu_seqlens.detach().cpu().tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    out = torch.zeros_like(q)
    for start, end in pairwise(bounds):
        if end <= start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        weights = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[start:end] = (weights @ vs).transpose(0, 1)
    return out


def assert_matches_reference(out: torch.Tensor, batch: PackedBatch, dtype: torch.dtype | None = None) -> None:
    """``out`` equals the float64 reference within the dtype's tolerance, and its padding rows are exactly zero."""
    expected = varlen_reference(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.scale)
    atol, rtol = ATTENTION_TOLERANCES[dtype or batch.q.dtype]
    got = out.detach().to("cpu", torch.float64)
    assert got.shape == expected.shape, f"output shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    pad = got[batch.total:]
    assert torch.equal(pad, torch.zeros_like(pad)), (
        f"{batch.padding_rows} padding rows must be zero, max |value| {pad.abs().max().item() if pad.numel() else 0}")
    torch.testing.assert_close(got[:batch.total], expected[:batch.total], atol=atol, rtol=rtol)
