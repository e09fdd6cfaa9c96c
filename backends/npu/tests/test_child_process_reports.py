"""The child process that runs the simulated-NPU tests (``conftest.py`` here) reports each of them as it ended there:
a skip as a skip, a test whose child crashed as a failure, and those after it as they ran."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD_TESTS = '''
import os
import signal

import pytest
import torch


def test_a_passes(simulated_npu_process):
    pass


def test_b_skips(simulated_npu_process):
    pytest.skip("a reason of the child's")


def test_c_renames_privateuse1(simulated_npu_process):
    torch.utils.rename_privateuse1_backend("npu")
    assert torch.device("npu:0").type == "npu"


def test_d_in_the_parent():
    with pytest.raises(RuntimeError):
        torch.device("npu:0")  # the child's rename did not reach this process


def test_z_crashes_the_child(simulated_npu_process):
    os.kill(os.getpid(), signal.SIGSEGV)  # a native crash (a vendor runtime's abort), after the others
'''


def test_a_skip_and_a_crash_in_the_child_are_reported_as_a_skip_and_a_failure(tmp_path):
    """A crash during the last child test left only its setup report: the run passed without it. A skip's reason
    came back from JSON as a list, and the summary (-ra) raised INTERNALERROR."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_child.py").write_text(textwrap.dedent(CHILD_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -ra\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HWGRAPH_SIMULATED_NPU"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1 and "INTERNALERROR" not in out, out
    assert "1 failed, 3 passed, 1 skipped" in out, out
    assert "SKIPPED [1] test_child.py" in out and "a reason of the child's" in out, out
    assert "FAILED test_child.py::test_z_crashes_the_child" in out, out
    assert "the child process did not report this test to its end: exit status -11" in out, out
