"""The conformance suite's results and cases, and the CPU reference backend: each test failed on the code before
its fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hwgraph.attention.sdpa import TORCH_SDPA
from hwgraph.graphs import CaptureError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.testing.cases import SuiteSettings, conformance_params
from hwgraph.testing.results import ResultCollector, failing_checks


def report(nodeid, when, outcome, longrepr=None):
    return pytest.TestReport(nodeid, ("m.py", 1, nodeid), {}, outcome, longrepr, when, duration=0.1)


def test_a_skipped_check_whose_teardown_fails_is_an_error_not_a_skip():
    """pytest counts an error for a check skipped in its body (a vendor's override) or at setup whose teardown then
    fails (the manager fixture's weights check, a module fixture's finalizer): the collector kept it as skipped, so
    validate's report listed no failing check while pytest's exit status said one failed."""
    collector = ResultCollector()
    overridden, marked = "m.py::TestCapture::test_x[cpu-TORCH_SDPA-float32]", "m.py::T::last[cpu-X-float32]"
    for event in [
        report(overridden, "setup", "passed"),
        report(overridden, "call", "skipped", ("m.py", 9, "Skipped: overridden by the vendor")),
        report(overridden, "teardown", "failed", "AssertionError: capture changed the tower's weights in place"),
        report(marked, "setup", "skipped", ("m.py", 9, "Skipped: not selected")),
        report(marked, "teardown", "failed", "RuntimeError: module fixture teardown broke"),
    ]:
        collector.pytest_runtest_logreport(event)
    got = {r.check: (r.outcome, r.message) for r in collector.results.values()}
    assert got == {
        "TestCapture::test_x[cpu-TORCH_SDPA-float32]": (
            "error", "teardown: AssertionError: capture changed the tower's weights in place"),
        "T::last[cpu-X-float32]": ("error", "teardown: RuntimeError: module fixture teardown broke"),
    }
    assert collector.counts() == {"passed": 0, "failed": 0, "error": 2, "skipped": 0}
    results = {"results": [r.as_dict() for r in collector.results.values()]}
    assert len(failing_checks(results)) == 2


def test_a_selected_kernel_for_another_accelerator_is_a_skip_saying_why(monkeypatch):
    """HWGRAPH_ATTENTION naming an installed kernel of another accelerator (ROCM_AITER_FA in a CUDA job) had no case at
    all: every other kernel was skipped as 'not selected', and the one asked for vanished without a reason."""
    from hwgraph.attention import registry

    other = dataclasses.replace(TORCH_SDPA, name="OTHER_ACCEL", kinds=("npu",))
    monkeypatch.setattr(registry, "kernel_specs", lambda: [TORCH_SDPA, other])
    base = {"backend": "cpu", "preset": "tiny", "dtype": None, "allowed_backends": None}
    params = {p.id: p for p in conformance_params(SuiteSettings(kernels=("OTHER_ACCEL",), **base))}
    assert set(params) == {"cpu-TORCH_SDPA-float32", "cpu-OTHER_ACCEL-float32"}
    [mark] = params["cpu-OTHER_ACCEL-float32"].marks
    assert mark.name == "skip" and mark.kwargs["reason"] == \
        "attention kernel OTHER_ACCEL runs on npu, not on the cpu graph backend's cpu devices"
    # not selected, it is still no concern of this backend's conformance: no case at all
    params = {p.id: p for p in conformance_params(SuiteSettings(kernels=None, **base))}
    assert set(params) == {"cpu-TORCH_SDPA-float32"} and not params["cpu-TORCH_SDPA-float32"].marks


def test_a_replay_whose_output_dtype_differs_from_the_captured_one_raises():
    """A device graph replays the kernels it captured, so its outputs keep their dtypes; the emulation cast a replay's
    new dtype into the captured outputs silently (copy_), hiding a forward that changed between capture and replay."""
    dtype = [torch.float32]
    x = torch.ones(4)
    graph = CpuGraphBackend().capture(lambda: (x * 2).to(dtype[0]))
    dtype[0] = torch.float64
    with pytest.raises(CaptureError, match=r"^replay produced dtype torch\.float64, captured torch\.float32$"):
        graph.replay()
    dtype[0] = torch.float32
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4,), 6.0))
