"""A simulated GPU runtime for testing gates, selection and graph backends' bookkeeping on a CPU-only machine (core
and plugin tests)."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

from hwgraph.graphs.cpu import CpuGraphBackend


class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns, reduced to the fields the gates read."""

    def __init__(self, name: str, major: int, minor: int, gcnArchName: str = ""):  # noqa: N803 (torch's spelling)
        self.name, self.major, self.minor, self.gcnArchName = name, major, minor, gcnArchName


def simulate_gpu(monkeypatch, *, cuda: str | None = None, hip: str | None = None, count: int = 1,
                 props: DeviceProperties | None = None) -> None:
    """Make torch report a CUDA (``cuda=`` version) or ROCm (``hip=`` version) build with ``count`` devices whose
    properties are ``props``, for the duration of a test (``monkeypatch``)."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


def simulate_aiter(monkeypatch) -> types.ModuleType:
    """Install an ``aiter`` module with a ``flash_attn_varlen_func`` that computes nothing, for the duration of a
    test: what the ROCm gates look for. Tests that call the kernel replace the function."""
    module = types.ModuleType("aiter")
    module.flash_attn_varlen_func = lambda **kwargs: None
    monkeypatch.setitem(sys.modules, "aiter", module)
    return module


class _BrokenModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, name: str, error: str):
        self.name, self.error = name, error

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(self.error) if isinstance(self.error, str) else self.error


def simulate_broken_import(monkeypatch, name: str, error: str | Exception) -> None:
    """Make module ``name`` installed but failing to import with ``ImportError(error)`` (or ``error`` itself, an
    exception), for the duration of a test: a ``torch_npu`` without the CANN toolkit's environment, a plugin module
    built against another core, a vendor runtime failing as it initialises (RuntimeError, OSError)."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenModule(name, error), *sys.meta_path])


class RefusedModeBackend(CpuGraphBackend):
    """A graph backend that refuses its default mode, 'aclgraph', when constructed, as npu's does on a torch_npu
    without ``torch.npu.NPUGraph``; its other mode works (as the cpu backend)."""
    name, modes = "refusedmode", ("aclgraph", "other")

    def __init__(self, device=None, mode=None):
        from hwgraph.registry import SelectionError

        if (mode or self.modes[0]) == "aclgraph":
            raise SelectionError("refusedmode graph mode 'aclgraph' is unavailable: no graph API")
        super().__init__(device, mode)


REFUSED_MODE_CLASS = f"{__name__}:RefusedModeBackend"


def simulate_refused_mode_backend(monkeypatch, class_path: str = REFUSED_MODE_CLASS) -> None:
    """Add ``RefusedModeBackend`` (from ``class_path``) to the discovered graph backends, for the duration of a test:
    its probe accepts this machine and outranks every other backend, so it is the automatic choice."""
    from hwgraph import registry
    from hwgraph.capability import Capability

    spec = registry.BackendSpec("refusedmode", class_path, (registry.detect().kind,), lambda p: Capability.available(),
                                modes=RefusedModeBackend.modes, priority=1000)
    real = registry.discovered()
    monkeypatch.setattr(registry, "discovered", lambda: ((*real[0], spec), real[1]))


class FakeStream:
    """A stream of a ``FakeGraphRuntime``: waiting on another is recorded in the runtime's ``events``."""

    def __init__(self, name: str, device, runtime: FakeGraphRuntime):
        self.name, self.device, self.runtime = name, device, runtime

    def wait_stream(self, other: FakeStream) -> None:
        self.runtime.events.append(f"{self.name} waits for {other.name}")


class FakeGraphRuntime:
    """The stream and device plumbing of a ``torch.cuda``-like namespace (``torch.cuda``, ``torch.npu``), for testing a
    graph backend's bookkeeping on the CPU: side streams are numbered and kept in ``streams``, what the backend calls
    is appended to ``events``. Subclasses add the graph, pool and memory calls they fake."""

    def __init__(self, count: int = 1):
        self.count, self.events, self.capturing, self.streams = count, [], False, []
        self.default = self.current = FakeStream("default", None, self)

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def Stream(self, device=None):  # noqa: N802 (torch's spelling)
        self.streams.append(FakeStream(f"side{len(self.streams) + 1}", device, self))
        return self.streams[-1]

    def current_stream(self):
        return self.current

    def set_stream(self, stream):
        self.current = stream

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def device(self, device):
        yield

    def is_current_stream_capturing(self):
        return self.capturing


def assert_refused_for_a_host_device(monkeypatch, backend: str, device, device_types: str) -> None:
    """On a (simulated) machine ``backend`` serves: naming it, as an argument or in ``$HWGRAPH_GRAPH_BACKEND``, for the
    CPU device ``device`` raises ``SelectionError`` saying it captures on ``device_types`` devices (not its gate's
    "no GPU visible"), and an automatic choice for that device is the cpu reference backend."""
    import re

    import pytest

    from hwgraph.registry import GRAPH_BACKEND_ENV, SelectionError, create_backend

    expected = f"graph backend {backend!r} captures on {device_types} devices; got device {str(device)!r}"
    monkeypatch.delenv(GRAPH_BACKEND_ENV, raising=False)
    with pytest.raises(SelectionError, match=f"^{re.escape(expected)}$"):
        create_backend(backend, device=device)
    monkeypatch.setenv(GRAPH_BACKEND_ENV, backend)
    with pytest.raises(SelectionError, match=f"^{re.escape(f'${GRAPH_BACKEND_ENV}: {expected}')}$"):
        create_backend(device=device)
    monkeypatch.delenv(GRAPH_BACKEND_ENV)
    assert type(create_backend(device=device)) is CpuGraphBackend
