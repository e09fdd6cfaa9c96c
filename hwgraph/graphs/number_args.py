"""Where a tensor method or a torch function takes a size, a dimension or a number, from its ATen schemas.

Torch's Python argument parser reads a one-element tensor given where a method wants a number with
``Tensor::item()``: a device-to-host read on a device. ``number_argument_methods`` lists the methods where that can
happen, ``number_argument_functions`` the functions in ``torch``, and each one's ``NumberSlots`` tells, from the kinds
of a call's arguments, whether it does.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import NamedTuple

import torch

#: Argument types, as torch's schemas write them (their real types: a dtype, a layout or a memory format is no number),
#: that torch's argument parser fills from a one-element tensor by reading its value (``Tensor::item()``): sizes,
#: dimensions and numbers (``bool`` takes no tensor)
NUMBER_TYPES = frozenset({"int", "float", "complex", "number", "List[int]", "List[float]", "List[complex]",
                          "Optional[int]", "Optional[float]", "Optional[complex]", "Optional[number]",
                          "Optional[List[int]]", "Optional[List[float]]"})
TENSOR_TYPES = frozenset({"Any", "t", "List[t]", "Optional[t]"})


def takes_a_tensor(type_: str | None) -> bool:
    return type_ is not None and ("Tensor" in type_ or type_ in TENSOR_TYPES)


def reads_a_number(types) -> bool:
    """Whether a one-element tensor given where the overloads have ``types`` is read: one takes a number, none a
    tensor."""
    return any(t in NUMBER_TYPES for t in types) and not any(takes_a_tensor(t) for t in types)


def value_kind(value) -> str:
    """What a call's argument is, as far as telling which overloads could take it goes: "one" (a one-element tensor,
    which torch's argument parser takes as a tensor or as a number), "tensor" (another tensor), "number" (a Python
    number, not a bool), "list", "list-one" or "list-numbers" (a list or tuple; the second of tensors (or None), one of
    them of one element; the third holding a one-element tensor among other items, so that no list of tensors takes
    it), or "other" (None, a bool, a string, a dtype...)."""
    if isinstance(value, torch.Tensor):
        return "one" if value.numel() == 1 else "tensor"
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return "number"
    if isinstance(value, (list, tuple)):
        if not one_element_tensor_in(value):
            return "list"
        return "list-one" if all(v is None or isinstance(v, torch.Tensor) for v in value) else "list-numbers"
    return "other"


def fits(type_: str | None, kind: str) -> bool:
    """Whether torch's argument parser could take an argument of ``kind`` (``value_kind``) as ``type_``: a Python
    number only as a number, a tensor of other than one element only as a tensor, a list only as a list; a one-element
    tensor and anything else as either. A list that holds other items than tensors is never a list of tensors (a
    ``histogramdd`` of bins ``(3, n)`` takes them as ints)."""
    if type_ in TENSOR_TYPES and not type_.startswith("List"):
        return True
    if kind == "number":
        return type_ in NUMBER_TYPES
    if kind == "tensor":
        return takes_a_tensor(type_)
    if kind in ("list", "list-one", "list-numbers"):
        return type_ is not None and "List[" in type_ and not (kind == "list-numbers" and takes_a_tensor(type_))
    return True


class Overload(NamedTuple):
    """One ATen overload of a tensor method, after ``self``: its positional arguments' types, and every argument's
    (torch takes positional ones by keyword too). ``separate``: its first argument is a size list, which torch also
    takes as separate arguments (``x.permute(2, 0, 1)``)."""
    positional: tuple[str, ...]
    named: tuple[tuple[str, str], ...]
    separate: bool

    def type_at(self, position: int) -> str | None:
        if position < len(self.positional):
            return self.positional[position]
        return "int" if self.separate else None

    def type_of(self, key: str) -> str | None:
        return next((type_ for name, type_ in self.named if name == key), None)

    def takes_a_tensor_first(self) -> bool:
        return bool(self.positional) and takes_a_tensor(self.positional[0])

    def could_take(self, args: tuple[str, ...], kwargs: tuple[tuple[str, str], ...]) -> bool:
        """Whether torch's argument parser could pick this overload for a call whose positional arguments and keywords
        are of these kinds (``value_kind``)."""
        if len(args) > len(self.positional) and not self.separate:
            return False
        return all(fits(self.type_at(p), kind) for p, kind in enumerate(args)) and \
            all(self.type_of(key) is not None and fits(self.type_of(key), kind) for key, kind in kwargs)


class NumberSlots(NamedTuple):
    """How a tensor method's ATen overloads (those taking ``self`` first) take sizes, dimensions and numbers.
    ``tensor_width``: the most tensors an overload taking a tensor first takes before any other argument (None where
    none does); a call with more positional arguments that ends in as many tensors is one of torch's deprecated orders,
    whose numbers stand before the tensors and which the schemas do not list (``x.add(2, y)`` for
    ``x.add(y, alpha=2)``, ``x.addmm(beta, alpha, m1, m2)``)."""
    overloads: tuple[Overload, ...]
    tensor_width: int | None

    def reads(self, args: tuple[str, ...], kwargs: tuple[tuple[str, str], ...]) -> bool:
        """Whether torch's argument parser reads back a one-element tensor of a call whose positional arguments and
        keywords are of these kinds (``value_kind``): one given where the overloads that could take the call take a
        number and none takes a tensor (a Python number elsewhere rules out clamp's tensor overload in
        ``x.clamp(n, 1.0)``, a list tensor_split's in ``x.tensor_split((n, 2))``), or before the tensors of a
        deprecated order."""
        given = ("one", "list-one", "list-numbers")
        candidates = tuple(o for o in self.overloads if o.could_take(args, kwargs))
        if self.deprecated_order(args, candidates):
            others = [o for o in self.overloads if not o.takes_a_tensor_first()]
            if any(kind in given and not any(takes_a_tensor(o.type_at(p)) for o in others)
                   for p, kind in enumerate(args[:len(args) - self.tensor_width])):
                return True
            args, candidates = (), ()  # the rest are its tensors; its keywords are any overload's
        candidates = candidates or self.overloads
        return any(kind in given and reads_a_number([o.type_at(p) for o in candidates])
                   for p, kind in enumerate(args)) or \
            any(kind in given and reads_a_number([o.type_of(key) for o in candidates]) for key, kind in kwargs)

    def deprecated_order(self, args: tuple[str, ...], candidates: tuple[Overload, ...]) -> bool:
        """Whether positional arguments of these kinds are one of torch's deprecated orders: more than
        ``tensor_width``, ending in that many tensors, where none of the ``candidates`` (the overloads that could take
        the call) takes a tensor first."""
        width = self.tensor_width
        return width is not None and len(args) > width and \
            all(kind in ("one", "tensor") for kind in args[len(args) - width:]) and \
            not any(o.takes_a_tensor_first() for o in candidates)


def number_slots(name: str, function: bool = False) -> NumberSlots | None:
    """The ``NumberSlots`` of ``torch.Tensor``'s method ``name`` (or, with ``function``, of the function ``torch.name``)
    from the schemas of its ATen operator, or None where no call can have a one-element tensor read as a number: no
    argument takes only numbers, and no Python number can rule out an overload that takes a tensor where another takes a
    number. A function takes every argument of its overloads, the first too (by keyword ``input`` where the schema says
    ``self``), of those the dispatcher has (not TorchScript's own, such as ``add.int``); its deprecated orders are not
    judged (``tensor_width`` None)."""
    overloads = []
    for schema in torch._C._jit_get_schemas_for_operator(f"aten::{name}"):
        arguments = schema.arguments
        if function and is_dispatched(name, schema.overload_name):
            taken = arguments
        elif not function and arguments and arguments[0].name == "self" and str(arguments[0].type) == "Tensor":
            taken = arguments[1:]
        else:
            continue
        positional = tuple(str(a.real_type) for a in taken if not a.kwarg_only)
        named = tuple(("input" if a.name == "self" else a.name, str(a.real_type)) for a in taken)
        # where an overload's first argument is a size list, torch takes its sizes as separate arguments too
        overloads.append(Overload(positional, named, bool(positional) and positional[0] == "List[int]"))
    if not overloads:
        return None
    positions = [[o.type_at(p) for o in overloads] for p in range(max(len(o.positional) for o in overloads))]
    by_name = {key: [o.type_of(key) for o in overloads] for o in overloads for key, _ in o.named}
    number_names = [key for key, types in by_name.items() if any(t in NUMBER_TYPES for t in types)]
    # a number given to one argument may rule out the overload taking a tensor at another (x.clamp(n, 1.0))
    ruled_out = len(number_names) > 1 and any(takes_a_tensor(t) for key in number_names for t in by_name[key])
    if not (any(reads_a_number(types) for types in (*positions, *by_name.values()))
            or any(o.separate for o in overloads) or ruled_out):
        return None
    firsts = [next((p for p, t in enumerate(o.positional) if not takes_a_tensor(t)), len(o.positional))
              for o in overloads if o.takes_a_tensor_first()]
    return NumberSlots(tuple(overloads), max(firsts) if firsts and not function else None)


def is_dispatched(name: str, overload: str) -> bool:
    """Whether ``aten::name.overload`` is an operator of the dispatcher, which torch's functions bind (TorchScript
    registers more under the same names, ``add.int(int a, int b)`` among them, that no Python call reaches)."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"aten::{name}", overload)
    except RuntimeError:
        return False
    return True


@functools.cache
def number_argument_methods() -> tuple[tuple[str, NumberSlots], ...]:
    """The public methods of ``torch.Tensor`` (no properties) a call of which can have a one-element tensor read as a
    size, a dimension or a number (``number_slots``), with their ``NumberSlots``; the same for the life of the
    process."""
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


@functools.cache
def number_argument_functions() -> tuple[tuple[str, NumberSlots | None, NumberSlots | None], ...]:
    """The functions in ``torch`` that torch's argument parser binds (``torch._C._VariableFunctions``), a call of which
    can have a one-element tensor read as a size, a dimension or a number: (name, its ``NumberSlots`` as a function, and
    its method's where a call with a tensor first is that method's call of it: every overload taking a tensor first
    takes it as ``self``), one of them not None; the same for the life of the process. Through its method, a call is
    judged as the method's is, deprecated orders included (``torch.add(x, n, y)`` is ``x.add(n, y)``)."""
    bound = torch._C._VariableFunctions
    methods = dict(number_argument_methods())
    found = []
    for name in dir(bound):
        if name.startswith("_") or getattr(torch, name, None) is not getattr(bound, name):
            continue
        as_method = methods.get(name)
        if as_method is not None and not all(
                s.arguments[0].name == "self" for s in torch._C._jit_get_schemas_for_operator(f"aten::{name}")
                if s.arguments and str(s.arguments[0].type) == "Tensor" and is_dispatched(name, s.overload_name)):
            as_method = None  # torch.where(condition, input, other): its tensor first is no self
        as_function = number_slots(name, function=True)
        if as_function is not None or as_method is not None:
            found.append((name, as_function, as_method))
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
