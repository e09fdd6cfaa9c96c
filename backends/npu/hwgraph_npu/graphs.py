"""Ascend NPU graphs in two modes.

- ``aclgraph``: ``torch.npu.NPUGraph`` captured with ``torch.npu.graph(g, pool=...)`` after a warm-up on the capture
  stream. torch_npu mirrors ``torch.cuda``'s graph API, so this reuses the shared implementation in
  ``hwgraph.graphs.torch_cuda`` with ``torch.npu`` as the runtime. The pool is a ``torch.npu.MemPool`` where torch_npu
  can count and release its uses, so that what a failed capture kept is given back; else a graph pool handle.
- ``torchair``: the callable compiled by ``torch.compile`` with torchair's NPU backend in its ``reduce-overhead``
  (aclgraph) execution mode; torchair manages its own graph memory, so ``pool`` is not used.

Both keep strong references to their outputs for as long as the graph lives (a weakly held output buffer has
crashed NPU replays). torch_npu and torchair are imported only when a backend is constructed, never at import.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch

from hwgraph.capability import Capability, require_module
from hwgraph.compile_mode import own_code_copy
from hwgraph.graphs.base import CapturedGraph, CaptureError, Outputs
from hwgraph.graphs.cpu import flat_tensors
from hwgraph.graphs.torch_cuda import TorchCudaGraphBackend, pool_id
from hwgraph.platform import detect, npu_module
from hwgraph.registry import SelectionError

#: torchair's execution mode that captures the compiled graph as an aclgraph (its default, "max-autotune", is GE).
TORCHAIR_MODE = "reduce-overhead"


def clone_outputs(outputs: Outputs) -> Outputs:
    """A copy of ``outputs`` with the same nesting of tuples and lists, in fresh tensors."""
    flat_tensors(outputs)  # rejects anything that is not tensors
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    items = [clone_outputs(item) for item in outputs]
    # A named tuple takes its fields as arguments: given one iterable, it took it for its first field and raised
    return type(outputs)(*items) if hasattr(outputs, "_fields") else type(outputs)(items)


class CompiledGraph(CapturedGraph):
    """A torchair-compiled callable. Its results may be fresh tensors or torchair's internal buffers, so each replay
    copies them into the static ``outputs`` made at capture (device copies, no host sync)."""

    def __init__(self, compiled, outputs: Outputs):
        self.compiled = compiled
        self.outputs = outputs

    def replay(self) -> None:
        if self.compiled is None:
            raise RuntimeError("replay() of a released graph")
        with torch.inference_mode():  # the static outputs are inference tensors, writable only inside it
            fresh = flat_tensors(self.compiled())
            static = flat_tensors(self.outputs)
            if len(fresh) != len(static):
                raise CaptureError(f"the compiled callable returned a different number of outputs on replay: "
                                   f"{len(fresh)}, against {len(static)} at capture")
            # After a recompilation (a guard failed) copy_ would broadcast an output of another shape without a word
            if any(src.shape != dst.shape for dst, src in zip(static, fresh, strict=True)):
                raise CaptureError(f"the compiled callable returned outputs of other shapes on replay: "
                                   f"{[tuple(t.shape) for t in fresh]}, against {[tuple(t.shape) for t in static]} "
                                   f"at capture")
            for dst, src in zip(static, fresh, strict=True):
                dst.copy_(src)

    def release(self) -> None:
        self.compiled = None
        self.outputs = None


class NpuGraphBackend(TorchCudaGraphBackend):
    name = "npu"
    modes: ClassVar[tuple[str, ...]] = ("aclgraph", "torchair")
    runtime_name = "npu"

    def __init__(self, device=None, mode=None):
        chosen = self.modes[0] if mode is None else mode  # only None: '' is the base class's unknown mode
        if chosen in self.modes:  # an unknown mode is the base class's ValueError
            cap = self.mode_capability(chosen)
            if not cap.ok:
                raise SelectionError(f"npu graph mode {chosen!r} is unavailable: " + "; ".join(cap.reasons))
        super().__init__(device, mode)

    @classmethod
    def runtime(cls):
        if npu_module() is None:
            raise RuntimeError("torch.npu is unavailable: torch_npu is not installed or fails to import")
        runtime = getattr(torch, "npu", None)
        if runtime is None:
            raise RuntimeError("torch_npu imported but did not register torch.npu")
        return runtime

    @classmethod
    def capability(cls, device=None) -> Capability:
        from hwgraph_npu.platform import gate

        cap = gate(detect())
        return cls.device_capability(device) if cap.ok else cap

    @classmethod
    def mode_capability(cls, mode: str) -> Capability:
        """Whether graph mode ``mode`` can run here; the reasons say what to install otherwise."""
        if mode not in cls.modes:
            return Capability.unavailable(f"the npu graph backend has modes {', '.join(cls.modes)}; got {mode!r}")
        from hwgraph_npu.platform import torch_npu_refusal

        refusal = torch_npu_refusal(f"npu graph mode {mode!r}")
        if refusal:
            return Capability.unavailable(refusal)
        if mode == "aclgraph":
            runtime = getattr(torch, "npu", None)
            missing = [name for name in ("NPUGraph", "graph", "graph_pool_handle") if not hasattr(runtime, name)]
            if missing:
                needed = ", ".join(f"torch.npu.{name}" for name in missing)
                return Capability.unavailable(f"npu graph mode 'aclgraph' needs {needed}, which this torch_npu lacks; "
                                              f"upgrade torch_npu")
            return Capability.available()
        cap = require_module("torchair", "npu graph mode 'torchair'")  # after torch_npu, as torchair requires
        if not cap.ok:
            return Capability.unavailable(f"{cap.describe()}; install the torchair release matching torch_npu")
        return cap

    def new_graph(self):
        return self.runtime().NPUGraph()

    def _release_pool_use(self):
        """torch_npu binds the allocator's ``releasePool`` in its own module, as
        ``torch_npu._C._npu_releasePool(device_index, pool_id)``, not in ``torch._C`` where the shared code looks (which
        found nothing, so the NPU captured into a pool handle and a failed capture's kept uses were never given back).
        None where this torch_npu lacks it, or has a ``torch.npu.MemPool`` without ``use_count`` (older releases):
        there the kept uses cannot be counted, and a pool handle serves as well."""
        release = getattr(getattr(npu_module(), "_C", None), "_npu_releasePool", None)
        mem_pool = getattr(getattr(torch, "npu", None), "MemPool", None)
        if release is None or not hasattr(mem_pool, "use_count"):
            return None
        return release

    def end_allocate_to_pool(self, pool) -> None:
        # torch_npu binds the allocator's call in its own module, not in torch._C where the shared code looks. Older
        # torch_npu make it in capture_end only after the capture ended cleanly: after a failed one the allocator kept
        # routing into the pool of the graph just released.
        end = getattr(getattr(npu_module(), "_C", None), "_npu_endAllocateCurrentStreamToPool", None)
        if end is None:
            return
        # Raises "not currently recording to mempool_id" when torch_npu already ended it. It takes the pool's id, as the
        # graph was given: given a MemPool it raises a TypeError, which would pass for that and leave the routing on.
        with contextlib.suppress(Exception):
            end(self.device.index, pool_id(pool))

    def compile_support(self) -> Capability:
        """Inductor generates no NPU code; on Ascend the compiler is torchair, which graph mode 'torchair' applies
        to every capture. So the manager's compiled mode captures uncompiled here, and says which mode compiles."""
        if self.mode == "torchair":
            return Capability.unavailable("npu graph mode 'torchair' already compiles every capture with torchair's "
                                          "NPU backend; no inductor pass is added")
        torchair = self.mode_capability("torchair")
        hint = ("use npu graph mode 'torchair' to compile with it (EncoderGraphManager(..., graph_mode='torchair'), "
                "hwgraph bench --graph-mode torchair)" if torchair.ok
                else f"graph mode 'torchair' would compile with it, but {torchair.describe()}")
        return Capability.unavailable(f"torch.compile's inductor generates no NPU code; torchair is the NPU compiler: "
                                      f"{hint}")

    def numerics_settings(self, dtype: torch.dtype) -> tuple:
        """torch.backends.cuda's settings do not apply on Ascend. torch_npu's HF32 setting for matrix products
        (``torch.npu.matmul.allow_hf32``, as CUDA's ``allow_tf32``) does, in float32."""
        if dtype != torch.float32:
            return ()
        return (("torch.npu.matmul.allow_hf32", getattr(getattr(self.runtime(), "matmul", None), "allow_hf32", None)),)

    def capture(self, fn, pool=None) -> CapturedGraph:
        if self.mode == "torchair":
            return self.compile_torchair(fn)
        return super().capture(fn, pool)

    def prepare(self, fn, *, current_stream: bool = False) -> None:
        # torchair captures on streams of its own choosing, not on the shared capture stream: an eager run there would
        # only give that stream workspaces which no torchair graph uses.
        if self.mode != "torchair":
            super().prepare(fn, current_stream=current_stream)

    def compile_torchair(self, fn) -> CompiledGraph:
        import torchair

        config = torchair.CompilerConfig()
        config.mode = TORCHAIR_MODE
        # A code object of its own: dynamo keeps compilations per code object, and a manager's captures (every
        # budget and slot count, and other managers') share their forward's, so they would fill dynamo's recompile
        # limit for the whole process and later captures would fail.
        compiled = torch.compile(own_code_copy(fn), backend=torchair.get_npu_backend(compiler_config=config),
                                 fullgraph=True, dynamic=False)
        try:
            with self.runtime().device(self.device), torch.inference_mode():
                for _ in range(self.warmup_runs):  # the first run compiles and captures, the next replays
                    flat_tensors(compiled())
                outputs = clone_outputs(compiled())
        except CaptureError:
            raise
        except Exception as exc:
            raise CaptureError(f"torchair compilation failed: {type(exc).__name__}: {exc}") from exc
        return CompiledGraph(compiled, outputs)
