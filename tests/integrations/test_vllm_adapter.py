"""vLLM 0.33 integration on CPU: the adapter against vLLM's installed protocol, the single-replay manager's decisions
and outputs, the install hook, and the version check. Runs in .venv-vllm (ci/test.sh vllm); the default CPU run has
no vllm and skips this module.

vLLM's manager reads only a few config fields (compilation, multimodal, parallel, scheduler); building a real
``VllmConfig`` would need a Hugging Face model config, so the real sub-configs are assembled in a namespace.
"""

from __future__ import annotations

import inspect
import logging
import re
import subprocess
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from packaging.version import Version

pytest.importorskip("vllm", reason="vllm is not installed: the vLLM integration tests run with ci/test.sh vllm")

from vllm.config import CompilationConfig, MultiModalConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsEncoderCudaGraph, supports_encoder_cudagraph  # noqa: E402
from vllm.v1.worker import encoder_cudagraph as upstream  # noqa: E402
from vllm.v1.worker.encoder_cudagraph_defs import (  # noqa: E402
    EncoderCudaGraphCaptureInputs,
    EncoderCudaGraphConfig,
    EncoderCudaGraphReplayBuffers,
    EncoderItemSpec,
)

from hwgraph.attention.sdpa import sdpa_varlen  # noqa: E402
from hwgraph.budget_capture import relative_error  # noqa: E402
from hwgraph.graphs.cpu import CpuGraphBackend  # noqa: E402
from hwgraph.integrations import vllm as hv  # noqa: E402
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower  # noqa: E402

pytestmark = pytest.mark.vllm

BUDGETS = [64, 128, 256]
MAX_ITEMS = 4
CPU = torch.device("cpu")


def vllm_config(budgets=None, max_items=0, max_batched_tokens=8192):
    return SimpleNamespace(
        compilation_config=CompilationConfig(cudagraph_mm_encoder=True, encoder_cudagraph_token_budgets=budgets or [],
                                             encoder_cudagraph_max_vision_items_per_batch=max_items),
        model_config=SimpleNamespace(multimodal_config=MultiModalConfig(limit_per_prompt={"image": 8, "video": 0})),
        parallel_config=ParallelConfig(),
        scheduler_config=SchedulerConfig(max_model_len=8192, is_encoder_decoder=False,
                                         max_num_batched_tokens=max_batched_tokens),
    )


def cpu_manager(adapter):
    """hwgraph's single-replay manager for ``adapter`` on the CPU reference backend, at the tests' budgets."""
    return hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32, adapter,
                                                  graph_backend="cpu")


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()


@pytest.fixture(scope="module")
def adapter(tower):
    return hv.Qwen3OmniEncoderCudaGraphAdapter(tower)


@pytest.fixture(scope="module")
def captured(adapter):
    m = cpu_manager(adapter)
    m.capture(graph_pool=None)
    yield m
    m.clear()


@pytest.fixture
def manager(captured):
    captured.reset_stats()  # captured once per module; each test counts from zero
    return captured


def manager_whose_first_capture_fails(adapter, monkeypatch):
    """A manager of BUDGETS on the cpu backend, captured once; the first capture (the largest budget) raised."""
    m = cpu_manager(adapter)
    real, calls = m.backend.capture, []

    def capture(fn, pool=None):
        calls.append(fn)
        if len(calls) == 1:  # the first capture is the largest budget
            raise RuntimeError("simulated capture failure")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    m.capture(graph_pool=None)
    return m


def tokens_of(grid):
    return [t * h * w // 4 for t, h, w in grid]


def mm_kwargs(tower, grid, seed=0, grid_as=list):
    g = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grid)
    return {"pixel_values": torch.randn(patches, tower.patch_row_width, generator=g), "image_grid_thw": grid_as(grid)}


def eager_per_image(tower, kwargs):
    grid = list(kwargs["image_grid_thw"])
    with torch.inference_mode():
        out = tower.forward(kwargs["pixel_values"], grid)
    return out.split(tokens_of(grid))


# bf16 (the CUDA test): a padded replay and an unpadded eager call run different GEMM tilings, so near-zero values
# differ by rounding; torch.testing's bf16 rtol with atol 1e-2 plus a relative-L2 bound, as hwgraph's CUDA tests.
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


def assert_matches_eager(adapter, got, want):
    assert len(got) == len(want)
    for features, ref in zip(got, want, strict=True):
        assert features.shape == (ref.num_tokens, adapter.out_hidden_size)  # no padding row leaked
        out = adapter.split(features)
        assert len(out.deepstack) == len(ref.deepstack) == 3
        for a, b in zip(out.tensors(), ref.tensors(), strict=True):
            if b.dtype == torch.bfloat16:
                torch.testing.assert_close(a, b, **BF16)
                assert relative_error(a, b) < 1e-2
            else:
                torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------------ protocol
def test_adapter_is_a_supports_encoder_cudagraph_model(adapter):
    assert isinstance(adapter, SupportsEncoderCudaGraph)
    assert supports_encoder_cudagraph(adapter)
    assert type(adapter).supports_encoder_cudagraph is True


def protocol_methods():
    return sorted(name for name, value in vars(SupportsEncoderCudaGraph).items()
                  if inspect.isfunction(value) and not name.startswith("_"))


@pytest.mark.parametrize("name", protocol_methods())
def test_every_protocol_method_has_the_installed_signature(adapter, name):
    want = inspect.signature(getattr(SupportsEncoderCudaGraph, name))
    got = inspect.signature(getattr(type(adapter), name))
    assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in want.parameters.values()]


def test_config_names_the_image_modality_buffers_and_width_with_deepstack(adapter, tower):
    config = adapter.get_encoder_cudagraph_config()
    assert isinstance(config, EncoderCudaGraphConfig)
    assert config.modalities == ["image"]
    assert config.buffer_keys == ["pixel_values", "pos_indices", "pos_weights", "rotary_positions", "cu_seqlens"]
    assert config.out_hidden_size == tower.out_hidden_size * (1 + 3) == 128
    assert set(config.padding_logics) <= set(config.buffer_keys)
    assert config.max_frames_per_video == 1 and adapter.get_max_frames_per_video() == 1
    assert list(config.paths) == ["default"] and config.capture_axes == ()


