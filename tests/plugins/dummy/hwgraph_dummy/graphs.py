"""The dummy plugin's graph backend: the CPU reference emulation under its own name."""

from __future__ import annotations

from hwgraph.graphs.cpu import CpuGraphBackend


class DummyGraphBackend(CpuGraphBackend):
    name = "dummy"
