"""The sequence slots of the tensor types, which replacing ``Tensor.__getitem__`` fills for good, put back as found.

``RejectHostReads`` (``hwgraph.graphs.host_reads``) replaces ``__getitem__`` and ``__setitem__`` on ``torch.Tensor``
while a guard is open; this module reads and restores the CPython type slots that the replacement fills.
"""

from __future__ import annotations

import ctypes
import sys

import torch

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