def test_budget_range_starts_at_the_smallest_image_and_respects_the_scheduler(tower, adapter):
    assert adapter.get_encoder_cudagraph_budget_range(vllm_config()) == (64, 256)
    assert adapter.get_encoder_cudagraph_budget_range(vllm_config(max_batched_tokens=128)) == (64, 128)
    wide = hv.Qwen3OmniEncoderCudaGraphAdapter(tower, min_token_budget=16, max_token_budget=1024)
    assert wide.get_encoder_cudagraph_budget_range(vllm_config()) == (16, 1024)
    with pytest.raises(ValueError, match="min_token_budget"):
        hv.Qwen3OmniEncoderCudaGraphAdapter(tower, min_token_budget=128, max_token_budget=64)


def test_the_budget_range_never_ends_below_its_start_under_a_small_scheduler_budget(adapter):
    small = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=32))  # below the 64 minimum
    assert adapter.get_encoder_cudagraph_budget_range(small) == (64, 64)


@pytest.mark.parametrize("name, value", [("min_token_budget", 64.5), ("min_token_budget", True),
                                         ("min_token_budget", None), ("max_token_budget", 256.0),
                                         ("max_token_budget", False), ("max_token_budget", "256")])
def test_adapter_refuses_budgets_that_are_not_ints_naming_the_value(tower, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an int .*got {re.escape(repr(value))}"):
        hv.Qwen3OmniEncoderCudaGraphAdapter(tower, **{name: value})


def test_adapter_takes_numpy_int_budgets_as_ints(tower):
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower, min_token_budget=np.int64(32), max_token_budget=np.int32(512))
    assert adapter.get_encoder_cudagraph_budget_range(vllm_config()) == (32, 512)
    assert type(adapter.min_token_budget) is int and type(adapter.max_token_budget) is int


@pytest.mark.parametrize("grid_as", [list, torch.tensor, np.array], ids=["list", "cpu-tensor", "numpy"])
def test_item_specs_come_from_the_host_grid(tower, adapter, grid_as):
    kwargs = mm_kwargs(tower, [(1, 8, 8), (1, 4, 12), (1, 2, 2)], grid_as=grid_as)
    specs = adapter.get_encoder_cudagraph_item_specs(kwargs)
    assert all(type(s) is EncoderItemSpec for s in specs)
    assert [(s.input_size, s.output_tokens) for s in specs] == [(64, 16), (48, 12), (4, 1)]
    assert all(type(s.input_size) is int and type(s.output_tokens) is int for s in specs)
    assert adapter.get_input_modality(kwargs) == "image"
    assert adapter.get_encoder_cudagraph_item_frames(kwargs) == [1, 1, 1]


@pytest.mark.parametrize("as_rows", [False, True], ids=["stacked", "per-image rows"])
def test_a_device_grid_is_refused_with_the_field_declaration_that_keeps_it_on_the_host(tower, adapter, as_rows):
    # vLLM moves image_grid_thw to the device unless the processor declares keep_on_cpu=True (vLLM 0.33's Qwen-Omni
    # processor does; an override may not): every protocol method that reads the grid, the eager fallback's too, must
    # say how to keep it on the host
    grid = torch.empty(2, 3, device="meta", dtype=torch.int64)
    kwargs = {"pixel_values": torch.zeros(4, tower.patch_row_width), "image_grid_thw": list(grid) if as_rows else grid}
    calls = [adapter.get_encoder_cudagraph_item_specs, adapter.get_encoder_cudagraph_item_frames,
             lambda kw: adapter.select_encoder_cudagraph_items(kw, [0]), adapter.encoder_eager_forward]
    for call in calls:
        with pytest.raises(ValueError, match=r"mm_kwargs\['image_grid_thw'\] is on meta, not the host: declare "
                                             r"image_grid_thw as MultiModalFieldConfig\.batched\(\"image\", "
                                             r"keep_on_cpu=True\) in the model's multimodal processor"):
            call(kwargs)


def test_select_slices_pixels_by_patch_offsets(tower, adapter):
    grid = [(1, 8, 8), (1, 4, 4), (1, 2, 6)]
    kwargs = mm_kwargs(tower, grid)
    px = kwargs["pixel_values"]
    picked = adapter.select_encoder_cudagraph_items(kwargs, [2, 0])
    assert picked["image_grid_thw"] == [(1, 2, 6), (1, 8, 8)]
    torch.testing.assert_close(picked["pixel_values"], torch.cat((px[80:92], px[0:64])), rtol=0, atol=0)
    whole = adapter.select_encoder_cudagraph_items(kwargs, [0, 1, 2])
    assert whole["pixel_values"].data_ptr() == px.data_ptr()  # the whole group in order is a view
    empty = adapter.select_encoder_cudagraph_items(kwargs, [])
    assert empty["pixel_values"].shape == (0, tower.patch_row_width) and empty["image_grid_thw"] == []
    assert adapter.get_encoder_cudagraph_item_specs(empty) == []
    with pytest.raises(IndexError):
        adapter.select_encoder_cudagraph_items(kwargs, [3])


@pytest.mark.parametrize("rows, width_change", [(72, 0), (88, 0), (80, -1)],
                         ids=["too few rows", "too many rows", "wrong width"])
def test_pixels_that_disagree_with_the_grid_are_refused_on_every_path(tower, adapter, manager, rows, width_change):
    """Replay zero-pads its pixel buffer: a group short of rows would replay zeros for them, a wrong answer."""
    grid = [(1, 8, 8), (1, 4, 4)]  # 80 patch rows, 20 tokens: the 64 budget would replay them
    width = tower.patch_row_width + width_change
    kwargs = {"pixel_values": torch.randn(rows, width), "image_grid_thw": grid}
    if width_change:
        message = rf"\[patches, {tower.patch_row_width}\].*got shape \({rows}, {width}\)"
    else:
        message = rf"pixel_values has {rows} rows but grids .* need 80 patch rows"
        with pytest.raises(ValueError, match=message):
            adapter.select_encoder_cudagraph_items(kwargs, [0])
    with pytest.raises(ValueError, match=message):
        adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, MAX_ITEMS, MAX_ITEMS)
    with pytest.raises(ValueError, match=message):
        manager.execute(kwargs)  # the single-replay dispatch
    with pytest.raises(ValueError, match=message):
        upstream.EncoderCudaGraphManager._execute_local(manager, kwargs)  # vLLM's packing: select, then replay
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        adapter.encoder_eager_forward(kwargs)  # as eager does
    assert manager.graph_hits == 0 and manager.replays == 0


