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
    """A tower's or a graph manager's ``dtype`` argument: a floating-point ``torch.dtype`` (float64 included, for
    reference runs), or one of ``DTYPES``' names; ``ValueError`` naming the value otherwise."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype or its name, got {dtype!r}")
        return dtype
    return parse_dtype(dtype)
