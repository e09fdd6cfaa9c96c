"""Which kernels run the tower's matrix products: ATen's, or a graph backend's measured choice while it captures.

The tower calls ``linear`` and ``linear_gelu_tanh`` here instead of ``F.linear``. With no chooser active they are
ATen's calls. ``EncoderGraphManager(measure_products=True)`` activates its backend's ``product_chooser()`` around
each capture (``chosen_by``): the CUDA plugin's picks, per shape, the cuBLASLt algorithm that measured fastest
(``hwgraph_cuda.products``). Eager calls keep ATen's, and so do products that autograd records (a chooser's kernels
have no backward). While ``torch.compile`` traces with a chooser active, each product becomes one opaque custom op
(``hwgraph::chosen_linear``, ``hwgraph::chosen_linear_gelu_tanh``) that calls the chooser active when the compiled
code runs, so compiled captures take the chooser's kernels too.

A chooser has ``linear(x, weight, bias)`` and ``linear_gelu_tanh(x, weight, bias)`` with ``F.linear``'s shapes, hands
back ATen's result for any input it does not take, counts the ``seconds`` it has spent measuring, and
``describe()``s what it chose: in all, or since a ``mark()`` (a chooser is a process's, shared by its managers).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from hwgraph.attention.varlen_inputs import eager_or_op, records_grad


class ProductChooser(Protocol):
    seconds: float  # spent measuring so far (part of the captures' time)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def linear_gelu_tanh(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def mark(self) -> Any:
        """A snapshot of what it has done so far, opaque to callers, for ``describe(since=...)``."""

    def describe(self, since: Any = None) -> str:
        """What it chose, in a line (the manager's ``stats()['products']``): so far in the process, or with ``since``
        (a ``mark()``) only what it measured or recalled after that mark, and the seconds it spent on it."""


ACTIVE: ProductChooser | None = None


def active_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as the chooser active now runs it (ATen's without one)."""
    chooser = ACTIVE
    return F.linear(x, weight, bias) if chooser is None else chooser.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the active chooser if there is one (``chosen_linear`` while
    torch.compile traces) and autograd does not record the call (``records_grad``: neither a chooser's kernels nor
    the custom ops have a backward)."""
    chooser = ACTIVE  # read once: another thread's chosen_by block may close between two reads
    if chooser is None or records_grad(x, weight, bias):
        return F.linear(x, weight, bias)
    return eager_or_op(chosen_linear, chooser.linear)(x, weight, bias)


def aten_linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``gelu(F.linear(x, weight, bias), approximate="tanh")``; on CUDA the GELU runs as the matmul's epilogue
    (cuBLASLt's GELU epilogue is the tanh approximation; off CUDA ``_addmm_activation`` would use exact GELU, so it is
    not used there). The unfused pair while autograd records (``records_grad``): ``_addmm_activation`` has no
    backward, so a call that records gradients gave a forward whose backward raised."""
    if x.is_cuda and not torch.version.hip and x.dim() == 2 and bias is not None \
            and not records_grad(x, weight, bias):
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def active_linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``aten_linear_gelu_tanh`` as the chooser active now runs it (ATen's without one)."""
    chooser = ACTIVE
    return aten_linear_gelu_tanh(x, weight, bias) if chooser is None else chooser.linear_gelu_tanh(x, weight, bias)


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``aten_linear_gelu_tanh``, through the active chooser if there is one (``chosen_linear_gelu_tanh`` while
    torch.compile traces) and autograd does not record the call, as ``linear``."""
    chooser = ACTIVE  # read once: another thread's chosen_by block may close between two reads
    if chooser is None or records_grad(x, weight, bias):
        return aten_linear_gelu_tanh(x, weight, bias)
    return eager_or_op(chosen_linear_gelu_tanh, chooser.linear_gelu_tanh)(x, weight, bias)


def product_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The products' fake: ``F.linear``'s output, uninitialised."""
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# The products as torch.compile sees them with a chooser active: one opaque node each, which inductor calls as it
# is (no fusion around the chooser's kernel); the chooser is looked up when the compiled code runs.
chosen_linear = torch.library.custom_op("hwgraph::chosen_linear", active_linear, mutates_args=())
chosen_linear.register_fake(product_shape)
chosen_linear_gelu_tanh = torch.library.custom_op("hwgraph::chosen_linear_gelu_tanh", active_linear_gelu_tanh,
                                                  mutates_args=())
chosen_linear_gelu_tanh.register_fake(product_shape)


# The ``chosen_by`` blocks open now, in every thread, in the order they were entered (one entry each); ``ACTIVE`` is
# the last one's chooser. Changed only under ``_open_lock``.
_open: list[list] = []
_open_lock = threading.Lock()


@contextlib.contextmanager
def chosen_by(chooser: ProductChooser | None):
    """Route ``linear`` and ``linear_gelu_tanh`` through ``chooser`` (None: ATen's) inside the context, process-wide:
    the chooser of the block entered last among those still open, in any thread. Leaving a block takes its own entry
    out, so blocks left in another order than entered (captures in two threads) leave the one still open active and,
    once all have left, none (restoring what each found on entering put an earlier one back for good)."""
    global ACTIVE
    entry = [chooser]  # a block's own, by identity: the same chooser may be open twice
    with _open_lock:
        _open.append(entry)
        ACTIVE = chooser
    try:
        yield chooser
    finally:
        with _open_lock:
            del _open[next(i for i, e in enumerate(_open) if e is entry)]
            ACTIVE = _open[-1][0] if _open else None
