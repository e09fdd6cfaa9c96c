"""The shipped conformance suite against the npu graph backend; skipped, with the gates' reasons, elsewhere."""

import pytest

from hwgraph.testing.suite import *  # noqa: F401,F403

pytestmark = pytest.mark.npu  # selected by `pytest -m npu`; the backend gate, not the marker, decides the skip
HWGRAPH_BACKEND = "npu"
