"""Discover graph backends (the built-in CPU reference and every ``hwgraph.backends`` entry point) and pick one.

An entry point names a *probe*: a cheap function in the plugin's ``platform.py`` that returns a
``BackendSpec``. The spec carries the backend's class path, imported only when that backend is chosen, its gate,
and the attention kernels the plugin brings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib.metadata import distributions, entry_points

from packaging.utils import canonicalize_name

from hwgraph import spec_fields
from hwgraph.capability import Capability
from hwgraph.platform import PlatformInfo, detect, device_type, platform_for, runs_on_host

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hwgraph.backends"
GRAPH_BACKEND_ENV = "HWGRAPH_GRAPH_BACKEND"


class SelectionError(RuntimeError):
    """No candidate could be used; the message lists every candidate with its reasons."""


def load_object(path: str):
    """Import ``'package.module:attribute'``."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def gate_capability(name: str, gate: Callable[[PlatformInfo], Capability], platform: PlatformInfo) -> Capability:
    """``gate(platform)``, the gate of the backend or kernel ``name``. A gate that raises, or returns something other
    than a ``Capability`` (True or None crashed `hwgraph info` and every choice), is a reason naming ``name``: a
    plugin's error must not take selection down with it."""
    try:
        cap = gate(platform)
    except Exception as exc:
        log.debug("the %s gate failed", name, exc_info=True)  # its traceback, for the plugin's author
        return Capability.unavailable(f"the {name} gate failed: {type(exc).__name__}: {exc}")
    if not isinstance(cap, Capability):
        return Capability.unavailable(f"the {name} gate returned {cap!r} ({type(cap).__name__}), "
                                      f"expected a Capability")
    return cap


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin's probe returns; nothing here imports a vendor SDK."""

    name: str
    class_path: str  # "package.module:Class", a GraphBackend subclass
    kinds: tuple[str, ...]  # platform kinds it serves ("cuda", "rocm", "npu", "cpu")
    gate: Callable[[PlatformInfo], Capability]
    modes: tuple[str, ...] = ("full",)
    priority: int = 0  # higher wins among available backends for the detected kind
    attention: tuple = ()  # KernelSpec of the kernels this plugin brings
    description: str = ""
    distribution: str | None = field(default=None, compare=False)

    def __post_init__(self):
        from hwgraph.attention.base import KernelSpec

        name = f"BackendSpec {self.name!r}"
        spec_fields.text("BackendSpec", "name", self.name)
        spec_fields.text(name, "class_path", self.class_path)
        object.__setattr__(self, "kinds", spec_fields.names(name, "kinds", self.kinds))
        spec_fields.function(name, "gate", self.gate)
        object.__setattr__(self, "modes", spec_fields.names(name, "modes", self.modes))
        spec_fields.integer(name, "priority", self.priority)
        object.__setattr__(self, "attention", spec_fields.items(name, "attention", self.attention, KernelSpec,
                                                                empty=True))
        spec_fields.text(name, "description", self.description, empty=True)
        if self.distribution is not None:  # reports look its version up by it (a tuple raised there, in TypeError)
            spec_fields.text(name, "distribution", self.distribution)

    def capability(self, platform: PlatformInfo | None = None) -> Capability:
        return gate_capability(self.name, self.gate, platform or detect())

    def device_refusal(self, device) -> str | None:
        """Why this backend cannot capture on ``device`` whatever the machine has, or None: a CPU (or meta) device
        for a backend that serves no CPU (its gate would judge that CPU job's platform, and blame the machine's GPU)."""
        if device is None or "cpu" in self.kinds or not runs_on_host(device):
            return None
        types = " or ".join(dict.fromkeys(device_type(kind) for kind in self.kinds))
        return f"graph backend {self.name!r} captures on {types} devices; got device {str(device)!r}"

    def mode_refusal(self, mode: str | None) -> str | None:
        """Why ``mode`` is not one of this backend's graph modes, or None (also for None: its first mode)."""
        if mode is None or mode in self.modes:
            return None
        return f"graph backend {self.name!r} has modes {', '.join(self.modes)}"

    def load(self):
        """The backend's class. A ``class_path`` that does not import is an ``ImportError`` naming it, the plugin that
        declared it and the exception, whatever its type (a vendor runtime may raise RuntimeError or OSError as it
        initialises)."""
        try:
            return load_object(self.class_path)
        except Exception as exc:
            log.debug("graph backend %r failed to load", self.name, exc_info=True)  # its traceback, for its author
            source = f" (distribution {self.distribution})" if self.distribution else ""
            raise ImportError(f"graph backend {self.name!r}{source} declares class_path {self.class_path!r}, which "
                              f"does not load: {type(exc).__name__}: {exc}") from exc