def test_pixels_that_disagree_with_a_huge_grid_are_refused_before_its_metadata_is_built(adapter, manager,
                                                                                         monkeypatch):
    """A grid's tables take memory in proportion to it: every path compares the rows with the grid first."""
    from hwgraph.models.qwen3_omni import metadata

    monkeypatch.setattr(metadata, "frame_tables", lambda *a: pytest.fail("tables built for rows that do not match"))
    kwargs = {"pixel_values": torch.randn(80, adapter.tower.patch_row_width), "image_grid_thw": [(1, 20000, 20000)]}
    message = r"pixel_values has 80 rows but grids \[\(1, 20000, 20000\)\] need 400000000 patch rows"
    with pytest.raises(ValueError, match=message):
        adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, MAX_ITEMS, MAX_ITEMS)
    with pytest.raises(ValueError, match=message):
        manager.execute(kwargs)
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        adapter.encoder_eager_forward(kwargs)


@pytest.mark.parametrize("budget", BUDGETS)
def test_capture_inputs_and_forward_have_the_budget_shapes(tower, adapter, budget):
    inputs = adapter.prepare_encoder_cudagraph_capture_inputs(budget, MAX_ITEMS, MAX_ITEMS, CPU, torch.bfloat16)
    assert isinstance(inputs, EncoderCudaGraphCaptureInputs)
    v = inputs.values
    assert list(v) == adapter.get_encoder_cudagraph_config().buffer_keys
    rows = budget * 4
    # in the tower's dtype (float32 here), whatever vLLM's dtype: the eager forward casts pixels to it too
    assert v["pixel_values"].shape == (rows, tower.patch_row_width) and v["pixel_values"].dtype == torch.float32
    assert v["pos_indices"].shape == (4, rows) and v["pos_indices"].dtype == torch.int64
    assert v["pos_weights"].shape == (4, rows) and v["pos_weights"].dtype == torch.float32
    assert v["rotary_positions"].shape == (rows, 2) and v["rotary_positions"].dtype == torch.int64
    assert v["cu_seqlens"].shape == (MAX_ITEMS + 1,) and v["cu_seqlens"].dtype == torch.int32
    assert v["cu_seqlens"].tolist() == [0] + [rows] * MAX_ITEMS  # one image filling the budget, then empty ones
    with torch.inference_mode():
        out = adapter.encoder_cudagraph_forward(v)
    assert out.shape == (budget, adapter.out_hidden_size) and out.dtype == torch.float32


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_captured_forward_keeps_the_budgets_patch_rows_as_max_seqlen(tower, adapter, monkeypatch, budget):
    """One image may fill the budget, so the host ``max_seqlen`` every replay keeps is the buffer's patch-row count
    (flash kernels size their grid by it); the merged-token count would cut that image's attention short."""
    seen = []
    real = tower.forward_with_metadata
    monkeypatch.setattr(tower, "forward_with_metadata",
                        lambda pixels, metadata: (seen.append(metadata.max_seqlen), real(pixels, metadata))[1])
    values = adapter.prepare_encoder_cudagraph_capture_inputs(budget, MAX_ITEMS, MAX_ITEMS, CPU, torch.float32).values
    with torch.inference_mode():
        adapter.encoder_cudagraph_forward(values)
    assert seen == [budget * adapter.merge_area] and type(seen[0]) is int


def test_replay_buffers_are_the_unpadded_host_metadata(tower, adapter):
    grid = [(1, 8, 8), (1, 4, 4)]
    kwargs = mm_kwargs(tower, grid)
    buffers = adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, MAX_ITEMS, MAX_ITEMS)
    assert isinstance(buffers, EncoderCudaGraphReplayBuffers)
    assert set(buffers.values) == set(adapter.get_encoder_cudagraph_config().buffer_keys)
    assert buffers.values["pixel_values"] is kwargs["pixel_values"]
    want = tower.prepare_metadata(grid)
    for key, tensor in want.tensors().items():
        torch.testing.assert_close(buffers.values[key], tensor, rtol=0, atol=0)


