"""Tests from a mutation audit of the attention kernels' host side and the test infrastructure vendors use.

Each test pins a behaviour that a plausible one-line change broke without any other test failing: the common input
checks (heads, v's shape, k/v devices, infinite or tensor scales, negative or bool max_seqlen, 2-D cu_seqlens);
TRITON_INTERPRET's spelling; TRITON_ATTN's launch (inputs handed to the kernel with unit stride on D, an m program
even at max_seqlen 0, the Gluon kernel for one sequence slot from 1024 rows and for 128-lane heads from 2048); the
TMA, fp32 and fixed-shift thresholds; rows the ping-pong launcher allocates padded to 16 bytes; FLASH_ATTN's
provider choice, max_seqlen clamp and scale folding; the conformance cases (non-graph-safe kernels skipped, gates
asked with the head dim); the plugin's markers and their skips; the suite's tolerances and relative-L2 bound; the
validate collector's outcomes; and the float64 reference's own checks. No Triton kernel is launched (launches are
recorded), so nothing here needs the interpreter.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types

import pytest
import torch

from hwgraph.attention.sdpa import TORCH_SDPA, sdpa_varlen
from hwgraph.attention.triton_attn import interpreter_enabled, triton_varlen
from hwgraph.testing import plugin
from hwgraph.testing.cases import SuiteSettings, conformance_params
from hwgraph.testing.reference import (
    ATTENTION_TOLERANCES,
    assert_matches_reference,
    random_packed_batch,
    varlen_reference,
)
from hwgraph.testing.results import ResultCollector, failing_checks, run_conformance
from hwgraph.testing.simulate import DeviceProperties, simulate_gpu
from hwgraph.testing.suite import ConformanceSuite

# ---------------------------------------------------------------- the common input checks


def valid_args():
    return random_packed_batch([3, 4], heads=2, head_dim=8, padding_rows=1).args()


@pytest.mark.parametrize("kernel", [sdpa_varlen, triton_varlen], ids=["sdpa", "triton"])
@pytest.mark.parametrize("index,value,message", [
    (1, torch.zeros(8, 3, 8), r"one shape, got q \(8, 2, 8\), k \(8, 3, 8\)"),  # another head count
    (2, torch.zeros(8, 2, 4), r"one shape, got .* v \(8, 2, 4\)"),
    (1, torch.zeros(8, 2, 8, device="meta"), r"one device, got q cpu, k meta"),
    (2, torch.zeros(8, 2, 8, device="meta"), r"one device, got q cpu, k cpu, v meta"),
    (3, torch.tensor([[0, 3, 7]], dtype=torch.int32), r"cu_seqlens must be 1-D .*\(1, 3\)"),
    (4, -1, r"max_seqlen must be a non-negative host int.*-1"),
    (4, True, r"max_seqlen must be a non-negative host int.*True \(bool\)"),
    (5, float("inf"), r"scale must be a finite host float, got inf"),
    (5, -float("inf"), r"scale must be a finite host float, got -inf"),
    (5, torch.tensor(0.35), r"scale must be a finite host float.*\(Tensor\)"),  # float() of it reads the device
    (5, True, r"scale must be a finite host float, got True"),
    (3, torch.tensor([0, 99, 3, 99, 7, 99], dtype=torch.int32)[::2], r"cu_seqlens must be contiguous, got stride "
                                                                     r"\(2,\)"),  # read by pointer: 99 a boundary
], ids=["heads", "v-shape", "k-device", "v-device", "2d-cu", "negative-max", "bool-max", "inf", "-inf",
        "tensor-scale", "bool-scale", "strided-cu"])
def test_kernels_reject_inputs_the_common_signature_excludes(kernel, index, value, message):
    args = list(valid_args())
    args[index] = value
    with pytest.raises(ValueError, match=message):
        kernel(*args)


# ---------------------------------------------------------------- TRITON_ATTN's gate and launch


@pytest.mark.parametrize("value", ["1", "TRUE", "Yes", "on", "y", " yes ", "true ", "0", "", "off", "false", "no"])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value):
    """The gate must agree with Triton, or TRITON_ATTN is refused on CPU while Triton interprets (``y``), or chosen
    while it does not (`` yes ``), and its first call fails."""
    knobs = pytest.importorskip("triton.knobs", reason="a Triton with knobs reads TRITON_INTERPRET itself")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_enabled() is bool(knobs.runtime.interpret)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter_enabled() is False


class RecordingKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call, launches nothing.
    (The launcher then takes itself to be interpreted, so it accepts CPU tensors.)"""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def triton_kernel(monkeypatch):
    """``hwgraph.attention.triton_kernel`` with both Triton kernels recording instead of launching."""
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    monkeypatch.setattr(module, "varlen_attention_kernel", RecordingKernel())
    monkeypatch.setattr(module, "varlen_attention_tma_kernel", RecordingKernel())
    return module


