"""Which tensors from outside itself a captured callable reads, and whether a replay would still read those.

A device graph reads, at every replay, the buffers its capture read. Where the caller replaces a tensor the callable
reads (``holder.x = torch.randn(...)``, a parameter given a new tensor or new ``.data``) instead of copying new values
into it (``copy_``), a device graph keeps reading the old buffer (stale values, or freed memory), while the CPU
reference backend's replay, which reruns the callable, read the new tensor and passed. ``captured_reads`` and
``ReadPaths`` let that replay refuse instead.

Before the capture's run, the objects the callable reaches are searched for tensors, keeping the way to each
(``holder.x``, ``tower.blocks.0.attn.qkv.weight``): closure cells, the globals its code names, defaults, a bound
method's ``self``, a wrapped function, and through them modules, plain objects, dicts, lists and tuples. The run goes
under a recording that notes the storages it reads from outside (``read_recording``: ``ReadRecorder``, under the
``force_eager`` stance). Where the recorded run fails and a run without the recording does not (torch takes other
paths under a mode), the capture goes on unchecked (``captured_reads``).

A replay follows the ways to those storages again before it reruns the callable (``ReadPaths.stale``): where every way
to one now leads to another tensor, the callable would read that tensor where a device graph reads the captured
buffer. As the callable may itself put the captured tensor back before reading it (``self.table = cached(...)``, a
holder that another graph's callable pointed at its own buffer), the replay reruns it and follows the ways again, and
raises ``CaptureError`` naming both tensors, before it writes any output, only for a read stale both times
(``ReadPaths.check(before=...)``); a replay that finds nothing stale follows the ways once.

Checking every op of every replay under such a mode would see every read, but the mode alone costs about 15 us an op
(the tiny tower's replay: 290 ops, 2.7 ms without a mode, 7 ms under one that does nothing), and dynamo runs no
compiled frame under it; following the ways costs about 70 us a replay. What the ways miss: a tensor reached otherwise
(through a class, a C++ object, an object of torch's such as a ``BlockMask``, or the module of a method the callable
calls), a switch between two tensors that both existed at capture (an index into a list of buffers), a replaced tensor
whose storage is still reached by another way (a second reference left unchanged), a tensor that a higher-order op's
functions read other than as its operands (a ``torch.cond`` branch's closure: its dense kernel refuses a mode), and a
replaced tensor read by a callable that then puts the captured one back itself.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import types
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hwgraph.graphs import read_recording
from hwgraph.graphs.base import CaptureError
from hwgraph.graphs.read_recording import ReadRecorder, forced_eager, storage_key

log = logging.getLogger(__name__)

#: bounds of the search for the ways to the tensors read: objects looked into, ways kept per storage, and the items
#: looked at in one dict, list or tuple
MAX_OBJECTS = 20_000
MAX_WAYS = 8
MAX_ITEMS = 4096
#: packages whose objects the search does not look into (their tensors are not the caller's to replace), beyond the
#: standard library; their modules (``torch.nn``) and functions wrapping a caller's function are still followed
SKIPPED_PACKAGES = frozenset({"torch", "numpy", "triton", "transformers", "sympy"})


def captured_reads(fn: Callable) -> tuple[object, ReadPaths | None]:
    """``fn()`` under a ``ReadRecorder``: its result, and the ways from ``fn`` to the tensors it read from outside,
    searched before it runs (a tensor it reads may be one it replaces: ``state.prev = state.prev + 1``).

    Compiled code (``fn`` itself or a ``torch.compile``'d function it calls) runs eagerly here, under the
    ``force_eager`` stance (``forced_eager``), for the whole process while any capture records (other threads'
    compiled code runs eagerly meanwhile): dynamo runs no compiled frame under a dispatch mode, and the eager code
    reads the same tensors.

    Where the run fails in a way the recording may cause (``failed_for_the_recording``: in our code, in
    torch's code that runs otherwise under a mode and the eager stance, or torch refusing the recorder), ``fn`` runs
    once more, without the recording, as a capture without the check would: if that succeeds, the result comes with
    no ways (None: its replays are not checked; logged at debug); if it fails, that failure is raised. Any other error
    (the callable's own, an op's) is raised at once, as a device backend's capture fails on it: a callable that fails
    only in the capture's run is not given another."""
    ways = ways_to_tensors(fn)
    recorder = ReadRecorder()
    try:
        with forced_eager(), recorder:
            out = fn()
    except Exception as exc:
        if not failed_for_the_recording(exc):
            raise
        out = fn()
        log.debug("recording the reads of %s failed where a run without it did not, so its replays are not checked "
                  "for replaced tensors", callable_name(fn), exc_info=exc)
        return out, None
    return out, ReadPaths.of(fn, ways, recorder.read)


#: torch's code that runs otherwise under a dispatch mode and the ``force_eager`` stance than in a plain run: a
#: higher-order op's eager path (``torch.cond``'s refuses nested operands, which its compiled path takes), dynamo
RECORDING_PATHS = tuple(os.path.join(os.path.dirname(torch.__file__), name) + os.sep
                        for name in ("_higher_order_ops", "_dynamo"))
#: our code that runs in the recorded run: this module and the recorder's
RECORDING_FILES = (__file__, read_recording.__file__)


def failed_for_the_recording(exc: BaseException) -> bool:
    """Whether ``exc`` may come from the recording rather than from the callable: its innermost frame is in
    ``RECORDING_FILES`` or ``RECORDING_PATHS``, or it names the recorder (torch refusing a mode names it). Not an op's
    error (raised where torch calls the op, ``torch/_ops.py``) nor one the callable's own code raises."""
    if ReadRecorder.__name__ in str(exc):
        return True
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame, tb.tb_next
    return last is not None and (last.f_code.co_filename in RECORDING_FILES
                                 or last.f_code.co_filename.startswith(RECORDING_PATHS))


# ---------------------------------------------------------------- the ways from a callable to the tensors it read
# A way is a tuple of steps from the callable; each step (kind, key, name) follows one reference, as FOLLOW[kind] does
ATTR, KEY, ITEM, CELL, GLOBAL, DEFAULT, KWDEFAULT, SELF, FUNC, WRAPPED, ARG, KEYWORD = range(12)
GONE = object()  # a dict's entry that is no longer there

FOLLOW = {
    ATTR: lambda obj, key: obj.__dict__[key],  # the instance's own attributes: no property or __getattr__ runs
    KEY: lambda obj, key: dict.get(obj, key, GONE),  # a defaultdict's __missing__ would add the entry
    ITEM: lambda obj, key: obj[key],  # a list's or a tuple's
    CELL: lambda obj, key: obj.__closure__[key].cell_contents,
    GLOBAL: lambda obj, key: obj.__globals__[key],
    DEFAULT: lambda obj, key: obj.__defaults__[key],
    KWDEFAULT: lambda obj, key: obj.__kwdefaults__[key],
    SELF: lambda obj, key: obj.__self__,
    FUNC: lambda obj, key: obj.__func__ if isinstance(obj, types.MethodType) else obj.func,
    WRAPPED: lambda obj, key: getattr(obj, key),
    ARG: lambda obj, key: obj.args[key],
    KEYWORD: lambda obj, key: obj.keywords[key],
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
        elif kind == ATTR and key not in MODULE_DICTS:
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
    if isinstance(obj, (dict, list, tuple, types.FunctionType, types.MethodType, functools.partial, torch.nn.Module)):
        return True
    if isinstance(obj, (type, types.ModuleType, torch.Tensor)) or type(obj) is types.SimpleNamespace:
        return type(obj) is types.SimpleNamespace
    package = (getattr(type(obj), "__module__", None) or "").partition(".")[0]
    try:
        has_attributes = hasattr(obj, "__dict__")
    except Exception:  # noqa: BLE001 - an object whose attributes cannot be read is not searched
        return False
    return has_attributes and package not in SKIPPED_PACKAGES and package not in sys.stdlib_module_names


@functools.cache
def module_internals() -> frozenset[str]:
    """The attributes every ``nn.Module`` has (hooks, flags), which hold none of its tensors; its parameters, buffers
    and submodules are in ``_parameters``, ``_buffers`` and ``_modules``."""
    return frozenset(vars(torch.nn.Module())) - {"_parameters", "_buffers", "_modules"}


def references(obj) -> Iterator[tuple[tuple, object]]:
    """(step, object) for each reference the search follows out of ``obj``."""
    if isinstance(obj, dict):
        module_entries = "module" if getattr(obj, "_hwgraph_module_dict", False) else None
        for i, (key, value) in enumerate(obj.items()):
            if i == MAX_ITEMS:
                break
            if isinstance(key, (str, int)):
                yield (KEY, key, module_entries), value
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj[:MAX_ITEMS]):
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
            elif isinstance(key, str) and key not in internals:
                yield (ATTR, key, key), value


class ModuleEntries(dict):
    """An nn.Module's ``_parameters``, ``_buffers`` or ``_modules`` as the search sees it: entries written as
    attributes (``tower.blocks.0``). Only the search holds one; a replay follows the module's own dict."""

    _hwgraph_module_dict = True


def describe(tensor: torch.Tensor) -> str:
    return described(tensor_facts(tensor))


def tensor_facts(tensor: torch.Tensor) -> tuple:
    """(shape, dtype, address) of ``tensor``; address None where it has none (a sparse tensor)."""
    try:
        address = tensor.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        address = None
    return tuple(tensor.shape), tensor.dtype, address


def described(facts: tuple) -> str:
    shape, dtype, address = facts
    return f"a tensor of shape {shape}, {dtype}, at {'no address' if address is None else hex(address)}"


def ways_to_tensors(fn: Callable) -> dict[int, list[tuple[tuple, tuple]]]:
    """Storage address -> (way, the tensor found there: shape, dtype, address) for the tensors reachable from ``fn``,
    searched breadth first (shortest ways first) through at most ``MAX_OBJECTS`` objects."""
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
    return found


@dataclass
class Read:
    """One storage the capture read from outside, the ways from the callable to it, and the tensor each led to."""

    storage: StorageWeakRef
    ways: tuple[tuple, ...]
    captured: tuple[tuple, ...]  # (shape, dtype, address)


@dataclass
class ReadPaths:
    """The ways from a captured callable to the tensors its capture read from outside (``captured_reads``);
    ``stale()`` lists the reads a replay would find another tensor in place of, and ``check()`` raises ``CaptureError``
    for them (after a rerun: for those that were stale before it too)."""

    fn: Callable
    reads: list[Read]
    tree: dict  # the ways as a tree: step -> (subtree, [(read index, way index, storage address) ending here])

    @classmethod
    def of(cls, fn: Callable, ways: dict[int, list], read: dict[int, StorageWeakRef]) -> ReadPaths:
        """The ways (``ways_to_tensors(fn)``) to the storages ``fn`` read (``ReadRecorder.read``)."""
        kept = [Read(ref, *zip(*ways[key][:MAX_WAYS], strict=True)) for key, ref in read.items() if key in ways]
        tree: dict = {}
        for i, r in enumerate(kept):
            for j, way in enumerate(r.ways):
                node = tree
                for step in way[:-1]:
                    node = node.setdefault(plain(step), ({}, []))[0]
                node.setdefault(plain(way[-1]), ({}, []))[1].append((i, j, r.storage.cdata))
        return cls(fn, kept, tree)

    def stale(self) -> dict[int, tuple[int, torch.Tensor]]:
        """The reads every way to which now leads to another tensor: read index -> (way index, that tensor). Empty
        where the callable would read what its capture read."""
        same = [False] * len(self.reads)  # a way still leads to the storage read
        other: dict[int, tuple[int, torch.Tensor]] = {}  # read -> (way, the other tensor it leads to)
        self._follow(self.fn, self.tree, same, other)
        return {i: found for i, found in other.items() if not same[i]}

    def check(self, before: dict[int, tuple[int, torch.Tensor]] | None = None) -> None:
        """Raise ``CaptureError`` where every way to a storage the capture read now leads to another tensor: the
        callable would read it, where a device graph reads the captured buffer.

        ``before``: what ``stale()`` found before a rerun of the callable; then only a read stale both before and now
        is refused, named by the tensor found before (what the rerun found there). A read the rerun made agree again is
        one the callable put back itself before reading it (``self.table = cached(...)``), as it does on a device."""
        now = self.stale()
        if before is not None:
            now = {i: before[i] for i in now if i in before}
        for i, (j, tensor) in now.items():
            r = self.reads[i]
            raise CaptureError(stale_read_message(self.fn, way_text(r.ways[j]), tensor, r.captured[j],
                                                  not r.storage.expired()))

    def _follow(self, obj, tree: dict, same: list, other: dict) -> None:
        for step, (subtree, ends) in tree.items():
            try:
                value = FOLLOW[step[0]](obj, step[1])
            except Exception:  # noqa: BLE001 - a way that no longer leads anywhere reads nothing
                continue
            if ends and isinstance(value, torch.Tensor):
                # Our weak reference keeps a storage's address from being reused: the same address is the same storage
                key = storage_key(value)
                for i, j, storage in ends:
                    if key == storage:
                        same[i] = True
                    elif i not in other:
                        other[i] = (j, value)
            if subtree:
                self._follow(value, subtree, same, other)


def plain(step: tuple) -> tuple:
    """A step as a replay follows it: by kind and key (the name is only for the message)."""
    return step[0], step[1]


def callable_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def stale_read_message(fn: Callable, where: str, tensor: torch.Tensor, captured: tuple, alive: bool) -> str:
    name = callable_name(fn)
    since = "" if alive else ", freed since"
    return (f"replay of {name} would read {where}, now {describe(tensor)}, which existed before the replay but was not "
            f"read by the capture: the capture read {described(captured)} there{since}. A device graph would read the "
            f"captured buffer instead ({'stale values' if alive else 'freed memory'}). Copy new values into the "
            f"captured tensor (copy_) instead of replacing it, or capture again")
