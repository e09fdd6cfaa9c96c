"""The shipped conformance suite against the CPU reference backend (the one every CI machine has)."""

from hwgraph.testing.suite import *  # noqa: F401,F403

HWGRAPH_BACKEND = "cpu"
