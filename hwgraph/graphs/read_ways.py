"""The ways from a captured callable to the tensors it can reach, searched at capture and followed at each replay.

A way is a tuple of steps from the callable, each following one reference (``FOLLOW``): closure cells, the globals its
code names, defaults, a bound method's ``self``, a wrapped function, and through them modules (their parameters,
buffers, submodules and forward hooks), plain objects (their ``__dict__`` and ``__slots__``), dicts, lists, tuples
and deques. ``ways_to_tensors`` searches them breadth first; ``capture_reads`` keeps those to the tensors a capture
read and follows them again before each replay.
"""

from __future__ import annotations

import functools
import itertools
import reprlib
import sys
import types
from collections import deque
from collections.abc import Callable, Iterator

import torch

from hwgraph.graphs.read_recording import storage_key, tensor_facts

#: bounds of the search for the ways to the tensors read: objects looked into, ways kept per storage, and the items
#: looked at in one dict, list or tuple
MAX_OBJECTS = 20_000
MAX_WAYS = 8
MAX_ITEMS = 4096
#: packages whose objects the search does not look into (their tensors are not the caller's to replace), beyond the
#: standard library; their modules (``torch.nn``) and functions wrapping a caller's function are still followed
SKIPPED_PACKAGES = frozenset({"torch", "numpy", "triton", "transformers", "sympy"})


# ---------------------------------------------------------------- the ways from a callable to the tensors it read
# A way is a tuple of steps from the callable; each step (kind, key, name) follows one reference, as FOLLOW[kind] does
ATTR, KEY, ITEM, CELL, GLOBAL, DEFAULT, KWDEFAULT, SELF, FUNC, WRAPPED, ARG, KEYWORD, SLOT = range(13)
GONE = object()  # a dict's entry that is no longer there

FOLLOW = {
    ATTR: lambda obj, key: obj.__dict__[key],  # the instance's own attributes: no property or __getattr__ runs
    KEY: lambda obj, key: dict.get(obj, key, GONE),  # a defaultdict's __missing__ would add the entry
    ITEM: lambda obj, key: obj[key],  # a list's, a tuple's or a deque's
    CELL: lambda obj, key: obj.__closure__[key].cell_contents,
    GLOBAL: lambda obj, key: obj.__globals__[key],
    DEFAULT: lambda obj, key: obj.__defaults__[key],
    KWDEFAULT: lambda obj, key: obj.__kwdefaults__[key],
    SELF: lambda obj, key: obj.__self__,
    FUNC: lambda obj, key: obj.__func__ if isinstance(obj, types.MethodType) else obj.func,
    WRAPPED: lambda obj, key: getattr(obj, key),
    ARG: lambda obj, key: obj.args[key],
    KEYWORD: lambda obj, key: obj.keywords[key],
    SLOT: lambda obj, key: getattr(obj, key),  # a __slots__ attribute (its name mangled where it is private)
}


MODULE_DICTS = ("_parameters", "_buffers", "_modules")
VARIABLES = {CELL: "closure", GLOBAL: "global", DEFAULT: "default", KWDEFAULT: "default"}


def way_text(way: tuple) -> str:
    """A way as the caller would write it: ``holder.x``, ``tower.blocks.0.norm1.weight``, ``cache['rope']``;
    ``self.weight`` from a callable object (a module)."""
    text = "self" if way and way[0][0] == ATTR else ""
    for kind, key, name in way:
        if kind in VARIABLES:  # the callable's own variable, or one of a function reached through it
            text = f"{text}.<{VARIABLES[kind]}>.{name}" if text else name
        elif kind == KEY and name == "module":  # an entry of a module's _parameters, _buffers or _modules
            text = f"{text}.{key}"
        elif kind in (KEY, ITEM):
            text = f"{text}[{key!r}]"
        elif (kind == ATTR and key not in MODULE_DICTS) or kind == SLOT:
            text = f"{text}.{key}"
        elif kind == SELF:
            text = f"{text}.__self__" if text else "self"
        elif kind in (ARG, KEYWORD):
            text = f"{text or 'partial'}.{'args' if kind == ARG else 'keywords'}[{key!r}]"
        # FUNC and WRAPPED: a method's or a partial's function, a wrapper's: the same callable
    return text or "the callable"