def test_an_all_empty_call_with_max_seqlen_zero_still_runs_the_padding_slot(triton_kernel):
    """The padding slot zeroes the rows past cu_seqlens[-1]: a grid with no m program would leave them unwritten."""
    batch = random_packed_batch([], heads=2, head_dim=72, zero_length=2, padding_rows=5)
    assert batch.max_seqlen == 0
    triton_varlen(*batch.args())
    ((grid, _, _),) = triton_kernel.varlen_attention_kernel.calls
    assert grid == (1, 2, 3)  # one m program, 2 heads, 2 empty slots + the padding slot


def test_inputs_without_unit_stride_on_d_reach_the_kernel_as_unit_stride_copies(triton_kernel):
    """The pointer kernel addresses lanes as ``base + lane``: a view with another stride on D (a transpose, every
    other lane) must be copied first, or it reads the wrong lanes."""
    batch = random_packed_batch([5, 3], heads=2, head_dim=16, padding_rows=2)
    lanes_apart = [torch.stack([t, torch.full_like(t, 9.0)], dim=-1)[..., 0] for t in (batch.q, batch.k, batch.v)]
    transposed = batch.q.transpose(1, 2).contiguous().transpose(1, 2)
    for q, k, v in ((*lanes_apart,), (transposed, batch.k, batch.v)):
        assert q.stride(-1) != 1
        triton_varlen(q, k, v, batch.cu_seqlens, batch.max_seqlen, batch.scale)
        (_, args, _), = triton_kernel.varlen_attention_kernel.calls[-1:]
        for given, original in zip(args[:3], (batch.q, batch.k, batch.v), strict=True):
            assert given.stride(-1) == 1 and torch.equal(given, original)


