"""Which storages a run reads from outside itself, noted as it runs, and the eager stance compiled code takes meanwhile.

The CPU reference backend's capture run goes under a ``TorchDispatchMode`` (``ReadRecorder``) that notes the storages
its ops read without having made them in the run: its inputs, parameters and buffers; a higher-order op
(``torch.cond``, ``flex_attention``) comes to it whole and runs with it popped, its tensor operands its reads. Compiled
code runs eagerly meanwhile (dynamo runs no compiled frame under a mode): the first capture recording sets the
``force_eager`` stance for the process, the last one out puts back the stance found (``FORCED_EAGER``). What the
storages read are used for, the ways the callable reaches them and each replay's check: ``capture_reads``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hwgraph.graphs.base import CountedSwitch

#: ops whose tensor argument torch made just before the call, outside any op (``torch.tensor(...)``,
#: ``torch.from_numpy``): new in the run, not read from outside it
FRESH_INPUT_OPS = (torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy, torch.ops.aten.lift)


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (shared by its views), or None where it has none (a sparse tensor)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensor_facts(tensor: torch.Tensor) -> tuple:
    """(shape, dtype, address, strides) of ``tensor``: where its reads go, the stride of a dimension of size 1 as 0
    (it steps nowhere: ``col.t()`` and ``col.view(1, n)`` read alike). Address and strides None where it has none (a
    sparse tensor)."""
    try:
        shape = tuple(tensor.shape)
    except (RuntimeError, NotImplementedError, TypeError):  # a strided nested tensor has no single shape
        return None, tensor.dtype, None, None
    try:
        address = tensor.data_ptr()
        strides = tuple(stride if size > 1 else 0 for size, stride in zip(shape, tensor.stride(), strict=True))
    except (RuntimeError, NotImplementedError, TypeError):
        address = strides = None
    return shape, tensor.dtype, address, strides


def tensors_in(values) -> Iterator[torch.Tensor]:
    """The tensors among ``values`` and in the lists and tuples among them (how ops take them: ``torch.cat``)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


class ReadRecorder(TorchDispatchMode):
    """Notes the storages that the ops run under it read without an op under it having made them: what the run reads
    from outside (``read``: storage address -> weak reference). A view or an in-place result of such a tensor shares
    its storage, so it is that tensor's.

    A higher-order op (``torch.cond``, ``flex_attention``; a ``HigherOrderOperator``, which has no overloadpacket)
    comes here whole, with this mode popped: without ``supports_higher_order_operators`` torch refuses it under the
    mode, and its dense kernels refuse to run under any mode, so the ops inside it are not seen. Its tensor operands,
    at any depth of its arguments (a ``BlockMask``'s tuple), are its reads, and its outputs are made in the run."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.made: set[int] = set()
        self.read: dict[int, StorageWeakRef] = {}
        self.views: dict[int, set[tuple]] = {}  # storage address -> the views of it read (tensor_facts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.note_reads(leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor))
            out = func(*args, **kwargs)  # torch popped this mode for the call: a caller's mode below still sees it
            self.note_made(leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor))
            return out
        if func.overloadpacket in FRESH_INPUT_OPS:
            self.note_made(tensors_in((*args, *kwargs.values())))
        else:
            self.note_reads(tensors_in((*args, *kwargs.values())))
        out = func(*args, **kwargs)
        self.note_made(tensors_in(out if isinstance(out, (list, tuple)) else (out,)))
        return out

    def note_reads(self, tensors) -> None:
        for tensor in tensors:
            key = storage_key(tensor)
            if key is None or key in self.made:
                continue
            if key not in self.read:
                self.read[key] = StorageWeakRef(tensor.untyped_storage())
            self.views.setdefault(key, set()).add(tensor_facts(tensor))

    def note_made(self, tensors) -> None:
        for tensor in tensors:
            key = storage_key(tensor)
            if key is not None:
                self.made.add(key)


def _force_eager():
    """Sets the ``force_eager`` stance now; the object returned puts back the stance it found (its ``__exit__``)."""
    return torch.compiler.set_stance("force_eager")


#: The captures recording now, in every thread: the first one in sets ``force_eager``, the last one out puts back the
#: stance the first one found (each putting back what it found would leave ``force_eager`` for good where two overlap)
FORCED_EAGER = CountedSwitch(_force_eager, lambda stance: stance.__exit__(None, None, None))


@contextlib.contextmanager
def forced_eager():
    """Inside: the ``force_eager`` stance, process-wide (``FORCED_EAGER``), where dynamo is loaded (without it nothing
    is compiled), unless this thread runs inside a compiled function (between its graph breaks), where dynamo refuses
    a new stance: there the stance is left as it is."""
    if "torch._dynamo" not in sys.modules or in_compiled_region():
        yield
        return
    with FORCED_EAGER:
        yield


def in_compiled_region() -> bool:
    """Whether this thread runs inside a ``torch.compile``'d function (dynamo's frame callback is set), where
    ``set_stance`` raises."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return get_eval_frame_callback() not in (None, False)