def test_padding_logics_pad_exactly_like_the_towers_padded_metadata(tower):
    host = tower.prepare_metadata([(1, 8, 8), (1, 4, 4)])
    padded = host.padded(256, MAX_ITEMS)
    for key, pad in hv.PADDING_LOGICS.items():
        dst = torch.full_like(padded.tensors()[key], 7)  # stale values from an earlier replay
        pad(dst, host.tensors()[key])
        torch.testing.assert_close(dst, padded.tensors()[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not fit"):
        hv.pad_cu_seqlens(torch.zeros(2, dtype=torch.int32), host.cu_seqlens)
    with pytest.raises(ValueError, match="does not fit"):
        hv.pad_columns(torch.zeros(4, 8), host.pos_weights)


def test_select_then_postprocess_reproduce_the_eager_tower_per_image(tower, adapter):
    grid = [(1, 8, 8), (1, 4, 4), (1, 2, 6), (1, 6, 2)]
    kwargs = mm_kwargs(tower, grid, seed=5)
    want = eager_per_image(tower, kwargs)
    tokens = tokens_of(grid)
    dest: dict[int, torch.Tensor] = {}
    for indices in ([3, 1], [0], [2]):
        sub = adapter.select_encoder_cudagraph_items(kwargs, indices)
        with torch.inference_mode():
            out = adapter.encoder_eager_forward(sub)
        padded = torch.cat((out, torch.full((5, out.shape[1]), float("nan"))))  # rows past the images: padding
        adapter.postprocess_encoder_output({"default": padded}, indices, tokens, dest, clone=True)
    assert sorted(dest) == [0, 1, 2, 3]
    assert_matches_eager(adapter, [dest[i] for i in range(4)], want)
    with pytest.raises(ValueError, match="exceed"):
        adapter.postprocess_encoder_output({"default": out[:1]}, [0], tokens, {}, clone=False)


# ------------------------------------------------------------------------------------------------ manager
def test_manager_takes_its_budgets_from_the_adapter_and_captures_through_hwgraph(adapter):
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(), CPU, torch.float32, adapter, graph_backend="cpu")
    assert m.token_budgets == BUDGETS and m.max_batch_size == 4  # auto-inferred from (64, 256)
    m.capture(graph_pool=None)
    try:
        assert m.captured_budgets() == BUDGETS and m.is_captured()
        assert m.backend.name == "cpu" and m.get_cumulative_stats()["graph_backend"] == "cpu"
        for budget, meta in m.budget_graphs["default"].items():
            assert meta.output_buffer.shape == (budget, adapter.out_hidden_size)
            assert meta.input_buffers["pixel_values"].shape[0] == budget * 4
    finally:
        m.clear()
    assert m.captured_budgets() == [] and not m.is_captured()


CASES = [  # grid, expected decision (budget or None), reason
    ([(1, 16, 16)], 64, "replay"),  # exactly the smallest budget
    ([(1, 8, 8), (1, 8, 8), (1, 4, 4)], 64, "replay"),  # 16 + 16 + 4 tokens
    ([(1, 16, 16), (1, 8, 8), (1, 4, 8)], 128, "replay"),  # 64 + 16 + 8
    ([(1, 16, 32), (1, 16, 28), (1, 2, 2), (1, 2, 2)], 256, "replay"),  # 128 + 112 + 1 + 1: four images, full
    ([(1, 4, 4)] * 5, None, "too many images"),  # 5 > max_batch_size 4, though 20 tokens fit
    ([(1, 16, 32), (1, 16, 36)], None, "over budget"),  # 128 + 144 = 272 > 256: upstream would replay twice
    ([(1, 40, 40)], None, "over budget"),  # one oversized image
    ([(2, 8, 8)], None, "video"),  # t > 1
]


@pytest.mark.parametrize("grid, budget, reason", CASES, ids=[c[2] + f"-{i}" for i, c in enumerate(CASES)])
def test_single_replay_decision_and_outputs(tower, adapter, manager, monkeypatch, grid, budget, reason):
    kwargs = mm_kwargs(tower, grid, seed=len(grid))
    specs = adapter.get_encoder_cudagraph_item_specs(kwargs)
    decision = manager.decide(specs, "image", adapter.get_encoder_cudagraph_item_frames(kwargs))
    assert (decision.budget, decision.reason) == (budget, reason)
    eager_calls = []
    real_eager = adapter.encoder_eager_forward
    monkeypatch.setattr(adapter, "encoder_eager_forward", lambda kw, path="default": (eager_calls.append(kw),
                                                                                       real_eager(kw, path))[1])
    got = manager.execute(kwargs)
    assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
    stats = manager.get_cumulative_stats()
    n = len(grid)
    if budget is not None:
        assert eager_calls == []
        assert (stats["graph_hits"], stats["graph_misses"], stats["replays"]) == (n, 0, 1)
        assert stats["replays_per_budget"] == {budget: 1}
        assert stats["padding_tokens"] == budget - sum(tokens_of(grid))
    else:
        assert len(eager_calls) == 1 and eager_calls[0] is kwargs  # the whole group, once, unsplit
        assert (stats["graph_hits"], stats["graph_misses"], stats["replays"]) == (0, n, 0)
        assert stats["eager_groups"] == 1 and stats["eager_reasons"] == {reason: 1}


def test_no_captured_graph_means_one_eager_call(tower, adapter):
    m = cpu_manager(adapter)
    kwargs = mm_kwargs(tower, [(1, 8, 8)])
    assert m.decide(adapter.get_encoder_cudagraph_item_specs(kwargs)).reason == "no graphs"
    assert_matches_eager(adapter, m.execute(kwargs), eager_per_image(tower, kwargs))
    assert m.get_cumulative_stats()["eager_reasons"] == {"no graphs": 1}


def test_a_manager_in_another_dtype_than_the_towers_replays_what_eager_computes(tower, adapter):
    """vLLM builds the manager with its model's dtype, the tower may be in another: the graph's pixel buffer once
    took vLLM's bfloat16 and rounded every replay's pixels, which the eager forward (cast to the tower's float32)
    did not."""
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.bfloat16, adapter,
                                               graph_backend="cpu")
    m.capture(graph_pool=None)
    try:
        kwargs = mm_kwargs(tower, [(1, 8, 8)], seed=11)
        got = m.execute(kwargs)
        assert m.get_cumulative_stats()["replays"] == 1
        assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
    finally:
        m.clear()


def test_graphs_captured_under_other_numerics_settings_are_not_replayed(tower, adapter, monkeypatch, caplog):
    """As EncoderGraphManager: a graph keeps its capture's numerics settings (CUDA's TF32, say), so while the
    backend's differ the group runs eagerly, with the reason; clear() and capture() replay again. The settings are
    read for the tower's dtype (float32), not the manager's (bfloat16)."""
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.bfloat16, adapter,
                                               graph_backend="cpu")
    setting = {"value": "ieee"}
    asked = []
    monkeypatch.setattr(m.backend, "numerics_settings",
                        lambda dtype: (asked.append(dtype), (("matmul precision", setting["value"]),))[1])
    m.capture(graph_pool=None)
    try:
        kwargs = mm_kwargs(tower, [(1, 8, 8)], seed=12)
        specs = adapter.get_encoder_cudagraph_item_specs(kwargs)
        assert m.decide(specs).replay
        setting["value"] = "tf32"
        with caplog.at_level(logging.WARNING, logger="hwgraph.integrations.vllm"):
            assert m.decide(specs).reason == "numerics settings changed since capture"
            got = m.execute(kwargs)
        assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
        stats = m.get_cumulative_stats()
        assert stats["replays"] == 0 and stats["eager_reasons"] == {"numerics settings changed since capture": 1}
        [warning] = [r.getMessage() for r in caplog.records if "numerics settings" in r.getMessage()]  # once
        assert "matmul precision: 'ieee' -> 'tf32'" in warning
        m.clear()
        m.capture(graph_pool=None)
        assert m.decide(specs).replay
        m.execute(kwargs)
        assert m.get_cumulative_stats()["replays"] == 1
        assert set(asked) == {torch.float32}
    finally:
        m.clear()


def test_a_capture_that_leaves_every_budget_eager_is_logged_as_a_warning(adapter, monkeypatch, caplog):
    m = cpu_manager(adapter)

    def capture(fn, pool=None):
        raise RuntimeError("simulated capture failure")

    monkeypatch.setattr(m.backend, "capture", capture)
    with caplog.at_level(logging.INFO, logger="hwgraph.integrations.vllm"):
        m.capture(graph_pool=None)
    [record] = [r for r in caplog.records if r.getMessage().startswith("encoder graphs captured on cpu")]
    assert record.levelno == logging.WARNING and "budgets []" in record.getMessage()


