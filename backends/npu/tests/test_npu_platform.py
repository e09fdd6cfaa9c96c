"""The npu plugin: gate and mode refusals with reasons, and capture through a simulated torch.npu runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import types

import pytest
import torch
from hwgraph_npu.graphs import NpuGraphBackend, clone_outputs
from hwgraph_npu.platform import gate, probe

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower  # here: its first import must not meet a fake torch_npu
from hwgraph.platform import PlatformInfo, checked_device, detect, npu_module, torch_npu_unavailable
from hwgraph.registry import SelectionError, choose_backend, create_backend
from hwgraph.testing.simulate import (
    FakeGraphRuntime,
    assert_refused_for_a_host_device,
    simulate_broken_import,
    simulate_gpu,
)


class FakeGraph:
    def __init__(self, runtime: FakeNpu):
        self.runtime = runtime

    def capture_begin(self, pool=None):
        self.runtime.capturing = True
        self.runtime.events.append(f"capture begins on {self.runtime.current.name} into {pool}")

    def capture_end(self):
        self.runtime.capturing = False
        self.runtime.events.append("capture ends")
        if self.runtime.invalidated:
            raise RuntimeError("the capture was invalidated")

    def replay(self):
        self.runtime.events.append("replay")

    def reset(self):
        self.runtime.events.append("reset")


class FakeGraphContext:
    """Mirrors ``torch.npu.graph``: switches to the capture stream, begins; on exit ends, then switches back."""

    def __init__(self, runtime, graph, pool, stream):
        self.runtime, self.graph, self.pool, self.stream = runtime, graph, pool, stream

    def __enter__(self):
        self.previous, self.runtime.current = self.runtime.current, self.stream
        self.graph.capture_begin(self.pool)

    def __exit__(self, *exc):
        self.graph.capture_end()  # when this raises, the stream is not switched back (as in torch)
        self.runtime.current = self.previous


class FakeNpu(FakeGraphRuntime):
    """Stand-in for the ``torch.npu`` namespace torch_npu registers, recording what the backend calls, in order."""

    def __init__(self, with_sync_debug_mode: bool = False):
        super().__init__(count=1)
        self.invalidated = False
        if with_sync_debug_mode:
            self.debug_mode = 0
            self.set_sync_debug_mode = self._set_mode
            self.get_sync_debug_mode = lambda: self.debug_mode

    def _set_mode(self, mode):
        self.debug_mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)

    def is_available(self):
        return False  # asked by torch.accelerator (inside torch.compile); the tensors here are CPU tensors

    def get_device_name(self, index=0):
        return "Ascend910B3"

    def synchronize(self, device=None):
        self.events.append("synchronize")

    def memory_reserved(self, device=None):
        return 4096

    def graph_pool_handle(self):
        return ("pool", 7)

    def NPUGraph(self):  # noqa: N802 (torch.npu's spelling)
        return FakeGraph(self)

    def graph(self, graph, pool=None, stream=None):
        return FakeGraphContext(self, graph, pool, stream)


def simulate_npu(monkeypatch, runtime: FakeNpu) -> FakeNpu:
    """``runtime`` as ``torch.npu`` with a fake ``torch_npu``, on a torch that is neither a CUDA nor a ROCm build
    (detection asks torch.cuda first: on a GPU machine the real GPU would otherwise win)."""
    simulate_gpu(monkeypatch, count=0)
    fake = types.ModuleType("torch_npu")
    fake.__version__ = "2.13.0"
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", runtime, raising=False)
    # What importing torch_npu does, and torch cannot undo: only in the child process whose tests request
    # simulated_npu_process (conftest.py), so that the tests after these do not see "npu" as a torch device type.
    torch.utils.rename_privateuse1_backend("npu")
    return runtime


@pytest.fixture
def npu(monkeypatch, simulated_npu_process):
    return simulate_npu(monkeypatch, FakeNpu())


@pytest.mark.skipif(npu_module() is not None, reason="checks the reasons given where torch_npu is absent")
def test_refused_without_torch_npu_with_what_to_install(monkeypatch):
    simulate_gpu(monkeypatch, count=0)  # on a GPU machine the gate would first say to use that GPU's backend
    (reason,) = NpuGraphBackend.capability().reasons
    assert "needs the torch_npu package (ModuleNotFoundError" in reason
    assert "install torch_npu built for torch" in reason and "CANN" in reason
    with pytest.raises(SelectionError, match="torch_npu"):
        create_backend("npu")
    for mode in ("aclgraph", "torchair"):
        assert "torch_npu" in NpuGraphBackend.mode_capability(mode).describe()


CANN_UNSET = "libascendcl.so: cannot open shared object file: No such file or directory"


def test_an_installed_torch_npu_that_does_not_import_is_refused_saying_to_set_the_cann_environment(monkeypatch):
    """The CANN toolkit's set_env.sh not sourced: the gate said torch_npu was missing and to install it, while
    ``checked_device("npu:0")`` said it is installed and to set CANN's environment. Both now say the latter, in the
    same words, and so do both graph modes."""
    simulate_gpu(monkeypatch, count=0)
    simulate_broken_import(monkeypatch, "torch_npu", CANN_UNSET)
    why = torch_npu_unavailable(f"ImportError: {CANN_UNSET}")
    assert "torch_npu is installed but does not import" in why and "set_env.sh" in why
    assert gate(detect()).reasons == (f"the npu graph backend needs torch_npu, and {why}",)
    with pytest.raises(SelectionError, match=re.escape(why)):
        create_backend("npu")
    for mode in ("aclgraph", "torchair"):
        assert NpuGraphBackend.mode_capability(mode).reasons == (f"npu graph mode {mode!r} needs torch_npu, and {why}",)
    with pytest.raises(ValueError, match=re.escape(why)):
        checked_device("npu:0")


def test_refused_when_torch_npu_sees_no_device(monkeypatch, npu):
    monkeypatch.setattr(npu, "device_count", lambda: 0)
    (reason,) = gate(detect()).reasons
    assert "torch_npu imports but no Ascend NPU is usable" in reason and "ASCEND_RT_VISIBLE_DEVICES" in reason


def test_chosen_automatically_on_a_simulated_npu(npu):
    selected = choose_backend()
    assert (selected.spec.name, selected.reason) == ("npu", "best available for npu")
    backend = NpuGraphBackend()
    assert (backend.device, backend.mode) == (torch.device("npu", 0), "aclgraph")


def test_the_npu_backend_named_for_a_cpu_device_on_an_npu_machine_says_it_captures_on_npu_devices(monkeypatch, npu):
    """A tower left on the CPU with the npu backend named (or in $HWGRAPH_GRAPH_BACKEND): the gate judged the CPU
    job's platform and said no Ascend NPU was usable, to check npu-smi and ASCEND_RT_VISIBLE_DEVICES, on a machine
    whose NPU is. An automatic choice for that device is still the cpu reference backend."""
    assert_refused_for_a_host_device(monkeypatch, "npu", torch.device("cpu"), "npu")
    assert_refused_for_a_host_device(monkeypatch, "npu", "cpu", "npu")


def test_the_probe_describes_both_modes():
    spec = probe()
    assert (spec.name, spec.kinds, spec.modes, spec.priority) == ("npu", ("npu",), ("aclgraph", "torchair"), 100)
    assert spec.load() is NpuGraphBackend and spec.modes == NpuGraphBackend.modes  # the class loads only when chosen


def test_without_torch_npu_the_runtime_and_both_modes_say_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu now fails, also on an Ascend machine
    with pytest.raises(RuntimeError, match="torch.npu is unavailable: torch_npu is not installed or fails to import"):
        NpuGraphBackend.runtime()
    for mode in ("aclgraph", "torchair"):
        assert NpuGraphBackend.mode_capability(mode).describe().startswith(
            f"npu graph mode {mode!r} needs the torch_npu package (")


def test_refused_when_torch_npu_cannot_count_devices_naming_the_error(monkeypatch, npu):
    def device_count():
        raise RuntimeError("drvRet 87: the NPU driver is not loaded")

    monkeypatch.setattr(npu, "device_count", device_count)
    assert gate(detect()).reasons == (
        "torch_npu imports but no Ascend NPU is usable (torch_npu imports but cannot count devices (drvRet 87: the NPU "
        "driver is not loaded)); check npu-smi info and ASCEND_RT_VISIBLE_DEVICES",)


def test_capability_refuses_a_device_that_is_not_a_visible_npu(npu):
    assert NpuGraphBackend.capability("npu:0").ok
    assert NpuGraphBackend.capability("npu:1").reasons == ("npu:1 does not exist: 1 device(s) are visible",)
    assert NpuGraphBackend.capability("cpu").reasons == ("the npu graph backend captures on npu devices, got cpu",)


CAPTURE_VARIABLE = "HWGRAPH_TEST_CAPTURE_VARIABLE"


class EnvironmentBackend(NpuGraphBackend):
    """The shared ``torch.cuda`` capture path (as the CUDA plugin takes it) with a capture environment."""

    capture_environment = {CAPTURE_VARIABLE: "0"}


def environment_seen(npu, fail_in_capture: bool = False):
    """A function to capture that records, per call, whether it is captured and the variable's value."""
    seen = []

    def fn():
        seen.append((npu.capturing, os.environ.get(CAPTURE_VARIABLE)))
        if fail_in_capture and npu.capturing:
            raise RuntimeError("boom")
        return torch.ones(2)

    return fn, seen


