"""The graph-backend interface every capture/replay implementation provides."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from hwgraph.capability import Capability, require_module

Outputs = Any  # a tensor, or a tuple/list of tensors, as returned by the captured callable


class CaptureError(RuntimeError):
    """A capture failed; the manager logs it and leaves that budget eager."""


@contextlib.contextmanager
def as_capture_error(step: str):
    """Inside: an ``Exception`` is raised again as a ``CaptureError`` "``step``: its type: its message" (a
    ``CaptureError`` as it is; ``KeyboardInterrupt`` and the like pass), so every backend words a failed step alike."""
    try:
        yield
    except CaptureError:
        raise
    except Exception as exc:
        raise CaptureError(f"{step}: {type(exc).__name__}: {exc}") from exc


class HostSyncError(RuntimeError):
    """A device-to-host synchronisation happened inside ``sync_guard()``."""


class CountedSwitch:
    """A process-wide setting that overlapping users share: the first one in turns it on, the last one out turns it
    back to what the first one found. Re-entrant, and safe to enter and leave from several threads (each restoring
    what it found would turn the setting off while another's block still runs, or leave it on for good).

    ``turn_on()`` applies the setting and returns what it replaced; ``turn_off(that)`` puts that back. ``with
    switch:`` holds it on for the block; ``depth`` is how many blocks hold it now, in every thread.
    """

    def __init__(self, turn_on: Callable[[], Any], turn_off: Callable[[Any], None]):
        self._turn_on, self._turn_off = turn_on, turn_off
        self._lock = threading.Lock()
        self._found = None
        self.depth = 0  # changed only under _lock

    def __enter__(self):
        with self._lock:
            if self.depth == 0:
                self._found = self._turn_on()
            self.depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        with self._lock:
            if self.depth == 0:  # below zero the switch would never turn on again, silently
                raise RuntimeError("CountedSwitch left more often than entered")
            self.depth -= 1
            if self.depth == 0:
                found, self._found = self._found, None
                self._turn_off(found)
        return False


class CapturedGraph(ABC):
    """One captured callable. ``outputs`` are static tensors that every ``replay()`` overwrites in place."""

    outputs: Outputs

    @abstractmethod
    def replay(self) -> None: ...

    def release(self) -> None:
        """Drop the graph and its outputs; the pool memory returns once every graph in it is released."""
        self.outputs = None


class GraphBackend(ABC):
    """Capture/replay primitives of one accelerator.

    ``capture(fn, pool)`` calls ``fn()`` (which reads only static input tensors and returns its outputs) to warm
    it up, then captures it; ``replay()`` reruns it on whatever the static inputs hold now, into the same output
    tensors. The manager calls ``capture`` inside ``torch.inference_mode()`` and ``replay()`` outside it: a backend
    that emulates replay by writing into the captured (inference) outputs enters ``inference_mode`` in ``replay()``,
    as ``CpuCapturedGraph`` does.
    """

    name: ClassVar[str]
    modes: ClassVar[tuple[str, ...]] = ("full",)
    #: Whether replay actually saves launches (False only for the CPU reference emulation).
    accelerates: ClassVar[bool] = True

    def __init__(self, device: torch.device | str | None = None, mode: str | None = None):
        self.device = torch.device(device) if device is not None else self.default_device()
        if mode is None:  # only None: a falsy mode ('' or 0) is a mistake to name, not a request for the default
            mode = self.modes[0]
        elif not isinstance(mode, str):
            raise TypeError(f"graph backend {self.name!r} takes a mode name (one of {list(self.modes)}), "
                            f"got mode={mode!r}")
        if mode not in self.modes:
            raise ValueError(f"graph backend {self.name!r} has modes {list(self.modes)}, got mode={mode!r}")
        self.mode = mode

    @classmethod
    @abstractmethod
    def capability(cls, device: torch.device | str | None = None) -> Capability: ...

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device("cpu")

    @abstractmethod
    def new_pool(self) -> Any: ...

    @abstractmethod
    def capture(self, fn: Callable[[], Outputs], pool: Any = None) -> CapturedGraph: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def memory_in_use(self) -> int:
        """Bytes of device memory this backend's allocator holds now (graph pools included)."""

    def empty_cache(self) -> None:
        """Return cached free memory to the device (after graphs are released). No-op where there is no cache."""
        return None

    def prepare(self, fn: Callable[[], Outputs], *, current_stream: bool = False) -> None:
        """Called before the memory a capture of ``fn`` costs is measured: make now what the runtime makes on the
        first use of a stream the capture runs on and keeps for the process (e.g. the math libraries' per-stream
        workspaces), so that it is not counted as that capture's. ``current_stream``: the caller will also run
        ``fn`` on the current stream before it measures (a compiled forward's first call). No-op by default."""
        return None

    def compile_support(self) -> Capability:
        """Whether ``EncoderGraphManager(compile=True)`` may compile forwards with ``torch.compile`` (inductor)
        before this backend captures them; the reasons say why not (the manager then captures uncompiled)."""
        return inductor_support(self.device)

    def products_support(self) -> Capability:
        """Whether ``EncoderGraphManager(measure_products=True)`` can have ``product_chooser()`` pick the matrix
        products' kernels by measurement while capturing (``hwgraph.products``); the reasons say why not."""
        return Capability.unavailable(f"the {self.name} graph backend has no measured choice of matrix-product "
                                      f"kernels; its graphs run ATen's")

    def product_chooser(self) -> Any:
        """The ``hwgraph.products.ProductChooser`` this backend captures the products with; only called where
        ``products_support()`` is ok."""
        raise NotImplementedError(f"the {self.name} graph backend has no product chooser")

    def numerics_settings(self, dtype: torch.dtype) -> tuple:
        """The process-wide settings that decide how this backend's kernels compute in ``dtype`` and that a captured
        graph keeps from its capture, as ``(name, value)`` pairs (e.g. CUDA's TF32 setting for float32 products).
        The manager reads them when it captures a budget and before each replay: a graph captured under other
        settings is not replayed (its group runs eagerly, under the settings of now) until ``capture()`` captures
        it again. Cheap (host reads only, no device). ``()`` by default: nothing kept (an emulating backend runs the
        forward at each replay)."""
        return ()

    @abstractmethod
    def sync_guard(self) -> contextlib.AbstractContextManager:
        """A context inside which any device-to-host synchronisation raises."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, mode={self.mode!r})"


def inductor_support(device: torch.device) -> Capability:
    """Whether inductor generates code for ``device``: Triton on CUDA and ROCm GPUs, C++ on the CPU."""
    if device.type == "cuda":  # CUDA and ROCm builds of torch both name their GPUs "cuda"
        found = require_module("triton", "torch.compile's inductor on GPUs")
        from hwgraph.attention.triton_attn import interpreter_enabled, interpreter_refusal

        return interpreter_refusal("inductor's kernels", "cuda") if found.ok and interpreter_enabled() else found
    if device.type == "cpu":
        # Only the compilers inductor itself runs: on a host with c++ or clang++ but no g++, every compiled capture
        # failed ("InvalidCxxCompiler") where this said available.
        searched = inductor_cpp_compilers()
        if any(shutil.which(name) for name in searched):
            return Capability.available()
        return Capability.unavailable(f"torch.compile's inductor on CPU needs a C++ compiler: it runs "
                                      f"{' or '.join(searched)} (torch._inductor.config.cpp.cxx, which CXX sets when "
                                      f"inductor is imported), and none was found on PATH")
    return Capability.unavailable(f"torch.compile's inductor generates no code for {device.type} devices")


def inductor_cpp_compilers() -> list[str]:
    """The C++ compilers inductor's CPU code generation tries, in order (``torch._inductor.config.cpp.cxx``, without
    its conda download of g++, which is off unless ``TORCH_INDUCTOR_INSTALL_GXX`` is set). Read from inductor's
    config once it is imported (it takes ``CXX`` then); before, as it will read it, without importing it (1-2 s)."""
    config = sys.modules.get("torch._inductor.config")
    cxx = getattr(getattr(config, "cpp", None), "cxx", None) if config is not None else None
    if cxx is None:
        if sys.platform == "win32":
            return [os.environ.get("CXX", "cl")]
        cxx = (os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++"),)
    return [name for name in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if name]