def test_empty_group_returns_no_outputs(tower, manager):
    assert manager.execute({"pixel_values": torch.zeros(0, tower.patch_row_width), "image_grid_thw": []}) == []
    assert manager.decide([]).reason == "empty"


def test_changing_budgets_leave_no_stale_inputs_and_kept_outputs_survive(tower, adapter, manager):
    calls = [[(1, 32, 32)], [(1, 4, 4)], [(1, 8, 8), (1, 8, 8)], [(1, 4, 4), (1, 2, 2)], [(1, 16, 16)], [(1, 2, 4)]]
    kept = []
    for i, grid in enumerate(calls):
        kwargs = mm_kwargs(tower, grid, seed=100 + i)
        got = manager.execute(kwargs)
        assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
        kept.append((got, [t.clone() for t in got]))
    for got, copies in kept:  # outputs handed back never alias a graph buffer that a later replay overwrote
        for t, c in zip(got, copies, strict=True):
            torch.testing.assert_close(t, c, rtol=0, atol=0)
    assert manager.get_cumulative_stats()["replays_per_budget"] == {256: 1, 64: 5}


def test_the_replay_path_reads_nothing_back_from_the_device(tower, adapter, manager):
    kwargs = mm_kwargs(tower, [(1, 8, 8), (1, 4, 4)], seed=7)
    with manager.backend.sync_guard():  # rejects .item(), .tolist(), .cpu(), bool() on tensors
        got = manager.execute(kwargs)
    assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
    assert manager.get_cumulative_stats()["replays"] == 1


def test_adapter_also_serves_vllms_greedy_packing(tower, adapter, manager):
    """Upstream's dispatch (several replays per step) on the same captured graphs gives the same outputs."""
    grid = [(1, 16, 32), (1, 16, 36), (1, 4, 4), (1, 40, 40)]  # 128 + 144 + 4 + 400 tokens
    kwargs = mm_kwargs(tower, grid, seed=11)
    got = upstream.EncoderCudaGraphManager._execute_local(manager, kwargs)
    assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
    assert manager.graph_hits == 3 and manager.graph_misses == 1  # two replays hold three images; one eager


def test_a_failed_capture_leaves_that_budget_eager(tower, adapter, monkeypatch):
    m = manager_whose_first_capture_fails(adapter, monkeypatch)
    assert m.captured_budgets() == [64, 128] and "simulated" in m.capture_failures[256]
    kwargs = mm_kwargs(tower, [(1, 16, 32), (1, 8, 8)], seed=3)  # 144 tokens: only the failed 256 would hold it
    assert_matches_eager(adapter, m.execute(kwargs), eager_per_image(tower, kwargs))
    # The configured 256 budget would hold the group: its failed capture, not the budgets, sent it eager.
    assert m.get_cumulative_stats()["eager_reasons"] == {"capture failed": 1}
    oversized = mm_kwargs(tower, [(1, 40, 40)])  # 400 tokens: no configured budget holds it
    assert m.decide(adapter.get_encoder_cudagraph_item_specs(oversized)).reason == "over budget"
    m.clear()


def test_a_group_of_exactly_a_failed_budgets_size_is_reported_as_a_capture_failure(adapter, monkeypatch):
    m = manager_whose_first_capture_fails(adapter, monkeypatch)
    try:
        assert m.captured_budgets() == [64, 128] and list(m.capture_failures) == [256]
        kwargs = {"pixel_values": torch.zeros(1024, adapter.tower.patch_row_width), "image_grid_thw": [(1, 32, 32)]}
        decision = m.decide(adapter.get_encoder_cudagraph_item_specs(kwargs))  # 256 tokens: the failed budget holds it
        assert (decision.budget, decision.reason) == (None, "capture failed")
    finally:
        m.clear()


def test_a_failure_allocating_a_budgets_buffers_leaves_that_budget_eager(tower, adapter, monkeypatch):
    """The buffers are allocated on the device before the capture: running out of memory there aborted capture()
    and left the manager half made (its pool set, budgets after 128 not captured, no failure recorded)."""
    m = cpu_manager(adapter)
    real = adapter.prepare_encoder_cudagraph_capture_inputs

    def prepare(token_budget, *args, **kwargs):
        if token_budget == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return real(token_budget, *args, **kwargs)

    monkeypatch.setattr(adapter, "prepare_encoder_cudagraph_capture_inputs", prepare)
    try:
        m.capture(graph_pool=None)
        assert m.captured_budgets() == [64, 256]
        assert m.capture_failures == {128: "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB"}
        kwargs = mm_kwargs(tower, [(1, 16, 24)], seed=5)  # 96 tokens: the failed 128 would hold it, 256 does
        assert_matches_eager(adapter, m.execute(kwargs), eager_per_image(tower, kwargs))
        assert m.get_cumulative_stats()["replays_per_budget"] == {256: 1}
    finally:
        m.clear()


def test_capture_failures_are_those_of_the_last_capture(tower, adapter, monkeypatch):
    m = cpu_manager(adapter)
    real, fail = m.backend.capture, [True]

    def capture(fn, pool=None):
        if fail[0]:
            fail[0] = False  # only the first capture (the largest budget) fails
            raise RuntimeError("simulated transient failure")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    m.capture(graph_pool=None)
    assert list(m.get_cumulative_stats()["capture_failures"]) == [256]
    m.clear()  # as vLLM does after its profiling capture
    assert m.get_cumulative_stats()["capture_failures"] == {}
    fail[0] = True
    m.capture(graph_pool=None)
    assert list(m.capture_failures) == [256]
    m.capture(graph_pool=None)  # a clean capture without clear() mends it
    stats = m.get_cumulative_stats()
    assert stats["capture_failures"] == {} and stats["captured_budgets"] == BUDGETS
    kwargs = mm_kwargs(tower, [(1, 16, 32), (1, 8, 8)], seed=3)
    assert_matches_eager(adapter, m.execute(kwargs), eager_per_image(tower, kwargs))
    assert m.get_cumulative_stats()["replays_per_budget"] == {256: 1}
    m.clear()


