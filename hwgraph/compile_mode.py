"""Compiled mode's dynamo settings: one compiled block forward per manager, under a recompile limit sized to it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import types

import torch

from hwgraph.capability import Capability

log = logging.getLogger(__name__)


def compile_block_forward(fn):
    """``torch.compile(fn, dynamic=False, fullgraph=True)`` on a copy of ``fn`` with a code object of its own
    (``own_code_copy``). A graph break fails the compiled capture, which falls back with the reason: without
    ``fullgraph`` dynamo would trace the part after it (a tower module) as a frame of its own, shared by every
    manager and counted against each one's recompile limit."""
    return torch.compile(own_code_copy(fn), dynamic=False, fullgraph=True)


def own_code_copy(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object: with a copy, this
    manager's compilations neither reuse nor count against those of other managers (another attention kernel or
    tower in the same process), so ``compile_limits`` can size the recompile limit to this manager alone.
    Defaults, keyword-only ones included, and the qualified name carry over; anything but a plain Python function (a
    bound method, a ``functools.partial``) is a ``TypeError`` naming it, since its code object cannot be copied."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"own_code_copy needs a plain Python function (its code object is copied), got "
                        f"{type(fn).__name__} {fn!r}")
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = dict(fn.__kwdefaults__) if fn.__kwdefaults__ else None
    copy.__qualname__ = fn.__qualname__
    return copy


def pin_triton_cache_dir(device: torch.device) -> str | None:
    """Set ``TRITON_CACHE_DIR``, where it is unset, to the folder inductor switches it to, and return it (None on the
    CPU, where compiled code is not Triton's, or where this torch has no such folder). A variable set empty counts
    as unset.

    Inductor sets the variable for the whole process when it first loads one of its Triton kernels
    (``CachingAutotuner``), so hwgraph's own Triton kernels (attention, rotary, LayerNorm) were cached in Triton's
    default folder before that moment and in inductor's after it. A first process, compiling, switched early; a
    second one, loading inductor's cached graphs, switched later, missed the kernels the first had cached in
    inductor's folder and compiled them again (6 kernels, about 10 s on the H200's host). Set before the first
    kernel compiles, the folder is one for every process.

    Where inductor's folder cannot be made or written (a read-only, pre-filled inductor cache), Triton's default
    folder is pinned instead, with a warning: left unset, inductor would still switch the process to the unusable
    folder as it loaded its first kernel, and every Triton kernel compiled after that, hwgraph's own in plain
    captures and eager calls too, would fail. None, logged, when neither folder can be used."""
    if device.type == "cpu":
        return None
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    # Set empty, Triton would find no cache folder and refuse to compile, and inductor would hand back "" as its own.
    os.environ.pop("TRITON_CACHE_DIR", None)
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

        # the graph backend's device, which names its index (torch.cuda backends resolve "cuda" to the current one)
        folder = usable_folder(lambda: triton_cache_dir(device.index if device.index is not None else 0))
    except ImportError:  # another torch layout: inductor's own switch still applies
        return None
    except OSError as exc:  # inductor's folder cannot be made (importing inductor makes it) or written
        try:
            folder = usable_folder(triton_default_cache_dir)
        except OSError as fallback_exc:
            log.warning("Triton's cache folder for compiled mode is not set: %s; nor can Triton's default folder be "
                        "used: %s", exc, fallback_exc)
            return None
        log.warning("Triton's cache folder for compiled mode is Triton's default, %s: inductor's cannot be used: %s",
                    folder, exc)
    os.environ["TRITON_CACHE_DIR"] = folder
    log.debug("Triton's cache folder for compiled mode: %s", folder)
    return folder


def usable_folder(name) -> str:
    """The folder ``name()`` returns, made if missing; ``OSError`` where it cannot be made or Triton cannot write it."""
    folder = name()
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{folder} is not writable")
    return folder


def triton_default_cache_dir() -> str:
    """The folder Triton caches its kernels in when ``TRITON_CACHE_DIR`` is unset; ``OSError`` without Triton."""
    try:
        from triton import knobs  # Triton 3.4 and later

        return knobs.cache.get_triton_dir("cache")
    except (ImportError, AttributeError):
        pass
    try:
        from triton.runtime.cache import default_cache_dir

        return default_cache_dir()
    except (ImportError, AttributeError) as exc:
        raise FileNotFoundError(f"this Triton names no default cache folder ({type(exc).__name__}: {exc})") from None


