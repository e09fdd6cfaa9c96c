"""An attention kernel a vendor's test module names (``HWGRAPH_ATTENTION``) that is unavailable here: pytest must agree
with ``hwgraph validate --attention``, which fails it. Where the graph backend is available and the kernel runs on its
devices' kind, a refusing gate errs in every check with the gate's reasons (a skip passed the vendor's CI with nothing
checked); where this machine lacks the kernel's hardware (a CUDA kernel on a CPU machine) its cases are still skips
that say why."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from hwgraph.attention import registry as attention_registry
from hwgraph.attention.sdpa import TORCH_SDPA
from hwgraph.capability import Capability
from hwgraph.testing.cases import ATTENTION_ENV, SuiteSettings, UnservedCase, conformance_params

REFUSAL = "VENDOR_FA needs the vendor_fa package (No module named 'vendor_fa')"
REASON = (f"attention kernel VENDOR_FA is unavailable: {REFUSAL} (selected by HWGRAPH_ATTENTION or {ATTENTION_ENV}, "
          f"on the cpu graph backend's cpu devices)")


def settings(**kw) -> SuiteSettings:
    return SuiteSettings(**{"backend": "cpu", "kernels": None, "preset": "tiny", "dtype": None,
                            "allowed_backends": None, **kw})


def skip_reason(param) -> str | None:
    marks = [m for m in param.marks if m.name == "skip"]
    return marks[0].kwargs["reason"] if marks else None


def refusing_kernel(name="VENDOR_FA", kinds=("cpu",)):
    """A kernel of ``kinds`` whose gate refuses every platform, as a missing vendor package makes it."""
    return dataclasses.replace(TORCH_SDPA, name=name, kinds=kinds,
                               gate=lambda platform: Capability.unavailable(REFUSAL))


@pytest.fixture
def vendor_kernels(monkeypatch):
    kernels = [TORCH_SDPA, refusing_kernel(), refusing_kernel("GPU_FA", kinds=("cuda",))]
    monkeypatch.setattr(attention_registry, "kernel_specs", lambda: kernels)


@pytest.mark.cpu_machine  # the cpu backend is available only on a machine without an accelerator
def test_a_selected_kernel_refusing_the_backends_own_devices_errs_with_the_gates_reasons(vendor_kernels):
    """It was a skip: ``HWGRAPH_ATTENTION = ("VENDOR_FA",)`` passed every check of a broken install."""
    params = {p.id: p for p in conformance_params(settings(kernels=("VENDOR_FA", "TORCH_SDPA")))}
    assert params["cpu-VENDOR_FA-float32"].values == (UnservedCase(REASON),)
    assert skip_reason(params["cpu-VENDOR_FA-float32"]) is None
    assert skip_reason(params["cpu-TORCH_SDPA-float32"]) is None  # the other selected kernel still runs
    assert params["cpu-TORCH_SDPA-float32"].values[0].kernel == "TORCH_SDPA"


@pytest.mark.cpu_machine
def test_a_refusing_kernel_that_is_not_selected_is_still_a_skip_with_its_reasons(vendor_kernels):
    """With no kernel named the suite checks every available one: the others are no concern of the run."""
    params = {p.id: p for p in conformance_params(settings())}
    assert skip_reason(params["cpu-VENDOR_FA-float32"]) == f"attention kernel VENDOR_FA is unavailable: {REFUSAL}"
    params = {p.id: p for p in conformance_params(settings(kernels=("TORCH_SDPA",)))}
    assert skip_reason(params["cpu-VENDOR_FA-float32"]) == \
        "attention kernel VENDOR_FA not selected (selected: TORCH_SDPA)"


@pytest.mark.cpu_machine
def test_a_selected_kernel_for_hardware_this_machine_lacks_is_a_skip_saying_so(vendor_kernels):
    """A CUDA kernel on a CPU machine: a vendor's module shared by several machines names kernels some lack."""
    params = {p.id: p for p in conformance_params(settings(kernels=("GPU_FA",)))}
    assert skip_reason(params["cpu-GPU_FA-float32"]) == \
        "attention kernel GPU_FA runs on cuda, not on the cpu graph backend's cpu devices"
    assert all(skip_reason(p) for p in params.values()), params  # the others: not selected
    [param] = conformance_params(settings(backend="cuda", kernels=("GPU_FA",)))  # the backend itself is unavailable
    assert skip_reason(param).startswith("graph backend 'cuda' is unavailable: ")


