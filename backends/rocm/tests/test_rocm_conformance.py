"""The shipped conformance suite against the rocm graph backend; skipped, with the gates' reasons, elsewhere."""

import pytest

from hwgraph.testing.suite import *  # noqa: F401,F403

pytestmark = pytest.mark.rocm  # selected by `pytest -m rocm`; the backend gate, not the marker, decides the skip
HWGRAPH_BACKEND = "rocm"
