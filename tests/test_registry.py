"""Graph-backend discovery and selection: explicit, environment, automatic, and every refusal says why."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import types
from importlib.metadata import EntryPoint

import pytest
import torch

from hwgraph import registry
from hwgraph.attention.registry import kernel_named
from hwgraph.capability import Capability
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.platform import PlatformInfo
from hwgraph.registry import GRAPH_BACKEND_ENV, BackendSpec, SelectionError, choose_backend, create_backend
from hwgraph.testing.simulate import REFUSED_MODE_CLASS, RefusedModeBackend, simulate_broken_import


def platform_of(kind: str) -> PlatformInfo:
    runtime = {"cuda": "CUDA", "rocm": "HIP", "npu": "CANN"}.get(kind)
    return PlatformInfo(kind, f"simulated {kind}", None, torch.__version__, runtime, None, 0 if kind == "cpu" else 1)


@pytest.fixture(autouse=True)
def fresh_discovery(monkeypatch):
    monkeypatch.delenv(GRAPH_BACKEND_ENV, raising=False)
    registry.discovered.cache_clear()
    yield
    registry.discovered.cache_clear()


def install_probes(monkeypatch, **probes):
    """Replace the installed entry points by fake plugins whose probes are ``probes`` (name -> callable)."""
    module = types.ModuleType("hwgraph_fake_plugins")
    for name, probe in probes.items():
        setattr(module, name, probe)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    eps = [EntryPoint(name=name, value=f"{module.__name__}:{name}", group=registry.ENTRY_POINT_GROUP)
           for name in probes]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry.discovered.cache_clear()


def spec(name: str, kind: str, reasons: tuple[str, ...] = (), priority: int = 50) -> BackendSpec:
    return BackendSpec(name=name, class_path="hwgraph.graphs.cpu:CpuGraphBackend", kinds=(kind,),
                       gate=lambda platform: Capability(reasons), priority=priority)


def test_the_builtin_cpu_backend_is_listed_and_chosen_on_cpu():
    listed = {s.name: cap for s, cap in registry.list_backends(platform_of("cpu"))}
    assert listed["cpu"].ok
    selected = choose_backend(platform=platform_of("cpu"))
    assert selected.spec.name == "cpu"
    assert selected.reason == "best available for cpu"


def test_the_installed_vendor_plugins_are_discovered_without_problems():
    specs, problems = registry.discovered()
    assert {"cpu", "cuda", "rocm", "npu"} <= {s.name for s in specs}
    assert problems == ()


def test_environment_variable_chooses_the_backend(monkeypatch):
    install_probes(monkeypatch, other=lambda: spec("other", "cpu", priority=-5))
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "other")
    selected = choose_backend(platform=platform_of("cpu"))
    assert (selected.spec.name, selected.reason) == ("other", "explicit")


def test_an_explicit_name_wins_over_the_environment(monkeypatch):
    install_probes(monkeypatch, other=lambda: spec("other", "cpu"))
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "other")
    assert choose_backend("cpu", platform=platform_of("cpu")).spec.name == "cpu"


def test_an_explicit_unavailable_choice_raises_with_its_reasons(monkeypatch):
    install_probes(monkeypatch, gated=lambda: spec("gated", "cuda", ("needs a widget", "needs a gadget")))
    with pytest.raises(SelectionError, match="'gated' is unavailable: needs a widget; needs a gadget"):
        choose_backend("gated", platform=platform_of("cpu"))


def test_an_unavailable_choice_from_the_environment_raises_too(monkeypatch):
    install_probes(monkeypatch, gated=lambda: spec("gated", "cuda", ("needs a widget",)))
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "gated")
    with pytest.raises(SelectionError, match="needs a widget"):
        create_backend(platform=platform_of("cpu"))


@pytest.mark.cpu_machine
def test_the_real_cuda_plugin_refused_on_this_cpu_machine_says_why():
    why = "CPU-only build; install a CUDA build of torch" if torch.version.cuda is None else "build but no NVIDIA GPU"
    with pytest.raises(SelectionError, match=f"cuda' is unavailable: .*{why}"):
        choose_backend("cuda")


def test_an_unknown_name_lists_the_known_ones(monkeypatch):
    install_probes(monkeypatch, other=lambda: spec("other", "cpu"))
    with pytest.raises(SelectionError, match=r"unknown graph backend 'nope'; known: cpu, other"):
        choose_backend("nope", platform=platform_of("cpu"))


def test_automatic_choice_on_cuda_without_any_plugin_falls_back_to_cpu_and_says_why(monkeypatch):
    install_probes(monkeypatch)
    selected = choose_backend(platform=platform_of("cuda"))
    assert selected.spec.name == "cpu"
    assert "falling back to the cpu reference backend" in selected.reason
    assert "no installed backend serves cuda" in selected.reason
    assert "pip install -e backends/cuda" in selected.reason, selected.reason


def test_the_install_hints_name_a_command_that_works_without_a_package_index(monkeypatch):
    """The plugins are not on a package index: the hints said pip install 'hwgraph[cuda]', which fails with 'No
    matching distribution found for hwgraph-backend-cuda==0.1.0'. They name the checkout's folder instead."""
    install_probes(monkeypatch)
    reason = choose_backend(platform=platform_of("rocm")).reason
    assert "pip install -e backends/rocm" in reason and "hwgraph[" not in reason, reason
    with pytest.raises(SelectionError) as info:
        choose_backend("cuda", platform=platform_of("cpu"))
    assert "pip install -e backends/cuda" in str(info.value) and "hwgraph[" not in str(info.value), info.value


def test_automatic_choice_on_cuda_with_a_refused_plugin_falls_back_naming_its_reasons(monkeypatch, caplog):
    install_probes(monkeypatch, gpu=lambda: spec("gpu", "cuda", ("the driver is too old",)))
    selected = choose_backend(platform=platform_of("cuda"))
    assert selected.spec.name == "cpu"
    assert "gpu: the driver is too old" in selected.reason
    assert "gpu: the driver is too old" in caplog.text  # logged as a warning off CPU


def test_the_graph_backend_fallback_names_every_refused_plugin(monkeypatch):
    install_probes(monkeypatch, first=lambda: spec("first", "cuda", ("the driver is too old",), priority=90),
                   second=lambda: spec("second", "cuda", ("the runtime is missing",), priority=10))
    selected = choose_backend(platform=platform_of("cuda"))
    assert selected.spec.name == "cpu"
    assert "first: the driver is too old" in selected.reason
    assert "second: the runtime is missing" in selected.reason


def test_automatic_choice_prefers_the_highest_priority_available_backend(monkeypatch):
    install_probes(monkeypatch,
                   low=lambda: spec("low", "cuda", priority=10),
                   high=lambda: spec("high", "cuda", priority=90),
                   refused=lambda: spec("refused", "cuda", ("no", ), priority=100))
    assert choose_backend(platform=platform_of("cuda")).spec.name == "high"


def test_a_probe_that_raises_is_a_listed_problem_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("vendor SDK exploded")

    install_probes(monkeypatch, broken=broken, fine=lambda: spec("fine", "cpu", priority=-1))
    specs, problems = registry.discovered()
    assert [s.name for s in specs] == ["cpu", "fine"]
    assert len(problems) == 1
    assert "'broken'" in problems[0] and "RuntimeError: vendor SDK exploded" in problems[0]
    assert choose_backend(platform=platform_of("cpu")).spec.name == "cpu"


def test_a_probe_returning_the_wrong_type_is_a_problem(monkeypatch):
    install_probes(monkeypatch, wrong=lambda: "not a spec")
    problems = registry.discovered()[1]
    assert "expected BackendSpec" in problems[0]


def test_a_repeated_backend_name_is_a_problem_and_ignored(monkeypatch):
    install_probes(monkeypatch, again=lambda: spec("cpu", "cuda"))
    specs, problems = registry.discovered()
    assert [s.name for s in specs] == ["cpu"]
    assert "repeats the backend name 'cpu'" in problems[0]


def test_problems_name_the_distributions_involved(monkeypatch):
    """Two distributions claiming one backend name: which one was kept depended on entry-point order, unsaid."""
    def entry_point(name, dist, probe):
        return types.SimpleNamespace(name=name, value=f"{dist.replace('-', '_')}.platform:probe",
                                     dist=types.SimpleNamespace(name=dist), load=lambda: probe)

    def broken():
        raise ImportError("no module named 'bad_sdk'")

    eps = [entry_point("toy", "hwgraph-backend-toy", lambda: spec("toy", "cpu")),
           entry_point("toy", "hwgraph-backend-toy-fork", lambda: spec("toy", "cpu")),
           entry_point("bad", "hwgraph-backend-bad", broken)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry.discovered.cache_clear()
    specs, problems = registry.discovered()
    assert [(s.name, s.distribution) for s in specs] == [("cpu", None), ("toy", "hwgraph-backend-toy")]
    assert problems == (
        "entry point 'toy' (hwgraph_backend_toy_fork.platform:probe, distribution hwgraph-backend-toy-fork) repeats "
        "the backend name 'toy', which the first found (distribution hwgraph-backend-toy) keeps; ignored",
        "entry point 'bad' (hwgraph_backend_bad.platform:probe, distribution hwgraph-backend-bad) failed to load: "
        "ImportError: no module named 'bad_sdk'")


def test_a_gate_that_crashes_is_a_reason(monkeypatch):
    def crashing_gate(platform):
        raise KeyError("arch")

    install_probes(monkeypatch, crashy=lambda: BackendSpec("crashy", "x:Y", ("cuda",), crashing_gate, priority=10))
    selected = choose_backend(platform=platform_of("cuda"))
    assert selected.spec.name == "cpu"
    assert "the crashy gate failed: KeyError" in selected.reason


def test_a_crashed_gates_traceback_is_logged_at_debug_level(monkeypatch, caplog):
    def crashing_gate(platform):
        raise KeyError("arch")

    spec = BackendSpec("crashy", "x:Y", ("cuda",), crashing_gate)
    with caplog.at_level(logging.DEBUG, logger="hwgraph.registry"):
        assert "the crashy gate failed: KeyError: 'arch'" in spec.capability(platform_of("cuda")).reasons[0]
    [record] = [r for r in caplog.records if r.getMessage() == "the crashy gate failed"]
    assert record.levelno == logging.DEBUG and record.exc_info[0] is KeyError


@pytest.mark.parametrize("class_path", ["hwgraph_no_such_module.graphs:Backend", "hwgraph.graphs.cpu:NoSuchClass"])
def test_a_class_path_that_does_not_load_is_named_with_its_plugin(monkeypatch, class_path):
    install_probes(monkeypatch, toy=lambda: BackendSpec("toy", class_path, ("cpu",), lambda p: Capability.available(),
                                                        distribution="hwgraph-backend-toy"))
    with pytest.raises(ImportError, match=rf"graph backend 'toy' \(distribution hwgraph-backend-toy\) declares "
                                          rf"class_path '{class_path}', which does not load: "):
        create_backend("toy", platform=platform_of("cpu"))


class DeviceCheckRaises(CpuGraphBackend):
    name = "raising"

    @classmethod
    def capability(cls, device=None):
        raise RuntimeError("device query exploded")


@pytest.mark.parametrize("class_path, reason", [
    ("hwgraph_no_such_module.graphs:Backend", "declares class_path 'hwgraph_no_such_module.graphs:Backend', which "
                                              "does not load"),
    (f"{__name__}:DeviceCheckRaises", "cannot capture on cpu: its capability(cpu) failed: RuntimeError: device "
                                      "query exploded")])
def test_an_automatic_choice_that_cannot_load_or_check_the_device_falls_back_with_the_reason(
        monkeypatch, caplog, class_path, reason):
    """A plugin serving cpu above the reference backend, whose class does not import or whose device check raises:
    every manager raised that error, while ``hwgraph info`` showed the plugin selected and available (found by a
    plugin author's walkthrough). An explicit choice still raises."""
    install_probes(monkeypatch, broken=lambda: BackendSpec("broken", class_path, ("cpu",),
                                                           lambda p: Capability.available(), priority=5))
    cpu = platform_of("cpu")
    with caplog.at_level(logging.WARNING, logger="hwgraph.registry"):
        backend = create_backend(device="cpu", platform=cpu)
    assert type(backend) is CpuGraphBackend
    [message] = [m for m in caplog.messages if "falling back" in m]
    assert f"graph backend 'broken' {reason}" in message
    with pytest.raises((ImportError, SelectionError), match=re.escape(reason)):
        create_backend("broken", device="cpu", platform=cpu)


def test_a_negative_priority_is_chosen_only_by_name(monkeypatch):
    """README: a negative priority is chosen only by name. On a cuda machine without a cuda plugin, a plugin serving
    cuda with priority -1 was chosen automatically."""
    install_probes(monkeypatch, byname=lambda: spec("byname", "cuda", priority=-1))
    selected = choose_backend(platform=platform_of("cuda"))
    assert selected.spec.name == "cpu" and "no installed backend serves cuda" in selected.reason
    assert choose_backend("byname", platform=platform_of("cuda")).spec.name == "byname"


def test_an_unknown_name_also_names_the_plugins_that_failed_to_load(monkeypatch):
    """Naming a plugin whose probe failed said only 'unknown graph backend ... pip install'."""
    def broken():
        raise ImportError("no module named 'toy_sdk'")

    install_probes(monkeypatch, toy=broken)
    with pytest.raises(SelectionError, match=r"unknown graph backend 'toy'; known: cpu .*; installed plugins that "
                                             r"failed to load: entry point 'toy' .* ImportError: no module named "
                                             r"'toy_sdk'"):
        choose_backend("toy", platform=platform_of("cpu"))


def test_a_failed_probes_traceback_is_logged_at_debug_level(monkeypatch, caplog):
    def broken():
        raise KeyError("sdk")

    install_probes(monkeypatch, broken=broken)
    with caplog.at_level(logging.DEBUG, logger="hwgraph.registry"):
        registry.discovered()
    [record] = [r for r in caplog.records if r.levelno == logging.DEBUG and "failed to load" in r.getMessage()]
    assert record.exc_info[0] is KeyError


class OneDeviceBackend(CpuGraphBackend):
    """The CPU reference backend under another name, refusing every device but the first of its kind."""

    name = "onedevice"

    @classmethod
    def capability(cls, device=None):
        if device is not None and torch.device(device).index not in (None, 0):
            return Capability.unavailable(f"{device} is an unsupported architecture")
        return Capability.available()


def test_the_backend_class_judges_the_device_an_explicit_choice_raises_and_an_automatic_one_falls_back(
        monkeypatch, caplog):
    install_probes(monkeypatch, onedevice=lambda: BackendSpec(
        "onedevice", f"{__name__}:OneDeviceBackend", ("cpu",), lambda p: Capability.available(), modes=("emulated",),
        priority=10))
    cpu = platform_of("cpu")
    assert type(create_backend(device="cpu:0", platform=cpu)) is OneDeviceBackend
    with pytest.raises(SelectionError, match=r"graph backend 'onedevice' cannot capture on cpu:1: cpu:1 is an "
                                             r"unsupported architecture"):
        create_backend("onedevice", device="cpu:1", platform=cpu)
    with caplog.at_level(logging.WARNING, logger="hwgraph.registry"):
        fallback = create_backend(device="cpu:1", platform=cpu)
    assert type(fallback) is CpuGraphBackend
    assert ("falling back to the cpu reference backend (eager-equivalent, no speed-up): graph backend 'onedevice' "
            "cannot capture on cpu:1: cpu:1 is an unsupported architecture") in caplog.messages
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "onedevice")
    with pytest.raises(SelectionError, match="cannot capture on cpu:1"):
        create_backend(device="cpu:1", platform=cpu)


