"""The shipped conformance suite against the npu graph backend; skipped, with the gates' reasons, elsewhere."""

import pytest

from hwgraph.testing.suite import *  # noqa: F401,F403

# Selected by `pytest -m npu`. Off an Ascend machine the marker skips every test here and so does the
# backend gate, whose reasons are the ones reported; on an Ascend machine the gate alone decides.
pytestmark = pytest.mark.npu
HWGRAPH_BACKEND = "npu"