def test_the_capture_environment_is_set_for_the_capture_alone(monkeypatch, npu):
    monkeypatch.delenv(CAPTURE_VARIABLE, raising=False)
    fn, seen = environment_seen(npu)
    EnvironmentBackend(device="npu:0").capture(fn)
    assert seen == [(False, None), (False, None), (True, "0")]  # two warm-ups without it, the capture with it
    assert CAPTURE_VARIABLE not in os.environ


def test_the_capture_environment_is_removed_after_a_failed_capture(monkeypatch, npu):
    monkeypatch.delenv(CAPTURE_VARIABLE, raising=False)
    fn, seen = environment_seen(npu, fail_in_capture=True)
    with pytest.raises(CaptureError, match="boom"):
        EnvironmentBackend(device="npu:0").capture(fn)
    assert seen[-1] == (True, "0")
    assert CAPTURE_VARIABLE not in os.environ


def test_a_variable_the_process_sets_itself_stands_during_capture(monkeypatch, npu):
    monkeypatch.setenv(CAPTURE_VARIABLE, "4096")
    fn, seen = environment_seen(npu)
    EnvironmentBackend(device="npu:0").capture(fn)
    assert seen == [(False, "4096"), (False, "4096"), (True, "4096")]
    assert os.environ[CAPTURE_VARIABLE] == "4096"


