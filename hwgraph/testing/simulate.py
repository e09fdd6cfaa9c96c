"""A simulated GPU runtime for testing gates and selection on a CPU-only machine (core and plugin tests)."""

from __future__ import annotations

import torch


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