# A plugin module whose attention kernels failed to import -> why, so that asking for one of them by name says why
# it is unknown (the backend itself still loads).
ATTENTION_LOAD_FAILURES: dict[str, str] = {}


def plugin_attention(module: str, *names: str) -> tuple:
    """The attention kernels (``KernelSpec`` objects) ``names`` of a plugin's ``module``, for its probe; empty, and
    logged (debug when the module is absent, warning when it fails to import, with any exception: a kernel library
    may raise RuntimeError as it registers its ops), so the backend still loads."""
    try:
        loaded = importlib.import_module(module)
        kernels = tuple(getattr(loaded, name) for name in names)
    except Exception as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == module
        (log.debug if missing else log.warning)("%s brings no attention kernels: %s: %s", module.split(".")[0],
                                                type(exc).__name__, exc)
        if not missing:
            log.debug("%s failed to import", module, exc_info=True)  # its traceback, for the plugin's author
            ATTENTION_LOAD_FAILURES[module] = f"{module} brings no attention kernels: {type(exc).__name__}: {exc}"
        return ()
    ATTENTION_LOAD_FAILURES.pop(module, None)
    return kernels


def plugin_install_hint(kind: str | None = None) -> str:
    """How a user installs a vendor plugin. They are not on a package index, so ``pip install 'hwgraph[cuda]'``
    fails (no hwgraph-backend-cuda to be found); they install from hwgraph's checkout (README, Install)."""
    folder = f"backends/{kind}" if kind in ("cuda", "rocm", "npu") else "backends/cuda (or rocm, npu)"
    return f"the plugins are not on a package index; from hwgraph's checkout: pip install -e {folder}"


def failed_plugins(problems) -> str:
    """What an unknown name's error adds: the installed plugins (or their modules) that failed to load, whose names
    may be the one asked for; empty without any."""
    return f"; installed plugins that failed to load: {'; '.join(problems)}" if problems else ""


def cpu_probe() -> BackendSpec:
    return BackendSpec(
        name="cpu",
        class_path="hwgraph.graphs.cpu:CpuGraphBackend",
        kinds=("cpu",),
        gate=lambda platform: Capability.available(),
        modes=("emulated",),
        priority=0,
        description="reference backend: emulates capture/replay exactly, eagerly; no speed-up",
    )


