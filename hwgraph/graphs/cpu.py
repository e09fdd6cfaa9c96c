"""The CPU reference backend: exact graph semantics, no speed (it runs on any device, eagerly).

Capture runs the callable once to warm it up, then records it and the output tensors of its second run; replay
reruns the callable and copies the results into those same tensors. Inputs are whatever the captured static
buffers hold at replay time, so stale inputs, outputs overwritten by the next replay, and padding leaking out show
up on CPU exactly as they would on a device.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import numbers
import sys
import weakref
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch

from hwgraph.capability import Capability
from hwgraph.graphs.base import CapturedGraph, CaptureError, CountedSwitch, GraphBackend, HostSyncError, Outputs


def flat_tensors(outputs: Outputs) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (tuple, list)):
        return [t for item in outputs for t in flat_tensors(item)]
    raise CaptureError(f"a captured callable must return tensors or tuples of tensors, got {type(outputs).__name__}")


class CpuPool:
    """Emulated memory pool: tracks the graphs captured into it."""

    def __init__(self):
        self.graphs: weakref.WeakSet = weakref.WeakSet()

    def bytes_held(self) -> int:
        return sum(g.nbytes() for g in list(self.graphs))


class CpuCapturedGraph(CapturedGraph):
    def __init__(self, fn: Callable[[], Outputs], outputs: Outputs):
        self.fn = fn
        self.outputs = outputs
        self.pool: CpuPool | None = None  # set by the capture

    def replay(self) -> None:
        if self.outputs is None:
            raise RuntimeError("replay() of a released graph")
        # The static outputs were made under inference_mode at capture, so they may only be written inside it.
        with torch.inference_mode():
            fresh = flat_tensors(self.fn())
            static = flat_tensors(self.outputs)
            if len(fresh) != len(static):
                raise CaptureError(f"the captured callable returned a different number of outputs on replay: "
                                   f"{len(fresh)}, against {len(static)} at capture")
            for dst, src in zip(static, fresh, strict=True):
                if dst.shape != src.shape:
                    raise CaptureError(f"replay produced shape {tuple(src.shape)}, captured {tuple(dst.shape)}")
                if dst.dtype != src.dtype:  # copy_ would cast it silently; a device graph keeps its captured dtypes
                    raise CaptureError(f"replay produced dtype {src.dtype}, captured {dst.dtype}")
                dst.copy_(src)

    def nbytes(self) -> int:
        if self.outputs is None:
            return 0
        return sum(t.numel() * t.element_size() for t in flat_tensors(self.outputs))

    def release(self) -> None:
        self.fn = None
        self.outputs = None
        self.pool = None


class RejectHostReads:
    """While active, the tensor methods that read device memory back to the host raise ``HostSyncError``.

    The methods are replaced on ``torch.Tensor`` itself rather than intercepted by a torch function mode: a mode
    is switched off inside its own handler, so calls nested in Python-implemented ops (custom-op bodies among
    them) would slip through. Process-wide while active (other threads' reads are rejected too); re-entrant and
    safe to enter and leave from several threads: the first guard in replaces the methods, the last one out puts
    them back. Public so that device backends without a runtime sync-debug mode reuse it as their sync guard. Replacing
    ``__getitem__`` and ``__setitem__`` would make every tensor a Python sequence, for good: the guard puts the tensor
    types' sequence slots back as it found them, on entering and on leaving (``put_back_sequence_slots``).

    On the emulated device every tensor is on the CPU, so ``.cpu()`` and a blocking ``.to("cpu")`` stand for the
    device-to-host copies they are on a device. ``.numpy()`` is not rejected: torch refuses it for a device tensor
    (``TypeError``, no synchronisation), so it only ever reads host memory, such as a ``grid_thw`` the caller made.

    Ops whose result has a size or a Python value that the device computes (``nonzero``, a boolean-mask index,
    ``torch.equal``...) read it back before they return, and CUDA's sync debug mode rejects them too (capturing one
    fails): they are replaced on ``torch.Tensor`` and in ``torch`` alike (``DATA_DEPENDENT``; ``torch.where`` with only
    a condition, a boolean-mask index and ``repeat_interleave`` without ``output_size`` by wrappers that reject
    only those calls). So are the tensor methods that read a tensor's value back in C++, where no replaced method
    sees it: a 0-dim index tensor (``t[i]``: its value picks the element), a tensor ``value`` of ``masked_fill``, and a
    boolean mask in ``index_put_`` or in an assignment ``t[mask] = v`` (its ``nonzero()`` size). Not ``t[mask] = 1.0``
    with one mask and a Python number: torch makes that a ``masked_fill_`` of a host scalar, with no read.

    A tensor where a method wants a size, a dimension or a number (``x.view(n)``, ``x.flip(n)``, ``x.sum(dim=n)``,
    ``x.add(y, alpha=n)``) is read in C++ by torch's argument parser (``Tensor::item()``), so those methods are replaced
    too: ``SIZE_METHODS`` reject any tensor among their arguments (``narrow``'s tensor start is read too, although a
    schema takes it), and every other method a one-element tensor where none of its ATen schemas' overloads takes a
    tensor (``number_argument_methods``, about 200 of them; a call torch would refuse with a ``TypeError`` may be named
    a read instead). A list subscript holding a tensor (``t[[i, j]]``, which torch reads as ``t[i, j]``) is judged by
    its items.

    Two kinds of read are let through. A tensor where a ``torch`` function wants a number (``torch.arange(n)``,
    ``torch.zeros(n)``, ``torch.full(size, v)``) is read in C++ before the function runs, so only a replaced
    ``torch.arange`` or a torch function mode could see it, and torch.compile guards on both (the identity of the
    ``torch`` functions a compiled forward calls, and the mode stack): either recompiles the tower on the replay path.
    Tensor methods carry no such guard, which is why the reads above are replaced only as methods. Rejecting
    ``aten::_local_scalar_dense`` (what ``Tensor::item()`` runs) on the CPU dispatch key would catch these without a
    recompile, but the CPU kernels run it on host values where CUDA reads nothing back (``t[mask] = 1.0`` reads its
    wrapped number, ``t.var()`` its own result), and it would change a kernel every thread is dispatching. And
    ``copy_``, although a blocking copy between host and device synchronises on CUDA: it names no device, and the
    emulated device's static buffers are filled (and replay's outputs written) by blocking ``copy_`` between CPU
    tensors, which no guard can tell from a copy to the host. The replacements in ``torch`` (``DATA_DEPENDENT``,
    ``torch.where``, ``torch.repeat_interleave``) have the cost avoided for ``torch.arange``: a compiled forward that
    calls one of them, even ``torch.where(c, a, b)`` which reads nothing back, is recompiled inside the guard.
    """

    FORBIDDEN = {
        "item": ".item()",
        "tolist": ".tolist()",
        "cpu": ".cpu()",
        "__bool__": "bool()",
        "__int__": "int()",
        "__float__": "float()",
        "__complex__": "complex()",
        "__index__": "operator.index() (a tensor as a Python int: range(), a list subscript)",
    }
    # on torch.Tensor and in torch, where each has it
    DATA_DEPENDENT = {
        "nonzero": "nonzero() (its size is read back)",
        "argwhere": "argwhere() (its size is read back)",
        "masked_select": "masked_select() (its size is read back)",
        "unique": "unique() (its size is read back)",
        "unique_consecutive": "unique_consecutive() (its size is read back)",
        "equal": "equal() (a Python bool)",
        "allclose": "allclose() (a Python bool)",
        "is_nonzero": "is_nonzero() (a Python bool)",
    }
    #: Tensor methods whose arguments are sizes, dimensions or numbers: a tensor among them (or in a list or tuple
    #: of them) is read back by torch's argument parser
    SIZE_METHODS = ("view", "reshape", "expand", "repeat", "tile", "narrow", "select", "unflatten", "new_empty",
                    "new_zeros", "new_ones", "new_full")
    #: The guards open now, in every thread: the first one in replaces the attributes, the last one out puts back
    #: what it found (set below the class, from its methods)
    switch: ClassVar[CountedSwitch]

    @staticmethod
    def _rejecting(what: str):
        def reject(*args, **kwargs):
            raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host synchronisation "
                                f"on the replay path")
        return reject

    @staticmethod
    def _rejecting_host_copies(to):
        """``Tensor.to`` that rejects a blocking copy to the host; casts and non-blocking copies go through."""
        def reject_host_copy(self, *args, **kwargs):
            device, non_blocking = host_copy_target(args, kwargs)
            if device is not None and device.type == "cpu" and not non_blocking:
                raise HostSyncError(f".to({str(device)!r}) on a tensor inside sync_guard(): a device-to-host "
                                    f"synchronisation on the replay path")
            return to(self, *args, **kwargs)
        return reject_host_copy

    @staticmethod
    def _rejecting_calls(fn, what: str, reads):
        """``fn`` that raises for the calls ``reads(*args, **kwargs)`` says read a device-computed size back."""
        def reject_some(*args, **kwargs):
            if reads(*args, **kwargs):
                raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host synchronisation "
                                    f"on the replay path")
            return fn(*args, **kwargs)
        return reject_some

    @staticmethod
    @functools.cache  # one wrapper per method as found (about 200 of them), not new ones every time a guard opens
    def _rejecting_number_tensors(fn, name: str, slots: NumberSlots):
        """Tensor method ``fn`` that rejects a one-element tensor given where its schemas take a size, a dimension or a
        number (``x.flip(n)``, ``x.sum(dim=n)``, ``x.add(y, alpha=n)``): torch's argument parser reads it back."""
        what = f"{name}() with a tensor where a size, a dimension or a number is expected (its value is read back)"

        def reject_number_tensors(self, *args, **kwargs):
            if args and not (slots.tensor_first and isinstance(args[0], numbers.Number)):
                for position, value in enumerate(args):
                    if slots.reads_position(position) and one_element_tensor_in(value):
                        raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host "
                                            f"synchronisation on the replay path")
            for key, value in kwargs.items():
                if key in slots.keywords and one_element_tensor_in(value):
                    raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host synchronisation "
                                        f"on the replay path")
            return fn(self, *args, **kwargs)
        return reject_number_tensors

    @classmethod
    def _replacements(cls) -> list:
        """(owner, name, replacement) for every attribute the guard replaces, made from the attributes of now."""
        tensor = torch.Tensor
        out = [(tensor, name, cls._rejecting(what)) for name, what in cls.FORBIDDEN.items()]
        out.append((tensor, "to", cls._rejecting_host_copies(tensor.to)))
        out += [(owner, name, cls._rejecting(what)) for name, what in cls.DATA_DEPENDENT.items()
                for owner in (tensor, torch) if hasattr(owner, name)]
        out.append((tensor, "__getitem__", cls._rejecting_calls(
            tensor.__getitem__, "a boolean-mask or 0-dim tensor index (its size or value is read back)",
            lambda self, index: any(is_mask(i) or is_scalar_index(i) for i in index_parts(index)))))
        out.append((tensor, "__setitem__", cls._rejecting_calls(
            tensor.__setitem__, "an assignment through a 0-dim tensor index or a boolean mask, other than one mask "
            "given a Python number (its size or value is read back)",
            lambda self, index, value: assignment_reads_back(index, value))))
        out += [(tensor, name, cls._rejecting_calls(
            getattr(tensor, name), f"{name}() with a boolean-mask index (its size is read back)",
            lambda self, *args, **kwargs: holds_a_mask(args[0] if args else kwargs.get("indices"))))
            for name in ("index_put_", "index_put")]
        out += [(tensor, name, cls._rejecting_calls(
            getattr(tensor, name), f"{name}() with a tensor where a size or a number is expected (its value is read "
            f"back)", lambda self, *args, **kwargs: holds_a_tensor((*args, *kwargs.values()))))
            for name in cls.SIZE_METHODS]
        out += [(tensor, name, cls._rejecting_calls(
            getattr(tensor, name), f"{name}() with a tensor value (its value is read back)",
            lambda self, *args, **kwargs: isinstance(args[1] if len(args) > 1 else kwargs.get("value"),
                                                     torch.Tensor)))
            for name in ("masked_fill", "masked_fill_")]
        replaced = {name for owner, name, _ in out if owner is tensor} | {"repeat_interleave"}
        out += [(tensor, name, cls._rejecting_number_tensors(getattr(tensor, name), name, slots))
                for name, slots in number_argument_methods() if name not in replaced]
        out.append((torch, "where", cls._rejecting_calls(
            torch.where, "torch.where(condition) (its size is read back)",
            lambda *args, **kwargs: len(args) + len(kwargs) == 1)))
        out.append((tensor, "repeat_interleave", cls._rejecting_calls(
            tensor.repeat_interleave, "repeat_interleave() with tensor repeats and no output_size (its size is read "
            "back)", lambda self, *args, **kwargs: repeats_read_back(args[0] if args else kwargs.get("repeats"),
                                                                     kwargs))))
        out.append((torch, "repeat_interleave", cls._rejecting_calls(
            torch.repeat_interleave, "repeat_interleave() with tensor repeats and no output_size (its size is read "
            "back)", lambda *args, **kwargs: repeats_read_back(
                args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None), kwargs))))
        return out

    @classmethod
    def _replace(cls) -> tuple[list, dict]:
        """Replaces the host-reading attributes; returns (owner, name, the owner's own attribute or None) for each, and
        the sequence slots of the tensor types (``tensor_sequence_slots``), both as found."""
        replacements = cls._replacements()
        saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replacements]
        slots = tensor_sequence_slots()
        try:
            for owner, name, replacement in replacements:
                setattr(owner, name, replacement)
            put_back_sequence_slots(slots)
        except BaseException:  # interrupted half way (Ctrl-C): no guard is open that would put the rest back
            cls._put_back((saved, slots))
            raise
        return saved, slots

    @staticmethod
    def _put_back(found: tuple[list, dict]) -> None:
        saved, slots = found
        for owner, name, original in saved:
            if original is not None:
                setattr(owner, name, original)
            elif name in vars(owner):  # not there where an interrupted _replace had not reached it yet
                delattr(owner, name)
        put_back_sequence_slots(slots)

    def __enter__(self):
        RejectHostReads.switch.__enter__()
        return self

    def __exit__(self, *exc):
        return RejectHostReads.switch.__exit__(*exc)


