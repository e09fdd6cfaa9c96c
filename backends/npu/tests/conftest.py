"""The tests that simulate an Ascend NPU run in a child pytest process.

Simulating one renames torch's privateuse1 device type to "npu", as importing torch_npu does, so that
``torch.device("npu:0")`` parses. torch cannot undo that rename in-process: every later test of the session would
take "npu" for a device type, as no machine without torch_npu does. So the tests that request ``simulated_npu_process``
(the ``npu`` fixture does) run together in one child process, at the first one's turn here; each one's reports are
then replayed in its own turn, as if it had run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

REPORTS_FILE = "HWGRAPH_SIMULATED_NPU_REPORTS"  # set in the child process: where it writes its reports
FIXTURE = "simulated_npu_process"
CHILD_REPORTS = pytest.StashKey[dict]()
CHILD_OUTPUT = pytest.StashKey[str]()


@pytest.fixture
def simulated_npu_process():
    """A test that requests this may rename privateuse1: it runs in the child process."""
    if REPORTS_FILE not in os.environ:
        pytest.fail(f"{FIXTURE} outside the child process of {__file__}")


def runs_in_child(item) -> bool:
    return FIXTURE in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if REPORTS_FILE in os.environ or not runs_in_child(item):
        return None
    reports = child_reports(item.session).get(item.nodeid, [])
    if not any(report.when == "teardown" for report in reports):  # the child died or timed out during this test
        reports = [*reports, missing_report(item, "teardown" if any(r.when == "call" for r in reports) else "call")]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    # What this item's teardown would have done here: tear down the fixtures (and nodes) of earlier tests that
    # nextitem does not share. pytest has no public call for it; without it the next test here fails its setup.
    item.session._setupstate.teardown_exact(nextitem)
    return True


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield  # outermost: the report as every other plugin (xfail's included) leaves it
    if REPORTS_FILE in os.environ:
        data = item.config.hook.pytest_report_to_serializable(config=item.config, report=report)
        with open(os.environ[REPORTS_FILE], "a") as out:
            out.write(json.dumps(data) + "\n")
    return report


def child_reports(session) -> dict[str, list]:
    """nodeid -> reports of every test of the session that runs in the child process; runs it on the first call."""
    if CHILD_REPORTS in session.stash:
        return session.stash[CHILD_REPORTS]
    config = session.config
    nodeids = [item.nodeid for item in session.items if runs_in_child(item)]
    reports: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reports.jsonl"
        path.touch()
        env = {**os.environ, REPORTS_FILE: str(path)}
        env.pop("PYTEST_ADDOPTS", None)  # the child runs its tests itself, in order (no xdist workers)
        verbosity = config.get_verbosity()  # the failures' details, as asked for here
        verbose = [("-" + "v" * verbosity) if verbosity > 0 else ("-" + "q" * -verbosity)] if verbosity else []
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *verbose,
                   f"--tb={config.option.tbstyle}",
                   "--rootdir", str(config.rootpath), *(["-c", str(config.inipath)] if config.inipath else []),
                   *nodeids]
        try:
            result = subprocess.run(command, cwd=config.rootpath, env=env, capture_output=True, text=True,
                                    timeout=600)
            output = f"exit status {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        except subprocess.TimeoutExpired as exc:
            output = f"timed out after {exc.timeout} s"
        for line in path.read_text().splitlines():
            report = config.hook.pytest_report_from_serializable(config=config, data=json.loads(line))
            if report.skipped and isinstance(report.longrepr, list):  # JSON made the (path, line, reason) a list
                report.longrepr = tuple(report.longrepr)
            reports.setdefault(report.nodeid, []).append(report)
    session.stash[CHILD_REPORTS] = reports
    session.stash[CHILD_OUTPUT] = output
    return reports


def missing_report(item, when: str) -> pytest.TestReport:
    """A failure for a test the child process did not report in full (it crashed or timed out during the test, or
    did not collect it)."""
    output = item.session.stash.get(CHILD_OUTPUT, "")
    return pytest.TestReport(item.nodeid, item.location, {}, "failed",
                             f"the child process did not report this test to its end: {output}", when)


ASCEND_ALIGN = 16  # op-plugin torch_npu-npu_fused_infer_attention_score.md: fp16/bf16 inputs need D 16-aligned


@pytest.fixture
def fused_attention(monkeypatch):
    """A simulated torch_npu whose fused kernel refuses a D the Ascend kernel refuses and otherwise computes TND
    attention over the host sequence ends it is given; the head dims it was given, in order."""
    from hwgraph_npu import attention

    seen = []

    def npu_fused_infer_attention_score(q, k, v, *, num_heads, input_layout, actual_seq_lengths,
                                        actual_seq_lengths_kv, scale):
        assert input_layout == "TND" and actual_seq_lengths == actual_seq_lengths_kv
        seen.append(q.shape[-1])
        if q.shape[-1] % ASCEND_ALIGN:
            raise RuntimeError(f"EZ9999: head dim {q.shape[-1]} is not 16-aligned")  # what the kernel does
        out, start = torch.empty_like(q), 0
        for end in actual_seq_lengths:
            qs, ks, vs = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
            out[start:end] = torch.softmax(qs @ ks.transpose(1, 2) * scale, -1).matmul(vs).transpose(0, 1).to(q.dtype)
            start = end
        return out, torch.empty(1)

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(attention, "scale_keyword", lambda: "scale")
    return seen
