"""Capture/replay through ``torch.cuda``'s graph API, shared by the CUDA and ROCm plugins.

ROCm builds of torch map ``torch.cuda`` onto HIP graphs, so one implementation serves both plugins; it is pure
torch and imports no vendor SDK. The runtime namespace is a class attribute (``runtime_name``) because torch_npu
mirrors this API under ``torch.npu`` (``NPUGraph``, ``graph``, ``graph_pool_handle``), so the NPU plugin's aclgraph
mode reuses the same warm-up, capture and failure handling by overriding ``runtime`` and ``new_graph``.

Importing this module touches no device: streams and pools are created on first use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode

from hwgraph.capability import Capability, parse_version
from hwgraph.graphs.base import (
    CapturedGraph,
    CaptureError,
    CountedSwitch,
    GraphBackend,
    HostSyncError,
    Outputs,
    as_capture_error,
)
from hwgraph.graphs.cpu import flat_tensors
from hwgraph.graphs.host_reads import RejectHostReads

log = logging.getLogger(__name__)

#: The oldest torch the device backends support (the core's own requirement).
MIN_TORCH = "2.10"

#: Settings of ``torch.backends.cuda.matmul`` that decide how cuBLAS (hipBLASLt on ROCm) computes a product in each
#: dtype: TF32 for float32, reduced-precision reductions (and split-K's) for bf16 and fp16, fp16 accumulation. ATen
#: reads them when it launches a product, so a captured graph keeps the values of its capture.
MATMUL_SETTINGS = {
    torch.float32: ("fp32_precision",),
    torch.bfloat16: ("allow_bf16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction_split_k"),
    torch.float16: ("allow_fp16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction_split_k",
                    "allow_fp16_accumulation"),
}


def matmul_settings(dtype: torch.dtype) -> tuple:
    """``(name, value)`` of each cuBLAS setting that applies to ``dtype``'s products (``MATMUL_SETTINGS``); a setting
    this torch lacks reads None. For float32 also the generic ``torch.backends.fp32_precision`` that a matmul
    precision of "none" defers to. Only the new precision API is read: the legacy ``allow_tf32`` raises once both
    APIs were used, while ``fp32_precision`` reflects either."""
    matmul = torch.backends.cuda.matmul
    settings = tuple((f"torch.backends.cuda.matmul.{name}", getattr(matmul, name, None))
                     for name in MATMUL_SETTINGS.get(dtype, ()))
    if dtype == torch.float32:
        settings += (("torch.backends.fp32_precision", getattr(torch.backends, "fp32_precision", None)),)
    return settings


def torch_build() -> tuple[str, str | None]:
    """Which runtime this torch was built for: ``("rocm", hip)``, ``("cuda", cuda)`` or ``("cpu", None)``."""
    hip = getattr(torch.version, "hip", None)
    if hip:
        return "rocm", str(hip)
    if torch.version.cuda:
        return "cuda", str(torch.version.cuda)
    return "cpu", None


def torch_version_capability(backend: str, found: str | None, minimum: str = MIN_TORCH) -> Capability:
    """Gate on ``torch >= minimum``, compared as ``packaging`` release numbers (so 2.10 > 2.9). Pre-releases of the
    minimum count as it, as vLLM's ``is_torch_equal_or_newer`` counts them: NVIDIA's containers ship torch as
    ``2.10.0a0+<commit>.nv<yy.mm>``."""
    have = parse_version(found)
    if have is None or have.release < parse_version(minimum).release:
        return Capability.unavailable(f"the {backend} graph backend needs torch >= {minimum}, found {found or 'none'}; "
                                      f"upgrade torch")
    return Capability.available()


#: name -> [value, blocks]: the variables ``environment_defaults`` set, and how many open blocks hold each (in any
#: thread). Changed only under ``_defaults_lock``.
_defaults_held: dict[str, list] = {}
_defaults_lock = threading.Lock()


@contextlib.contextmanager
def environment_defaults(values: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """Set each of ``values`` in the process environment for the block, unless the process has set it already (the
    user's choice stands), and remove what it set once no block holds it. Yields what the block runs with that it
    set, or that another block still open (in any thread: captures on two devices) set and shares with it: the first
    block's value, which the last one out removes."""
    applied = {}
    try:  # each taken inside: one that fails (a value not a str) must not leave those before it set for the process
        with _defaults_lock:
            for name, value in values.items():
                held = _defaults_held.get(name)
                if held is None and name in os.environ:
                    continue
                if not isinstance(value, str):
                    raise TypeError(f"environment variable {name!r} takes a str value, got {value!r}")
                if held is None:
                    os.environ[name] = value
                    held = _defaults_held[name] = [value, 0]
                held[1] += 1
                applied[name] = held[0]
        yield applied
    finally:
        with _defaults_lock:
            for name in applied:
                held = _defaults_held[name]
                held[1] -= 1
                if held[1] == 0:
                    del _defaults_held[name]
                    os.environ.pop(name, None)


def pool_id(pool):
    """The id the runtime's graph calls take for ``pool``: a ``MemPool``'s (``new_pool``), or a pool handle, which is
    one. (Every torch since 2.10 takes an id; only newer ones take a MemPool too.)"""
    return getattr(pool, "id", pool)


def pool_uses(pool) -> int | None:
    """How many users hold ``pool`` (the pool object and each graph captured into it), or None for a pool handle."""
    use_count = getattr(pool, "use_count", None)
    return None if use_count is None else int(use_count())


class TorchCudaCapturedGraph(CapturedGraph):
    """A captured device graph and its outputs.

    The outputs live in the graph's private pool and every replay writes into them, so they are held strongly here
    for as long as the graph lives (a weakly held buffer can be freed and reused while the graph still writes it).
    """

    def __init__(self, graph: Any, outputs: Outputs):
        self.graph = graph
        self.outputs = outputs

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError("replay() of a released graph")
        self.graph.replay()

    def release(self) -> None:
        graph, self.graph, self.outputs = self.graph, None, None
        if graph is not None and hasattr(graph, "reset"):
            graph.reset()  # gives the graph's share of the pool back now rather than at garbage collection


class _TranslateSyncErrors(TorchFunctionMode):
    """Turns the runtime's sync-debug error ("called a synchronizing CUDA operation") into ``HostSyncError``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except RuntimeError as exc:
            if "called a synchronizing" not in str(exc) or isinstance(exc, HostSyncError):
                raise
            name = getattr(func, "__name__", str(func))
            raise HostSyncError(f"{name}() inside sync_guard() synchronised the device with the host, which breaks "
                                f"capture and stalls replay ({exc})") from exc


class TorchCudaGraphBackend(GraphBackend):
    """Device graphs through ``torch.cuda`` (HIP graphs on ROCm builds).

    ``capture(fn, pool)`` runs ``fn`` ``warmup_runs`` times on the backend's capture stream, then captures one more
    run on the same stream into ``pool``. Warming up on the capture stream itself matters: cuBLAS workspaces and
    hipBLASLt handles are made per stream, and creating one during capture fails (or, on ROCm, hangs).
    """

    modes: ClassVar[tuple[str, ...]] = ("full",)
    #: runtime namespace -> device -> the capture stream every backend on that device shares. cuBLAS and cuBLASLt
    #: give each stream a workspace on its first use and keep it for the process; freeing one could break a live
    #: graph that captured it (any in the process, e.g. a language model's), so hwgraph never frees them, and one
    #: stream per device keeps managers from leaving a workspace each.
    _capture_streams: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()
    #: The ``torch`` attribute holding the runtime namespace; also the device type ("cuda" on ROCm builds too).
    runtime_name: ClassVar[str] = "cuda"
    warmup_runs: ClassVar[int] = 2
    #: Replay once after capture and compare with an eager run (ROCm: a broken capture may not raise).
    check_replay_after_capture: ClassVar[bool] = False
    #: Process environment variables set while a graph is captured, after the warm-up, each unless the process has
    #: set it itself (``environment_defaults``); the CUDA plugin's says how cuBLASLt picks its kernels.
    capture_environment: ClassVar[Mapping[str, str]] = {}
    #: id of a runtime namespace -> the switch that holds its sync debug mode at "error" while any sync guard on it
    #: is open, in any thread (the mode is process-wide); kept for the process, with the runtime, so that an id is
    #: never reused while its entry lives. Changed only under ``_sync_debug_switches_lock``.
    _sync_debug_switches: ClassVar[dict[int, tuple[Any, CountedSwitch]]] = {}
    _sync_debug_switches_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: torch.device | str | None = None, mode: str | None = None):
        super().__init__(device, mode)
        if self.device.type != self.runtime_name:
            raise ValueError(f"the {self.name} graph backend captures on {self.runtime_name} devices, "
                             f"got {self.device}")
        if self.device.index is None:
            self.device = torch.device(self.runtime_name, self.runtime().current_device())

    # -- the runtime and its graph API (the NPU plugin overrides these) --------------------------------------------

    @classmethod
    def runtime(cls):
        return getattr(torch, cls.runtime_name)

    @classmethod
    def default_device(cls) -> torch.device:
        return torch.device(cls.runtime_name, cls.runtime().current_device())

    def new_graph(self) -> Any:
        return self.runtime().CUDAGraph()

    def graph_context(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        return self.runtime().graph(graph, pool=pool_id(pool), stream=stream)

    @classmethod
    def device_capability(cls, device: torch.device | str | None) -> Capability:
        """Whether ``device`` names a visible device of this runtime (``None``: the current one)."""
        if device is None:
            return Capability.available()
        device = torch.device(device)
        if device.type != cls.runtime_name:
            return Capability.unavailable(f"the {cls.name} graph backend captures on {cls.runtime_name} devices, "
                                          f"got {device}")
        count = int(cls.runtime().device_count())
        if device.index is not None and not 0 <= device.index < count:
            return Capability.unavailable(f"{device} does not exist: {count} device(s) are visible")
        return Capability.available()

    # -- the GraphBackend interface ---------------------------------------------------------------------------------

    def new_pool(self) -> Any:
        """The pool the captures of one manager share: a ``MemPool`` on the backend's device where the runtime can
        release a pool's uses (its use count shows what a failed capture kept, ``release_kept_uses``), else a graph
        pool handle. Either is given back when the last graph in it is released and the pool object dropped."""
        runtime = self.runtime()
        mem_pool = getattr(runtime, "MemPool", None)
        if mem_pool is None or self._release_pool_use() is None:
            return runtime.graph_pool_handle()
        with runtime.device(self.device):
            return mem_pool()

    def _release_pool_use(self):
        """The runtime's call ``(device_index, pool_id)`` that drops one use of a pool, or None where this torch has
        none: torch binds it as ``torch._C._cuda_releasePool`` (ROCm builds too). A plugin whose runtime binds it in
        a module of its own overrides this (the NPU plugin: ``torch_npu._C._npu_releasePool``)."""
        return getattr(torch._C, f"_{self.runtime_name}_releasePool", None)

    def capture_stream(self):
        """The device's capture stream, shared by every backend in the process; made on first capture and replaced
        after a failed one."""
        streams = TorchCudaGraphBackend._capture_streams.setdefault(self.runtime(), {})
        if self.device not in streams:
            streams[self.device] = self.runtime().Stream(device=self.device)
        return streams[self.device]

    def prepare(self, fn, *, current_stream: bool = False) -> None:
        """Run ``fn`` once on the device's capture stream, as its capture will, and once on the current stream where
        ``fn`` runs there too before the memory is read: the manager's compiled forward first runs (and compiles)
        there, and ``check_replay`` reruns each capture there. cuBLAS gives each stream its workspaces on first use
        and keeps them for the process (``_capture_streams``), 34 MiB on the H200. Made here, they are not counted
        in the capture's memory: those of these streams, and of a side stream ``fn`` forks (the tower's DeepStack
        mergers run on one up to 512 rows)."""
        runtime = self.runtime()
        with runtime.device(self.device):
            streams = [self.capture_stream()]
            if current_stream or self.check_replay_after_capture:
                streams.append(runtime.current_stream())
            for stream in streams:
                self.warm_up(fn, stream, runs=1)

    def capture(self, fn, pool=None) -> TorchCudaCapturedGraph:
        runtime = self.runtime()
        pool = pool if pool is not None else self.new_pool()
        with runtime.device(self.device):
            stream = self.capture_stream()  # one stream for every capture, as sharing a pool across graphs asks
            self.warm_up(fn, stream)
            with environment_defaults(self.capture_environment) as applied:
                if applied:
                    log.debug("capturing with %s set", applied)
                captured = self.capture_on(fn, pool, stream)
            if self.check_replay_after_capture:
                self.check_replay(captured, fn)
        return captured

    def warm_up(self, fn, stream, runs: int | None = None) -> None:
        """Run ``fn`` ``runs`` times (default ``warmup_runs``) on ``stream``, ordered after the current stream's work
        and before its later work; a failure is a ``CaptureError``."""
        runtime = self.runtime()
        stream.wait_stream(runtime.current_stream())
        try:
            with as_capture_error("warm-up before capture failed"), runtime.stream(stream), torch.inference_mode():
                for _ in range(self.warmup_runs if runs is None else runs):
                    flat_tensors(fn())
        finally:
            runtime.current_stream().wait_stream(stream)

    def capture_on(self, fn, pool, stream) -> TorchCudaCapturedGraph:
        runtime = self.runtime()
        graph = self.new_graph()
        previous = runtime.current_stream()
        raised_by_fn = None
        uses = pool_uses(pool)
        try:
            with torch.inference_mode(), self.graph_context(graph, pool, stream):
                try:
                    outputs = fn()
                except BaseException as exc:
                    raised_by_fn = exc
                    raise
        except BaseException as exc:
            self.abandon_capture(graph, pool, stream, previous, uses)
            first, raised_by_fn = (raised_by_fn if raised_by_fn is not None else exc), None
            try:
                if not isinstance(first, Exception):  # Ctrl-C or SystemExit is never a failed capture, also when
                    raise first from (None if first is exc else exc)  # ending the capture then raised too
                if not isinstance(exc, Exception):
                    raise
                message = f"capture failed: {type(first).__name__}: {first}"
                if exc is not first:
                    message += f" (ending the capture then failed too: {type(exc).__name__}: {exc})"
                raise CaptureError(message) from first
            finally:
                # The exception's traceback holds this frame: a name for it here would be a reference cycle keeping
                # what fn allocated in the pool before it failed (a budget's activations) until the garbage collector
                # runs, while the manager captures the next budget.
                del first
        captured = TorchCudaCapturedGraph(graph, outputs)
        try:
            flat_tensors(outputs)
        except CaptureError:
            captured.release()
            raise
        return captured

    def abandon_capture(self, graph, pool, stream, previous, uses: int | None = None) -> None:
        """Undo what a failed capture of ``graph`` into ``pool`` on ``stream`` leaves behind, so the device stays usable
        and its pool can be given back; ``previous``: the stream current before it.

        ``torch.cuda.graph.__exit__`` skips restoring the current stream when ending the capture raises, and torch
        before 2.12 also left the allocator routing into the pool (pytorch#180395): later syncs then assert. Torch
        2.11 also left the device's default generator marked as capturing (``unmark_generator_capture``). Each log
        record here keeps an exception's text, not the exception, whose context holds what the function allocated.
        ``uses``: the pool's use count before the capture began (``pool_uses``), for ``release_kept_uses``.
        """
        runtime = self.runtime()
        is_capturing = getattr(runtime, "is_current_stream_capturing", None)
        with contextlib.suppress(Exception), runtime.stream(stream):
            if is_capturing is not None and is_capturing():
                graph.capture_end()
        self.end_allocate_to_pool(pool)
        with contextlib.suppress(Exception):
            runtime.set_stream(previous)
        try:
            graph.reset()
        except Exception as exc:  # the graph may still hold its use of the pool: leave that to its destructor
            log.debug("resetting a failed capture's graph raised: %s: %s", type(exc).__name__, str(exc))
        else:
            self.release_kept_uses(pool, uses)
        # Never capture on a stream a failed capture has touched again. Its replacement gets cuBLAS workspaces of its
        # own on first use (34 MiB on the H200), kept for the process; torch hands out pooled streams, 32 per device,
        # which bounds what repeated failures can leave behind. The new one first ends the generator's capture.
        TorchCudaGraphBackend._capture_streams.get(runtime, {}).pop(self.device, None)
        self.unmark_generator_capture()
        try:
            runtime.synchronize(self.device)
        except Exception as exc:
            log.warning("the device did not synchronise after a failed capture: %s: %s", type(exc).__name__, str(exc))

    def unmark_generator_capture(self) -> None:
        """End the capture that the device's default generator still takes part in after a failed capture.

        A capture marks the current device's default generator as capturing when it begins and unmarks it only after
        ``cudaStreamEndCapture`` succeeded. Torch 2.11 (the device machines') keeps that mark in one flag per
        generator, so after a capture invalidated by a host read every random op on the device outside a capture
        raised "Offset increment outside graph capture encountered unexpectedly" for the rest of the process: the
        user's ``randn``, dropout or sampling after the manager had fallen back to eager. A capture with nothing in
        it, ended well, clears the mark; it moves no random offset and its graph is reset at once. It runs on the
        device's capture stream, which ``abandon_capture`` has just replaced, so no failed capture has touched it.
        Torch's current source keeps the mark per capture and drops it in the failed graph's ``reset``; there this
        changes nothing.
        """
        runtime, graph = self.runtime(), self.new_graph()
        try:
            with runtime.device(self.device), runtime.stream(self.capture_stream()), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The .* Graph is empty")  # as it is meant to be
                graph.capture_begin(capture_error_mode="thread_local")
                graph.capture_end()
        except Exception as exc:  # its text, not the exception: a kept log record would keep, through its context,
            # what the failed capture's function allocated (a budget's activations)
            log.warning("could not end the default generator's capture on %s after a failed capture; random ops "
                        "there may raise: %s: %s", self.device, type(exc).__name__, str(exc))
        finally:
            with contextlib.suppress(Exception):
                graph.reset()

    def release_kept_uses(self, pool, uses: int | None) -> None:
        """Drop the uses of ``pool`` a failed capture still holds after its graph was reset. Torch without
        pytorch#190348 (2.11 on the H200 machine) releases a graph's pool in ``reset`` only when its capture ended
        well, so after one failed capture the shared pool, with every budget's graph memory in it, stayed reserved
        for the process once the manager had released its graphs. ``uses``: the count before the capture (None: a
        pool handle, whose count cannot be read; nothing is done)."""
        kept = 0 if uses is None else pool_uses(pool) - uses
        if kept <= 0:
            return
        release = self._release_pool_use()
        if release is None:  # a caller's own MemPool on a runtime that cannot release uses: the capture's error stands
            log.warning("a failed capture kept %d use(s) of its graph pool, which this %s runtime cannot release: the "
                        "pool stays reserved after its graphs are released", kept, self.runtime_name)
            return
        log.debug("a failed capture kept %d use(s) of its graph pool: released", kept)
        for _ in range(kept):
            release(self.device.index, pool_id(pool))

    def end_allocate_to_pool(self, pool) -> None:
        end = getattr(torch._C, f"_{self.runtime_name}_endAllocateToPool", None)
        if end is None:
            return
        # Raises "not currently recording to mempool" when torch already ended it, which is the usual case.
        with contextlib.suppress(Exception):
            end(self.device.index, pool_id(pool))

    def compare_replay(self, replayed: list[torch.Tensor], eager: list[torch.Tensor]) -> None:
        """Raise ``AssertionError`` saying how ``replayed`` (the graph's outputs) differ from ``eager`` (a rerun's);
        here ``torch.testing.assert_close``'s closeness. A backend whose libraries round differently from run to run
        overrides it (ROCm)."""
        torch.testing.assert_close(replayed, eager, equal_nan=True)

    def check_replay(self, captured: TorchCudaCapturedGraph, fn) -> None:
        """Replay once and compare with an eager run of the same inputs (``compare_replay``); a mismatch is a
        ``CaptureError``.

        A host sync here is fine: this runs once at capture time, never on the replay path.
        """
        try:
            captured.replay()
            self.synchronize()
            replayed = [t.clone() for t in flat_tensors(captured.outputs)]
            with torch.inference_mode():
                eager = flat_tensors(fn())
            self.synchronize()
            self.compare_replay(replayed, eager)
        except Exception as exc:
            captured.release()
            raise CaptureError(f"the {self.name} graph's replay disagrees with an eager run of the same inputs, so the "
                               f"capture recorded a broken graph without raising (pytorch#155684); that budget stays "
                               f"eager: {type(exc).__name__}: {exc}") from exc

    def synchronize(self) -> None:
        self.runtime().synchronize(self.device)

    def empty_cache(self) -> None:
        # Not the math libraries' per-stream workspaces (torch._C._cuda_clearCublasWorkspaces): captured graphs
        # anywhere in the process may write to them (see _capture_streams).
        self.runtime().empty_cache()

    def numerics_settings(self, dtype: torch.dtype) -> tuple:
        return matmul_settings(dtype)

    def memory_in_use(self) -> int:
        # Reserved, not allocated: a graph's private pool keeps its blocks reserved between replays even while no
        # tensor is live in them, and that reservation is what a captured graph costs the device.
        return int(self.runtime().memory_reserved(self.device))

    @staticmethod
    def _sync_debug_switch(runtime) -> CountedSwitch:
        """The one switch of ``runtime``'s sync debug mode: "error" while held, then the mode its first holder found."""
        switches, lock = TorchCudaGraphBackend._sync_debug_switches, TorchCudaGraphBackend._sync_debug_switches_lock
        with lock:  # by id: a runtime need not be hashable
            if id(runtime) not in switches:
                def turn_on():
                    found = runtime.get_sync_debug_mode()
                    runtime.set_sync_debug_mode("error")
                    return found
                def turn_off(found):
                    runtime.set_sync_debug_mode(found)
                switches[id(runtime)] = (runtime, CountedSwitch(turn_on, turn_off))
            return switches[id(runtime)][1]

    @contextlib.contextmanager
    def sync_guard(self):
        """Raise ``HostSyncError`` on a device-to-host synchronisation inside the block.

        Uses the runtime's sync debug mode where it has one (it is process-wide: other threads see it too while the
        block runs); otherwise the CPU backend's guard, which rejects the host-reading tensor methods. Re-entrant and
        safe to enter and leave from several threads, as that guard is: both hold a ``CountedSwitch``.
        """
        runtime = self.runtime()
        if not (hasattr(runtime, "set_sync_debug_mode") and hasattr(runtime, "get_sync_debug_mode")):
            with RejectHostReads():
                yield
            return
        with TorchCudaGraphBackend._sync_debug_switch(runtime), _TranslateSyncErrors():
            yield