RejectHostReads.switch = CountedSwitch(RejectHostReads._replace, RejectHostReads._put_back)


# A Python-level __getitem__ (or __setitem__) on a class fills its sequence slots, sq_item (sq_ass_item) as well as the
# mapping one, and CPython keeps them filled once the attribute is deleted again; torch.Tensor's own indexing fills only
# the mapping slots. While filled, torch takes a tensor inside a list for a sequence: torch.tensor([a.sum(), b.sum()])
# raised "len() of a 0-d tensor", also after the guard that replaced the methods had ended, for the whole process. Only
# CPython's type layout can put them back: PyTypeObject's tp_as_sequence is the tenth pointer after its tp_name, which
# follows the PyVarObject header; in PySequenceMethods, sq_item and sq_ass_item are the fourth and sixth pointers.
_POINTER = ctypes.sizeof(ctypes.c_void_p)
_TP_NAME = object.__basicsize__ + _POINTER
_SEQUENCE_SLOTS = {"__getitem__": 3, "__setitem__": 5}


def sequence_slots(cls: type):
    """``cls``'s PySequenceMethods as a ctypes array of 6 pointers; None where the type's layout is not the one
    expected (checked against its name and size) or the interpreter is not CPython."""
    if sys.implementation.name != "cpython":
        return None
    address = id(cls)
    name = ctypes.c_char_p.from_address(address + _TP_NAME).value
    size = ctypes.c_ssize_t.from_address(address + _TP_NAME + _POINTER).value
    if name is None or name.decode(errors="replace").rsplit(".", 1)[-1] != cls.__name__ or size != cls.__basicsize__:
        return None
    methods = ctypes.c_void_p.from_address(address + _TP_NAME + 10 * _POINTER).value
    return (ctypes.c_void_p * 6).from_address(methods) if methods else None


