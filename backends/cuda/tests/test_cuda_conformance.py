"""The shipped conformance suite against the cuda graph backend; skipped, with the gates' reasons, elsewhere."""

import pytest

from hwgraph.testing.suite import *  # noqa: F401,F403

pytestmark = pytest.mark.cuda  # selected by `pytest -m cuda`; the backend gate, not the marker, decides the skip
HWGRAPH_BACKEND = "cuda"
