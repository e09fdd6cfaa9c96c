"""Review fixes: a graph backend's gate that returns something other than a Capability, and a Capability made from a
bare string, say so instead of crashing ``hwgraph info`` or listing each letter as a reason."""

from __future__ import annotations

import pytest

from hwgraph import cli, registry
from hwgraph.capability import Capability
from hwgraph.platform import PlatformInfo
from hwgraph.registry import BackendSpec


def cpu_platform() -> PlatformInfo:
    return PlatformInfo("cpu", "cpu", None, "2.13.0", None, None, 0)


def with_backend(monkeypatch, spec: BackendSpec) -> None:
    specs, problems = registry.discovered()
    monkeypatch.setattr(registry, "discovered", lambda: ((*specs, spec), problems))
    monkeypatch.delenv(registry.GRAPH_BACKEND_ENV, raising=False)


@pytest.mark.parametrize("answer", [True, None, "fine"])
def test_a_gate_returning_no_capability_is_a_reason_and_info_still_prints(monkeypatch, capsys, answer):
    spec = BackendSpec(name="toy", class_path="hwgraph.graphs.cpu:CpuGraphBackend", kinds=("cpu",),
                       gate=lambda platform: answer, priority=5)
    with_backend(monkeypatch, spec)
    cap = spec.capability(cpu_platform())
    assert not cap.ok
    assert cap.reasons == (f"the toy gate returned {answer!r} ({type(answer).__name__}), expected a Capability",)
    assert registry.choose_backend(platform=cpu_platform()).spec.name == "cpu"  # passed over, with its reason
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "toy" in out and "expected a Capability" in out and "selected: cpu" in out


@pytest.mark.parametrize("reasons", ["needs the toy package", None, ("ok", 3)])
def test_a_capability_takes_a_tuple_of_reasons_not_a_bare_string(reasons):
    with pytest.raises(TypeError, match="a Capability's reasons are strings in a tuple, got"):
        Capability(reasons)


def test_a_gate_making_a_capability_from_a_string_says_so_instead_of_listing_its_letters():
    spec = BackendSpec(name="toy", class_path="hwgraph.graphs.cpu:CpuGraphBackend", kinds=("cpu",),
                       gate=lambda platform: Capability("needs the toy package"))
    cap = spec.capability(cpu_platform())
    assert not cap.ok and len(cap.reasons) == 1
    assert cap.reasons[0].startswith("the toy gate failed: TypeError: a Capability's reasons are strings")
    assert "'needs the toy package'" in cap.reasons[0]


def test_a_capability_made_from_a_list_is_a_tuple_and_combines():
    cap = Capability(["a", "b"]) & Capability.unavailable("b", "c")
    assert cap.reasons == ("a", "b", "c") and hash(cap) == hash(Capability(("a", "b", "c")))


def test_a_kernel_whose_priority_on_raises_is_ranked_by_its_priority_and_choice_goes_on(caplog):
    """``KernelSpec.rank`` called a plugin's ``priority_on`` unguarded: one that raised took automatic selection and
    ``hwgraph info`` down with it, where a gate that raises is only a reason."""
    import torch

    from hwgraph.attention.base import KernelSpec

    def broken(platform):
        raise KeyError("arch")

    spec = KernelSpec(name="TOY", impl_path="unused:toy", kinds=("cpu",), dtypes=(torch.float32,), head_dims=(1, 256),
                      graph_safe=True, gate=lambda p: Capability.available(), priority=7, priority_on=broken)
    with caplog.at_level("WARNING", logger="hwgraph.attention.base"):
        assert spec.rank(cpu_platform()) == 7
    assert "TOY's priority_on failed (KeyError: 'arch'); ranking it by its priority, 7" in caplog.text