def tensor_types() -> list[type]:
    """``torch.Tensor`` and every subclass of it now (Parameter, FakeTensor...)."""
    found, todo = {}, [torch.Tensor]
    while todo:
        cls = todo.pop()
        if id(cls) not in found:
            found[id(cls)] = cls
            todo.extend(type.__subclasses__(cls))
    return list(found.values())


def tensor_sequence_slots() -> dict:
    """The sequence slots (``_SEQUENCE_SLOTS``) of each tensor type whose layout is known: {type: {name: pointer}}."""
    out = {}
    for cls in tensor_types():
        methods = sequence_slots(cls)
        if methods is not None:
            out[cls] = {name: methods[index] for name, index in _SEQUENCE_SLOTS.items()}
    return out


def put_back_sequence_slots(found: dict) -> None:
    """Gives each tensor type the sequence slots ``tensor_sequence_slots()`` found; a type made since, which indexes as
    ``torch.Tensor`` does, gets ``torch.Tensor``'s (one that indexes otherwise keeps its own)."""
    if torch.Tensor not in found:
        return
    for cls in tensor_types():
        methods = sequence_slots(cls)
        if methods is None:
            continue
        for name, index in _SEQUENCE_SLOTS.items():
            if cls in found:
                methods[index] = found[cls][name]
            elif getattr(cls, name) is getattr(torch.Tensor, name):
                methods[index] = found[torch.Tensor][name]


