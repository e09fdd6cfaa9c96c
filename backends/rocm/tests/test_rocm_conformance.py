"""The shipped conformance suite against the rocm graph backend; skipped, with the gates' reasons, elsewhere."""

import pytest

from hwgraph.testing.suite import *  # noqa: F401,F403

# Selected by `pytest -m rocm`. Off a ROCm machine the marker skips every test here and so does the
# backend gate, whose reasons are the ones reported; on a ROCm machine the gate alone decides.
pytestmark = pytest.mark.rocm
HWGRAPH_BACKEND = "rocm"
