"""``hwgraph validate`` on CPU: the report passes for the cpu backend and fails, naming the check, for a broken one;
the result collector's outcomes, and the conformance run it starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hwgraph.testing.results import ResultCollector, failing_checks, run_conformance, suite_module
from hwgraph.validate import verdict

STALE = Path(__file__).parent / "plugins" / "stale"
FAST = ["--tokens", "4", "16", "--warmup", "0", "--samples", "1"]


def run_validate(args, env=None, timeout=300):
    env = {**os.environ, **(env or {})}
    env.pop("HWGRAPH_TEST_BACKENDS", None)
    env.pop("HWGRAPH_GRAPH_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "hwgraph.cli", "validate", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.cpu_machine  # on an accelerator, validate chooses its backend and preset
def test_validate_on_cpu_writes_a_passing_report_with_plot(tmp_path):
    out = tmp_path / "report"
    result = run_validate(["--report", str(out), *FAST])
    assert result.returncode == 0, result.stdout + result.stderr
    assert {"report.md", "report.json", "latency.png", "conformance.log"} <= {p.name for p in out.iterdir()}
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "**PASS" in md and "Validated: **cpu**" in md and "| cpu | yes | emulated | **yes** |" in md
    for section in ("## Platform", "## Versions", "## Attention kernels", "## Conformance", "## Latency",
                    "## Graph memory per budget", "## Dispatch", "![latency against image tokens](latency.png)"):
        assert section in md, section
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is True and report["backend"] == "cpu"
    counts = report["conformance"]["counts"]
    assert counts["passed"] >= 10 and counts["failed"] == counts["error"] == 0
    assert [r["group"] for r in report["bench"]["rows"]] == ["1x4", "1x16"]
    assert "PASS" in result.stdout and "report.md" in result.stdout


@pytest.fixture(scope="module")
def stale_site(tmp_path_factory):
    """The deliberately broken plugin, installed as a separate distribution into its own folder."""
    tmp = tmp_path_factory.mktemp("stale")
    source = tmp / "src"
    shutil.copytree(STALE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    return target


def test_validate_fails_a_backend_whose_replays_go_stale_naming_the_checks(tmp_path, stale_site):
    out = tmp_path / "report"
    path = os.pathsep.join(filter(None, [str(stale_site), os.environ.get("PYTHONPATH")]))
    result = run_validate(["--backend", "stale", "--report", str(out), "--no-bench"], env={"PYTHONPATH": path})
    assert result.returncode == 1, result.stdout + result.stderr
    check = "TestReplayEqualsEager::test_single_image_replays_at_each_budget_and_equals_eager[stale-TORCH_SDPA-float32"
    assert f"conformance check failed: {check}-full]" in result.stderr
    assert "TestRetainedOutputs::" in result.stderr and "not close" in result.stderr
    report = json.loads((out / "report.json").read_text())
    outcomes = {r["check"]: r["outcome"] for r in report["conformance"]["results"]}
    # The manager's post-capture verification replays once and passes: only the suite's own checks catch it.
    assert outcomes["TestCapture::test_every_budget_captures_and_reports_its_memory[stale-TORCH_SDPA-float32]"] \
        == "passed"
    assert outcomes[f"{check}-padded]"] == "failed"
    md = (out / "report.md").read_text()
    assert "**FAIL" in md and f"`{check}-full]`" in md and "latency.png not written" in md


@pytest.mark.parametrize("argv, reason", [
    pytest.param(["--backend", "cuda"], "graph backend 'cuda' is unavailable: ", marks=pytest.mark.cpu_machine),
    (["--backend", "cpu", "--attention", "FLASH_ATTN"], "attention kernel FLASH_ATTN is unavailable: "),
], ids=["unavailable backend", "unavailable kernel"])
def test_a_benchmark_that_cannot_run_here_is_explained_without_a_traceback(tmp_path, argv, reason):
    from hwgraph.attention.registry import kernel_specs

    if "FLASH_ATTN" in argv and "FLASH_ATTN" not in {k.name for k in kernel_specs()}:
        pytest.skip("FLASH_ATTN comes with hwgraph-backend-cuda, which is not installed")
    out = tmp_path / "report"
    out.mkdir()
    (out / "latency.png").write_bytes(b"an earlier run's plot")
    result = run_validate(["--report", str(out), *argv, *FAST])
    assert result.returncode == 1, result.stdout + result.stderr  # nothing validated: no check ran
    assert not (out / "latency.png").exists()  # the report says none was drawn
    assert "Traceback" not in result.stderr, result.stderr
    assert f"latency.png not written: {reason}" in result.stdout
    md = (out / "report.md").read_text()
    assert f"No benchmark: {reason}" in md
    assert json.loads((out / "report.json").read_text())["bench_error"].startswith(reason)


def test_the_verdict_fails_when_no_check_ran():
    conformance = {"exit_code": 0, "counts": {"passed": 0, "failed": 0, "error": 0, "skipped": 2},
                   "results": [{"check": "x", "outcome": "skipped", "message": "graph backend 'cuda' is unavailable"}]}
    ok, summary = verdict(conformance)
    assert not ok and "no conformance check ran" in summary and "cuda" in summary


def test_the_generated_suite_module_names_backend_preset_and_kernels():
    text = suite_module("rocm", "tiny", ["triton_attn"], "bfloat16")
    assert "from hwgraph.testing.suite import *" in text
    assert "HWGRAPH_BACKEND = 'rocm'" in text and "HWGRAPH_ATTENTION = ('TRITON_ATTN',)" in text
    assert "HWGRAPH_DTYPE = 'bfloat16'" in text


def report(nodeid, when, outcome, longrepr=None, duration=0.25):
    return pytest.TestReport(nodeid, ("m.py", 1, nodeid), {}, outcome, longrepr, when, duration=duration)


def test_the_collector_reports_skips_with_their_reason_and_setup_or_teardown_failures_as_errors():
    collector = ResultCollector()
    skipped_case = "m.py::TestCapture::test_x[cpu-TRITON_ATTN-float32]"
    reason = "attention kernel TRITON_ATTN is unavailable: on CPU TRITON_ATTN runs only under the Triton interpreter"
    events = [
        report(skipped_case, "setup", "skipped", ("m.py", 149, f"Skipped: {reason}")),
        report(skipped_case, "teardown", "passed"),
        report("m.py::T::broken_fixture", "setup", "failed", "RuntimeError: capture failed"),
        report("m.py::T::broken_fixture", "teardown", "passed"),
        report("m.py::T::leaks", "setup", "passed"),
        report("m.py::T::leaks", "call", "passed"),
        report("m.py::T::leaks", "teardown", "failed", "AssertionError: pool not released"),
        report("m.py::T::wrong", "setup", "passed"),
        report("m.py::T::wrong", "call", "failed", "AssertionError: not close"),
        report("m.py::T::ok", "setup", "passed"),
        report("m.py::T::ok", "call", "passed"),
    ]
    for event in events:
        collector.pytest_runtest_logreport(event)
    got = {r.check: (r.outcome, r.message) for r in collector.results.values()}
    assert got == {
        "TestCapture::test_x[cpu-TRITON_ATTN-float32]": ("skipped", reason),
        "T::broken_fixture": ("error", "RuntimeError: capture failed"),
        "T::leaks": ("error", "teardown: AssertionError: pool not released"),
        "T::wrong": ("failed", "AssertionError: not close"),
        "T::ok": ("passed", ""),
    }
    assert collector.counts() == {"passed": 1, "failed": 1, "error": 2, "skipped": 1}
    results = {"results": [r.as_dict() for r in collector.results.values()]}
    assert [r["check"] for r in failing_checks(results)] == ["T::broken_fixture", "T::leaks", "T::wrong"]


def test_run_conformance_runs_the_explicit_backend_without_the_environments_narrowing(tmp_path, monkeypatch):
    """``hwgraph validate --backend cpu`` with HWGRAPH_TEST_BACKENDS=rocm left in the environment must still run the
    cpu cases (not skip them all as excluded), and leave the variable as it found it."""
    seen = []

    def main(args, plugins=()):
        seen.append(os.environ.get("HWGRAPH_TEST_BACKENDS"))
        return 0

    monkeypatch.setenv("HWGRAPH_TEST_BACKENDS", "rocm")
    monkeypatch.setattr(pytest, "main", main)
    result = run_conformance(tmp_path, "cpu", "tiny")
    assert seen == [None] and result["exit_code"] == 0
    assert os.environ["HWGRAPH_TEST_BACKENDS"] == "rocm"


class FakeTerminal:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_the_progress_bar_draws_only_on_a_terminal():
    from hwgraph.progress import Progress

    for tty in (True, False):
        stream = FakeTerminal(tty)
        with Progress("conformance", total=4, stream=stream) as bar:
            bar.advance(note="TestCapture")
        assert ("conformance [#######" in stream.text and "1/4" in stream.text) is tty
        assert (stream.text == "") is not tty