def test_a_recapture_without_clear_keeps_no_graph_of_the_earlier_capture(monkeypatch):
    """capture() again without clear() (test_capture_failures_are_those_of_the_last_capture does it): a budget whose
    recapture failed kept the earlier capture's graph, which decide() replayed although capture_failures named it;
    after tower.to() that graph read the old weights, past the weights guard (which holds the new capture's)."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    m = cpu_manager(adapter)
    m.capture(graph_pool=None)
    real, calls = m.backend.capture, []

    def capture(fn, pool=None):
        calls.append(fn)
        if len(calls) == 1:  # the largest budget's recapture fails
            raise RuntimeError("simulated capture failure")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    tower.to(torch.float64)  # the weights move between the two captures
    m.capture(graph_pool=None)
    try:
        assert m.captured_budgets() == [64, 128] and list(m.capture_failures) == [256]
        kwargs = mm_kwargs(tower, [(1, 16, 32), (1, 8, 8)], seed=3)  # 144 tokens: only 256 would hold them
        kwargs["pixel_values"] = kwargs["pixel_values"].double()
        assert_matches_eager(adapter, m.execute(kwargs), eager_per_image(tower, kwargs))
        assert m.get_cumulative_stats()["eager_reasons"] == {"capture failed": 1}
    finally:
        m.clear()


def replayed_once():
    """A tiny tower, a CPU manager that has captured it and replayed one 64-token image, and that image's kwargs."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()
    m = cpu_manager(hv.Qwen3OmniEncoderCudaGraphAdapter(tower))
    m.capture(graph_pool=None)
    kwargs = mm_kwargs(tower, [(1, 8, 8)])
    m.execute(kwargs)
    assert m.replays == 1
    return tower, m, kwargs


def test_a_replay_after_the_towers_weights_moved_raises_naming_the_move():
    tower, m, kwargs = replayed_once()
    tower.to(torch.float64)  # new weights: the graphs captured before would read the freed float32 ones
    message = r"weights were moved since .* captured for torch.float32 on cpu \(the tower is now torch.float64 on cpu"
    with pytest.raises(RuntimeError, match=message):
        m.execute(kwargs)
    with pytest.raises(RuntimeError, match=message):
        upstream.EncoderCudaGraphManager._execute_local(m, kwargs)
    assert m.replays == 1 and m.graph_hits == 1
    m.clear()


def test_a_replay_after_a_middle_weight_got_new_data_raises_naming_the_move(monkeypatch):
    """``weights_key()`` reads three addresses: a middle weight given new ``.data`` kept the key, and on a device the
    graphs read the freed weight. The CPU backend's own check of its reads is set aside, as a device backend has
    none."""
    from hwgraph.graphs import cpu

    monkeypatch.setattr(cpu, "captured_reads", lambda fn: (fn(), None))
    tower, m, kwargs = replayed_once()
    weight = tower.blocks[1].mlp.linear_fc1.weight
    weight.data = weight.data * 2
    for _ in range(2):  # the replay's look at every weight, then the key before the next replay
        with pytest.raises(RuntimeError, match=r"weights were moved since .* given a new tensor or new \.data"):
            m.execute(kwargs)
    m.clear()


def test_a_kernel_that_is_not_graph_safe_is_never_captured(monkeypatch):
    def host_bound_attention(q, k, v, cu_seqlens, max_seqlen, scale):
        return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)

    host_bound_attention.graph_safe = False  # as the NPU kernel: a capture would keep its host sequence lengths
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention=host_bound_attention).eval()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    m = cpu_manager(adapter)
    calls = []
    monkeypatch.setattr(m.backend, "capture", lambda fn, pool=None: calls.append(fn))
    m.capture(graph_pool=None)
    assert calls == [] and m.captured_budgets() == [] and not m.is_captured()
    why = "attention kernel host_bound_attention is not graph-safe"
    assert m.capture_refusal() == why
    assert m.get_cumulative_stats()["capture_failures"] == {b: why for b in BUDGETS}
    kwargs = mm_kwargs(tower, [(1, 8, 8), (1, 4, 4)])
    assert_matches_eager(adapter, m.execute(kwargs), eager_per_image(tower, kwargs))
    assert m.get_cumulative_stats()["eager_reasons"] == {"capture failed": 1}


def test_the_manager_asks_the_tower_for_graph_safe_kernels_when_it_chooses_automatically(monkeypatch):
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    asked = []
    real = tower.set_attention
    monkeypatch.setattr(tower, "set_attention", lambda *args, **kwargs: asked.append(kwargs) or real(*args, **kwargs))
    hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32,
                                           hv.Qwen3OmniEncoderCudaGraphAdapter(tower), graph_backend="cpu")
    assert [kwargs.get("graph_safe") for kwargs in asked] == [True]
    assert tower.attention_spec.graph_safe


def test_manager_refuses_multi_path_encoders(tower):
    class TwoPaths(hv.Qwen3OmniEncoderCudaGraphAdapter):
        def get_encoder_cudagraph_config(self):
            config = super().get_encoder_cudagraph_config()
            config.paths = {"default": config.paths["default"], "other": config.paths["default"]}
            return config

    with pytest.raises(ValueError, match="single-path"):
        hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32, TwoPaths(tower),
                                               graph_backend="cpu")


def test_install_swaps_the_class_vllm_runners_build_and_undoes_it():
    undo = hv.install_single_replay_manager()
    try:
        assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager
    finally:
        undo()
    assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager.__mro__[1]  # vLLM's own class
    assert not issubclass(upstream.EncoderCudaGraphManager, hv.SingleReplayEncoderCudaGraphManager)


def test_install_refuses_a_class_that_is_not_a_vllm_manager_and_a_second_install_before_undo():
    with pytest.raises(TypeError, match="needs a subclass of vLLM's EncoderCudaGraphManager, got <class 'object'>"):
        hv.install_single_replay_manager(object)
    assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager.__mro__[1]

    class Mine(hv.SingleReplayEncoderCudaGraphManager):
        pass

    undo = hv.install_single_replay_manager()
    try:
        with pytest.raises(RuntimeError, match=r"vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager is already "
                                               r"hwgraph.integrations.vllm_manager.SingleReplayEncoderCudaGraphManager"
                                               r": call the undo .* before installing .*Mine"):
            hv.install_single_replay_manager(Mine)
        assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager
    finally:
        undo()
    undo = hv.install_single_replay_manager(Mine)  # after the undo, another class installs
    try:
        assert upstream.EncoderCudaGraphManager is Mine
    finally:
        undo()
    assert not issubclass(upstream.EncoderCudaGraphManager, hv.SingleReplayEncoderCudaGraphManager)


