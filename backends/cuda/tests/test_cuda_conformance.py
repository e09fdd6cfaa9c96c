"""The shipped conformance suite against the cuda graph backend; skipped, with the gates' reasons, elsewhere."""

import pytest

from hwgraph.testing.suite import *  # noqa: F401,F403

# Selected by `pytest -m cuda`. Off a CUDA machine the marker skips every test here and so does the
# backend gate, whose reasons are the ones reported; on a CUDA machine the gate alone decides.
pytestmark = pytest.mark.cuda
HWGRAPH_BACKEND = "cuda"