def test_one_sequence_slot_from_1024_rows_takes_the_gluon_kernel(triton_kernel, monkeypatch):
    """``gluon_tiles``' ping-pong kernel from 1024 rows holds for a call of one slot only; the launcher must pass the
    slot count, or one image's call inside TMA_OVER_GLUON takes the slower TMA kernel (0.021 against 0.016 ms)."""
    gluon_kernel = pytest.importorskip("hwgraph.attention.gluon_kernel")
    gluon_calls = []
    monkeypatch.setattr(triton_kernel, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(triton_kernel, "gluon_ready", lambda index: True)
    monkeypatch.setattr(gluon_kernel, "launch_gluon_attention", lambda *args, **kwargs: gluon_calls.append(args))
    batch = random_packed_batch([1000], heads=2, head_dim=72, dtype=torch.bfloat16, max_seqlen=1024)
    triton_kernel.launch_varlen_attention(*batch.args())
    assert len(gluon_calls) == 1 and triton_kernel.varlen_attention_tma_kernel.calls == []
    two = random_packed_batch([600, 400], heads=2, head_dim=72, dtype=torch.bfloat16, max_seqlen=1024)
    triton_kernel.launch_varlen_attention(*two.args())  # two slots: the TMA kernel measured faster here
    assert len(gluon_calls) == 1 and len(triton_kernel.varlen_attention_tma_kernel.calls) == 1


def test_a_head_too_wide_for_the_pingpong_ring_takes_gluon_from_2048_rows(monkeypatch):
    """TMA_OVER_GLUON ends before 2048 rows: there 128 lanes a head (no ping-pong ring fits) take the plain Gluon
    kernel, not the TMA kernel."""
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    monkeypatch.setattr(module, "uses_tma", lambda q, k, v: True)
    monkeypatch.setattr(module, "gluon_ready", lambda index: True)
    batch = random_packed_batch([5], heads=2, head_dim=128, dtype=torch.bfloat16)
    assert module.uses_gluon(batch.q, batch.k, batch.v, 2048, 2)
    assert not module.uses_gluon(batch.q, batch.k, batch.v, 2047, 2)


def test_the_tma_kernel_serves_a_head_of_128_lanes(monkeypatch):
    """128 lanes is the widest head whose TMA tiles fit shared memory (``uses_tma``); 200 (256 lanes) is not."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    monkeypatch.setattr(module, "has_tma", module.has_tma.__wrapped__)
    monkeypatch.setattr(module, "is_interpreted", lambda: False)
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("simulated H200", 9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    for head_dim, tma in ((128, True), (16, True), (200, False)):
        batch = random_packed_batch([5], heads=2, head_dim=head_dim, dtype=torch.bfloat16)
        on_gpu = types.SimpleNamespace(is_cuda=True, dtype=batch.q.dtype, shape=batch.q.shape,
                                       device=torch.device("cuda", 0))
        assert module.uses_tma(on_gpu, batch.k, batch.v) is tma, head_dim


def test_tile_choices_follow_the_documented_thresholds():
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    gluon_kernel = pytest.importorskip("hwgraph.attention.gluon_kernel")
    # TMA tiles: 128x128 with 8 warps from max_seqlen 1024 (one sequence of 1024: 0.0226 against 0.0261 ms)
    assert module.tma_tiles(1024) == (128, 128, 8, 3) and module.tma_tiles(1023) == (64, 64, 4, 3)
    # fp32 and wide heads shrink their tiles to fit shared memory
    assert module.block_sizes(72, torch.float32) == (64, 32, 64, 16)
    assert module.block_sizes(72, torch.bfloat16) == (64, 64, 64, 16)
    assert module.block_sizes(64, torch.float32) == (64, 64, 64, 0)
    assert module.block_sizes(200, torch.float32) == (32, 16, 256, 0)
    assert module.block_sizes(200, torch.bfloat16) == (32, 32, 256, 0)
    # the ping-pong kernel's fixed shifts: bf16 from FIXED_SHIFT_FROM rows, never fp16
    assert gluon_kernel.uses_fixed_shift(torch.bfloat16, 2048)
    assert not gluon_kernel.uses_fixed_shift(torch.bfloat16, 2047)
    assert not gluon_kernel.uses_fixed_shift(torch.float16, 4096)


@pytest.mark.parametrize(("heads", "head_dim", "dtype", "row"), [
    (1, 20, torch.bfloat16, 24), (3, 20, torch.float16, 64), (16, 72, torch.bfloat16, 1152), (1, 6, torch.float32, 8)])
def test_rows_the_gluon_launcher_allocates_are_tma_addressable(heads, head_dim, dtype, row):
    """``tma_rows_like`` pads each token's ``heads * head_dim`` lanes to 16 bytes where they are not (20 bf16 lanes:
    40 bytes -> 48), so q's copy and the output pass ``tma_rows`` (a TMA descriptor needs 16-byte row strides)."""
    gluon_kernel = pytest.importorskip("hwgraph.attention.gluon_kernel")
    t = torch.zeros(5, heads, head_dim, dtype=dtype)
    like = gluon_kernel.tma_rows_like(t)
    assert like.shape == t.shape and like.dtype == dtype and like.stride() == (row, head_dim, 1)
    assert gluon_kernel.tma_rows(like)


# ---------------------------------------------------------------- FLASH_ATTN's adapter


