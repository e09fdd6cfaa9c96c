"""The sync guard of backends without a runtime sync-debug mode: ``RejectHostReads``, on the CPU and elsewhere.

While a guard is open, the tensor methods and ``torch`` functions that read a device tensor's value or a
device-computed size back to the host, or copy between the host and a device blocking, raise ``HostSyncError``, as
CUDA's sync debug mode does on a GPU. The CPU reference backend's ``sync_guard()`` is one; a device backend whose
runtime has no sync-debug mode falls back to it.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import operator
import threading
from typing import ClassVar

import torch
from torch.utils import _pytree as pytree

from hwgraph.graphs.base import CountedSwitch, HostSyncError
from hwgraph.graphs.function_reads import torch_function_wrappings
from hwgraph.graphs.host_copies import (
    blocking_copy_,
    blocking_copy_of_to,
    forced,
    host_type_copy,
    reporting_tensors_cpu,
)
from hwgraph.graphs.number_args import (
    NumberSlots,
    holds_a_tensor,
    number_argument_methods,
    one_element_tensor_in,
    value_kind,
)
from hwgraph.graphs.sequence_slots import put_back_sequence_slots, tensor_sequence_slots


class RejectHostReads:
    """While active, the tensor methods that read device memory back to the host raise ``HostSyncError``.

    The methods are replaced on ``torch.Tensor`` itself rather than intercepted by a torch function mode: a mode
    is switched off inside its own handler, so calls nested in Python-implemented ops (custom-op bodies among
    them) would slip through. Process-wide while active (other threads' reads are rejected too); re-entrant and
    safe to enter and leave from several threads: the first guard in replaces the methods, the last one out puts
    them back. The replacements are made once and kept (``_replacements``): opening a guard only swaps attributes.
A replacement rejects only while a guard is open (one bound inside a guard, or put back by a stand-in's undo, passes
its calls through, and the next guard puts back what it wraps), and the last guard out puts back only the attributes
still holding its replacements (a stand-in set or undone inside a guard stays as it was left).
    Public so that device backends without a runtime sync-debug mode reuse it as their sync guard. Replacing
    ``__getitem__`` and ``__setitem__`` would make every tensor a Python sequence, for good: the guard puts the tensor
    types' sequence slots back as it found them, on entering and on leaving (``put_back_sequence_slots``).

    On the emulated device every tensor is on the CPU, so ``.cpu()`` and a blocking ``.to("cpu")`` stand for the
    device-to-host copies they are on a device, and so do ``.numpy(force=True)`` and a blocking ``.type()`` naming a
    host tensor type (``t.type("torch.FloatTensor")``), which copy to the host in C++; but not ``x.to(x.device)``, a
    no-op on any device (a CPU tensor reports its device as one object, ``hwgraph.graphs.host_copies``). A blocking
    ``copy_`` or ``.to()`` between the host and a device tensor is rejected (either way, as CUDA does); between two
    CPU tensors ``copy_`` is not: the emulated device's static buffers are filled, and replay's outputs written, by
    blocking copies between CPU tensors, which a device makes without blocking or on itself. A plain ``.numpy()`` is
    not rejected: torch refuses it for a device tensor (``TypeError``, no synchronisation), so it only ever reads host
    memory, such as a ``grid_thw`` the caller made; nor is ``tensor_split`` of a tensor of indices or sections, for the
    same reason (torch refuses a device one).

    Ops whose result has a size or a Python value that the device computes (``nonzero``, a boolean-mask index,
    ``torch.equal``...) read it back before they return, and CUDA's sync debug mode rejects them too (capturing one
    fails): they are replaced on ``torch.Tensor`` and in ``torch`` alike (``DATA_DEPENDENT``; ``torch.where`` with only
    a condition, a boolean-mask index, ``repeat_interleave`` without ``output_size``, ``bincount`` (its size is the
    largest value) and ``histc`` with ``min == max`` (its defaults: the input's range is read) by wrappers that reject
    only those calls), and ``torch.nn.functional.one_hot`` without ``num_classes`` (its size is the largest value) in
    its module. So are the tensor methods that read a tensor's value back in C++, where no replaced method
    sees it: a 0-dim index tensor (``t[i]``: its value picks the element), a tensor ``value`` of ``masked_fill``, a
    boolean mask in ``index_put_`` or in an assignment ``t[mask] = v`` (its ``nonzero()`` size), and a tensor in the
    list given to ``new_tensor`` (``x.new_tensor([a.sum(), b.sum()])``: each value). Not ``t[mask] = 1.0``
    with one mask and a Python number: torch makes that a ``masked_fill_`` of a host scalar, with no read.

    A tensor where a method wants a size, a dimension or a number (``x.view(n)``, ``x.flip(n)``, ``x.sum(dim=n)``,
    ``x.add(y, alpha=n)``) is read in C++ by torch's argument parser (``Tensor::item()``), so those methods are replaced
    too: ``SIZE_METHODS`` reject any tensor among their arguments (``narrow``'s tensor start is read too, although a
    schema takes it), and every other method a one-element tensor where, of its ATen schemas' overloads that could take
    the call, one takes a number and none a tensor (``number_argument_methods``, about 200 of them: ``x.clamp(n, 1.0)``,
    whose number rules out the tensor overload, as well as ``x.flip(n)``), or that stands before the tensors of one of
    torch's deprecated orders (``x.add(n, y)``, ``x.addmm(n, m1, m2)``); a call torch would refuse with a ``TypeError``
    may be named a read instead. A list subscript holding a tensor (``t[[i, j]]``, which torch reads as ``t[i, j]``)
    is judged by its items.

    A tensor where a ``torch`` function wants a number (``torch.arange(n)``, ``torch.zeros(n)``, ``torch.full(size,
    v)``) is read in C++ before the function runs, so the functions are replaced in ``torch`` too, each judged as its
    method is where the method takes the call, else from its own schemas (``hwgraph.graphs.function_reads``, some 300
    of them, with ``torch.linspace``'s and ``torch.masked_fill``'s tensor start, end or value, read in the kernel, and
    ``torch.tensor([a, b])``), and in ``torch.nn.functional`` where it binds the same function under the same name
    (``F.avg_pool1d``). Not judged: the functions ``torch.nn.functional`` calls through ``torch._C._nn`` (``F.pad``,
    ``F.interpolate``, ``F.leaky_relu`` given a tensor as a size or a number). ``torch.save`` is rejected, and pickling
    a tensor with it (its storage saves itself with ``torch.save``), as is a storage's ``tolist()``: each copies device
    memory to the host. torch.compile guards on the ``torch`` functions a compiled forward calls (tensor
    methods carry no such guard): one that calls a replaced function is compiled again inside the first guard, once
    (the tower's own compiled forward calls none). Rejecting ``aten::_local_scalar_dense`` (what ``Tensor::item()``
    runs) on the CPU dispatch key would catch these without a recompile, but the CPU kernels run it on host values
    where CUDA reads nothing back (``t[mask] = 1.0`` reads its wrapped number, ``t.var()`` its own result), and it
    would change a kernel every thread is dispatching. While torch.compile compiles (``torch.compiler.is_compiling()``,
    in any thread) nothing is rejected: dynamo runs the calls it traces on fake tensors and inductor folds constants
    with ``.item()``; what it compiles runs unjudged, inside a guard or not.
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
    #: One ``Wrapped`` for each attribute the guard replaces, listed by the first ``_replacements()``; the attributes
    #: the last call found and the (owner, name, replacement) it gave for them; all three under ``_wrapped_lock``
    _wrapped: ClassVar[list] = []
    _last_found: ClassVar[list] = []
    _last_replacements: ClassVar[list] = []
    _wrapped_lock: ClassVar[threading.Lock] = threading.Lock()
    #: the tensor types' sequence slots as the first guard found them (``_replace``)
    _first_slots: ClassVar[dict | None] = None

    @staticmethod
    def _rejecting(fn, what: str):
        """``fn`` that raises, while torch.compile is not compiling."""
        return RejectHostReads._rejecting_calls(fn, what, lambda *args, **kwargs: True)

    @staticmethod
    def _rejecting_host_copies(to):
        """``Tensor.to`` that rejects a blocking copy between the host and a device (``blocking_copy_of_to``); casts,
        non-blocking copies and ``x.to(x.device)`` go through."""
        def reject_host_copy(self, *args, **kwargs):
            # is_compiling() first: dynamo would trace guard_open() and guard on the guards' depth, compiling again
            # for each depth
            device = None if torch.compiler.is_compiling() or not guard_open() else \
                blocking_copy_of_to(self, args, kwargs)
            if device is not None:
                what = "a device-to-host" if device.type == "cpu" else "a blocking host-to-device copy, a"
                raise HostSyncError(f".to({str(device)!r}) on a tensor inside sync_guard(): {what} "
                                    f"synchronisation on the replay path")
            return to(self, *args, **kwargs)
        return reject_host_copy

    @staticmethod
    def _rejecting_calls(fn, what: str, reads):
        """``fn`` that raises for the calls ``reads(*args, **kwargs)`` says read a device-computed size back (while
        torch.compile is not compiling)."""
        def reject_some(*args, **kwargs):
            if not torch.compiler.is_compiling() and guard_open() and reads(*args, **kwargs):
                raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host synchronisation "
                                    f"on the replay path")
            return fn(*args, **kwargs)
        return reject_some

    @staticmethod
    @functools.cache  # one wrapper per method as found (about 200 of them), not new ones every time a guard opens
    def _rejecting_number_tensors(fn, name: str, slots: NumberSlots):
        return RejectHostReads._rejecting_number_tensors_of(fn, name, slots)

    @staticmethod
    def _rejecting_number_tensors_of(fn, name: str, slots: NumberSlots):
        """Tensor method ``fn`` that rejects a one-element tensor given where its schemas take a size, a dimension or a
        number (``x.flip(n)``, ``x.sum(dim=n)``, ``x.add(y, alpha=n)``): torch's argument parser reads it back."""
        what = f"{name}() with a tensor where a size, a dimension or a number is expected (its value is read back)"

        verdicts: dict[tuple, bool] = {}  # by the kinds of the arguments, all the judgement depends on

        def reject_number_tensors(self, *args, **kwargs):
            if not torch.compiler.is_compiling() and \
                    (any(map(one_element_tensor_in, args)) or any(map(one_element_tensor_in, kwargs.values()))):
                kinds = (tuple(map(value_kind, args)), tuple((k, value_kind(v)) for k, v in kwargs.items()))
                reads = verdicts.get(kinds)
                if reads is None:
                    reads = slots.reads(*kinds)
                    if len(verdicts) < 4096:  # bounded: a few kinds of call per method, in practice
                        verdicts[kinds] = reads
                if reads and guard_open():
                    raise HostSyncError(f"{what} on a tensor inside sync_guard(): a device-to-host synchronisation "
                                        f"on the replay path")
            return fn(self, *args, **kwargs)
        return reject_number_tensors

    @classmethod
    def _with_number_slots(cls, name: str, fn):
        """``fn``, a wrapper of tensor method ``name``, that also rejects a one-element tensor given as one of its
        sizes, dimensions or numbers, as every other method does (a new wrapper each time: it wraps a new one)."""
        slots = dict(number_argument_methods()).get(name)
        return fn if slots is None else cls._rejecting_number_tensors_of(fn, name, slots)

    @classmethod
    def _wrappings(cls) -> list:
        """(owner, name, make, look) for every attribute the guard replaces: ``make(found)`` is the replacement of the
        attribute as ``look(owner, name, default)`` finds it (``getattr``; ``inspect.getattr_static`` for a
        property)."""
        tensor = torch.Tensor

        def rejecting(what: str):
            return lambda fn: cls._rejecting(fn, what)

        def rejecting_calls(what: str, reads):
            return lambda fn: cls._rejecting_calls(fn, what, reads)

        out = [(tensor, name, rejecting(what)) for name, what in cls.FORBIDDEN.items()]
        out.append((tensor, "to", cls._rejecting_host_copies))
        out.append((tensor, "copy_", rejecting_calls(
            "copy_() between the host and a device without non_blocking=True (the host waits for the device)",
            lambda self, *args, **kwargs: blocking_copy_(self, args, kwargs))))
        out += [(tensor, name, rejecting(what)) for name, what in cls.DATA_DEPENDENT.items()]
        # in torch, each function's own wrapper, under the one rejecting a tensor read back as a number
        own = {name: rejecting(what) for name, what in cls.DATA_DEPENDENT.items() if hasattr(torch, name)}
        out.append((tensor, "__getitem__", rejecting_calls(
            "a boolean-mask or 0-dim tensor index (its size or value is read back)",
            lambda self, index: any(is_mask(i) or is_scalar_index(i) for i in index_parts(index)))))
        out.append((tensor, "__setitem__", rejecting_calls(
            "an assignment through a 0-dim tensor index or a boolean mask, other than one mask given a Python number "
            "(its size or value is read back)", lambda self, index, value: assignment_reads_back(index, value))))
        out += [(tensor, name, rejecting_calls(
            f"{name}() with a boolean-mask index (its size is read back)",
            lambda self, *args, **kwargs: holds_a_mask(args[0] if args else kwargs.get("indices"))))
            for name in ("index_put_", "index_put")]
        out += [(tensor, name, rejecting_calls(
            f"{name}() with a tensor where a size or a number is expected (its value is read back)",
            lambda self, *args, **kwargs: holds_a_tensor((*args, *kwargs.values()))))
            for name in cls.SIZE_METHODS]
        out += [(tensor, name, rejecting_calls(
            f"{name}() with a tensor value (its value is read back)",
            lambda self, *args, **kwargs: isinstance(args[1] if len(args) > 1 else kwargs.get("value"),
                                                     torch.Tensor)))
            for name in ("masked_fill", "masked_fill_")]
        # copies to the host that torch makes in C++ (t.numpy(force=True), t.type("torch.FloatTensor"))
        out.append((tensor, "numpy", rejecting_calls(
            "numpy(force=True) (a copy to the host)",
            lambda self, *args, **kwargs: forced(kwargs.get("force", False)))))
        out.append((tensor, "type", rejecting_calls(
            "type() naming a host tensor type (a blocking copy to the host)",
            lambda self, *args, **kwargs: host_type_copy(args, kwargs))))
        # each tensor in a list of data is read back in C++ (Tensor::item()), as torch.tensor([a, b]) reads them
        out.append((tensor, "new_tensor", rejecting_calls(
            "new_tensor() with a list holding a tensor (its value is read back)",
            lambda self, *args, **kwargs: isinstance(data := args[0] if args else kwargs.get("data"), (list, tuple))
            and holds_a_tensor(data))))
        # ops that size their result, or pick its range, by a value they read back with item() in C++ (CUDA's kernels)
        own["bincount"] = rejecting_calls(
            BINCOUNT_READ, lambda *args, **kwargs: nonempty(args[0] if args else kwargs.get("input")))
        own["histc"] = rejecting_calls(HISTC_READ, lambda *args, **kwargs: histc_reads_range(
            args[0] if args else kwargs.get("input"), args[1:], kwargs))
        out.append((torch.nn.functional, "one_hot", rejecting_calls(
            "one_hot() without num_classes (its size, the largest value, is read back)",
            lambda *args, **kwargs: one_hot_reads_size(args[0] if args else kwargs.get("input"), args[1:], kwargs))))
        # repeat_interleave, bincount and histc below, with their number arguments too
        replaced = {name for owner, name, _ in out if owner is tensor} | {"repeat_interleave", "histc", "bincount"}
        out += [(tensor, name, functools.partial(cls._rejecting_number_tensors, name=name, slots=slots))
                for name, slots in number_argument_methods() if name not in replaced]
        out.append((tensor, "bincount", lambda fn: cls._with_number_slots("bincount", cls._rejecting_calls(
            fn, BINCOUNT_READ, lambda self, *args, **kwargs: nonempty(self)))))
        out.append((tensor, "histc", lambda fn: cls._with_number_slots("histc", cls._rejecting_calls(
            fn, HISTC_READ, lambda self, *args, **kwargs: histc_reads_range(self, args, kwargs)))))
        own["where"] = rejecting_calls(
            "torch.where(condition) (its size is read back)", lambda *args, **kwargs: len(args) + len(kwargs) == 1)
        out.append((tensor, "repeat_interleave", lambda fn: cls._with_number_slots(
            "repeat_interleave", cls._rejecting_calls(
                fn, "repeat_interleave() with tensor repeats and no output_size (its size is read back)",
                lambda self, *args, **kwargs: repeats_read_back(args[0] if args else kwargs.get("repeats"), kwargs)))))
        own["repeat_interleave"] = rejecting_calls(
            "repeat_interleave() with tensor repeats and no output_size (its size is read back)",
            lambda *args, **kwargs: repeats_read_back(
                args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None), kwargs))
        # serialising copies each storage to the host: torch.save, and pickle, whose storages save themselves with it
        own["save"] = rejecting_calls("torch.save() (a copy of each tensor's storage to the host; pickling a tensor "
                                      "saves its storage with it)",
                                      lambda *args, **kwargs: saves_memory(args[0] if args else kwargs.get("obj")))
        out += [(storage, "tolist", rejecting("a storage's tolist()")) for storage in (torch.UntypedStorage,
                                                                                        torch.TypedStorage)]
        out = [(owner, name, make, getattr) for owner, name, make in out]
        out.append((tensor, "device", reporting_tensors_cpu, inspect.getattr_static))  # the property, not its value
        functions = torch_function_wrappings(own)
        # torch.nn.functional binds some of torch's functions under the same names (F.avg_pool1d is
        # torch.avg_pool1d): those are replaced there too, by the same replacements
        functional = torch.nn.functional
        return out + [(owner, name, make, getattr) for name, make in functions for owner in (torch, functional)
                      if owner is torch or vars(functional).get(name, _NOTHING) is getattr(torch, name)]

    @classmethod
    def _replacements(cls) -> list:
        """(owner, name, replacement) for every attribute the guard replaces, each made for the attribute found now.

        The makers (``_wrappings``) are listed once, by the first call, and each replacement is kept with the attribute
        it was made for: a later call makes one again only for an attribute that is no longer that one (another
        library's or a test's stand-in, or the original once that is undone), so that no guard wraps a stale attribute
        nor puts one back (``_replace`` saves the attributes of now). An attribute that is the guard's own replacement
        (a guard is open) keeps it rather than being wrapped twice."""
        with cls._wrapped_lock:
            if not cls._wrapped:
                cls._wrapped = [Wrapped(*wrapping) for wrapping in cls._wrappings()]
            found = [wrapped.look(wrapped.owner, wrapped.name, _NOTHING) for wrapped in cls._wrapped]
            # the common case, every attribute found as the last call found it, compared in one pass
            if len(found) != len(cls._last_found) or not all(map(operator.is_, found, cls._last_found)):
                cls._last_replacements = [(wrapped.owner, wrapped.name, wrapped.replacement_for(now))
                             for wrapped, now in zip(cls._wrapped, found, strict=True) if now is not _NOTHING]
                cls._last_found = found
            return list(cls._last_replacements)

    @classmethod
    def _replace(cls) -> tuple[list, dict]:
        """Replaces the host-reading attributes; returns (owner, name, the owner's own attribute or None) for each, and
        the sequence slots of the tensor types (``tensor_sequence_slots``), both as found."""
        replacements = cls._replacements()
        saved, left = [], False
        for owner, name, replacement in replacements:
            own = owner.__dict__.get(name)
            # left outside every guard (a stand-in's undo put it back): what it wraps goes back
            if own is not None and own is replacement:
                own, left = cls._wrapped_original(owner, name), True
            saved.append((owner, name, own, replacement))
        # a __getitem__ left behind made every tensor a Python sequence: the slots the first guard found go back
        slots = cls._first_slots if left and cls._first_slots is not None else tensor_sequence_slots()
        if cls._first_slots is None:
            cls._first_slots = slots
        try:
            for owner, name, replacement in replacements:
                setattr(owner, name, replacement)
            put_back_sequence_slots(slots)
        except BaseException:  # interrupted half way (Ctrl-C): no guard is open that would put the rest back
            cls._put_back((saved, slots))
            raise
        return saved, slots

    @classmethod
    def _wrapped_original(cls, owner, name: str):
        """The owner's own attribute that the replacement of ``owner.name`` wraps, or None where the owner inherits it
        (putting it back removes the replacement)."""
        with cls._wrapped_lock:
            found = next((w.found for w in cls._wrapped if w.owner is owner and w.name == name), None)
        if isinstance(owner, type):
            inherited = next((vars(base)[name] for base in owner.__mro__[1:] if name in vars(base)), _NOTHING)
            if found is inherited:
                return None
        return found

    @staticmethod
    def _put_back(found: tuple[list, dict]) -> None:
        """Puts back each attribute that still holds the guard's replacement. One set or removed while the guard was
        open (a test's stand-in, or its undo) stays as it is now: putting the saved one back undid the stand-in at
        once, and left the guard's replacement in place for good once the stand-in's undo restored what it had seen.
        Interrupted (Ctrl-C), it goes on with the rest, then raises: the guard has already counted itself closed."""
        saved, slots = found
        interrupted = None
        for owner, name, original, replacement in saved:
            try:
                if vars(owner).get(name, _NOTHING) is not replacement:  # not reached by an interrupted _replace too
                    continue
                if original is not None:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)
            except BaseException as exc:  # each attribute is put back, whatever befell the one before
                interrupted = interrupted or exc
        try:
            put_back_sequence_slots(slots)
        except BaseException as exc:
            interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted

    def __enter__(self):
        RejectHostReads.switch.__enter__()
        return self

    def __exit__(self, *exc):
        return RejectHostReads.switch.__exit__(*exc)


