"""The floating-point dtypes the tower runs in, by the names the command line and the environment use.

Kept apart from ``hwgraph.testing`` so that ``hwgraph bench`` parses ``--dtype`` without pytest installed.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``, or the dtype itself) -> ``torch.bfloat16``; ``ValueError`` naming
    the value and the accepted names for anything else (integer dtypes, float64, misspellings)."""
    dtype = DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {str(name)!r}: expected one of {', '.join(DTYPES)}")
    return dtype


def graph_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A tower's or a graph manager's ``dtype`` argument: one of ``DTYPES``, as a ``torch.dtype`` or by name, or
    ``torch.float64`` (for reference runs); ``ValueError`` naming the value otherwise (integer and float8 dtypes)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (*DTYPES.values(), torch.float64):  # float8 types are floating point, and nothing runs in them
            raise ValueError(f"dtype must be a floating-point torch.dtype or its name, got {dtype!r}: expected one of "
                             f"{', '.join(DTYPES)} or torch.float64")
        return dtype
    if str(dtype).removeprefix("torch.") == "float64":  # by name as by dtype
        return torch.float64
    try:
        return parse_dtype(dtype)
    except ValueError:
        raise ValueError(f"unknown dtype {str(dtype)!r}: expected one of {', '.join(DTYPES)} or float64") from None