def test_flash_provider_takes_the_flash_attn_package_when_it_has_the_varlen_function(monkeypatch):
    attention = pytest.importorskip("hwgraph_cuda.attention")

    provider = attention.flash_provider.__wrapped__  # uncached: the fake modules change
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=lambda **kw: None))
    assert provider() == ("flash_attn", ())
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace())
    name, missing = provider()
    assert name != "flash_attn" and missing[0] == "flash_attn has no flash_attn_varlen_func"
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    name, missing = provider()
    assert name != "flash_attn" and missing[0].startswith("flash_attn does not import (")


def test_flash_gets_max_seqlen_of_at_least_one_for_an_all_padding_call(monkeypatch):
    attention = pytest.importorskip("hwgraph_cuda.attention")

    seen = []

    def aten_flash(q, k, v, cu, max_seqlen, scale):
        seen.append(max_seqlen)
        return torch.full_like(q, float("nan"))  # rows the kernel never writes

    monkeypatch.setattr(attention, "flash_provider", lambda: ("aten", ()))
    monkeypatch.setattr(attention, "aten_flash", aten_flash)
    batch = random_packed_batch([], heads=2, head_dim=72, zero_length=1, padding_rows=4, dtype=torch.bfloat16)
    out = attention.flash_varlen(*batch.args())
    assert seen == [1] and torch.equal(out, torch.zeros_like(out))


def test_torch_varlen_attn_without_a_scale_argument_gets_the_scale_folded_into_q(monkeypatch):
    """torch 2.10's ``varlen_attn`` scales by the (padded) head dim's ``** -0.5``: the adapter folds the ratio into
    q, with the padded width (36 lanes are padded to 40)."""
    import torch.nn.attention.varlen as torch_varlen
    attention = pytest.importorskip("hwgraph_cuda.attention")

    widths = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        widths.append(query.shape[-1])
        return varlen_reference(query, key, value, cu_seq_q, query.shape[-1] ** -0.5).to(query.dtype)

    monkeypatch.setattr(attention, "flash_provider", lambda: ("torch", ()))
    monkeypatch.setattr(attention, "varlen_attn_takes_scale", lambda: False)
    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    for head_dim in (36, 72):
        batch = random_packed_batch([9, 4], heads=2, head_dim=head_dim, zero_length=1, padding_rows=3,
                                    dtype=torch.float32, scale=0.3)
        assert_matches_reference(attention.flash_varlen(*batch.args()), batch)
    assert widths == [40, 72]


# ---------------------------------------------------------------- the conformance cases


def settings(**kw) -> SuiteSettings:
    return SuiteSettings(**{"backend": "cpu", "kernels": None, "preset": "tiny", "dtype": None,
                            "allowed_backends": None, **kw})


def skip_reason(param) -> str | None:
    marks = [m for m in param.marks if m.name == "skip"]
    return marks[0].kwargs["reason"] if marks else None


def test_a_kernel_that_is_not_graph_safe_is_skipped_saying_the_manager_runs_it_eagerly(monkeypatch):
    from hwgraph.attention import registry

    eager_only = dataclasses.replace(TORCH_SDPA, name="EAGER_ONLY", graph_safe=False)
    monkeypatch.setattr(registry, "kernel_specs", lambda: [TORCH_SDPA, eager_only])
    params = {p.id: p for p in conformance_params(settings())}
    assert skip_reason(params["cpu-EAGER_ONLY-float32"]) == \
        "attention kernel EAGER_ONLY is not graph-safe: the manager runs it eagerly"
    assert skip_reason(params["cpu-TORCH_SDPA-float32"]) is None


def test_kernel_gates_are_asked_with_the_presets_head_dim():
    """The real tower has 16 heads of 72 lanes (hidden 1152): its cases must not be skipped for a head dim of 1152."""
    params = {p.id: p for p in conformance_params(settings(preset="qwen3-omni-30b-a3b"))}
    assert skip_reason(params["cpu-TORCH_SDPA-float32"]) is None
    assert params["cpu-TORCH_SDPA-float32"].values[0].preset == "qwen3-omni-30b-a3b"
    assert all("head_dim" not in (skip_reason(p) or "") for p in params.values())


