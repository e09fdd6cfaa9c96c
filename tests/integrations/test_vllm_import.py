"""Without vLLM (the default CPU run): importing the integration says how to install it; hwgraph itself imports."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vllm is installed here; this checks the message shown without it")
def test_importing_the_vllm_integration_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "hwgraph.integrations.vllm", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'hwgraph\[vllm\]'"):
        importlib.import_module("hwgraph.integrations.vllm")


def test_importing_hwgraph_imports_no_vllm():
    code = ("import sys, hwgraph, hwgraph.integrations, hwgraph.manager; hwgraph.EncoderGraphManager; "
            "assert 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
