"""How the conformance suite selects its cases from a vendor's settings: kernel names in any case, and typos that fail
the run even where the backend under test is excluded or unavailable."""

from __future__ import annotations

import dataclasses
import types

import pytest

from hwgraph.attention import registry
from hwgraph.attention.sdpa import TORCH_SDPA
from hwgraph.testing.cases import ATTENTION_ENV, SuiteSettings, conformance_params, settings_for


def settings(**kw) -> SuiteSettings:
    return SuiteSettings(**{"backend": "cpu", "kernels": None, "preset": "tiny", "dtype": None,
                            "allowed_backends": None, **kw})


def skip_reason(param) -> str | None:
    marks = [m for m in param.marks if m.name == "skip"]
    return marks[0].kwargs["reason"] if marks else None


def install_mixed_case_kernel(monkeypatch):
    """A plugin's CPU kernel named in mixed case, beside TORCH_SDPA (kernel names are matched case-insensitively)."""
    kernel = dataclasses.replace(TORCH_SDPA, name="Toy_Attn")
    monkeypatch.setattr(registry, "kernel_specs", lambda: (TORCH_SDPA, kernel))
    return kernel


@pytest.mark.parametrize("asked", ["Toy_Attn", "toy_attn", " TOY_ATTN "])
def test_a_plugin_kernel_named_in_mixed_case_is_selected_by_its_name_in_any_case(monkeypatch, asked):
    """The selection is upper-cased and was compared with the kernels' names as they are: "unknown attention kernel
    'TOY_ATTN' ...; known: TORCH_SDPA, Toy_Attn", a collection error for the kernel's own name."""
    install_mixed_case_kernel(monkeypatch)
    monkeypatch.setenv(ATTENTION_ENV, asked)
    params = {p.id: p for p in conformance_params(settings_for(type("C", (), {}), types.SimpleNamespace()))}
    assert skip_reason(params["cpu-Toy_Attn-float32"]) is None
    assert params["cpu-Toy_Attn-float32"].values[0].kernel == "Toy_Attn"
    assert skip_reason(params["cpu-TORCH_SDPA-float32"]) == \
        "attention kernel TORCH_SDPA not selected (selected: Toy_Attn)"


def test_validate_passes_a_plugin_kernel_named_in_mixed_case(monkeypatch, tmp_path):
    """``hwgraph validate --attention Toy_Attn`` writes ``HWGRAPH_ATTENTION = ('TOY_ATTN',)``: every check was a
    collection error, and the verdict FAIL."""
    from hwgraph.testing.results import run_conformance
    from hwgraph.validate import verdict

    install_mixed_case_kernel(monkeypatch)
    conformance = run_conformance(tmp_path, "cpu", "tiny", kernels=["Toy_Attn"])
    assert conformance["counts"]["error"] == 0, conformance["results"]
    ok, summary = verdict(conformance, ["Toy_Attn"])
    assert ok, summary


@pytest.mark.parametrize(("kw", "message"), [
    ({"kernels": ("TORCH_SPDA",)}, "unknown attention kernel 'TORCH_SPDA' in HWGRAPH_ATTENTION or "
                                   "HWGRAPH_TEST_ATTENTION; known: "),
    ({"dtype": "bf16"}, "HWGRAPH_DTYPE or HWGRAPH_TEST_DTYPE: unknown dtype 'bf16': expected one of float32, "
                        "bfloat16, float16"),
    ({"preset": "tinny"}, "HWGRAPH_PRESET or HWGRAPH_TEST_PRESET: unknown tower preset 'tinny'; known: "),
])
def test_a_misspelt_setting_fails_even_where_the_backend_is_excluded(kw, message):
    """The names were checked only once the backend was found runnable: with the backend excluded (or unavailable)
    the run was one skip, and the typo passed that CI job unnoticed."""
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        conformance_params(settings(allowed_backends=("rocm",), **kw))


def test_a_misspelt_dtype_or_preset_names_the_variables_it_came_from():
    with pytest.raises(ValueError, match=r"^HWGRAPH_DTYPE or HWGRAPH_TEST_DTYPE: unknown dtype 'BF16'"):
        conformance_params(settings(dtype="BF16"))
    with pytest.raises(ValueError, match=r"^HWGRAPH_PRESET or HWGRAPH_TEST_PRESET: unknown tower preset ' tiny'"):
        conformance_params(settings(preset=" tiny"))
