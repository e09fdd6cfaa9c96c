"""How the shipped suite picks its cases: capability gates, HWGRAPH_TEST_BACKENDS, kernel narrowing, overrides."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from hwgraph.testing.cases import BACKENDS_ENV, SuiteSettings, conformance_params, settings_for


def settings(**kw) -> SuiteSettings:
    return SuiteSettings(**{"backend": "cpu", "kernels": None, "preset": "tiny", "dtype": None,
                            "allowed_backends": None, **kw})


def skip_reason(param) -> str | None:
    marks = [m for m in param.marks if m.name == "skip"]
    return marks[0].kwargs["reason"] if marks else None


def test_cpu_cases_run_torch_sdpa_in_float32_and_skip_unavailable_kernels_with_gate_reasons():
    params = {p.id: p for p in conformance_params(settings())}
    case = params["cpu-TORCH_SDPA-float32"].values[0]
    assert (case.backend, case.kernel, case.dtype, case.device) == ("cpu", "TORCH_SDPA", torch.float32, "cpu")
    assert skip_reason(params["cpu-TORCH_SDPA-float32"]) is None
    if "TRITON_INTERPRET" not in os.environ:
        assert "TRITON_INTERPRET=1" in skip_reason(params["cpu-TRITON_ATTN-float32"])
    assert not any("FLASH_ATTN" in i or "NPU" in i for i in params), "other accelerators' kernels are not cases"


def test_backends_outside_the_allowed_list_are_skipped_saying_so():
    [param] = conformance_params(settings(allowed_backends=("rocm",)))
    assert skip_reason(param) == f"{BACKENDS_ENV}=rocm excludes the cpu graph backend"


def test_an_unknown_backend_is_one_skip_naming_it():
    [param] = conformance_params(settings(backend="nonesuch"))
    assert "unknown graph backend 'nonesuch'" in skip_reason(param)


@pytest.mark.cpu_machine
def test_an_unavailable_backend_is_one_skip_with_its_reasons():
    [param] = conformance_params(settings(backend="cuda"))
    assert skip_reason(param).startswith("graph backend 'cuda' is unavailable: ") and "CUDA build" in \
        skip_reason(param)


def test_kernel_narrowing_skips_the_others_and_dtype_can_be_chosen():
    params = {p.id: p for p in conformance_params(settings(kernels=("TRITON_ATTN",), dtype="bfloat16"))}
    assert "not selected" in skip_reason(params["cpu-TORCH_SDPA-bfloat16"])


def test_an_unknown_kernel_name_is_an_error_naming_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown attention kernel 'TORCH_SPDA' in HWGRAPH_ATTENTION or "
                                         r"HWGRAPH_TEST_ATTENTION; known: TORCH_SDPA, TRITON_ATTN"):
        conformance_params(settings(kernels=("TRITON_ATTN", "TORCH_SPDA")))


def test_settings_come_from_the_class_then_the_module_then_the_environment(monkeypatch):
    monkeypatch.setenv("HWGRAPH_TEST_PRESET", "from-env")
    monkeypatch.setenv("HWGRAPH_TEST_ATTENTION", "torch_sdpa, triton_attn")
    module = types.SimpleNamespace(HWGRAPH_BACKEND="rocm", HWGRAPH_DTYPE="float16")
    cls = type("C", (), {"HWGRAPH_BACKEND": "cpu"})
    s = settings_for(cls, module)
    assert (s.backend, s.dtype, s.preset, s.kernels) == ("cpu", "float16", "from-env", ("TORCH_SDPA", "TRITON_ATTN"))


VENDOR_MODULE = '''
import pytest
from hwgraph.testing.suite import *  # noqa

HWGRAPH_BACKEND = "cpu"
HWGRAPH_ATTENTION = ("TORCH_SDPA",)


class TestCapture(TestCapture):
    def test_every_budget_captures_and_reports_its_memory(self, manager):
        pytest.skip("overridden by the vendor")
'''


def run_pytest(tmp_path, env_extra, module=VENDOR_MODULE):
    (tmp_path / "test_vendor_conformance.py").write_text(textwrap.dedent(module))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, **env_extra}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "TestCapture",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_vendor_overrides_a_check_by_subclassing_and_narrows_backends_by_environment(tmp_path):
    run = run_pytest(tmp_path, {})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "overridden by the vendor" in run.stdout and "passed" not in run.stdout
    narrowed = run_pytest(tmp_path, {BACKENDS_ENV: "rocm"})
    assert narrowed.returncode == 0, narrowed.stdout + narrowed.stderr
    assert "HWGRAPH_TEST_BACKENDS=rocm excludes the cpu graph backend" in narrowed.stdout


def test_a_misspelt_kernel_in_the_environment_fails_the_run_instead_of_skipping_every_case(tmp_path):
    module = VENDOR_MODULE.replace('HWGRAPH_ATTENTION = ("TORCH_SDPA",)\n', "")
    assert module != VENDOR_MODULE
    run = run_pytest(tmp_path, {"HWGRAPH_TEST_ATTENTION": "torch_spda"}, module)
    assert run.returncode != 0 and "unknown attention kernel 'TORCH_SPDA'" in run.stdout, run.stdout + run.stderr