def test_an_automatic_choice_whose_class_refuses_its_mode_falls_back_and_a_mode_for_it_says_why(monkeypatch, caplog):
    install_probes(monkeypatch, refusedmode=lambda: BackendSpec(
        "refusedmode", REFUSED_MODE_CLASS, ("cpu",), lambda p: Capability.available(),
        modes=("aclgraph", "other"), priority=10))
    cpu = platform_of("cpu")
    with caplog.at_level(logging.WARNING, logger="hwgraph.registry"):
        fallback = create_backend(platform=cpu)  # raised the SelectionError: its gate passed, its mode did not
    assert type(fallback) is CpuGraphBackend
    assert caplog.messages == ["falling back to the cpu reference backend (eager-equivalent, no speed-up): "
                               "refusedmode graph mode 'aclgraph' is unavailable: no graph API"]
    assert type(create_backend(platform=cpu, mode="other")) is RefusedModeBackend
    with pytest.raises(ValueError, match=re.escape(
            "graph mode 'aclgraph' is not a mode of the cpu reference backend (modes ['emulated']), and the automatic "
            "choice is falling back to the cpu reference backend (eager-equivalent, no speed-up): refusedmode graph "
            "mode 'aclgraph' is unavailable: no graph API")):  # was the cpu backend's "has modes [...]" alone
        create_backend(platform=cpu, mode="aclgraph")
    with pytest.raises(SelectionError, match="no graph API"):  # an explicit choice raises it
        create_backend("refusedmode", platform=cpu)