def test_aclgraph_capture_warms_up_on_the_capture_stream_then_captures_into_the_pool(npu):
    backend = NpuGraphBackend(device="npu:0")
    x = torch.arange(4.0)

    def fn():
        npu.events.append(f"fn on {npu.current.name}" + (" (captured)" if npu.capturing else ""))
        return x * 2

    pool = backend.new_pool()
    graph = backend.capture(fn, pool)
    assert npu.events == [
        "side1 waits for default",
        "fn on side1", "fn on side1",  # warm-up on the stream the capture will use
        "default waits for side1",
        "capture begins on side1 into ('pool', 7)",
        "fn on side1 (captured)",
        "capture ends",
    ]
    assert npu.current is npu.default
    torch.testing.assert_close(graph.outputs, x * 2)
    graph.replay()
    assert npu.events[-1] == "replay"
    graph.release()
    assert npu.events[-1] == "reset" and graph.outputs is None
    assert backend.memory_in_use() == 4096


def test_every_backend_on_a_device_shares_one_capture_stream_until_a_capture_fails(npu):
    x = torch.ones(2)
    NpuGraphBackend().capture(lambda: x + 1)
    NpuGraphBackend().capture(lambda: x + 2)  # another manager's backend: no second stream, no second workspace
    assert len(npu.streams) == 1
    npu.invalidated = True
    with pytest.raises(CaptureError):
        NpuGraphBackend().capture(lambda: x + 3)
    npu.invalidated = False
    NpuGraphBackend().capture(lambda: x + 4)  # the failed capture's stream is not used again
    assert len(npu.streams) == 2
    assert npu.events[-2:] == ["capture begins on side2 into ('pool', 7)", "capture ends"]


def test_a_failed_capture_raises_the_original_message_and_leaves_no_capture_state(npu):
    backend = NpuGraphBackend()
    x = torch.ones(2)

    def reads_back():
        if npu.capturing:
            npu.invalidated = True
            raise RuntimeError("operation not permitted when stream is capturing")
        return x + 1

    with pytest.raises(CaptureError, match="operation not permitted when stream is capturing") as failure:
        backend.capture(reads_back)
    assert "the capture was invalidated" in str(failure.value)
    assert npu.current is npu.default, "the current stream is restored"
    assert not npu.capturing
    assert npu.events[-2:] == ["reset", "synchronize"]
    npu.invalidated = False
    backend.capture(lambda: x + 1)  # the next capture works, on a fresh stream
    assert len(npu.streams) == 2


@pytest.mark.parametrize("already_ended", [False, True], ids=["left routing", "already ended"])
def test_a_failed_capture_ends_torch_npus_allocation_to_the_pool(npu, monkeypatch, already_ended):
    """torch_npu binds the allocator's end of routing into a graph pool as
    ``torch_npu._C._npu_endAllocateCurrentStreamToPool``; older torch_npu reach it in ``capture_end`` only after the
    capture ended cleanly. The cleanup of a failed capture looked for ``torch._C._npu_endAllocateToPool``, which no
    torch has, so the allocator kept routing into the pool of the graph just released. Where torch_npu ended it
    already, its refusal to end it twice is not the capture's error."""
    ended = []

    def end_allocate_to_pool(device, pool):
        ended.append((device, pool))
        if already_ended:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(sys.modules["torch_npu"], "_C",
                        types.SimpleNamespace(_npu_endAllocateCurrentStreamToPool=end_allocate_to_pool), raising=False)
    npu.invalidated = True
    with pytest.raises(CaptureError, match="the capture was invalidated"):
        NpuGraphBackend(device="npu:0").capture(lambda: torch.ones(2) + 1)
    assert ended == [(0, ("pool", 7))]


class GraphKeepingItsPool(FakeGraph):
    """As torch_npu's NPUGraph, ported from torch's before pytorch#190348: capturing into a pool takes a use of it, and
    ``reset`` gives that use back only after a capture that ended."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        super().capture_begin(pool)
        self.pool = {mem_pool.id: mem_pool for mem_pool in self.runtime.mem_pools}.get(pool)
        self.ended = False
        if self.pool is not None:
            self.pool.uses += 1

    def capture_end(self):
        super().capture_end()
        self.ended = True

    def reset(self):
        super().reset()
        if getattr(self, "ended", False) and self.pool is not None:
            self.pool.uses -= 1
            self.ended = False


class NpuWithMemPools(FakeNpu):
    """A ``torch.npu`` whose ``MemPool`` counts its uses (torch_npu binds ``_MemPool.use_count``): one for the object,
    one per graph captured into it."""

    def __init__(self, counts_uses: bool = True):
        super().__init__()
        runtime, self.mem_pools = self, []

        class MemPool:
            def __init__(self):
                self.uses, self.id = 1, ("mempool", len(runtime.mem_pools) + 1)
                runtime.mem_pools.append(self)

        if counts_uses:
            MemPool.use_count = lambda pool: pool.uses
        self.MemPool = MemPool

    def NPUGraph(self):  # noqa: N802 (torch.npu's spelling)
        return GraphKeepingItsPool(self)


def torch_npu_binds(monkeypatch, **functions) -> list:
    """``functions`` as the fake torch_npu's ``torch_npu._C``, where torch_npu binds its allocator's calls; each call
    is recorded, by name, in the list returned."""
    calls = []

    def recorded(name, function):
        def call(*args):
            calls.append((name, *args))
            return function(*args)
        return call

    monkeypatch.setattr(sys.modules["torch_npu"], "_C",
                        types.SimpleNamespace(**{name: recorded(name, f) for name, f in functions.items()}),
                        raising=False)
    return calls


def invalidating(npu, value):
    """A function whose capture is invalidated (a host read while capturing), so ending the capture fails."""
    def fn():
        if npu.capturing:
            npu.invalidated = True
            raise RuntimeError("operation not permitted when stream is capturing")
        return value + 1
    return fn


@pytest.fixture
def npu_with_mem_pools(monkeypatch, simulated_npu_process):
    return simulate_npu(monkeypatch, NpuWithMemPools())


def test_a_failed_aclgraph_capture_gives_back_the_uses_of_the_mempool_its_graph_kept(npu_with_mem_pools, monkeypatch):
    """torch_npu binds the allocator's releasePool as ``torch_npu._C._npu_releasePool(device, pool_id)``; the shared
    code looked for ``torch._C._npu_releasePool``, which no torch has, so the NPU captured into a graph pool handle and
    the use of the pool that a failed capture's graph kept after its reset was never given back: the shared pool, with
    every budget's graph memory in it, stayed reserved for the process once the manager had released its graphs."""
    npu = npu_with_mem_pools

    def release_pool(device, pool_id):
        {pool.id: pool for pool in npu.mem_pools}[pool_id].uses -= 1

    calls = torch_npu_binds(monkeypatch, _npu_releasePool=release_pool,
                            _npu_endAllocateCurrentStreamToPool=lambda device, pool_id: None)
    assert not hasattr(torch._C, "_npu_releasePool")
    backend, x = NpuGraphBackend(device="npu:0"), torch.ones(2)
    pool = backend.new_pool()
    assert isinstance(pool, npu.MemPool)
    kept = backend.capture(lambda: x + 1, pool)
    assert pool.use_count() == 2 and "capture begins on side1 into ('mempool', 1)" in npu.events
    with pytest.raises(CaptureError, match="operation not permitted when stream is capturing"):
        backend.capture(invalidating(npu, x), pool)
    assert calls == [("_npu_endAllocateCurrentStreamToPool", 0, ("mempool", 1)),
                     ("_npu_releasePool", 0, ("mempool", 1))]
    assert pool.use_count() == 2  # the graph that captured, and the pool object: none left by the failed capture
    kept.release()
    assert pool.use_count() == 1


