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


@pytest.mark.parametrize("answer", [True, None])
def test_a_kernel_gate_returning_no_capability_is_named_as_a_backends_is(answer):
    """A kernel's gate was judged apart from a backend's: True gave "the TOY gate failed: AttributeError: 'bool'
    object has no attribute 'reasons'", naming no answer."""
    cap = toy_kernel(gate=lambda platform: answer).capability(cpu_platform())
    assert cap.reasons == (f"the TOY gate returned {answer!r} ({type(answer).__name__}), expected a Capability",)


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


def toy_kernel(**changes):
    import torch

    from hwgraph.attention.base import KernelSpec

    fields = dict(name="TOY", impl_path="unused:toy", kinds=("cpu",), dtypes=(torch.float32,), head_dims=(1, 256),
                  graph_safe=True, gate=lambda p: Capability.available())
    return KernelSpec(**{**fields, **changes})


def always_available(platform) -> Capability:
    return Capability.available()


def toy_backend(**changes) -> BackendSpec:
    fields = dict(name="toy", class_path="hwgraph.graphs.cpu:CpuGraphBackend", kinds=("cpu",),
                  gate=always_available)
    return BackendSpec(**{**fields, **changes})


@pytest.mark.parametrize("make, changes, message", [
    # a bare string was read letter by letter: modes="full" accepted the mode "f" and listed "f, u, l, l"
    (toy_backend, {"modes": "full"}, "BackendSpec 'toy': modes is a tuple of one or more non-empty strings, got "
                                     "'full' (a bare string: write (name,))"),
    (toy_backend, {"kinds": "cuda"}, "BackendSpec 'toy': kinds is a tuple"),
    (toy_backend, {"modes": ()}, "BackendSpec 'toy': modes is a tuple of one or more non-empty strings, got ()"),
    # a string priority crashed the sort of every candidate when a backend was chosen
    (toy_backend, {"priority": "90"}, "BackendSpec 'toy': priority is an int, got '90' (str)"),
    (toy_backend, {"priority": True}, "BackendSpec 'toy': priority is an int, got True (bool)"),
    (toy_backend, {"gate": Capability.available()}, "BackendSpec 'toy': gate is a function, got Capability"),
    (toy_backend, {"attention": ("TRITON_ATTN",)}, "BackendSpec 'toy': attention is a tuple of KernelSpec"),
    (toy_backend, {"name": ""}, "BackendSpec: name is a non-empty string, got ''"),
    (toy_backend, {"class_path": None}, "BackendSpec 'toy': class_path is a non-empty string, got None"),
    (toy_backend, {"distribution": ("hwgraph-backend-toy",)},
     "BackendSpec 'toy': distribution is a non-empty string, got ('hwgraph-backend-toy',)"),
    (toy_kernel, {"kinds": "cpu"}, "KernelSpec 'TOY': kinds is a tuple"),
    (toy_kernel, {"dtypes": ("bfloat16",)}, "KernelSpec 'TOY': dtypes is a tuple of one or more dtype"),
    (toy_kernel, {"head_dims": (256, 1)}, "KernelSpec 'TOY': head_dims is (lowest, highest)"),
    (toy_kernel, {"head_dims": 72}, "KernelSpec 'TOY': head_dims is (lowest, highest)"),
    (toy_kernel, {"graph_safe": "yes"}, "KernelSpec 'TOY': graph_safe is a bool, got 'yes' (str)"),
    (toy_kernel, {"priority": 1.5}, "KernelSpec 'TOY': priority is an int, got 1.5 (float)"),
    (toy_kernel, {"priority_on": 3}, "KernelSpec 'TOY': priority_on is a function or None, got 3"),
])
def test_a_spec_with_a_field_of_the_wrong_type_is_refused_naming_the_spec_and_field(make, changes, message):
    with pytest.raises(TypeError) as info:
        make(**changes)
    assert str(info.value).startswith(message), str(info.value)


def test_a_specs_lists_become_tuples_so_that_specs_hash_and_compare_as_written():
    import torch

    kernel = toy_kernel(kinds=["cpu"], dtypes=[torch.float32], head_dims=[1, 256])
    assert (kernel.kinds, kernel.dtypes, kernel.head_dims) == (("cpu",), (torch.float32,), (1, 256))
    backend = toy_backend(kinds=["cpu"], modes=["full", "emulated"], attention=[kernel])
    assert backend == toy_backend(kinds=("cpu",), modes=("full", "emulated"), attention=(kernel,))
    assert backend.mode_refusal("f") == "graph backend 'toy' has modes full, emulated"
    hash(backend)
