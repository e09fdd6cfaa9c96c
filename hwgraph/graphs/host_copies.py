"""Which copies between the host and a device a sync guard rejects: the blocking ones, as CUDA's sync debug mode does.

On CUDA a copy between a host and a device tensor with ``non_blocking=False`` waits for the stream
(``memcpy_and_sync``), and the sync debug mode rejects it in either direction; a non-blocking one is queued
(``cudaMemcpyAsync``), into pinned memory or not, and is not rejected. ``RejectHostReads`` judges ``Tensor.copy_``,
``Tensor.to`` and ``Tensor.type`` by that.

On the emulated device (the CPU reference backend) every tensor is a CPU tensor. A ``copy_`` between two of them is
let through: it stands for the device-to-device copies of a replay and for the copies of host metadata into static
buffers, which a device makes without blocking and the CPU blocking; nothing tells a host tensor from a device one
there. A copy that names the host is rejected instead: ``.to("cpu")`` (or ``torch.device("cpu")``) stands for the
device-to-host copy it is on a device. ``x.to(x.device)`` names the device a tensor is on, a no-op on every device:
inside a guard a CPU tensor reports its device as ``TENSORS_CPU``, one object, which ``.to`` tells from the caller's
own ``torch.device("cpu")`` by identity.
"""

from __future__ import annotations

import torch

#: The device a CPU tensor reports while a guard is open (``reporting_tensors_cpu``): given to ``.to`` it names the
#: device the tensor is on, not the host
TENSORS_CPU = torch.device("cpu")


def reporting_tensors_cpu(found):
    """``Tensor.device`` that gives ``TENSORS_CPU`` for a CPU tensor; ``found``: the attribute as found (its getter)."""
    def device(self):
        where = found.__get__(self, type(self))
        return TENSORS_CPU if where.type == "cpu" else where
    return property(device, doc=getattr(found, "__doc__", None))


def forced(flag) -> bool:
    """Whether a flag such as ``numpy(force=...)`` or ``non_blocking`` was set (a tensor there is torch's error)."""
    return not isinstance(flag, torch.Tensor) and bool(flag)


def crosses_host(one: torch.device, other: torch.device) -> bool:
    """Whether a copy between tensors on these devices goes between the host and a device."""
    return (one.type == "cpu") != (other.type == "cpu")


def blocking_copy_of_to(tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.device | None:
    """The device a blocking ``tensor.to(*args, **kwargs)`` copies to across the host and a device (or to the emulated
    device's host, ``"cpu"``), or None: a cast, a copy on one device, a non-blocking copy, or ``x.to(x.device)``."""
    device, non_blocking = host_copy_target(args, kwargs)
    if device is None or non_blocking:
        return None
    if tensor.device.type == "cpu" and device.type == "cpu":  # the emulated device: "cpu" names the host...
        given = kwargs["device"] if "device" in kwargs else args[0] if args else None
        return None if given is TENSORS_CPU else device  # ...unless it is the device a tensor reported
    return device if crosses_host(tensor.device, device) else None


def blocking_copy_(dst: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``dst.copy_(*args, **kwargs)`` (``src, non_blocking=False``) copies between the host and a device
    without ``non_blocking``; never between CPU tensors (the emulated device's own copies)."""
    src = args[0] if args else kwargs.get("src")
    non_blocking = args[1] if len(args) > 1 else kwargs.get("non_blocking", False)
    return isinstance(src, torch.Tensor) and not forced(non_blocking) and crosses_host(dst.device, src.device)


def host_type_copy(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.type(*args, **kwargs)`` makes a blocking copy to the host: it names a host tensor type
    (``torch.FloatTensor``, ``"torch.sparse.FloatTensor"``; not a dtype, nor ``"torch.cuda.FloatTensor"``) and is not
    ``non_blocking``."""
    target = args[0] if args else kwargs.get("dtype")
    non_blocking = args[1] if len(args) > 1 else kwargs.get("non_blocking", False)
    if isinstance(target, str):
        path = target.split(".")
        target = torch if path[0] == "torch" else None
        for part in path[1:]:
            target = getattr(target, part, None)
    return isinstance(target, type(torch.FloatTensor)) and target.__module__ in ("torch", "torch.sparse") and \
        not forced(non_blocking)


def host_copy_target(args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """The device a ``Tensor.to(*args, **kwargs)`` call names and whether it is non-blocking; ``(None, False)`` for a
    cast, a ``.to(other_tensor)`` (it follows a tensor, wherever that is), or arguments ``to`` itself will refuse."""
    if args and isinstance(args[0], torch.Tensor):
        return None, False
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # torch's parser of to()'s arguments lacks copy
    for given in (args, args[:-1]):  # the second: a positional copy flag dropped
        try:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*given, **kwargs)
        except (TypeError, RuntimeError):
            continue
        return device, bool(non_blocking)
    return None, False