@pytest.mark.parametrize("release_bound, counts_uses", [(False, True), (True, False)],
                         ids=["no releasePool", "MemPool without use_count"])
def test_the_npu_captures_into_a_pool_handle_where_torch_npu_cannot_release_a_pools_uses(monkeypatch,
                                                                                        simulated_npu_process,
                                                                                        release_bound, counts_uses):
    """Older torch_npu lack ``_npu_releasePool``, or have a ``MemPool`` that cannot count its uses: what a failed
    capture kept cannot be found or given back, so a graph pool handle serves as before."""
    npu = simulate_npu(monkeypatch, NpuWithMemPools(counts_uses=counts_uses))
    torch_npu_binds(monkeypatch, **({"_npu_releasePool": lambda device, pool_id: None} if release_bound else {}))
    backend = NpuGraphBackend(device="npu:0")
    assert backend._release_pool_use() is None
    assert backend.new_pool() == ("pool", 7) and npu.mem_pools == []


def test_a_failed_capture_into_a_callers_mempool_ends_the_routing_into_that_pools_id(npu_with_mem_pools, monkeypatch):
    """torch_npu's ``_npu_endAllocateCurrentStreamToPool`` takes the pool's id, as the graph was given it; the NPU
    cleanup passed the pool itself, whose MemPool the call refuses (its refusal was taken for "already ended"), so
    the allocator kept routing into the failed capture's pool."""
    npu = npu_with_mem_pools
    calls = torch_npu_binds(monkeypatch, _npu_releasePool=lambda device, pool_id: None,
                            _npu_endAllocateCurrentStreamToPool=lambda device, pool_id: None)
    pool = npu.MemPool()
    with pytest.raises(CaptureError, match="the capture was invalidated"):
        NpuGraphBackend(device="npu:0").capture(invalidating(npu, torch.ones(2)), pool)
    assert calls[0] == ("_npu_endAllocateCurrentStreamToPool", 0, ("mempool", 1))


def test_a_use_kept_of_a_callers_mempool_that_torch_npu_cannot_release_leaves_the_captures_error(monkeypatch,
                                                                                               simulated_npu_process,
                                                                                               caplog):
    """A caller's own counting MemPool on a torch_npu without ``_npu_releasePool``: releasing the kept use called
    None, and its TypeError replaced the capture's error. The capture's error stands, and the pool left reserved is
    logged."""
    npu = simulate_npu(monkeypatch, NpuWithMemPools())
    torch_npu_binds(monkeypatch)
    pool = npu.MemPool()
    with caplog.at_level(logging.WARNING), \
            pytest.raises(CaptureError, match="operation not permitted when stream is capturing"):
        NpuGraphBackend(device="npu:0").capture(invalidating(npu, torch.ones(2)), pool)
    assert "kept 1 use(s) of its graph pool, which this npu runtime cannot release" in caplog.text
    assert pool.use_count() == 2


@pytest.mark.npu
def test_on_an_ascend_npu_graphs_share_a_mempool_whose_uses_torch_npu_counts_and_releases():
    """On the NPU itself: where torch_npu binds ``_npu_releasePool`` and a counting ``MemPool``, captures go into one,
    each graph holding a use until it is released; elsewhere into a graph pool handle (a tuple of ints)."""
    torch_npu = npu_module()
    counted = (hasattr(getattr(torch_npu, "_C", None), "_npu_releasePool")
               and hasattr(getattr(torch.npu, "MemPool", None), "use_count"))
    backend = NpuGraphBackend(device="npu:0")
    pool = backend.new_pool()
    assert isinstance(pool, torch.npu.MemPool) if counted else isinstance(pool, tuple)
    x = torch.ones(4, device="npu:0")
    graph = backend.capture(lambda: x * 2, pool)
    if counted:
        assert pool.use_count() == 2
    graph.release()
    if counted:
        assert pool.use_count() == 1


