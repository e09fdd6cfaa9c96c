"""The npu plugin: gate and mode refusals with reasons, and capture through a simulated torch.npu runtime."""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch
from hwgraph_npu.graphs import NpuGraphBackend
from hwgraph_npu.platform import gate, probe

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.platform import PlatformInfo, detect, npu_module
from hwgraph.registry import SelectionError, choose_backend, create_backend
from hwgraph.testing.simulate import FakeGraphRuntime, simulate_gpu


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
    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does; idempotent
    return runtime


@pytest.fixture
def npu(monkeypatch):
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


def test_refused_when_torch_npu_sees_no_device(monkeypatch, npu):
    monkeypatch.setattr(npu, "device_count", lambda: 0)
    (reason,) = gate(detect()).reasons
    assert "torch_npu imports but no Ascend NPU is usable" in reason and "ASCEND_RT_VISIBLE_DEVICES" in reason


def test_chosen_automatically_on_a_simulated_npu(npu):
    selected = choose_backend()
    assert (selected.spec.name, selected.reason) == ("npu", "best available for npu")
    backend = NpuGraphBackend()
    assert (backend.device, backend.mode) == (torch.device("npu", 0), "aclgraph")


def test_the_probe_describes_both_modes():
    spec = probe()
    assert (spec.name, spec.kinds, spec.modes, spec.priority) == ("npu", ("npu",), ("aclgraph", "torchair"), 100)


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
    with pytest.raises(SelectionError, match="npu graph mode 'torchair' is unavailable: .*torchair package"):
        NpuGraphBackend(mode="torchair")
    assert NpuGraphBackend.mode_capability("aclgraph").ok


def test_an_unknown_mode_is_refused(npu):
    assert "has modes aclgraph, torchair" in NpuGraphBackend.mode_capability("eager").describe()
    with pytest.raises(ValueError, match="modes"):
        NpuGraphBackend(mode="eager")


def test_aclgraph_mode_needs_the_graph_api(npu, monkeypatch):
    monkeypatch.delattr(FakeNpu, "NPUGraph")
    assert "needs torch.npu.NPUGraph" in NpuGraphBackend.mode_capability("aclgraph").describe()


def fake_torchair(monkeypatch) -> list[str]:
    """A ``torchair`` whose NPU backend records the config's mode and runs the traced graph as is."""
    modes: list[str] = []

    class CompilerConfig:
        mode = "max-autotune"

    def get_npu_backend(compiler_config):
        def backend(graph_module, example_inputs):
            modes.append(compiler_config.mode)
            return graph_module.forward

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
    with pytest.raises(RuntimeError, match="released"):
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
                                                                  r"at 13 tokens"):
        npu_varlen(q, q, q, cu_seqlens, 9, 0.125)
    assert fused_attention_calls == []
