"""The CPU reference backend: exact graph semantics, no speed (it runs on any device, eagerly).

Capture runs the callable once to warm it up, then records it and the output tensors of its second run; replay
reruns the callable and copies the results into those same tensors. Inputs are whatever the captured static
buffers hold at replay time, so stale inputs, outputs overwritten by the next replay, and padding leaking out show
up on CPU exactly as they would on a device. A rerun would read a tensor the caller put in place of a captured one
(``holder.x = new`` instead of ``holder.x.copy_(new)``), where a device graph keeps reading the captured buffer: the
second run notes the tensors it reads and where the callable finds them, and a replay that finds another tensor there
before its rerun, and again after it (the callable did not put the captured one back itself), raises ``CaptureError``
before writing its outputs (``hwgraph.graphs.capture_reads``; the noting: ``hwgraph.graphs.read_recording``). A
higher-order op (``torch.cond``, ``flex_attention``) is noted by its operands; a capture whose noting fails where a
plain run does not replays unchecked.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

from hwgraph.capability import Capability
from hwgraph.graphs.base import CapturedGraph, CaptureError, GraphBackend, Outputs, as_capture_error
from hwgraph.graphs.capture_reads import ReadPaths, captured_reads
from hwgraph.graphs.host_reads import RejectHostReads

__all__ = ["CpuCapturedGraph", "CpuGraphBackend", "CpuPool", "RejectHostReads", "flat_tensors"]


def flat_tensors(outputs: Outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for item in outputs for t in flat_tensors(item)]
    raise CaptureError(f"a captured callable must return tensors or tuples of tensors, got {type(outputs).__name__}")


def write_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into the static output ``dst``. Where ``dst`` broadcasts (stride 0, e.g. ``expand``) it holds each
    value once: written through one element of each broadcast dimension, as a device replay rewrites the memory behind
    it (``copy_`` refuses to write one element twice)."""
    for dim in range(dst.dim()):
        if dst.stride(dim) == 0 and dst.shape[dim] > 1:
            dst, src = dst.narrow(dim, 0, 1), src.narrow(dim, 0, 1)
    dst.copy_(src)


class CpuPool:
    """Emulated memory pool: tracks the graphs captured into it."""

    def __init__(self):
        self.graphs: weakref.WeakSet = weakref.WeakSet()

    def bytes_held(self) -> int:
        return sum(g.nbytes() for g in list(self.graphs))


class CpuCapturedGraph(CapturedGraph):
    """``replay()`` reruns ``fn`` and copies its results into ``outputs``. Where ``reads`` (the ways to the tensors the
    capture read) finds another tensor in place of one before the rerun, the rerun goes on, and the replay raises
    ``CaptureError`` before writing any output unless the rerun put the captured tensor back (``ReadPaths.check``):
    then the callable reads what a device graph reads. Where the rerun fails on the tensor put in place, the refusal
    is raised, with the rerun's error as its context."""

    def __init__(self, fn: Callable[[], Outputs], outputs: Outputs, reads: ReadPaths | None = None):
        self.fn = fn
        self.outputs = outputs
        self.pool: CpuPool | None = None  # set by the capture
        #: where ``fn`` finds the tensors its capture read; None: not checked
        self.reads = reads

    def replay(self) -> None:
        if self.outputs is None:
            raise RuntimeError("replay() of a released graph")
        # Before the rerun, one pass over the ways; a read found stale is refused only if the rerun leaves it stale:
        # a callable may put the captured tensor back itself before reading it (``self.table = cached(...)``, or a
        # holder another graph's callable pointed at its own buffer), and a device graph reads that tensor too.
        stale = self.reads.stale() if self.reads is not None else None
        # The static outputs were made under inference_mode at capture, so they may only be written inside it.
        with torch.inference_mode():
            try:
                fresh = flat_tensors(self.fn())
            except Exception:
                if stale:  # the rerun failed on the tensor put in place (another shape): that is the error to name
                    self.reads.check(before=stale)
                raise
            if stale:  # before any output is written
                self.reads.check(before=stale)
            static = flat_tensors(self.outputs)
            if len(fresh) != len(static):
                raise CaptureError(f"the captured callable returned a different number of outputs on replay: "
                                   f"{len(fresh)}, against {len(static)} at capture")
            for dst, src in zip(static, fresh, strict=True):
                if dst.shape != src.shape:
                    raise CaptureError(f"replay produced shape {tuple(src.shape)}, captured {tuple(dst.shape)}")
                if dst.dtype != src.dtype:  # copy_ would cast it silently; a device graph keeps its captured dtypes
                    raise CaptureError(f"replay produced dtype {src.dtype}, captured {dst.dtype}")
                write_into(dst, src)

    def nbytes(self) -> int:
        if self.outputs is None:
            return 0
        return sum(t.numel() * t.element_size() for t in flat_tensors(self.outputs))

    def release(self) -> None:
        self.fn = None
        self.outputs = None
        self.pool = None
        self.reads = None


class CpuGraphBackend(GraphBackend):
    name = "cpu"
    modes = ("emulated",)
    accelerates = False

    def __init__(self, device=None, mode=None):
        # Any device works: replay is an eager rerun, so this is also the eager-equivalent fallback elsewhere.
        super().__init__(device, mode)
        # weakly: a pool lives while its owner or one of its graphs holds it, not for the backend's life
        self._pools: weakref.WeakSet[CpuPool] = weakref.WeakSet()

    @classmethod
    def capability(cls, device=None) -> Capability:
        return Capability.available()

    def new_pool(self) -> CpuPool:
        pool = CpuPool()
        self._pools.add(pool)
        return pool

    def capture(self, fn, pool=None) -> CpuCapturedGraph:
        pool = pool if pool is not None else self.new_pool()
        if not isinstance(pool, CpuPool):
            raise TypeError(f"the {self.name} graph backend captures into a CpuPool (from new_pool()), got {pool!r}")
        # A failure is a CaptureError, with the device backends' words (TorchCudaGraphBackend.warm_up, capture_on)
        with torch.inference_mode():
            with as_capture_error("warm-up before capture failed"):
                flat_tensors(fn())  # warm-up, as a device backend does before capturing
            with as_capture_error("capture failed"):
                outputs, reads = captured_reads(fn)
        flat_tensors(outputs)
        graph = CpuCapturedGraph(fn, outputs, reads)
        graph.pool = pool  # kept while the graph is, as a device graph keeps its pool's memory
        pool.graphs.add(graph)
        self._pools.add(pool)
        return graph

    def synchronize(self) -> None:
        return None

    def memory_in_use(self) -> int:
        return sum(pool.bytes_held() for pool in list(self._pools))

    @contextlib.contextmanager
    def sync_guard(self):
        with RejectHostReads():
            yield