@functools.lru_cache(maxsize=1024)
def names_in(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the functions defined in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(names_in(const))
    return tuple(sorted(names))


def searched(obj) -> bool:
    """Whether the search looks into ``obj``: dicts, lists, tuples, functions, bound methods, partials, modules and
    other objects with attributes, but not classes, modules of code, nor objects of the standard library or of the
    packages in ``SKIPPED_PACKAGES`` (other than ``nn.Module``s and ``SimpleNamespace``s)."""
    if isinstance(obj, (dict, list, tuple, deque, types.FunctionType, types.MethodType, functools.partial,
                        torch.nn.Module)):
        return True
    if isinstance(obj, (type, types.ModuleType, torch.Tensor)) or type(obj) is types.SimpleNamespace:
        return type(obj) is types.SimpleNamespace
    package = (getattr(type(obj), "__module__", None) or "").partition(".")[0]
    try:
        has_attributes = hasattr(obj, "__dict__") or bool(slot_names(type(obj)))
    except Exception:  # noqa: BLE001 - an object whose attributes cannot be read is not searched
        return False
    return has_attributes and package not in SKIPPED_PACKAGES and package not in sys.stdlib_module_names


@functools.cache
def module_internals() -> frozenset[str]:
    """The attributes every ``nn.Module`` has (flags, backward and state-dict hooks), which hold none of the tensors
    its forward reads; its parameters, buffers and submodules are in ``_parameters``, ``_buffers`` and ``_modules``,
    and its forward hooks (a steering vector in a hook's closure) in ``FORWARD_HOOKS``."""
    return frozenset(vars(torch.nn.Module())) - {"_parameters", "_buffers", "_modules", *FORWARD_HOOKS}


FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")


@functools.cache
def slot_names(cls: type) -> tuple[str, ...]:
    """The ``__slots__`` attributes of ``cls``'s instances, as ``getattr`` names them (a private one mangled)."""
    names = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            private = name.startswith("__") and not name.endswith("__")
            names.append(f"_{klass.__name__.lstrip('_')}{name}" if private else name)
    return tuple(dict.fromkeys(names))


def references(obj) -> Iterator[tuple[tuple, object]]:
    """(step, object) for each reference the search follows out of ``obj``."""
    if isinstance(obj, dict):
        module_entries = "module" if getattr(obj, "_hwgraph_module_dict", False) else None
        for key, value in itertools.islice(obj.items(), MAX_ITEMS):  # a replay looks the key up again
            if not isinstance(key, torch.Tensor):  # which a way would keep alive (a per-call input as a key)
                yield (KEY, key, module_entries), value
        return
    if isinstance(obj, (list, tuple, deque)):
        for i, value in enumerate(itertools.islice(obj, MAX_ITEMS)):
            yield (ITEM, i, None), value
        return
    if isinstance(obj, types.MethodType):
        yield (SELF, None, None), obj.__self__
        yield (FUNC, None, None), obj.__func__
        return
    if isinstance(obj, functools.partial):
        yield (FUNC, None, None), obj.func
        for i, value in enumerate(obj.args):
            yield (ARG, i, None), value
        for key, value in obj.keywords.items():
            yield (KEYWORD, key, None), value
        return
    if isinstance(obj, types.FunctionType):
        # a torch.compile'd function or a functools.wraps wrapper: the function it wraps
        for name in ("_torchdynamo_orig_callable", "__wrapped__"):
            wrapped = getattr(obj, name, None)
            if wrapped is not None:
                yield (WRAPPED, name, None), wrapped
        if (obj.__module__ or "").partition(".")[0] in SKIPPED_PACKAGES:
            return
        code = obj.__code__
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                yield (CELL, i, code.co_freevars[i]), cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for i, value in enumerate(obj.__defaults__ or ()):
            yield (DEFAULT, i, code.co_varnames[code.co_argcount - len(obj.__defaults__) + i]), value
        for key, value in (obj.__kwdefaults__ or {}).items():
            yield (KWDEFAULT, key, key), value
        for name in names_in(code):
            if name in obj.__globals__:
                yield (GLOBAL, name, name), obj.__globals__[name]
        return
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        internals = module_internals() if isinstance(obj, torch.nn.Module) else ()
        for key, value in list(attributes.items())[:MAX_ITEMS]:
            if key in MODULE_DICTS and internals:
                yield (ATTR, key, key), ModuleEntries(value)
            elif isinstance(key, str) and key not in internals and (key not in FORWARD_HOOKS or value):
                yield (ATTR, key, key), value
    for name in slot_names(type(obj)):
        try:
            yield (SLOT, name, name), getattr(obj, name)
        except AttributeError:  # a slot not set
            continue


class ModuleEntries(dict):
    """An nn.Module's ``_parameters``, ``_buffers`` or ``_modules`` as the search sees it: entries written as
    attributes (``tower.blocks.0``). Only the search holds one; a replay follows the module's own dict."""

    _hwgraph_module_dict = True


def describe(value, strides: bool = False) -> str:
    """What a way leads to: a tensor (``described``) or another object (``None``: a bias removed)."""
    if isinstance(value, torch.Tensor):
        return described(tensor_facts(value), strides)
    return "None" if value is None else f"a {type(value).__name__} ({reprlib.repr(value)})"


def described(facts: tuple, strides: bool = False) -> str:
    """A tensor's ``tensor_facts`` in words; its strides too where asked (two views of one storage)."""
    shape, dtype, address, steps = facts
    return (f"a tensor of shape {shape}, {dtype}, at {'no address' if address is None else hex(address)}"
            + (f", strides {steps}" if strides and steps is not None else ""))


def ways_to_tensors(fn: Callable) -> tuple[dict[int, list[tuple[tuple, tuple]]], bool]:
    """Storage address -> (way, the tensor found there: ``tensor_facts``) for the tensors reachable from ``fn``,
    searched breadth first (shortest ways first) through at most ``MAX_OBJECTS`` objects; and whether the search
    looked at every object it found (False: it stopped at the bound)."""
    found: dict[int, list] = {}
    seen: dict[int, object] = {}  # held, so that no id is reused by an object made while searching
    queue = deque([(fn, ())])
    looked = 0
    while queue and looked < MAX_OBJECTS:
        obj, way = queue.popleft()
        looked += 1
        try:
            for step, value in references(obj):
                if isinstance(value, torch.Tensor):
                    key = storage_key(value)
                    if key is not None:
                        found.setdefault(key, []).append(((*way, step), tensor_facts(value)))
                elif id(value) not in seen and searched(value):
                    seen[id(value)] = value
                    queue.append((value, (*way, step)))
        except Exception:  # noqa: BLE001 - an object that cannot be looked into is not searched further
            continue
    return found, not queue