RejectHostReads.switch = CountedSwitch(RejectHostReads._replace, RejectHostReads._put_back)


def guard_open() -> bool:
    """Whether a guard is open now, in any thread. A replacement found outside every guard passes its calls through:
    a module imported inside a guard bound it (``from torch import nonzero``), or a stand-in's undo restored it."""
    return RejectHostReads.switch.depth > 0

_NOTHING = object()  # what Wrapped holds before it has wrapped anything, and what look() gives for no attribute


class Wrapped:
    """One attribute a guard replaces: the attribute it last found (``found``) and the replacement made for it."""

    __slots__ = ("owner", "name", "make", "look", "found", "replacement")

    def __init__(self, owner, name: str, make, look):
        self.owner, self.name, self.make, self.look = owner, name, make, look
        self.found = self.replacement = _NOTHING

    def replacement_for(self, found):
        """The replacement for the attribute ``found`` now, made again only where that is neither the attribute last
        wrapped nor its replacement (a guard is open)."""
        if found is not self.found and found is not self.replacement:
            self.replacement, self.found = self.make(found), found
        return self.replacement


#: what ``torch.save`` writes without touching tensor memory, in plain dicts, lists and tuples
PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


def saves_memory(obj) -> bool:
    """Whether ``torch.save(obj)`` may copy tensor memory to the host: ``obj`` is more than plain dicts, lists and
    tuples of Python values (a tensor, a storage, which pickling a tensor saves with ``torch.save``, a module, any
    other object, which may hold them)."""
    return any(not isinstance(leaf, PLAIN_VALUES) for leaf in pytree.tree_leaves(obj))


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


BINCOUNT_READ = "bincount() (its size, the largest value, is read back)"
HISTC_READ = "histc() with min equal to max (the input's range is read back)"


def nonempty(tensor) -> bool:
    """Whether ``tensor`` is a tensor with elements (an empty one reads nothing back: its result's size is known)."""
    return isinstance(tensor, torch.Tensor) and tensor.numel() > 0


def histc_reads_range(tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``histc(tensor, *args, **kwargs)`` (``bins, min, max``, defaults 100, 0, 0) reads the input's range back:
    ``min == max`` (its defaults included) on a non-empty input. Numbers only: a tensor there is a number's read."""
    low = args[1] if len(args) > 1 else kwargs.get("min", 0)
    high = args[2] if len(args) > 2 else kwargs.get("max", 0)
    return nonempty(tensor) and isinstance(low, numbers.Number) and isinstance(high, numbers.Number) and low == high


def one_hot_reads_size(tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``one_hot(tensor, *args, **kwargs)`` reads its class count back: ``num_classes`` -1 (the default) on a
    non-empty input."""
    classes = args[0] if args else kwargs.get("num_classes", -1)
    return nonempty(tensor) and isinstance(classes, numbers.Integral) and classes == -1
