"""The ``torch`` functions that read a tensor back as a number, replaced in ``torch`` while a sync guard is open.

A one-element tensor where a ``torch`` function wants a size, a dimension or a number (``torch.arange(n)``,
``torch.full(size, v)``, ``torch.zeros(n)``, ``torch.add(x, y, alpha=n)``) is read by torch's argument parser with
``Tensor::item()`` before the function runs, as a method's is (``hwgraph.graphs.number_args``); a few tensor overloads
read their tensor in the kernel (``torch.linspace(0, t, 5)``, ``torch.masked_fill(x, m, t)``, ``torch.narrow(x, 0, t,
1)``), and ``torch.tensor([a, b])`` reads each tensor of its list. CUDA's sync debug mode rejects each. A one-element
tensor that an overload takes as an operand (``torch.clamp(x, max=t)``, ``torch.add(x, t)``) is read by none.

Each replacement is made once for the function it wraps (``torch_replacement``), as the methods' are: not some 300 new
ones each time a guard opens, nor a new one where a guard finds a function it wrapped before again. torch.compile guards
on the ``torch`` functions a compiled forward calls (on a replacement's code), so a forward that calls one is compiled
again the first time it runs inside a guard, and that compilation serves every later guard. While torch.compile
compiles, a replacement judges nothing: dynamo traces the function itself, and a tensor read back there is compiled
into the forward, as it is outside a guard.
"""

from __future__ import annotations

import functools

import torch

from hwgraph.graphs.base import HostSyncError
from hwgraph.graphs.number_args import holds_a_tensor, number_argument_functions, one_element_tensor_in, value_kind

#: ``torch`` functions whose tensor overload reads a 0-dim tensor back in its kernel (``Tensor::item()``) where the
#: schemas take it as an operand: the parameters read, in positional order (None: one that is not read)
KERNEL_READS = {
    "linspace": ("start", "end"),
    "logspace": ("start", "end"),
    "masked_fill": (None, None, "value"),
    "narrow": (None, None, "start"),
}
#: ``torch`` functions that read each tensor in a list of data (``torch.tensor([a.sum(), b.sum()])``)
DATA_READS = ("tensor", "as_tensor")
NUMBER_READ = "with a tensor where a size, a dimension or a number is expected (its value is read back)"

_made: dict = {}  # (name, the function wrapped) -> its replacement: one each, for the life of the process


def torch_function_wrappings(own: dict) -> list:
    """(name, make) for each ``torch`` function that can read a tensor back as a number, and for those the guard wraps
    itself: ``make(found)`` is the replacement of ``torch.name`` as found when a guard opens (``torch_replacement``).
    ``own``: name -> the maker of the guard's own wrapper of the function found (its only reads)."""
    names = {name for name, _, _ in number_argument_functions()} | set(KERNEL_READS) | set(DATA_READS) | set(own)
    return [(name, functools.partial(torch_replacement, name, wrap=own.get(name)))
            for name in sorted(names) if hasattr(torch, name)]


def torch_replacement(name: str, found, wrap=None):
    """``torch.name`` inside a guard: it rejects a tensor read back as a number, then calls ``wrap(found)`` (the
    guard's own wrapper of ``found``, made with it) or ``found`` (the function as found). Made once for each (name,
    found), so that a function found again after another stood in its place (a test's monkeypatch, undone) gets the
    replacement torch.compile has already guarded on."""
    made = _made.get((name, found))
    if made is None:
        made = _made.setdefault((name, found), rejecting_number_tensors(name, found if wrap is None else wrap(found)))
    return made


def guard_open() -> bool:
    """``host_reads.guard_open`` (which imports this module): whether a sync guard is open now."""
    from hwgraph.graphs.host_reads import guard_open

    return guard_open()


def rejecting_number_tensors(name: str, fn):
    def reject_number_tensors(*args, **kwargs):
        if not torch.compiler.is_compiling() and \
                (any(map(one_element_tensor_in, args)) or any(map(one_element_tensor_in, kwargs.values()))):
            what = read_back(name, args, kwargs)
            if what is not None and guard_open():
                raise HostSyncError(f"torch.{name}() {what} on a tensor inside sync_guard(): a device-to-host "
                                    f"synchronisation on the replay path")
        return fn(*args, **kwargs)
    reject_number_tensors.__name__ = reject_number_tensors.__qualname__ = name
    return reject_number_tensors


def read_back(name: str, args: tuple, kwargs: dict) -> str | None:
    """What ``torch.name(*args, **kwargs)`` reads back (a phrase for the error), or None where it reads nothing."""
    if name in DATA_READS:
        data = args[0] if args else kwargs.get("data")
        return "with a list holding a tensor (its value is read back)" \
            if isinstance(data, (list, tuple)) and holds_a_tensor(data) else None
    read = KERNEL_READS.get(name, ())
    if any(param is not None and isinstance(value, torch.Tensor) for param, value in zip(read, args, strict=False)) or \
            any(param is not None and isinstance(kwargs.get(param), torch.Tensor) for param in read):
        return f"with a tensor {' or '.join(p for p in read if p)} (its kernel reads the value back)"
    return NUMBER_READ if number_read(name, args, kwargs) else None


def number_read(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether torch's argument parser reads a one-element tensor of ``torch.name(*args, **kwargs)`` back: judged as
    its method's call where the method takes it (the tensor first as ``self``), else from the function's schemas."""
    slots = function_slots().get(name)
    if slots is None:
        return False
    as_function, as_method = slots
    through_method = as_method is not None and isinstance(args[0] if args else kwargs.get("input"), torch.Tensor)
    if through_method:
        args, kwargs = (args[1:], kwargs) if args else (args, {k: v for k, v in kwargs.items() if k != "input"})
    elif as_function is None:
        return False
    return reads_of_kinds(name, through_method, tuple(map(value_kind, args)),
                          tuple((k, value_kind(v)) for k, v in kwargs.items()))


@functools.cache
def function_slots() -> dict:
    """name -> (its ``NumberSlots`` as a function, as a method) for ``number_argument_functions``."""
    return {name: (as_function, as_method) for name, as_function, as_method in number_argument_functions()}


@functools.lru_cache(maxsize=4096)  # by the kinds of the arguments, all the judgement depends on
def reads_of_kinds(name: str, through_method: bool, args: tuple, kwargs: tuple) -> bool:
    as_function, as_method = function_slots()[name]
    return (as_method if through_method else as_function).reads(args, kwargs)