def test_on_a_gpu_machine_a_selected_kernel_its_gpu_refuses_errs_and_one_for_another_gpu_skips(monkeypatch):
    """FLASH_ATTN on a GPU too old for it, under the CUDA backend available there, fails; ROCM_AITER_FA named in the
    same settings is another vendor's kernel, which this machine lacks."""
    from hwgraph import registry
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("Tesla T4", 7, 5))
    real = registry.spec_named("cuda")
    monkeypatch.setattr(registry, "spec_named",
                        lambda name: dataclasses.replace(real, gate=lambda platform: Capability.available()))
    params = {p.id: p for p in conformance_params(settings(backend="cuda", kernels=("FLASH_ATTN", "ROCM_AITER_FA")))}
    [flash] = params["cuda-FLASH_ATTN-bfloat16"].values
    assert isinstance(flash, UnservedCase) and skip_reason(params["cuda-FLASH_ATTN-bfloat16"]) is None
    assert flash.reason.startswith("attention kernel FLASH_ATTN is unavailable: ") and "7.5" in flash.reason, flash
    assert flash.reason.endswith("(selected by HWGRAPH_ATTENTION or HWGRAPH_TEST_ATTENTION, on the cuda graph "
                                 "backend's cuda devices)"), flash
    assert skip_reason(params["cuda-ROCM_AITER_FA-bfloat16"]) == \
        "attention kernel ROCM_AITER_FA runs on rocm, not on the cuda graph backend's cuda devices"


VENDOR_MODULE = '''
import dataclasses

from hwgraph.attention import registry
from hwgraph.attention.sdpa import TORCH_SDPA
from hwgraph.capability import Capability

REFUSAL = {refusal!r}
kernels = [TORCH_SDPA, dataclasses.replace(TORCH_SDPA, name="VENDOR_FA", kinds={kinds!r},
                                           gate=lambda platform: Capability.unavailable(REFUSAL))]
registry.kernel_specs = lambda: kernels

from hwgraph.testing.suite import *  # noqa: E402,F401,F403

HWGRAPH_BACKEND = "cpu"
HWGRAPH_ATTENTION = ("VENDOR_FA",)
'''


def run_vendor_module(tmp_path, kinds) -> subprocess.CompletedProcess:
    (tmp_path / "test_vendor_conformance.py").write_text(textwrap.dedent(
        VENDOR_MODULE.format(refusal=REFUSAL, kinds=kinds)))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", ATTENTION_ENV)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.cpu_machine
def test_a_vendor_module_naming_a_kernel_its_backend_refuses_fails_every_check_naming_why(tmp_path):
    """The run exited 0 with every case skipped, while ``hwgraph validate`` failed the same kernel."""
    run = run_vendor_module(tmp_path, ("cpu",))
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    assert "error" in summary and "passed" not in summary and "failed" not in summary, run.stdout[-4000:]
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED ")]
    assert all("attention kernel TORCH_SDPA not selected (selected: VENDOR_FA)" in line for line in skips), skips
    errors = [line for line in run.stdout.splitlines() if line.startswith("ERROR ")]
    assert len(errors) >= 15 and all("[cpu-VENDOR_FA-float32" in line for line in errors), errors
    assert run.stdout.count(f" _\n{REASON}\n") == len(errors), run.stdout[-4000:]


@pytest.mark.cpu_machine
def test_a_vendor_module_naming_a_kernel_for_hardware_this_machine_lacks_skips_every_check_saying_why(tmp_path):
    run = run_vendor_module(tmp_path, ("cuda",))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    assert "skipped" in summary and "passed" not in summary and "error" not in summary, run.stdout[-4000:]
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED ")]
    assert any("attention kernel VENDOR_FA runs on cuda, not on the cpu graph backend's cpu devices" in line
               for line in skips), run.stdout[-4000:]


@pytest.mark.cpu_machine
def test_pytest_and_validate_agree_on_a_named_kernel_the_backend_refuses(tmp_path, monkeypatch):
    """``hwgraph validate --attention`` runs the same suite: its verdict fails, and each failing check names the gate's
    reasons, where it had said only that none of the kernel's checks ran."""
    from hwgraph.testing.results import failing_checks, run_conformance
    from hwgraph.validate import verdict

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    conformance = run_conformance(tmp_path, "cpu", "tiny", ["TRITON_ATTN"])
    ok, summary = verdict(conformance, ["TRITON_ATTN"])
    failing = failing_checks(conformance)
    assert not ok and summary.startswith("FAIL: "), summary
    assert failing and all("[cpu-TRITON_ATTN-float32" in r["check"] and r["outcome"] == "error" and
                           "attention kernel TRITON_ATTN is unavailable: " in r["message"] and
                           "TRITON_INTERPRET=1" in r["message"] for r in failing), failing
