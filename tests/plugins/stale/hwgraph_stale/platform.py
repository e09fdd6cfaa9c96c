"""The stale backend's probe: always available on CPU, never chosen automatically."""

from __future__ import annotations

from hwgraph.capability import Capability
from hwgraph.registry import BackendSpec


def probe() -> BackendSpec:
    return BackendSpec(
        name="stale",
        class_path="hwgraph_stale.graphs:StaleGraphBackend",
        kinds=("cpu",),
        gate=lambda platform: Capability.available(),
        modes=("emulated",),
        priority=-100,
        description="test plugin: replays stop updating their outputs after the first",
        distribution="hwgraph-backend-stale",
    )
