"""Without vLLM (the default CPU run): importing the integration says how to install it; hwgraph itself imports."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vllm is installed here; this checks the message shown without it")
def test_importing_the_vllm_integration_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "hwgraph.integrations.vllm", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'hwgraph\[vllm\]'"):
        importlib.import_module("hwgraph.integrations.vllm")


def test_importing_hwgraph_imports_no_vllm(tmp_path):
    # An importable stand-in for vllm, so that the check can fail here too, where vllm itself is not installed
    # (test_vllm_adapter.py checks the same against the real vllm).
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("__version__ = '0.33.0'\n")
    code = ("import importlib.util, sys, hwgraph, hwgraph.integrations, hwgraph.manager; hwgraph.EncoderGraphManager; "
            "assert importlib.util.find_spec('vllm') is not None, 'the stand-in vllm is not importable'; "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, env=env)


def test_a_vllm_that_is_installed_but_fails_to_import_is_not_called_missing(tmp_path):
    """vLLM's own import raising a plain ImportError (no ``name``: a version check, a loader error re-raised) was
    reported as 'vLLM, which is not installed'."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('vLLM needs torch>=2.14, found 2.13')\n")
    code = ("import hwgraph.integrations.vllm_version\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "installed but failed to import" in last and "needs torch>=2.14" in last, last