# ---------------------------------------------------------------- the pytest plugin's markers


class FakeItem:
    def __init__(self, *markers):
        self.markers, self.skips = set(markers), []

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, mark):
        assert mark.name == "skip"
        self.skips.append(mark.kwargs["reason"])


@pytest.mark.parametrize("machine", ["cpu", "cuda", "rocm", "npu"])
def test_accelerator_markers_skip_off_their_accelerator_and_cpu_machine_off_a_cpu(monkeypatch, machine):
    monkeypatch.setattr(plugin, "detected_kind", lambda: machine)
    items = {name: FakeItem(name) for name in ("cuda", "rocm", "npu", "cpu_machine")}
    items["plain"] = FakeItem()
    plugin.pytest_collection_modifyitems(None, list(items.values()))
    for name, item in items.items():
        runs = name == "plain" or name == machine or (name == "cpu_machine" and machine == "cpu")
        if runs:
            assert item.skips == [], (name, item.skips)
        else:
            need = {**plugin.ACCELERATOR_MARKERS, "cpu_machine": plugin.CPU_MACHINE_NEED}[name]
            assert item.skips == [f"{need}; this machine is {machine}"]


def test_the_plugin_registers_every_marker_it_documents(monkeypatch):
    """A vendor's repository with ``--strict-markers`` gets ``cuda``/``rocm``/``npu``, ``cpu_machine``, ``vllm`` and
    ``slow`` from the plugin alone."""
    lines = []
    config = types.SimpleNamespace(addinivalue_line=lambda name, line: lines.append((name, line)))
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    plugin.pytest_configure(config)
    assert {name for name, _ in lines} == {"markers"}
    assert {line.split(":")[0] for _, line in lines} == {"cuda", "rocm", "npu", "cpu_machine", "vllm", "slow"}
    assert ("markers", f"cpu_machine: {plugin.CPU_MACHINE_NEED}") in lines


# ---------------------------------------------------------------- the suite's comparison


@pytest.mark.parametrize(("dtype", "want", "got"), [(torch.bfloat16, 0.5, 0.52), (torch.float16, 0.5, 0.5025)])
def test_the_suite_bounds_the_relative_l2_error_beyond_elementwise_closeness(dtype, want, got):
    """Every element within the suite's rtol/atol, yet a systematic shift of 4% (bf16) or 0.5% (fp16) of every
    element: the relative L2 bound (3e-2, 4e-3) is what fails it."""
    suite = ConformanceSuite()
    w, g = torch.full((1000,), want, dtype=dtype), torch.full((1000,), got, dtype=dtype)
    torch.testing.assert_close(g, w, **suite.tolerances[dtype])
    with pytest.raises(AssertionError, match=f"relative L2 error .* above {suite.relative_l2[dtype]} for {dtype}"):
        suite.assert_close(g, w, "embeddings")
    suite.assert_close(w.clone(), w, "embeddings")


def test_the_suite_allows_low_precision_rounding_up_to_its_widened_atol():
    """A few bf16 elements 0.0195 off (a padded replay's GEMM tiling): inside the suite's atol 2e-2 and the L2 bound,
    outside torch.testing's bf16 defaults; the suite must pass them."""
    w = torch.full((1000,), 0.5, dtype=torch.bfloat16)
    g = w.clone()
    g[:10] = 0.52
    with pytest.raises(AssertionError):
        torch.testing.assert_close(g, w)
    ConformanceSuite().assert_close(g, w, "embeddings")


# ---------------------------------------------------------------- validate's result collector


def report(nodeid, when, outcome, longrepr=None, duration=0.25):
    return pytest.TestReport(nodeid, ("m.py", 1, nodeid), {}, outcome, longrepr, when, duration=duration)