def is_mask(index) -> bool:
    """Whether an index is a boolean (or uint8, which torch reads as boolean) tensor mask."""
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def index_parts(index) -> tuple:
    """The parts of a subscript as torch reads them: a tuple's items; a list's items where it holds a tensor and has
    fewer than 32 (NumPy's old rule, which torch keeps: ``t[[i, j]]`` is ``t[i, j]``); otherwise the index itself (a
    longer list becomes an index tensor, which reads any tensor in it through ``__index__``)."""
    if isinstance(index, tuple):
        return index
    if isinstance(index, list) and len(index) < 32 and holds_a_tensor(index):
        return tuple(index)
    return (index,)


#: Argument types, as torch's schemas write them, that torch's argument parser fills from a one-element tensor by
#: reading its value (``Tensor::item()``): sizes, dimensions, numbers, dtypes (``bool`` takes no tensor)
NUMBER_TYPES = frozenset({"int", "float", "complex", "number", "List[int]", "List[float]", "List[complex]",
                          "Optional[int]", "Optional[float]", "Optional[complex]", "Optional[number]",
                          "Optional[List[int]]", "Optional[List[float]]"})
TENSOR_TYPES = frozenset({"Any", "t", "List[t]", "Optional[t]"})


class NumberSlots(NamedTuple):
    """Where a tensor method's overloads take a number and none takes a tensor: its positional arguments (after
    ``self``), the positions from ``rest_from`` on (the sizes of ``x.view(2, n)``, where an overload takes its size
    list as separate arguments; None where none does) and its keywords. ``tensor_first``: an overload takes a tensor
    first, so a number there is one of torch's deprecated orders (``x.add(2, y)`` for ``x.add(y, alpha=2)``), whose
    positions the schemas do not list, and only the keywords are judged."""
    positions: frozenset[int]
    rest_from: int | None
    keywords: frozenset[str]
    tensor_first: bool

    def reads_position(self, position: int) -> bool:
        return position in self.positions or (self.rest_from is not None and position >= self.rest_from)