def test_a_warm_up_failure_is_a_capture_error(npu):
    backend = NpuGraphBackend()

    def broken():
        raise ValueError("shape mismatch")

    with pytest.raises(CaptureError, match="warm-up before capture failed: ValueError: shape mismatch"):
        backend.capture(broken)
    assert not any("capture begins" in event for event in npu.events)


def test_sync_guard_falls_back_to_rejecting_host_reads(npu):
    backend = NpuGraphBackend()
    with backend.sync_guard(), pytest.raises(HostSyncError):
        torch.ones(2).sum().item()


@pytest.mark.usefixtures("simulated_npu_process")
def test_sync_guard_uses_the_runtime_sync_debug_mode_and_restores_it(monkeypatch):
    npu = simulate_npu(monkeypatch, FakeNpu(with_sync_debug_mode=True))
    npu.debug_mode = 1
    backend = NpuGraphBackend()
    with backend.sync_guard():
        assert npu.debug_mode == 2
    assert npu.debug_mode == 1
    with pytest.raises(KeyError), backend.sync_guard():
        raise KeyError("boom")
    assert npu.debug_mode == 1


def test_torchair_mode_is_refused_with_a_reason_without_torchair(npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchair", None)
    (reason,) = NpuGraphBackend.mode_capability("torchair").reasons
    assert "npu graph mode 'torchair' needs the torchair package" in reason
    assert reason.endswith("; install the torchair release matching torch_npu")
    with pytest.raises(SelectionError, match="npu graph mode 'torchair' is unavailable: .*torchair package"):
        NpuGraphBackend(mode="torchair")
    assert NpuGraphBackend.mode_capability("aclgraph").ok


def test_an_unknown_mode_is_refused(npu):
    assert "has modes aclgraph, torchair" in NpuGraphBackend.mode_capability("eager").describe()
    with pytest.raises(ValueError, match="modes"):
        NpuGraphBackend(mode="eager")


def test_aclgraph_mode_needs_the_graph_api(npu, monkeypatch):
    monkeypatch.delattr(FakeNpu, "NPUGraph")
    monkeypatch.delattr(FakeNpu, "graph_pool_handle")
    reason = ("npu graph mode 'aclgraph' needs torch.npu.NPUGraph, torch.npu.graph_pool_handle, which this torch_npu "
              "lacks; upgrade torch_npu")
    assert NpuGraphBackend.mode_capability("aclgraph").reasons == (reason,)
    with pytest.raises(SelectionError, match=re.escape(f"npu graph mode 'aclgraph' is unavailable: {reason}")):
        NpuGraphBackend()  # the default mode
    # only None means the default: '' was taken for it, and refused for aclgraph's graph API, not as no mode
    with pytest.raises(ValueError, match=r"graph backend 'npu' has modes \['aclgraph', 'torchair'\], got mode=''"):
        NpuGraphBackend(mode="")


def fake_torchair(monkeypatch, events: list[str] | None = None, shared_outputs: bool = False,
                  run_error: Exception | None = None) -> list[str]:
    """A ``torchair`` whose NPU backend records the config's mode and runs the traced graph as is; each compilation
    and each run of a compiled graph is appended to ``events``. With ``shared_outputs`` every compiled graph returns
    its results in one set of output buffers, overwritten by the next run of any of them (reduce-overhead's graphs
    reuse their memory pool's output blocks); with ``run_error`` every run raises it."""
    modes: list[str] = []
    events = [] if events is None else events
    buffers: list[torch.Tensor] = []

    class CompilerConfig:
        mode = "max-autotune"

    def get_npu_backend(compiler_config):
        def backend(graph_module, example_inputs):
            modes.append(compiler_config.mode)
            events.append("torchair compiles")

            def run(*args):
                events.append("compiled run")
                if run_error is not None:
                    raise run_error
                results = graph_module.forward(*args)
                if not shared_outputs:
                    return results
                buffers.extend(torch.empty_like(t) for t in results[len(buffers):])
                return tuple(buffer.copy_(t) for buffer, t in zip(buffers, results, strict=False))

            return run

        return backend

    module = types.ModuleType("torchair")
    module.CompilerConfig, module.get_npu_backend = CompilerConfig, get_npu_backend
    monkeypatch.setitem(sys.modules, "torchair", module)
    return modes


def test_torchair_mode_compiles_in_reduce_overhead_mode_and_replays_into_static_outputs(npu, monkeypatch):
    modes = fake_torchair(monkeypatch)
    backend = NpuGraphBackend(mode="torchair")
    x = torch.zeros(3)
    torch._dynamo.reset()
    graph = backend.capture(lambda: (x * 2 + 1,))
    assert modes == ["reduce-overhead"]
    static = graph.outputs[0]
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    graph.replay()
    assert graph.outputs[0] is static
    torch.testing.assert_close(static, torch.tensor([3.0, 5.0, 7.0]))
    graph.release()
    assert graph.outputs is None  # the static outputs are freed with the graph
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def test_torchair_compiles_and_warms_up_on_the_backend_device_within_capture(npu, monkeypatch):
    """reduce-overhead records its graph on a run after the first: the warm-up runs inside ``capture()`` keep the
    compilation and the recording out of the first replay, and all of it runs on the backend's device."""
    fake_torchair(monkeypatch, events=npu.events)

    @contextlib.contextmanager
    def device(device):
        npu.events.append(f"on {device}")
        yield
        npu.events.append(f"off {device}")

    monkeypatch.setattr(npu, "device", device)
    backend = NpuGraphBackend(device="npu:0", mode="torchair")
    x = torch.zeros(3)
    torch._dynamo.reset()
    graph = backend.capture(lambda: (x + 1,))
    runs = ["compiled run"] * (NpuGraphBackend.warmup_runs + 1)  # the warm-ups, then the run whose outputs are kept
    assert npu.events == ["on npu:0", "torchair compiles", *runs, "off npu:0"]
    del npu.events[:]
    graph.replay()
    assert [e for e in npu.events if "compile" in e] == ["compiled run"]  # one run, no compilation


def test_prepare_runs_on_the_capture_stream_and_the_current_one_if_asked_in_aclgraph_not_torchair(npu, monkeypatch):
    """The manager calls ``prepare`` before measuring a budget's memory. aclgraph captures on the shared capture
    stream, which ``prepare`` makes ready with one eager run (and one on the current stream for a compiled forward,
    which first runs there); torchair captures on
    streams of its own, where an eager run on the capture stream would only make workspaces no graph uses."""
    fake_torchair(monkeypatch)
    ran_on = []

    def forward():
        ran_on.append(npu.current)
        return (torch.ones(2),)

    NpuGraphBackend(mode="torchair").prepare(forward, current_stream=True)
    assert ran_on == [] and npu.streams == []
    NpuGraphBackend(mode="aclgraph").prepare(forward)
    assert len(npu.streams) == 1 and ran_on == [npu.streams[0]]
    NpuGraphBackend(mode="aclgraph").prepare(forward, current_stream=True)
    assert ran_on[1:] == [npu.streams[0], npu.default]


def test_torchair_captures_of_one_forward_code_do_not_fill_dynamos_recompile_limit(npu, monkeypatch):
    """A manager's captures share one forward's code (every budget and slot count, and every other manager's), and
    dynamo counts compilations per code object: compiled as is, the captures after its recompile limit failed for
    the rest of the process. Each capture compiles a code object of its own."""
    from hwgraph.compile_mode import compile_limits

    fake_torchair(monkeypatch)
    backend = NpuGraphBackend(mode="torchair")

    def forward_for(x):
        def forward():
            return (x * 2 + 1,)
        return forward

    torch._dynamo.reset()
    with compile_limits(1):  # a recompile limit of 8, and a failure when it is hit
        graphs = [backend.capture(forward_for(torch.full((n,), float(n)))) for n in range(1, 13)]
    assert [g.outputs[0].tolist() for g in graphs] == [[2.0 * n + 1] * n for n in range(1, 13)]


def test_torchair_graphs_keep_their_outputs_when_torchair_reuses_its_output_memory(npu, monkeypatch):
    fake_torchair(monkeypatch, shared_outputs=True)
    backend = NpuGraphBackend(mode="torchair")
    x = torch.zeros(3)
    torch._dynamo.reset()
    plus_one = backend.capture(lambda: (x + 1,))
    times_ten = backend.capture(lambda: (x * 10 + 2,))
    torch.testing.assert_close(plus_one.outputs[0], torch.ones(3))  # the second capture's runs left it alone
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    plus_one.replay()
    torch.testing.assert_close(plus_one.outputs[0], torch.tensor([2.0, 3.0, 4.0]))
    torch.testing.assert_close(times_ten.outputs[0], torch.full((3,), 2.0))  # not replayed: its capture's values


def test_clone_outputs_copies_every_tensor_and_keeps_the_nesting():
    a, b = torch.ones(2), torch.arange(3.0)
    copied = clone_outputs([a, (b,)])
    assert type(copied) is list and type(copied[1]) is tuple
    assert copied[0].data_ptr() != a.data_ptr() and copied[1][0].data_ptr() != b.data_ptr()
    assert torch.equal(copied[0], a) and torch.equal(copied[1][0], b)
    assert clone_outputs(a).data_ptr() != a.data_ptr()
    with pytest.raises(CaptureError, match="must return tensors or tuples of tensors, got int"):
        clone_outputs((a, 3))


def test_torchair_mode_refuses_a_callable_that_reads_back_to_the_host(npu, monkeypatch):
    """Compiled as one graph (fullgraph): a graph break would run part of the callable outside the graph, on every
    replay, here with a device-to-host read."""
    fake_torchair(monkeypatch)
    x = torch.ones(3)
    torch._dynamo.reset()
    with pytest.raises(CaptureError, match=r"torchair compilation failed: Unsupported: .*tolist"):
        NpuGraphBackend(mode="torchair").capture(lambda: (x * x.tolist()[0],))


def test_torchair_mode_turns_a_failure_of_any_type_into_a_capture_error(npu, monkeypatch):
    fake_torchair(monkeypatch, run_error=ValueError("GE graph execution failed"))
    x = torch.ones(3)
    torch._dynamo.reset()
    with pytest.raises(CaptureError, match="torchair compilation failed: ValueError: GE graph execution failed"):
        NpuGraphBackend(mode="torchair").capture(lambda: (x + 1,))


def test_a_torchair_replay_that_returns_another_number_of_outputs_is_refused(npu, monkeypatch):
    fake_torchair(monkeypatch)
    x = torch.zeros(3)
    inputs = [x]
    torch._dynamo.reset()
    graph = NpuGraphBackend(mode="torchair").capture(lambda: tuple(t + 1 for t in inputs))
    inputs.append(x * 2)  # a guard fails: the callable is compiled again and now returns two outputs
    with pytest.raises(CaptureError, match="the compiled callable returned a different number of outputs on replay"):
        graph.replay()


def test_compiled_mode_is_declined_with_the_mode_that_compiles_on_npu(npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchair", None)
    reason = NpuGraphBackend(mode="aclgraph").compile_support().describe()
    assert "inductor generates no NPU code" in reason and "needs the torchair package" in reason
    fake_torchair(monkeypatch)
    reason = NpuGraphBackend(mode="aclgraph").compile_support().describe()
    assert "use npu graph mode 'torchair' to compile with it" in reason
    assert "already compiles every capture" in NpuGraphBackend(mode="torchair").compile_support().describe()


# ---------------------------------------------------------------- gates and the NPU attention adapter's host lists


ASCEND = PlatformInfo("npu", "Ascend910B3", "Ascend910B3", torch.__version__, "CANN", "8.3.RC1", 1)


def test_refused_on_an_amd_or_nvidia_gpu_pointing_at_that_backend():
    for kind, runtime in (("rocm", "HIP"), ("cuda", "CUDA")):
        gpu = PlatformInfo(kind, f"simulated {kind}", None, torch.__version__, runtime, "1.0", 1)
        assert gate(gpu).reasons == (
            f"this machine's accelerator is {kind}, not an Ascend NPU: use the {kind} backend",)


def test_refused_on_an_npu_with_a_torch_older_than_the_backend_supports():
    assert gate(dataclasses.replace(ASCEND, torch_version="2.4.0")).reasons == (
        "the npu graph backend needs torch >= 2.10, found 2.4.0; upgrade torch",)
    assert gate(ASCEND).ok


def test_npu_attention_is_refused_when_torch_npu_lacks_the_fused_kernel(monkeypatch):
    from hwgraph_npu.attention import npu_gate

    old = types.ModuleType("torch_npu")
    old.__version__ = "2.1.0"
    monkeypatch.setitem(sys.modules, "torch_npu", old)
    assert npu_gate(ASCEND).reasons == (
        "NPU attention needs torch_npu.npu_fused_infer_attention_score, which torch_npu 2.1.0 lacks",)
    old.npu_fused_infer_attention_score = lambda *args, **kwargs: None
    assert npu_gate(ASCEND).ok


def test_npu_attention_is_refused_off_an_npu_even_where_torch_npu_imports(monkeypatch):
    from hwgraph_npu.attention import npu_gate

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "torch_npu", fake)  # installed on a GPU machine, say
    for kind in ("cuda", "rocm", "cpu"):
        elsewhere = dataclasses.replace(ASCEND, kind=kind)
        assert npu_gate(elsewhere).reasons == (f"NPU attention runs on Ascend NPUs, this platform is {kind}",)


@pytest.mark.parametrize("arguments,keyword", [
    ("float scale=1.0", "scale"), ("float scale_value=1.0", "scale_value"), ("float softmax_scale=1.0", "scale"),
    (None, "scale"),
], ids=["renamed", "older torch_npu", "names neither", "schema unreadable"])
def test_npu_scale_goes_under_the_keyword_the_installed_kernel_names(monkeypatch, arguments, keyword):
    from hwgraph_npu.attention import scale_keyword

    ops = types.SimpleNamespace()
    if arguments is not None:
        schema = torch._C.parse_schema(f"npu::npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, "
                                       f"*, int num_heads=1, {arguments}) -> (Tensor, Tensor)")
        ops.npu_fused_infer_attention_score = types.SimpleNamespace(default=types.SimpleNamespace(_schema=schema))
    monkeypatch.setattr(torch.ops, "npu", ops, raising=False)
    assert scale_keyword.__wrapped__() == keyword  # uncached: the schema changes


def test_npu_attention_takes_half_precision_only(monkeypatch):
    from hwgraph_npu.attention import NPU

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    for dtype in (torch.float16, torch.bfloat16):
        assert NPU.capability(ASCEND, dtype=dtype, head_dim=72).ok
    assert NPU.capability(ASCEND, dtype=torch.float32, head_dim=72).reasons == (
        "NPU supports dtypes float16, bfloat16, got float32",)


@pytest.fixture
def fused_attention_calls(monkeypatch):
    """A ``torch_npu`` whose fused kernel records the sequence ends it is given and returns garbage rows."""
    from hwgraph_npu import attention

    calls = []

    def npu_fused_infer_attention_score(q, k, v, *, actual_seq_lengths, actual_seq_lengths_kv, **kwargs):
        calls.append(list(actual_seq_lengths))
        return torch.full_like(q, float("nan")), torch.empty(0)

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(attention, "scale_keyword", lambda: "scale")
    return calls


def test_npu_sequence_ends_close_an_all_padding_batch_at_the_token_count(fused_attention_calls):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen, sequence_ends

    assert sequence_ends([0, 0, 0], 5) == [5]  # the kernel needs the last end equal to the token count
    assert sequence_ends([0, 4, 4, 9], 12) == [4, 9, 12]
    q = torch.randn(5, 2, 64, dtype=torch.float16)
    with host_cu_seqlens([0, 0, 0]):
        out = npu_varlen(q, q, q, torch.zeros(3, dtype=torch.int32), 0, 0.125)
    assert fused_attention_calls == [[5]]
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("values", [[0, 9, 20], [0, 9, 4], [1, 9, 13]],
                         ids=["past the token count", "decreasing", "not starting at 0"])
def test_npu_refuses_host_boundaries_that_do_not_describe_the_tokens(fused_attention_calls, values):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen

    q = torch.randn(13, 2, 64, dtype=torch.float16)
    cu_seqlens = torch.tensor([0, 9, 13], dtype=torch.int32)
    with host_cu_seqlens(values), pytest.raises(ValueError, match=r"must start at 0, not decrease and end at most "
                                                                  r"at 13 tokens, got " + re.escape(str(values))):
        npu_varlen(q, q, q, cu_seqlens, 9, 0.125)
    assert fused_attention_calls == []


def test_npu_refuses_bad_inputs_naming_the_kernel_before_calling_it(fused_attention_calls):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen

    q = torch.randn(13, 2, 64, dtype=torch.float16)
    with host_cu_seqlens([0, 9, 13]):
        with pytest.raises(ValueError, match=r"^NPU: cu_seqlens must be int32, got torch.int64"):
            npu_varlen(q, q, q, torch.tensor([0, 9, 13]), 9, 0.125)
        with pytest.raises(ValueError, match=r"^NPU: q, k, v must have one shape, .* k \(13, 2, 72\)"):
            npu_varlen(q, torch.randn(13, 2, 72, dtype=torch.float16), q, torch.tensor([0, 9, 13], dtype=torch.int32),
                       9, 0.125)
    assert fused_attention_calls == []


def test_npu_host_read_of_cu_seqlens_is_logged_once_with_the_remedy(fused_attention_calls, caplog):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen, warn_host_read

    q = torch.randn(13, 2, 64, dtype=torch.float16)
    cu_seqlens = torch.tensor([0, 9, 13], dtype=torch.int32)
    warn_host_read.cache_clear()  # it warns once per process: start as a process that has not warned yet
    try:
        with caplog.at_level(logging.WARNING, logger="hwgraph_npu.attention"):
            with host_cu_seqlens([0, 9, 13]):
                npu_varlen(q, q, q, cu_seqlens, 9, 0.125)
            assert caplog.records == []  # the host values were given: no read, nothing to say
            npu_varlen(q, q, q, cu_seqlens, 9, 0.125)
            npu_varlen(q, q, q, cu_seqlens, 9, 0.125)
    finally:
        warn_host_read.cache_clear()
    (record,) = caplog.records
    assert "read cu_seqlens back to the host (a device sync)" in record.getMessage()
    assert "hwgraph.attention.base.host_cu_seqlens(...)" in record.getMessage()
    assert fused_attention_calls == [[9, 13]] * 3


def test_the_tower_hands_npu_attention_its_host_boundaries_instead_of_a_read_per_block(fused_attention_calls,
                                                                                         caplog):
    """The tower's host metadata holds ``cu_seqlens``: NPU attention takes it from there in every block, so an eager
    forward reads nothing back (27 device syncs a forward on the real tower otherwise)."""
    from hwgraph_npu.attention import warn_host_read

    tower = Qwen3OmniVisionTower.from_preset("tiny").to(torch.float16)
    assert tower.set_attention("NPU", platform=ASCEND).spec.reads_host_boundaries
    grid = [(1, 4, 4), (2, 2, 4)]
    metadata = tower.prepare_metadata(grid)
    pixels = torch.randn(metadata.num_rows, tower.patch_row_width, dtype=torch.float16)
    warn_host_read.cache_clear()
    try:
        # inference: with autograd recording through the weights, the differentiable stand-in runs instead
        with caplog.at_level(logging.WARNING, logger="hwgraph_npu.attention"), torch.inference_mode():
            tower.forward_with_metadata(pixels, metadata)
    finally:
        warn_host_read.cache_clear()
    assert caplog.records == []
    assert fused_attention_calls == [[16, 24, 32]] * len(tower.blocks)  # one image, then a video's two frames


def test_graphs_keep_the_hf32_setting_of_their_capture_in_float32_only(npu):
    """torch_npu's HF32 products, as CUDA's TF32: a float32 graph keeps the setting of its capture, so the manager
    compares it before each replay. CUDA's settings do not apply here; bf16 and fp16 keep none of them."""
    npu.matmul = types.SimpleNamespace(allow_hf32=False)
    backend = NpuGraphBackend()
    before = backend.numerics_settings(torch.float32)
    assert before == (("torch.npu.matmul.allow_hf32", False),)
    npu.matmul.allow_hf32 = True
    assert backend.numerics_settings(torch.float32) == (("torch.npu.matmul.allow_hf32", True),) != before
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        assert backend.numerics_settings(torch.bfloat16) == backend.numerics_settings(torch.float16) == ()
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True


def test_an_automatic_choice_falls_back_to_cpu_when_the_default_mode_lacks_its_graph_api(npu, monkeypatch, caplog):
    # the npu gate passed (platform, torch version), so choose_backend took npu, and create_backend then raised the
    # mode's SelectionError instead of falling back as an automatic choice does
    from hwgraph.graphs.cpu import CpuGraphBackend
    from hwgraph.registry import choose_backend, create_backend

    monkeypatch.delattr(FakeNpu, "NPUGraph")
    assert choose_backend().spec.name == "npu"
    with caplog.at_level("WARNING", logger="hwgraph.registry"):
        backend = create_backend()
    assert type(backend) is CpuGraphBackend
    assert any("falling back to the cpu reference backend" in m and "needs torch.npu.NPUGraph" in m
               for m in caplog.messages), caplog.messages
    with pytest.raises(SelectionError, match="npu graph mode 'aclgraph' is unavailable"):
        create_backend("npu")  # named: its refusal, not a fallback


@pytest.mark.skipif(npu_module() is not None, reason="torch_npu imports here: it names privateuse1 'npu' itself")
def test_the_npu_simulations_above_leave_npu_no_torch_device_type_for_the_tests_after_them():
    """The simulation renames privateuse1 to "npu", which torch cannot undo: it did so in this process, and every
    later test of the session (any module's) took "npu" for a device type, as no machine without torch_npu does. Last
    in this module, so that the simulations above have run (here, their reports; they ran in a child process)."""
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"
    with pytest.raises(RuntimeError):
        torch.device("npu:0")