def plugin_entry_points(problems: list[str]) -> list:
    """Every installed ``hwgraph.backends`` entry point. importlib.metadata parses every distribution's entry points to
    select one group, so a malformed ``entry_points.txt`` anywhere (from Python 3.15, also an entry point whose value
    is no module path) raised out of discovery: then each distribution is read alone (the first of a name found, as
    importlib.metadata takes it), and one that cannot be read is a problem naming it."""
    try:
        return list(entry_points(group=ENTRY_POINT_GROUP))
    except Exception:
        log.debug("the installed entry points cannot be read together", exc_info=True)
    found, seen = [], set()
    for dist in distributions():
        name = None
        try:
            name = dist.metadata["Name"]
            key = canonicalize_name(name) if name else dist
            if key in seen:
                continue
            seen.add(key)
            found += [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        except Exception as exc:
            problems.append(f"distribution {name or dist!r}: its entry points cannot be read: "
                            f"{type(exc).__name__}: {exc}")
    return found


@lru_cache(maxsize=1)
def discovered() -> tuple[tuple[BackendSpec, ...], tuple[str, ...]]:
    """(specs, problems): the built-in CPU backend and every entry point; a broken plugin is a problem, not a crash."""
    specs = [cpu_probe()]
    problems = []
    for ep in plugin_entry_points(problems):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        where = f"{ep.value}, distribution {dist}" if dist else ep.value
        try:
            spec = ep.load()()
            if not isinstance(spec, BackendSpec):
                raise TypeError(f"probe returned {type(spec).__name__}, expected BackendSpec")
        except Exception as exc:
            log.debug("entry point %r (%s) failed to load", ep.name, where, exc_info=True)  # for its author
            problems.append(f"entry point {ep.name!r} ({where}) failed to load: {type(exc).__name__}: {exc}")
            continue
        kept = next((s for s in specs if s.name == spec.name), None)
        if kept is not None:
            first = f" (distribution {kept.distribution})" if kept.distribution else ""
            problems.append(f"entry point {ep.name!r} ({where}) repeats the backend name {spec.name!r}, which the "
                            f"first found{first} keeps; ignored")
            continue
        if spec.distribution is None and dist is not None:
            spec = dataclasses.replace(spec, distribution=dist)  # reports name its version
        specs.append(spec)
    for problem in problems:
        log.warning(problem)
    return tuple(specs), tuple(problems)


def backend_specs() -> tuple[BackendSpec, ...]:
    return discovered()[0]


def spec_named(name: str) -> BackendSpec:
    for spec in backend_specs():
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in backend_specs())
    failed = failed_plugins(discovered()[1])
    raise SelectionError(f"unknown graph backend {name!r}; known: {known} ({plugin_install_hint()}){failed}")


def list_backends(platform: PlatformInfo | None = None) -> list[tuple[BackendSpec, Capability]]:
    """Every known graph backend with its capability on this platform."""
    platform = platform or detect()
    return [(spec, spec.capability(platform)) for spec in backend_specs()]


@dataclass(frozen=True)
class Selected:
    spec: BackendSpec
    reason: str  # why this one: "explicit", "best available for cuda", or the fallback's why

    @property
    def explicit(self) -> bool:
        """Named by the caller or ``$HWGRAPH_GRAPH_BACKEND``, not chosen automatically."""
        return self.reason == "explicit"

    @property
    def fallback(self) -> bool:
        """The CPU reference backend, chosen because the automatic choice could not be used (``cpu_fallback``)."""
        return self.reason.startswith(FALLBACK)


FALLBACK = "falling back to the cpu reference backend"


def cpu_fallback(why: str) -> Selected:
    """The CPU reference backend, chosen because ``why`` rules out the automatic choice."""
    return Selected(spec_named("cpu"), f"{FALLBACK} (eager-equivalent, no speed-up): {why}")


def check_backend_name(name) -> None:
    """``ValueError`` / ``TypeError`` naming ``name`` unless it is None (the automatic choice) or a non-empty str: an
    empty one (a script's unset variable) or a falsy one silently became the automatic choice."""
    if name is None or (isinstance(name, str) and name):
        return
    known = ", ".join(s.name for s in backend_specs())
    if isinstance(name, str):
        raise ValueError(f"graph_backend={name!r}: expected a graph backend name, one of {known} (None: "
                         f"${GRAPH_BACKEND_ENV}, else the best available)")
    raise TypeError(f"graph_backend={name!r}: expected a graph backend name (a str), one of {known}, or None")