def test_an_undo_kept_from_an_earlier_install_leaves_a_later_install_in_place():
    """undo() swapped back whatever the modules held: install, undo, install again, then the first undo once more
    silently put vLLM's manager back under the second install."""
    first = hv.install_single_replay_manager()
    first()
    second = hv.install_single_replay_manager()
    try:
        first()  # stale: its install is gone
        assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager
    finally:
        second()
    assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager.__mro__[1]
    second()  # once is enough: a second call changes nothing
    assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager.__mro__[1]


def test_a_model_holding_the_adapter_gets_none_of_the_towers_parameters(tower):
    """The adapter was an nn.Module holding the tower: a model that kept it as an attribute (to forward the protocol
    to it) got every tower weight in its named_parameters(), which vLLM's loader reports as not loaded."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.cg = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)

    model = Model()
    assert [name for name, _ in model.named_parameters()] == ["proj.weight", "proj.bias"]
    assert model.cg.tower is tower and supports_encoder_cudagraph(model.cg)


class TwoModeBackend(CpuGraphBackend):
    """The CPU reference backend with a second mode, to see which one the manager asks for."""

    name = "twomode"
    modes = ("emulated", "other")


def test_an_installed_subclass_chooses_the_graph_backend_and_mode_vllm_cannot_pass(tower, adapter, monkeypatch):
    """vLLM constructs the manager with (config, device, dtype, model) only: a subclass is how a deployment picks a
    graph mode (e.g. torchair on Ascend). The mode reaches the backend and the stats; a mode it lacks is refused."""
    from hwgraph import registry
    from hwgraph.capability import Capability

    spec = registry.BackendSpec("twomode", f"{__name__}:TwoModeBackend", ("cpu",), lambda p: Capability.available(),
                                modes=TwoModeBackend.modes, priority=-5)
    specs, problems = registry.discovered()
    monkeypatch.setattr(registry, "discovered", lambda: ((*specs, spec), problems))

    class Other(hv.SingleReplayEncoderCudaGraphManager):
        mode = "other"

        def __init__(self, vllm_config, device, dtype, model):
            super().__init__(vllm_config, device, dtype, model, graph_backend="twomode", graph_mode=self.mode)

    undo = hv.install_single_replay_manager(Other)
    try:
        m = upstream.EncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32, adapter)
    finally:
        undo()
    assert type(m.backend) is TwoModeBackend and m.backend.mode == "other"
    m.capture(graph_pool=None)
    try:
        kwargs = mm_kwargs(tower, [(1, 8, 8)], seed=5)
        got = m.execute(kwargs)
        stats = m.get_cumulative_stats()
        assert (stats["graph_backend"], stats["graph_mode"], stats["replays"]) == ("twomode", "other", 1)
        assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
    finally:
        m.clear()
    default = hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32, adapter,
                                                     graph_backend="twomode")
    assert default.get_cumulative_stats()["graph_mode"] == "emulated", "the backend's first mode by default"
    Other.mode = "full"
    with pytest.raises(ValueError, match=r"graph backend 'twomode' has modes \['emulated', 'other'\], got "
                                         r"mode='full'"):
        Other(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32, adapter)


def test_install_also_rewires_vllms_v2_model_state_and_undo_restores_it(monkeypatch):
    """vLLM 0.33's v2 model state binds EncoderCudaGraphManager at import: an already imported one is patched too."""
    name = "vllm.v1.worker.gpu.model_states.interface"
    v2 = types.ModuleType(name)
    v2.EncoderCudaGraphManager = upstream.EncoderCudaGraphManager
    monkeypatch.setitem(sys.modules, name, v2)
    undo = hv.install_single_replay_manager()
    try:
        assert v2.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager
        assert upstream.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager
    finally:
        undo()
    assert v2.EncoderCudaGraphManager is upstream.EncoderCudaGraphManager
    assert not issubclass(upstream.EncoderCudaGraphManager, hv.SingleReplayEncoderCudaGraphManager)


def test_undo_also_restores_vllms_v2_model_state_imported_after_install(monkeypatch):
    """Imported after install, the v2 model state binds the installed class from the defining module; undo must put
    upstream's back there too, or vLLM's v2 runner keeps building the single-replay manager."""
    name = "vllm.v1.worker.gpu.model_states.interface"
    monkeypatch.delitem(sys.modules, name, raising=False)
    undo = hv.install_single_replay_manager()
    try:
        v2 = types.ModuleType(name)
        v2.EncoderCudaGraphManager = upstream.EncoderCudaGraphManager  # what its import binds now
        monkeypatch.setitem(sys.modules, name, v2)
        assert v2.EncoderCudaGraphManager is hv.SingleReplayEncoderCudaGraphManager
    finally:
        undo()
    assert v2.EncoderCudaGraphManager is upstream.EncoderCudaGraphManager
    assert not issubclass(v2.EncoderCudaGraphManager, hv.SingleReplayEncoderCudaGraphManager)


# ------------------------------------------------------------------------------------------------ versions, imports
@pytest.mark.parametrize("version", ["0.33.0", "0.33.2", "0.33.1.dev3+gabc123", "0.33.0+cu130",
                                     "0.33.0rc1", "0.33.0.dev5", "0.33.0.dev0", "0.33.0.post1"])
def test_supported_versions_are_accepted(version, monkeypatch):
    monkeypatch.delenv(hv.ALLOW_UNSUPPORTED_ENV, raising=False)
    assert hv.check_vllm_version(version).release[:2] == (0, 33)


@pytest.mark.parametrize("version", ["0.32.1", "0.32.9rc1", "0.34.0", "0.34.0rc1", "0.34.0.dev1", "1.0.0",
                                     "not-a-version", None])
def test_unsupported_versions_are_refused_with_the_fix(monkeypatch, version):
    monkeypatch.delenv(hv.ALLOW_UNSUPPORTED_ENV, raising=False)
    with pytest.raises(hv.UnsupportedVllmError, match=r"pip install 'hwgraph\[vllm\]'") as info:
        hv.check_vllm_version(version)
    assert str(hv.SUPPORTED_VLLM) in str(info.value) and isinstance(info.value, ImportError)