@contextlib.contextmanager
def compile_limits(num_budgets: int):
    """Room for every budget's compiled graphs (two per budget) under dynamo's recompile limit, a hard error instead
    of a silent eager fallback if it is hit anyway or inductor fails (``suppress_errors`` off: the capture then fails
    and is logged), and bf16/fp16 intermediates rounded as eager rounds them (inductor's
    ``emulate_precision_casts``), so that compiled replays equal eager as plain ones do."""
    wanted = {"recompile_limit": max(8, 2 * num_budgets + 2), "fail_on_recompile_limit_hit": True,
              "suppress_errors": False}
    config = torch._dynamo.config
    import torch._inductor.config as inductor_config

    # Round low-precision intermediates as eager does, so compiled bf16/fp16 replays equal eager's (invariant 3).
    rounding = {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {}
    with config.patch({k: v for k, v in wanted.items() if hasattr(config, k)}), inductor_config.patch(rounding):
        yield


def dynamo_enabled() -> Capability:
    """Whether ``torch.compile`` compiles in this process now. With ``torch._dynamo.config.disable`` on (which
    ``TORCH_COMPILE_DISABLE=1`` sets) or ``TORCHDYNAMO_DISABLE=1`` in the environment (read at each
    ``torch.compile``) it hands back the function itself, and a "compiled" capture would be a plain one counted as
    compiled (and the rounding probe would compare eager with eager)."""
    if getattr(torch._dynamo.config, "disable", False):
        why = "torch._dynamo.config.disable, which TORCH_COMPILE_DISABLE=1 sets"
    elif os.environ.get("TORCHDYNAMO_DISABLE", "") == "1":
        why = "TORCHDYNAMO_DISABLE=1"
    else:
        return Capability.available()
    return Capability.unavailable(f"torch.compile is disabled in this process ({why}): it would run the forward "
                                  f"uncompiled")


_ROUNDING_PROBES: dict = {}


def inductor_rounds_as_eager(device: torch.device, dtype: torch.dtype):
    """Whether inductor's code for ``device`` rounds ``dtype`` (bf16, fp16) intermediates as eager does under
    ``compile_limits`` (``emulate_precision_casts``): a ``Capability``, measured once per process, device and dtype.
    Other dtypes need no rounding of their own and are not probed.

    Eager rounds every op's result to the low-precision dtype; inductor fuses pointwise ops and, unless it emulates
    eager's casts, rounds only once at the end. Triton's code (GPUs) emulates them; the CPU's C++ code ignored the
    setting up to torch 2.11 (pytorch/pytorch#182882 and #185847), so compiled bf16 replays there were not within
    bf16's closeness of eager (invariant 3) on any output; torch 2.10's fails to compile them at all
    (``CppVecOverrides.to_dtype() got an unexpected keyword argument 'use_compute_types'``), and the manager
    captures plain there too. The probe computes ``x * 3 - x * 2`` on every bf16/fp16 mantissa pattern of a few
    exponents. Each fp32 step of it is exact, so eager and inductor differ only in whether
    ``x * 3`` is rounded before the subtraction: unrounded, the result is ``x``; rounded as eager does, it is off by
    one unit of ``x`` for about two values in three."""
    if dtype not in (torch.bfloat16, torch.float16):
        return Capability.available()
    key = (device.type, device.index, dtype)
    if key not in _ROUNDING_PROBES:
        _ROUNDING_PROBES[key] = _probe_rounding(device, dtype)
    return _ROUNDING_PROBES[key]


def _probe_rounding(device: torch.device, dtype: torch.dtype):
    def cancelling(x):
        return x * 3 - x * 2

    mantissa_bits = round(-math.log2(torch.finfo(dtype).eps))  # 7 (bf16), 10 (fp16)
    # on the device given: under a caller's torch.set_default_device("meta") a bare arange was a meta tensor, and
    # copying it to the device raised out of capture()
    x = (1 + torch.arange(2 ** mantissa_bits, dtype=torch.float32, device=device) / 2 ** mantissa_bits)  # [1, 2)
    x = torch.cat([x, -x / 4, x * 8]).to(dtype)
    name = str(dtype).removeprefix("torch.")
    try:
        with compile_limits(1), torch.no_grad():
            got = compile_block_forward(cancelling)(x)  # compiled as the managers' block forwards are
    except Exception as exc:  # the compiled capture would fail the same way; say why here
        return Capability.unavailable(f"inductor failed to compile a {name} probe on {device.type}: "
                                      f"{type(exc).__name__}: {exc}")
    want = cancelling(x)
    if torch.equal(got, want):
        return Capability.available()
    differ = int((got != want).sum())
    return Capability.unavailable(
        f"inductor on torch {torch.__version__} does not round {name} intermediates on {device.type} as eager "
        f"does ({differ} of {x.numel()} probe values differ with emulate_precision_casts on), so compiled "
        f"replays would not equal eager within {name}'s tolerance")