def test_create_backend_constructs_the_cpu_backend_on_cpu():
    backend = create_backend(platform=platform_of("cpu"))
    assert backend.name == "cpu" and backend.mode == "emulated"


def test_plugin_attention_returns_the_named_kernels_or_nothing_with_a_logged_reason(monkeypatch, caplog):
    module = types.ModuleType("hwgraph_fake.attention")
    module.KERNEL = object()
    monkeypatch.setitem(sys.modules, "hwgraph_fake.attention", module)
    assert registry.plugin_attention("hwgraph_fake.attention", "KERNEL") == (module.KERNEL,)
    with caplog.at_level(logging.DEBUG, logger="hwgraph.registry"):
        assert registry.plugin_attention("hwgraph_fake.attention", "MISSING") == ()  # a broken plugin module: a warning
        monkeypatch.setitem(sys.modules, "hwgraph_fake.attention", None)  # an absent one: debug only
        assert registry.plugin_attention("hwgraph_fake.attention", "KERNEL") == ()
    levels = [r.levelname for r in caplog.records if "hwgraph_fake brings no attention kernels" in r.getMessage()]
    assert levels == ["WARNING", "DEBUG"]


def test_every_installed_backends_probe_agrees_with_its_class_on_name_and_modes():
    """The suite's TestDeclaration runs on each vendor's hardware; here, on any machine, for every plugin installed
    (importing a backend class imports no vendor SDK)."""
    registry.discovered.cache_clear()
    specs = registry.backend_specs()
    assert "cpu" in {s.name for s in specs}
    for spec in specs:
        cls = spec.load()
        assert (cls.name, tuple(cls.modes)) == (spec.name, tuple(spec.modes)), spec.class_path