def choose_backend(name: str | None = None, platform: PlatformInfo | None = None, device=None) -> Selected:
    """Pick a graph backend: ``name``, else (None) ``$HWGRAPH_GRAPH_BACKEND``, else the best available for the platform
    (by default the one serving ``device``, ``platform_for``; else the machine's, ``detect``). A ``name`` that is
    empty or not a str is refused (``check_backend_name``).

    An explicit choice that cannot capture on ``device`` (a CPU device for a GPU backend, on a machine it serves) or
    fails its gate raises ``SelectionError`` with its reasons. An automatic choice, among the backends of
    non-negative priority that serve the platform's kind, that finds nothing falls back to the CPU reference backend
    (eager-equivalent) and says why.
    """
    check_backend_name(name)
    with named_by_variable(name):
        return chosen_backend(name, platform, device)


@contextlib.contextmanager
def named_by_variable(name: str | None):
    """Where ``name`` is None and ``$HWGRAPH_GRAPH_BACKEND`` names the backend, a ``SelectionError`` or
    ``ImportError`` raised inside begins with the variable, as the command line's errors do: a manager's refusal of
    "graph backend 'cuda'" did not say that the name came from the environment."""
    from_variable = name is None and backend_from_variable() is not None
    try:
        yield
    except (SelectionError, ImportError) as exc:
        if not from_variable:
            raise
        raise type(exc)(f"${GRAPH_BACKEND_ENV}: {exc}") from exc


def variable_setting(name: str) -> str | None:
    """Environment variable ``name`` without surrounding blanks, or None where it is unset, empty or blank: how
    ``$HWGRAPH_GRAPH_BACKEND`` and ``$HWGRAPH_ATTENTION`` are read (set blank, or ``cpu\\n`` read from a file, either
    was an unknown name)."""
    return os.environ.get(name, "").strip() or None


def backend_from_variable() -> str | None:
    """``$HWGRAPH_GRAPH_BACKEND`` as ``variable_setting`` reads it."""
    return variable_setting(GRAPH_BACKEND_ENV)


def chosen_backend(name: str | None, platform: PlatformInfo | None, device) -> Selected:
    """``choose_backend``'s choice, its name checked."""
    platform = platform or (detect() if device is None else platform_for(device))
    name = name if name is not None else backend_from_variable()
    if name:
        spec = spec_named(name)
        refusal = spec.device_refusal(device)
        if refusal and spec.capability(detect()).ok:  # a machine it serves: the device is what is wrong
            raise SelectionError(refusal)
        cap = spec.capability(platform)
        if not cap.ok:
            raise SelectionError(f"graph backend {name!r} is unavailable: " + "; ".join(cap.reasons))
        return Selected(spec, "explicit")
    refused = []
    for spec in sorted(backend_specs(), key=lambda s: -s.priority):
        if platform.kind not in spec.kinds or spec.priority < 0:  # a negative priority: chosen only by name
            continue
        cap = spec.capability(platform)
        if cap.ok:
            return Selected(spec, f"best available for {platform.kind}")
        refused.append(f"{spec.name}: {cap.describe()}")
    problems = discovered()[1]
    if refused:
        why = "; ".join(refused)
    elif problems:  # the plugin for this kind may be installed and have failed to load: say so, not "pip install"
        why = (f"no loaded backend serves {platform.kind}; installed plugins that failed to load: "
               f"{'; '.join(problems)}")
    else:
        why = f"no installed backend serves {platform.kind} ({plugin_install_hint(platform.kind)})"
    fallback = cpu_fallback(why)
    if platform.kind != "cpu":
        log.warning(fallback.reason)
    return fallback