def number_slots(name: str) -> NumberSlots | None:
    """The ``NumberSlots`` of ``torch.Tensor``'s method ``name`` from the schemas of its ATen operator (the overloads
    that take ``self`` first), or None where it has none."""
    overloads = []
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        arguments = schema.arguments
        if arguments and arguments[0].name == "self" and str(arguments[0].type) == "Tensor":
            overloads.append(arguments[1:])
    if not overloads:
        return None

    def takes(types) -> tuple[bool, bool]:
        """(whether one of ``types`` is a number, whether one takes a tensor)"""
        return (any(t in NUMBER_TYPES for t in types),
                any("Tensor" in t or t in TENSOR_TYPES for t in types if t is not None))

    positional = [[str(a.type) for a in arguments if not a.kwarg_only] for arguments in overloads]
    # where an overload's first argument is a size list, torch takes its sizes as separate arguments too
    separate = [bool(types) and types[0] == "List[int]" for types in positional]
    width = max(len(types) for types in positional)
    positions = set()
    for position in range(width):
        types = [types[position] if position < len(types) else ("int" if apart else None)
                 for types, apart in zip(positional, separate, strict=True)]
        number, tensor = takes(types)
        if number and not tensor:
            positions.add(position)
    by_keyword: dict[str, list[str]] = {}
    for arguments in overloads:
        for argument in arguments:
            by_keyword.setdefault(argument.name, []).append(str(argument.type))
    keywords = {key for key, types in by_keyword.items() if takes(types) == (True, False)}
    if not positions and not keywords and not any(separate):
        return None
    return NumberSlots(frozenset(positions), width if any(separate) else None, frozenset(keywords),
                       any(takes(types[:1])[1] for types in positional))