# An automatic choice that finds no backend for the platform because the installed plugin for it failed to load says
# so, instead of telling the user to pip install the plugin they have; so does a kernel asked for by name whose
# plugin module failed to import.
ROCM_MI300X = PlatformInfo("rocm", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-", torch.__version__, "HIP", "6.4", 1)


def test_the_fallback_names_the_installed_plugin_that_failed_to_load(monkeypatch):
    def probe():  # e.g. hwgraph-backend-rocm built against another hwgraph core
        raise ImportError("cannot import name 'torch_build' from 'hwgraph.graphs.torch_cuda'")

    module = types.ModuleType("hwgraph_fake_rocm")
    module.probe = probe
    monkeypatch.setitem(sys.modules, module.__name__, module)
    eps = [EntryPoint(name="rocm", value="hwgraph_fake_rocm:probe", group=registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry.discovered.cache_clear()

    selected = choose_backend(platform=ROCM_MI300X)
    assert selected.spec.name == "cpu"
    assert "cannot import name 'torch_build'" in selected.reason, selected.reason
    assert "pip install -e backends/rocm" not in selected.reason, selected.reason


def test_an_unknown_kernel_names_the_plugin_attention_module_that_failed_to_import(monkeypatch):
    pytest.importorskip("hwgraph_rocm", reason="needs the rocm plugin installed (pip install -e backends/rocm)")
    error = "cannot import name 'register_varlen_kernel' from 'hwgraph.attention.varlen_inputs'"
    simulate_broken_import(monkeypatch, "hwgraph_rocm.attention", error)
    registry.discovered.cache_clear()

    with pytest.raises(SelectionError) as raised:
        kernel_named("ROCM_AITER_FA")
    assert "unknown attention kernel 'ROCM_AITER_FA'" in str(raised.value)
    assert f"hwgraph_rocm.attention brings no attention kernels: ImportError: {error}" in str(raised.value)


def raise_on_import(monkeypatch, name: str, error: Exception) -> None:
    """Make importing ``name``, a module of a package that imports, raise ``error`` for the duration of a test."""
    package = types.ModuleType(name.rpartition(".")[0])
    package.__path__ = []
    monkeypatch.setitem(sys.modules, package.__name__, package)
    simulate_broken_import(monkeypatch, name, error)


@pytest.mark.parametrize("error", [RuntimeError("vendor runtime: driver version is insufficient"),
                                   OSError("libvendor.so: undefined symbol: vendorInit")],
                         ids=lambda e: type(e).__name__)
def test_a_backend_class_whose_module_raises_any_exception_is_a_reason_naming_the_plugin(monkeypatch, caplog, error):
    """Only ImportError and AttributeError were caught: an automatic choice whose class's module raised anything else
    crashed every manager instead of falling back to the CPU reference backend with the reason."""
    raise_on_import(monkeypatch, "hwgraph_fake_vendor.graphs", error)
    install_probes(monkeypatch, vendor=lambda: BackendSpec(
        "vendor", "hwgraph_fake_vendor.graphs:VendorGraphBackend", ("cpu",), lambda p: Capability.available(),
        priority=5, distribution="hwgraph-backend-vendor"))
    reason = (f"graph backend 'vendor' (distribution hwgraph-backend-vendor) declares class_path "
              f"'hwgraph_fake_vendor.graphs:VendorGraphBackend', which does not load: {type(error).__name__}: {error}")
    cpu = platform_of("cpu")
    with caplog.at_level(logging.WARNING, logger="hwgraph.registry"):
        assert type(create_backend(device="cpu", platform=cpu)) is CpuGraphBackend
    [message] = [m for m in caplog.messages if "falling back" in m]
    assert message.endswith(reason), message
    with pytest.raises(ImportError, match=f"^{re.escape(reason)}$") as raised:
        create_backend("vendor", device="cpu", platform=cpu)
    assert raised.value.__cause__ is error


@pytest.mark.parametrize("error", [RuntimeError("hwgraph::vendor_varlen: a kernel is already registered"),
                                   TypeError("custom_op() got an unexpected keyword argument 'device_types'")],
                         ids=lambda e: type(e).__name__)
def test_a_plugin_attention_module_that_raises_any_exception_leaves_the_backend_loaded(monkeypatch, caplog, error):
    """Only ImportError and AttributeError were caught: any other exception from a plugin's attention module escaped
    its probe, and the whole graph backend became a failed entry point."""
    module = "hwgraph_fake_vendor.attention"
    raise_on_import(monkeypatch, module, error)
    install_probes(monkeypatch, vendor=lambda: dataclasses.replace(
        spec("vendor", "cpu"), attention=registry.plugin_attention(module, "VENDOR_ATTN")))
    try:
        with caplog.at_level(logging.WARNING, logger="hwgraph.registry"):
            specs, problems = registry.discovered()
        failure = registry.ATTENTION_LOAD_FAILURES.get(module)
    finally:
        registry.ATTENTION_LOAD_FAILURES.pop(module, None)
    [vendor] = [s for s in specs if s.name == "vendor"]
    assert (vendor.attention, problems) == ((), ())
    assert failure == f"{module} brings no attention kernels: {type(error).__name__}: {error}"
    assert f"hwgraph_fake_vendor brings no attention kernels: {type(error).__name__}: {error}" in caplog.messages


def test_an_explicit_backend_serving_no_cpu_is_refused_a_cpu_device_for_that_on_a_machine_it_serves(monkeypatch):
    """Its gate judged the CPU job's platform, so a GPU backend named for a CPU tower said no GPU was visible, on a
    machine whose GPU is. On a machine it does not serve, its gate's reasons (no GPU) stay the message. A plugin
    serving cpu takes a CPU device as before, and an automatic choice for one is the cpu reference backend."""
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

    install_probes(monkeypatch, gpu=lambda: BackendSpec("gpu", "hwgraph.graphs.cpu:CpuGraphBackend", ("cuda", "rocm"),
                                                        lambda p: Capability(() if p.kind == "cuda" else
                                                                             ("no GPU is visible",)), priority=5),
                   host=lambda: spec("host", "cpu", priority=-1))
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    for device in ("cpu", torch.device("cpu"), "meta"):
        with pytest.raises(SelectionError, match=f"^graph backend 'gpu' captures on cuda devices; got device "
                                                 f"{re.escape(repr(str(device)))}$"):
            choose_backend("gpu", device=device)
    assert choose_backend("gpu", device="cuda:0").spec.name == "gpu"
    assert choose_backend("host", device="cpu").spec.name == "host"
    simulate_gpu(monkeypatch, count=0)  # no GPU: what the gate says is what to fix
    with pytest.raises(SelectionError, match="^graph backend 'gpu' is unavailable: no GPU is visible$"):
        choose_backend("gpu", device="cpu")
    assert choose_backend(device="cpu").spec.name == "cpu"


def test_a_probe_returning_a_spec_with_a_bare_string_of_modes_is_that_plugins_problem(monkeypatch):
    """modes="full" made "f" a mode of the backend; now the spec is refused where discovery names the plugin."""
    def bare_modes():
        return BackendSpec(name="bare", class_path="hwgraph.graphs.cpu:CpuGraphBackend", kinds=("cpu",),
                           gate=lambda platform: Capability.available(), modes="full")

    install_probes(monkeypatch, bare_modes=bare_modes)
    specs, problems = registry.discovered()
    assert [s.name for s in specs] == ["cpu"]
    assert len(problems) == 1 and "'bare_modes'" in problems[0]
    assert "TypeError: BackendSpec 'bare': modes is a tuple of one or more non-empty strings, got 'full'" in problems[0]


@pytest.mark.parametrize("name, error, match", [
    # a script's unset variable (graph_backend=os.environ.get("X", "")): it silently became the automatic choice (or
    # $HWGRAPH_GRAPH_BACKEND's), as an empty graph_mode once became the first mode
    ("", ValueError, r"graph_backend='': expected a graph backend name, one of cpu, other \(None: "),
    (0, TypeError, r"graph_backend=0: expected a graph backend name \(a str\), one of cpu, other"),
    (False, TypeError, r"graph_backend=False: expected a graph backend name"),
    (CpuGraphBackend, TypeError, r"graph_backend=<class '.*CpuGraphBackend'>: expected a graph backend name"),
])
def test_only_none_means_the_automatic_choice_and_an_empty_or_non_str_name_is_refused(monkeypatch, name, error, match):
    install_probes(monkeypatch, other=lambda: spec("other", "cpu", priority=60))
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "cpu")  # the variable is not what an empty argument asks for either
    with pytest.raises(error, match=match):
        choose_backend(name, platform=platform_of("cpu"))
    with pytest.raises(error, match=match):
        create_backend(name, device=torch.device("cpu"))
    assert choose_backend(None, platform=platform_of("cpu")).spec.name == "cpu"  # None: the variable's
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "")  # a variable set empty counts as unset
    assert choose_backend(None, platform=platform_of("cpu")).spec.name == "other"


def test_an_error_about_the_backend_the_variable_names_says_the_variable_named_it(monkeypatch):
    """``EncoderGraphManager(tower)`` with ``$HWGRAPH_GRAPH_BACKEND`` naming an unknown or unavailable backend said
    "graph backend 'x' is unavailable" without saying that the name came from the environment (the command line's
    errors added it themselves)."""
    install_probes(monkeypatch, other=lambda: spec("other", "cuda", reasons=("needs a GPU",), priority=60))
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "other")
    with pytest.raises(SelectionError, match=rf"^\${GRAPH_BACKEND_ENV}: graph backend 'other' is unavailable: needs "
                                             rf"a GPU$"):
        choose_backend(platform=platform_of("cpu"))
    with pytest.raises(SelectionError, match=rf"^\${GRAPH_BACKEND_ENV}: graph backend 'other' is unavailable"):
        create_backend(device=torch.device("cpu"))  # once, not again by create_backend around choose_backend
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "bogus")
    with pytest.raises(SelectionError, match=rf"^\${GRAPH_BACKEND_ENV}: unknown graph backend 'bogus'; known: "):
        create_backend(device=torch.device("cpu"))
    with pytest.raises(SelectionError, match=r"^graph backend 'other' is unavailable: needs a GPU$"):
        choose_backend("other", platform=platform_of("cpu"))  # named as an argument: the variable is not the source