def test_an_unsupported_version_can_be_tried_on_purpose(monkeypatch, caplog):
    monkeypatch.setenv(hv.ALLOW_UNSUPPORTED_ENV, "1")
    assert hv.check_vllm_version("0.34.0") == Version("0.34.0")
    assert "supports vllm" in caplog.text
    assert hv.VLLM_VERSION.release[:2] == (0, 33)


@pytest.mark.parametrize("value", ["0", "true", "yes"])
def test_only_the_documented_value_opts_in_to_an_unsupported_vllm(monkeypatch, value):
    monkeypatch.setenv(hv.ALLOW_UNSUPPORTED_ENV, value)
    with pytest.raises(hv.UnsupportedVllmError, match=rf"set {hv.ALLOW_UNSUPPORTED_ENV}=1"):
        hv.check_vllm_version("0.34.0")


def test_the_manager_module_imports_on_its_own_and_is_the_one_the_integration_reexports():
    code = ("import hwgraph.integrations.vllm_manager as m, hwgraph.integrations.vllm as v; "
            "assert v.SingleReplayEncoderCudaGraphManager is m.SingleReplayEncoderCudaGraphManager")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_importing_hwgraph_never_imports_vllm():
    code = ("import sys, hwgraph, hwgraph.integrations, hwgraph.manager, hwgraph.models.qwen3_omni; "
            "hwgraph.EncoderGraphManager; assert 'vllm' not in sys.modules, sorted(m for m in sys.modules "
            "if m.startswith('vllm'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ------------------------------------------------------------------------------------------------ device
@pytest.mark.cuda
@pytest.mark.parametrize("manager_cls", ["single-replay", "upstream"])
def test_real_capture_and_replay_on_cuda(manager_cls):
    """The real capture path: vLLM's pool handle, a device graph per budget, replay equal to eager (bf16)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    tower = Qwen3OmniVisionTower.from_preset("tiny").to(device, torch.bfloat16).eval()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    config = vllm_config(BUDGETS, MAX_ITEMS)
    if manager_cls == "upstream":
        m = upstream.EncoderCudaGraphManager(config, device, torch.bfloat16, adapter)
    else:
        m = hv.SingleReplayEncoderCudaGraphManager(config, device, torch.bfloat16, adapter)
        assert m.backend.name == "cuda", "install backends/cuda (ci/vllm.sh does) for the real capture path"
    m.capture(graph_pool=torch.cuda.graph_pool_handle())
    try:
        for seed, grid in enumerate([[(1, 16, 16)], [(1, 8, 8), (1, 4, 4)], [(1, 40, 40)], [(1, 16, 32)] * 3]):
            kwargs = mm_kwargs(tower, grid, seed=seed)
            kwargs["pixel_values"] = kwargs["pixel_values"].to(device, torch.bfloat16)
            got = m.execute(kwargs)
            torch.accelerator.synchronize()
            assert_matches_eager(adapter, got, eager_per_image(tower, kwargs))
        assert m.graph_hits > 0
    finally:
        m.clear()



def test_a_group_of_precomputed_image_embeddings_is_left_to_the_models_embed_multimodal(tower, adapter, manager):
    """With ``enable_mm_embeds``, vLLM batches ``image_embeds`` items as their own image group (different fields:
    vllm/multimodal/utils.py group_and_batch_mm_kwargs) and hands it to the manager; both runners fall back to
    ``model.embed_multimodal`` when ``execute`` returns None. The group once raised KeyError: 'pixel_values'."""
    kwargs = {"image_embeds": torch.randn(20, adapter.out_hidden_size), "image_grid_thw": torch.tensor([(1, 8, 8),
                                                                                                     (1, 4, 4)])}
    assert manager.execute(kwargs) is None
    assert manager.graph_hits == 0 and manager.replays == 0 and manager.eager_groups == 0


@pytest.mark.parametrize("grid", [[(1, 8, 8), (1, 4, 4)], [(1, 8, 8), (1, 40, 40)]], ids=["replayed", "oversized"])
def test_vllms_own_manager_passes_a_group_of_image_embeddings_through(adapter, manager, grid):
    """vLLM builds its own manager unless install_single_replay_manager() is called, and that one knows no
    encoder_cudagraph_accepts: a group of image_embeds (enable_mm_embeds) raised ValueError inside the engine step.
    Each image gets its rows of image_embeds, as embed_multimodal gives them."""
    tokens = tokens_of(grid)
    embeds = torch.randn(sum(tokens), adapter.out_hidden_size)
    kwargs = {"image_embeds": embeds, "image_grid_thw": torch.tensor(grid)}
    got = upstream.EncoderCudaGraphManager._execute_local(manager, kwargs)  # vLLM's packing: select, replay, eager
    torch.testing.assert_close(torch.cat(got), embeds, rtol=0, atol=0)
    assert [t.shape[0] for t in got] == tokens
    with pytest.raises(ValueError, match=r"image_embeds must be one \[tokens, width\] tensor"):
        upstream.EncoderCudaGraphManager._execute_local(manager, {**kwargs, "image_embeds": embeds[:-1]})


def test_under_encoder_dp_every_rank_gathers_in_the_managers_dtype(tower, adapter, monkeypatch):
    """vLLM's _dp_gather pads and all-gathers in the manager's dtype (empty ranks send torch.empty(..., self.dtype));
    a float32 tower under a bfloat16 manager made ranks with images send float32: all_gather inputs of different
    dtypes and byte sizes across ranks."""
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.bfloat16, adapter,
                                               graph_backend="cpu")
    m.capture(graph_pool=None)
    try:
        m.use_dp = True
        monkeypatch.setattr(upstream, "get_tensor_model_parallel_world_size", lambda: 2)
        kwargs = mm_kwargs(tower, [(1, 8, 8)])
        sent = {}
        for rank in (0, 1):  # one image: rank 0 encodes it, rank 1 has none
            monkeypatch.setattr(upstream, "get_tensor_model_parallel_rank", lambda r=rank: r)
            monkeypatch.setattr(upstream, "tensor_model_parallel_all_gather",
                                lambda t, dim=0, r=rank: (sent.__setitem__(r, t.dtype), torch.cat([t, t]))[1])
            m.execute(kwargs)
        assert sent == {0: torch.bfloat16, 1: torch.bfloat16}
    finally:
        m.clear()