def test_the_collector_reports_skips_with_their_reason_and_setup_or_teardown_failures_as_errors():
    collector = ResultCollector()
    skipped_case = "m.py::TestCapture::test_x[cpu-TRITON_ATTN-float32]"
    reason = "attention kernel TRITON_ATTN is unavailable: on CPU TRITON_ATTN runs only under the Triton interpreter"
    events = [
        report(skipped_case, "setup", "skipped", ("m.py", 149, f"Skipped: {reason}")),
        report(skipped_case, "teardown", "passed"),
        report("m.py::T::broken_fixture", "setup", "failed", "RuntimeError: capture failed"),
        report("m.py::T::broken_fixture", "teardown", "passed"),
        report("m.py::T::leaks", "setup", "passed"),
        report("m.py::T::leaks", "call", "passed"),
        report("m.py::T::leaks", "teardown", "failed", "AssertionError: pool not released"),
        report("m.py::T::wrong", "setup", "passed"),
        report("m.py::T::wrong", "call", "failed", "AssertionError: not close"),
        report("m.py::T::ok", "setup", "passed"),
        report("m.py::T::ok", "call", "passed"),
    ]
    for event in events:
        collector.pytest_runtest_logreport(event)
    got = {r.check: (r.outcome, r.message) for r in collector.results.values()}
    assert got == {
        "TestCapture::test_x[cpu-TRITON_ATTN-float32]": ("skipped", reason),
        "T::broken_fixture": ("error", "RuntimeError: capture failed"),
        "T::leaks": ("error", "teardown: AssertionError: pool not released"),
        "T::wrong": ("failed", "AssertionError: not close"),
        "T::ok": ("passed", ""),
    }
    assert collector.counts() == {"passed": 1, "failed": 1, "error": 2, "skipped": 1}
    results = {"results": [r.as_dict() for r in collector.results.values()]}
    assert [r["check"] for r in failing_checks(results)] == ["T::broken_fixture", "T::leaks", "T::wrong"]


def test_run_conformance_runs_the_explicit_backend_without_the_environments_narrowing(tmp_path, monkeypatch):
    """``hwgraph validate --backend cpu`` with HWGRAPH_TEST_BACKENDS=rocm left in the environment must still run the
    cpu cases (not skip them all as excluded), and leave the variable as it found it."""
    seen = []

    def main(args, plugins=()):
        seen.append(os.environ.get("HWGRAPH_TEST_BACKENDS"))
        return 0

    monkeypatch.setenv("HWGRAPH_TEST_BACKENDS", "rocm")
    monkeypatch.setattr(pytest, "main", main)
    result = run_conformance(tmp_path, "cpu", "tiny")
    assert seen == [None] and result["exit_code"] == 0
    assert os.environ["HWGRAPH_TEST_BACKENDS"] == "rocm"


# ---------------------------------------------------------------- the float64 reference's own checks


def test_the_reference_check_rejects_non_zero_padding_rows_and_a_five_percent_error():
    batch = random_packed_batch([1, 2, 3], heads=2, head_dim=16, padding_rows=3, dtype=torch.bfloat16, seed=3)
    exact = varlen_reference(*batch.args()[:4], batch.scale).to(torch.bfloat16)
    assert_matches_reference(exact, batch)
    leaked = exact.clone()
    leaked[batch.total] = 1.0
    with pytest.raises(AssertionError, match="3 padding rows must be zero"):
        assert_matches_reference(leaked, batch)
    with pytest.raises(AssertionError):
        assert_matches_reference(exact * 1.05, batch)
    assert ATTENTION_TOLERANCES[torch.bfloat16] == (1.6e-2, 1.6e-2)


def test_random_batches_fill_padding_rows_with_large_garbage():
    """So that a kernel reading padding keys or values, or copying padding rows out, fails the comparison."""
    batch = random_packed_batch([4, 2], heads=2, head_dim=8, zero_length=1, padding_rows=3, dtype=torch.float16)
    for t in (batch.q, batch.k, batch.v):
        assert torch.equal(t[6:], torch.full_like(t[6:], 1e3)) and t[:6].abs().max() < 100
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 6] and batch.max_seqlen == 4
    assert math.isclose(batch.scale, 8 ** -0.5)
