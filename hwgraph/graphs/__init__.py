"""Graph backends: the interface and the built-in CPU reference backend."""

from hwgraph.graphs.base import CapturedGraph, CaptureError, GraphBackend, HostSyncError

__all__ = ["CapturedGraph", "CaptureError", "GraphBackend", "HostSyncError"]