@functools.cache
def number_argument_methods() -> tuple[tuple[str, NumberSlots], ...]:
    """The public methods of ``torch.Tensor`` (no properties) whose ATen schemas take a size, a dimension or a number
    somewhere no overload takes a tensor, with their ``NumberSlots``; the same for the life of the process."""
    found = []
    for name in dir(torch.Tensor):
        if name.startswith("_"):
            continue
        attribute = inspect.getattr_static(torch.Tensor, name)
        if not callable(attribute) or isinstance(attribute, (property, staticmethod, classmethod)):
            continue
        slots = number_slots(name)
        if slots is not None:
            found.append((name, slots))
    return tuple(found)


def one_element_tensor_in(value) -> bool:
    """Whether ``value`` is a one-element tensor, or a list or tuple holding one: what torch's argument parser reads
    where it wants a number (a larger tensor there is a ``TypeError``, read nothing)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (list, tuple)) and any(one_element_tensor_in(v) for v in value)


def holds_a_tensor(values) -> bool:
    """Whether ``values`` holds a tensor, itself or inside a list or tuple among them."""
    return any(isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and holds_a_tensor(v)) for v in values)


def is_scalar_index(index) -> bool:
    """Whether an index is a 0-dim integer tensor: torch reads its value back to pick the element."""
    return isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point() \
        and not index.is_complex()


def assignment_reads_back(index, value) -> bool:
    """Whether ``tensor[index] = value`` reads a device value back: a 0-dim index tensor (its value), or a boolean mask
    (its ``nonzero()`` size in ``index_put_``) unless the mask is the index's only advanced part and ``value`` a
    number: torch then makes the value a host scalar and calls ``masked_fill_`` (``t[mask] = 1.0`` does not sync)."""
    parts = index_parts(index)
    if any(is_scalar_index(i) for i in parts):
        return True
    if not any(is_mask(i) for i in parts):
        return False
    return isinstance(value, torch.Tensor) or sum(not is_basic_index(i) for i in parts) > 1


def is_basic_index(index) -> bool:
    """Whether a part of a subscript selects without an index tensor: an int, a slice, ``None`` or ``...``."""
    return index is None or index is Ellipsis or isinstance(index, slice) or \
        (isinstance(index, numbers.Integral) and not isinstance(index, bool))


def holds_a_mask(indices) -> bool:
    """Whether ``index_put_``'s indices hold a boolean mask (expanded with ``nonzero()``)."""
    return isinstance(indices, (tuple, list)) and any(is_mask(i) for i in indices)


def repeats_read_back(repeats, kwargs: dict) -> bool:
    """Whether ``repeat_interleave`` reads its output size back: tensor repeats and no ``output_size``."""
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


def host_copy_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """The device a ``Tensor.to(*args, **kwargs)`` call names and whether it is non-blocking; ``(None, False)`` for a
    cast, a ``.to(other_tensor)`` (it follows a tensor, wherever that is), or arguments ``to`` itself will refuse."""
    if args and isinstance(args[0], torch.Tensor):
        return None, False
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # torch's parser of to()'s arguments lacks copy
    for given in (args, args[:-1]):  # the second: a positional copy flag dropped
        try:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*given, **kwargs)
        except (TypeError, RuntimeError):
            continue
        return device, bool(non_blocking)
    return None, False


class CpuGraphBackend(GraphBackend):
    name = "cpu"
    modes = ("emulated",)
    accelerates = False

    def __init__(self, device=None, mode=None):
        # Any device works: replay is an eager rerun, so this is also the eager-equivalent fallback elsewhere.
        super().__init__(device, mode)
        # weakly: a pool lives while its owner or one of its graphs holds it, not for the backend's life
        self._pools: weakref.WeakSet[CpuPool] = weakref.WeakSet()

    @classmethod
    def capability(cls, device=None) -> Capability:
        return Capability.available()

    def new_pool(self) -> CpuPool:
        pool = CpuPool()
        self._pools.add(pool)
        return pool

    def capture(self, fn, pool=None) -> CpuCapturedGraph:
        pool = pool if pool is not None else self.new_pool()
        with torch.inference_mode():
            fn()  # warm-up, as a device backend does before capturing
            outputs = fn()
        flat_tensors(outputs)
        graph = CpuCapturedGraph(fn, outputs)
        graph.pool = pool  # kept while the graph is, as a device graph keeps its pool's memory
        pool.graphs.add(graph)
        self._pools.add(pool)
        return graph

    def synchronize(self) -> None:
        return None

    def memory_in_use(self) -> int:
        return sum(pool.bytes_held() for pool in list(self._pools))

    @contextlib.contextmanager
    def sync_guard(self):
        with RejectHostReads():
            yield