@pytest.mark.parametrize("value, chosen", [("  ", "other"), ("\t", "other"), ("cpu\n", "cpu"), (" cpu ", "cpu")])
def test_the_variable_set_blank_is_unset_and_its_surrounding_blanks_are_ignored_as_hwgraph_attentions_are(
        monkeypatch, value, chosen):
    """``$HWGRAPH_GRAPH_BACKEND`` set blank (a shell's ``=" "``, a template's empty field) was "unknown graph backend
    '  '" and ``cpu\\n`` (a value read from a file) "unknown graph backend 'cpu\\n'", where ``$HWGRAPH_ATTENTION`` takes
    both: blank is unset, as empty is, and surrounding blanks are ignored."""
    install_probes(monkeypatch, other=lambda: spec("other", "cpu", priority=60))
    monkeypatch.setenv(GRAPH_BACKEND_ENV, value)
    assert choose_backend(platform=platform_of("cpu")).spec.name == chosen
    assert isinstance(create_backend(device=torch.device("cpu")), CpuGraphBackend)  # the class of both


def test_a_distribution_whose_entry_points_cannot_be_read_is_a_problem_naming_it_and_the_plugins_still_load(
        tmp_path, monkeypatch):
    """importlib.metadata parses every installed distribution's entry points to select the ``hwgraph.backends`` group,
    so one malformed ``entry_points.txt`` anywhere (a line without '=', here in another group) raised out of discovery
    ("TypeError: Pair.__new__() missing 1 required positional argument: 'value'"): every choice and ``hwgraph info``
    crashed, naming nothing (from Python 3.15, an entry point whose value is not a module path does too)."""
    def dist_info(name: str, entry_points: str) -> None:
        folder = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (folder / "entry_points.txt").write_text(entry_points)

    dist_info("broken-dist", "[console_scripts]\nbroken-tool\n")
    dist_info("hwgraph-toy-backend", "[hwgraph.backends]\ntoy = hwgraph_toy_probe:probe\n")
    (tmp_path / "hwgraph_toy_probe.py").write_text(
        "from hwgraph.capability import Capability\nfrom hwgraph.registry import BackendSpec\n\n\n"
        "def probe():\n    return BackendSpec('toy', 'hwgraph.graphs.cpu:CpuGraphBackend', ('cpu',),\n"
        "                       lambda platform: Capability.available(), priority=-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.discovered.cache_clear()
    try:
        specs, problems = registry.discovered()
    finally:
        sys.modules.pop("hwgraph_toy_probe", None)
    assert {"cpu", "toy"} <= {s.name for s in specs}
    assert registry.spec_named("toy").distribution == "hwgraph-toy-backend"
    (problem,) = problems
    assert problem.startswith("distribution 'broken-dist': its entry points cannot be read: TypeError: "), problem
