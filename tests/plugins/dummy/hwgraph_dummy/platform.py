"""The dummy plugin's probe: available everywhere, never preferred over the CPU reference backend."""

from __future__ import annotations

from hwgraph.capability import Capability
from hwgraph.registry import BackendSpec


def probe() -> BackendSpec:
    return BackendSpec(
        name="dummy",
        class_path="hwgraph_dummy.graphs:DummyGraphBackend",
        kinds=("cpu",),
        gate=lambda platform: Capability.available(),
        modes=("emulated",),
        priority=-1,
        description="test plugin: the CPU reference backend under another name",
        distribution="hwgraph-backend-dummy",
    )
