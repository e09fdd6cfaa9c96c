"""Checks of the fields a plugin fills in a ``BackendSpec`` or ``KernelSpec``, made when the spec is built.

A wrong type there did not fail where it was written: a bare string read as a tuple made each of its letters a
name (``modes="full"`` accepted the mode "f" and listed "f, u, l, l"), a priority given as a string crashed the
sort of every candidate, and a gate that is not callable surfaced only as a reason at selection. Each check raises
``TypeError`` naming the spec, the field and the value, which discovery reports as that plugin's problem.
"""

from __future__ import annotations

from hwgraph.budgets import is_int


def names(owner: str, field: str, value, *, empty: bool = False) -> tuple[str, ...]:
    """``value`` (a tuple or list of non-empty strings) as a tuple; at least one unless ``empty``."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) and v for v in value) and (value or empty):
        return tuple(value)
    raise TypeError(f"{owner}: {field} is a tuple of {'' if empty else 'one or more '}non-empty strings, got "
                    f"{value!r}" + (" (a bare string: write (name,))" if isinstance(value, str) else ""))


def items(owner: str, field: str, value, kind: type, *, empty: bool = False) -> tuple:
    """``value`` (a tuple or list of ``kind``) as a tuple; at least one unless ``empty``."""
    if isinstance(value, (tuple, list)) and all(isinstance(v, kind) for v in value) and (value or empty):
        return tuple(value)
    raise TypeError(f"{owner}: {field} is a tuple of {'' if empty else 'one or more '}{kind.__name__}, got {value!r}")


def text(owner: str, field: str, value, *, empty: bool = False) -> str:
    if isinstance(value, str) and (value or empty):
        return value
    raise TypeError(f"{owner}: {field} is a {'' if empty else 'non-empty '}string, got {value!r}")


def integer(owner: str, field: str, value) -> int:
    if is_int(value):
        return int(value)
    raise TypeError(f"{owner}: {field} is an int, got {value!r} ({type(value).__name__})")


def flag(owner: str, field: str, value) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"{owner}: {field} is a bool, got {value!r} ({type(value).__name__})")


def function(owner: str, field: str, value, *, optional: bool = False):
    if callable(value) or (optional and value is None):
        return value
    raise TypeError(f"{owner}: {field} is a function{' or None' if optional else ''}, got {value!r}")