def create_backend(name: str | None = None, device=None, mode: str | None = None, platform=None):
    """Instantiate the chosen graph backend (importing its class only now).

    An explicit backend given a CPU device it does not serve, on a machine whose accelerator it serves, raises
    ``SelectionError`` saying so (``BackendSpec.device_refusal``); elsewhere its gate's reasons say more. The
    probe's gate judges the platform; the class then judges ``device`` itself (``GraphBackend.capability``: that it
    exists, that it is a device of its runtime, its architecture). A device it refuses raises ``SelectionError``
    with the reasons for an explicit choice; an automatic choice falls back to the CPU reference backend, as when no
    gate accepts the platform, and says why. So does an automatic choice whose class does not import (an explicit
    one raises that ``ImportError``), whose ``capability`` raises (a reason, as a gate's crash is), or whose
    construction refuses its graph mode with ``SelectionError`` (npu's ``aclgraph`` on a torch_npu without its graph
    API). A ``mode`` meant for the backend an automatic choice could not use raises ``ValueError`` with the
    reason."""
    check_backend_name(name)
    with named_by_variable(name):
        return created_backend(name, device, mode, platform)


def created_backend(name: str | None, device, mode: str | None, platform):
    """``create_backend``'s backend, its name checked."""
    # the platform serving device: its architecture (a host may mix GPUs), not device 0's; the CPU's for a CPU device
    chosen = chosen_backend(name, platform, device)
    selected, cls = loaded_class(chosen)
    refusal = device_refusal(selected.spec.name, cls, device)
    if refusal:
        if selected.explicit:
            raise SelectionError(refusal)
        selected = cpu_fallback(refusal)
        cls = selected.spec.load()
    selected, cls, backend = constructed(selected, cls, device, mode)  # it may still refuse its graph mode
    if backend is not None:
        log.info("graph backend %s (%s)", selected.spec.name, selected.reason)
        return backend
    if selected is not chosen:
        log.warning(selected.reason)
    if mode is not None and mode not in cls.modes:
        # the mode was meant for the backend the automatic choice could not use: say why, not just the cpu's modes
        raise ValueError(f"graph mode {mode!r} is not a mode of the cpu reference backend (modes "
                         f"{list(cls.modes)}), and the automatic choice is {selected.reason}")
    log.info("graph backend %s (%s)", selected.spec.name, selected.reason)
    return cls(device=device, mode=mode)


def constructed(selected: Selected, cls: type, device=None, mode: str | None = None) -> tuple[Selected, type, object]:
    """``selected``, its class ``cls`` and that class made for ``device`` and ``mode``; for the CPU reference
    fallback, which ``create_backend`` makes once it has checked ``mode``, None. A class that refuses its graph mode
    (npu's ``aclgraph`` on a torch_npu without ``torch.npu.NPUGraph``) raises ``SelectionError`` for an explicit
    choice and gives the CPU reference backend, with the reason, for an automatic one."""
    if selected.fallback:
        return selected, cls, None
    try:
        return selected, cls, cls(device=device, mode=mode)
    except SelectionError as exc:
        if selected.explicit:
            raise
        fallback = cpu_fallback(str(exc))
        return fallback, fallback.spec.load(), None


def loaded_class(selected: Selected) -> tuple[Selected, type]:
    """``selected`` and its backend class. Where the class does not import, an explicit choice raises that
    ``ImportError`` and an automatic one falls back to the CPU reference backend, which says why."""
    try:
        return selected, selected.spec.load()
    except ImportError as exc:
        if selected.explicit:
            raise
        fallback = cpu_fallback(str(exc))
        return fallback, fallback.spec.load()


def device_refusal(name: str, cls, device) -> str | None:
    """Why backend class ``cls`` (named ``name``) cannot capture on ``device``, or None (also for no device)."""
    if device is None:
        return None
    try:
        cap = cls.capability(device)
    except Exception as exc:  # a crashing device check is a reason, not a crash
        log.debug("graph backend %r: capability(%s) failed", name, device, exc_info=True)
        cap = Capability.unavailable(f"its capability({device}) failed: {type(exc).__name__}: {exc}")
    return None if cap.ok else f"graph backend {name!r} cannot capture on {device}: {cap.describe()}"
