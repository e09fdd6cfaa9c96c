"""The CPU reference backend: exact graph semantics, no speed (it runs on any device, eagerly).

Capture records the callable and the output tensors of its first run; replay reruns the callable and copies
the results into those same tensors. Inputs are whatever the captured static buffers hold at replay time, so
stale inputs, outputs overwritten by the next replay, and padding leaking out show up on CPU exactly as they
would on a device.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable

import torch

from hwgraph.capability import Capability
from hwgraph.graphs.base import CapturedGraph, CaptureError, GraphBackend, HostSyncError, Outputs


def flat_tensors(outputs: Outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for item in outputs for t in flat_tensors(item)]
    raise CaptureError(f"a captured callable must return tensors or tuples of tensors, got {type(outputs).__name__}")


class CpuPool:
    """Emulated memory pool: tracks the graphs captured into it."""

    def __init__(self):
        self.graphs: weakref.WeakSet = weakref.WeakSet()

    def bytes_held(self) -> int:
        return sum(g.nbytes() for g in list(self.graphs))


class CpuCapturedGraph(CapturedGraph):
    def __init__(self, fn: Callable[[], Outputs], outputs: Outputs):
        self.fn = fn
        self.outputs = outputs

    def replay(self) -> None:
        if self.outputs is None:
            raise RuntimeError("replay() of a released graph")
        # The static outputs were made under inference_mode at capture, so they may only be written inside it.
        with torch.inference_mode():
            fresh = flat_tensors(self.fn())
            static = flat_tensors(self.outputs)
            if len(fresh) != len(static):
                raise CaptureError("the captured callable returned a different number of outputs on replay")
            for dst, src in zip(static, fresh, strict=True):
                if dst.shape != src.shape:
                    raise CaptureError(f"replay produced shape {tuple(src.shape)}, captured {tuple(dst.shape)}")
                dst.copy_(src)

    def nbytes(self) -> int:
        if self.outputs is None:
            return 0
        return sum(t.numel() * t.element_size() for t in flat_tensors(self.outputs))

    def release(self) -> None:
        self.fn = None
        self.outputs = None


class RejectHostReads:
    """While active, the tensor methods that read device memory back to the host raise ``HostSyncError``.

    The methods are replaced on ``torch.Tensor`` itself rather than intercepted by a torch function mode: a mode
    is switched off inside its own handler, so calls nested in Python-implemented ops (custom-op bodies among
    them) would slip through. Process-wide while active (other threads' reads are rejected too); re-entrant and
    safe to enter and leave from several threads: the first guard in replaces the methods, the last one out puts
    them back. Public so that device backends without a runtime sync-debug mode reuse it as their sync guard.

    On the emulated device every tensor is on the CPU, so ``.cpu()`` and a blocking ``.to("cpu")`` stand for the
    device-to-host copies they are on a device. ``.numpy()`` is not rejected: torch refuses it for a device tensor
    (``TypeError``, no synchronisation), so it only ever reads host memory, such as a ``grid_thw`` the caller made.
    """

    FORBIDDEN = {
        "item": ".item()",
        "tolist": ".tolist()",
        "cpu": ".cpu()",
        "__bool__": "bool()",
        "__int__": "int()",
        "__float__": "float()",
        "__index__": "operator.index() (a tensor as a Python int: range(), a list subscript)",
    }
    _depth = 0  # guards active now, in every thread; changed only under _lock
    _saved: dict = {}
    _lock = threading.Lock()

    @staticmethod
    def _rejecting(what: str):
        def reject(*args, **kwargs):
            raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host synchronisation "
                                f"on the replay path")
        return reject

    @staticmethod
    def _rejecting_host_copies(to):
        """``Tensor.to`` that rejects a blocking copy to the host; casts and non-blocking copies go through."""
        def reject_host_copy(self, *args, **kwargs):
            device, non_blocking = host_copy_target(args, kwargs)
            if device is not None and device.type == "cpu" and not non_blocking:
                raise HostSyncError(f".to({str(device)!r}) on a tensor inside sync_guard(): a device-to-host "
                                    f"synchronisation on the replay path")
            return to(self, *args, **kwargs)
        return reject_host_copy

    def __enter__(self):
        cls = RejectHostReads
        with cls._lock:  # one thread saves the originals and replaces them; the others only count themselves in
            if cls._depth == 0:
                cls._saved = {name: torch.Tensor.__dict__.get(name) for name in (*cls.FORBIDDEN, "to")}
                for name, what in cls.FORBIDDEN.items():
                    setattr(torch.Tensor, name, cls._rejecting(what))
                torch.Tensor.to = cls._rejecting_host_copies(torch.Tensor.to)
            cls._depth += 1
        return self

    def __exit__(self, *exc):
        cls = RejectHostReads
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                for name, original in cls._saved.items():
                    if original is None:
                        delattr(torch.Tensor, name)
                    else:
                        setattr(torch.Tensor, name, original)
        return False


def host_copy_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """The device a ``Tensor.to(*args, **kwargs)`` call names and whether it is non-blocking; ``(None, False)`` for a
    cast, a ``.to(other_tensor)`` (it follows a tensor, wherever that is), or arguments ``to`` itself will refuse."""
    if args and isinstance(args[0], torch.Tensor):
        return None, False
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # torch's parser of to()'s arguments lacks copy
    for given in (args, args[:-1]):  # the second: a positional copy flag dropped
        try:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*given, **kwargs)
        except (TypeError, RuntimeError):
            continue
        return device, bool(non_blocking)
    return None, False


class CpuGraphBackend(GraphBackend):
    name = "cpu"
    modes = ("emulated",)
    accelerates = False

    def __init__(self, device=None, mode=None):
        # Any device works: replay is an eager rerun, so this is also the eager-equivalent fallback elsewhere.
        super().__init__(device, mode)
        self._pools: list[CpuPool] = []

    @classmethod
    def capability(cls, device=None) -> Capability:
        return Capability.available()

    def new_pool(self) -> CpuPool:
        pool = CpuPool()
        self._pools.append(pool)
        return pool

    def capture(self, fn, pool=None) -> CpuCapturedGraph:
        pool = pool if pool is not None else self.new_pool()
        with torch.inference_mode():
            fn()  # warm-up, as a device backend does before capturing
            outputs = fn()
        flat_tensors(outputs)
        graph = CpuCapturedGraph(fn, outputs)
        pool.graphs.add(graph)
        return graph

    def synchronize(self) -> None:
        return None

    def memory_in_use(self) -> int:
        return sum(pool.bytes_held() for pool in self._pools)

    @contextlib.contextmanager
    def sync_guard(self):
        with RejectHostReads():
            yield
