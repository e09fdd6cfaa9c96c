"""Which kernels run the tower's matrix products: ATen's, or a graph backend's measured choice while it captures.

The tower calls ``linear`` and ``linear_gelu_tanh`` here instead of ``F.linear``. With no chooser active they are
ATen's calls. ``EncoderGraphManager(measure_products=True)`` activates its backend's ``product_chooser()`` around
each plain capture (``chosen_by``): the CUDA plugin's picks, per shape, the cuBLASLt algorithm that measured fastest
(``hwgraph_cuda.products``). Eager calls and compiled captures (``torch.compile`` traces the products itself)
keep ATen's.

A chooser has ``linear(x, weight, bias)`` and ``linear_gelu_tanh(x, weight, bias)`` with ``F.linear``'s shapes, hands
back ATen's result for any input it does not take, and ``describe()``s what it chose.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn.functional as F


class ProductChooser(Protocol):
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def linear_gelu_tanh(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def describe(self) -> str:
        """What it chose so far, in a line (the manager's ``stats()['products']``)."""


ACTIVE: ProductChooser | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the active chooser if there is one."""
    return F.linear(x, weight, bias) if ACTIVE is None else ACTIVE.linear(x, weight, bias)


def aten_linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(F.linear(x, weight, bias), approximate="tanh")``; on CUDA the GELU runs as the matmul's epilogue
    (cuBLASLt's GELU epilogue is the tanh approximation; off CUDA ``_addmm_activation`` would use exact GELU, so it is
    not used there)."""
    if x.is_cuda and not torch.version.hip and x.dim() == 2 and bias is not None:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``aten_linear_gelu_tanh``, through the active chooser if there is one."""
    return aten_linear_gelu_tanh(x, weight, bias) if ACTIVE is None else ACTIVE.linear_gelu_tanh(x, weight, bias)


@contextlib.contextmanager
def chosen_by(chooser: ProductChooser | None):
    """Route ``linear`` and ``linear_gelu_tanh`` through ``chooser`` (None: ATen's) inside the context."""
    global ACTIVE
    saved, ACTIVE = ACTIVE, chooser
    try:
        yield chooser
    finally:
        ACTIVE = saved
