"""Review 65 of the vLLM integration: cases found against vLLM 0.33's encoder graph manager contract. Runs in
.venv-vllm (ci/test.sh vllm); the default CPU run has no vllm and skips this module."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: the vLLM integration tests run with ci/test.sh vllm")

from vllm.config import CompilationConfig, MultiModalConfig, ParallelConfig, SchedulerConfig  # noqa: E402

from hwgraph.attention.sdpa import sdpa_varlen  # noqa: E402
from hwgraph.integrations import vllm as hv  # noqa: E402
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower  # noqa: E402

pytestmark = pytest.mark.vllm

BUDGETS = [64, 128, 256]
MAX_ITEMS = 4
CPU = torch.device("cpu")


def vllm_config():
    return SimpleNamespace(
        compilation_config=CompilationConfig(cudagraph_mm_encoder=True, encoder_cudagraph_token_budgets=BUDGETS,
                                             encoder_cudagraph_max_vision_items_per_batch=MAX_ITEMS),
        model_config=SimpleNamespace(multimodal_config=MultiModalConfig(limit_per_prompt={"image": 8, "video": 0})),
        parallel_config=ParallelConfig(),
        scheduler_config=SchedulerConfig(max_model_len=8192, is_encoder_decoder=False, max_num_batched_tokens=8192),
    )


def fresh_tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()  # float32


def pixels_for(tower, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def dtype_dependent_numerics(dtype):
    """As the CUDA backend's numerics_settings (matmul_settings): which settings apply depends on the dtype."""
    return (("matmul precision", "ieee"),) if dtype == torch.float32 else ()


def test_a_replay_after_a_dtype_move_raises_naming_the_move_not_a_numerics_change(monkeypatch, caplog):
    """The numerics settings were read for the tower's dtype of now: after tower.to(float64) on a backend whose
    settings depend on the dtype (CUDA's), decide() called it 'numerics settings changed since capture', logged a
    warning about settings nobody changed and ran eagerly, where a device move of the same weights raised. The graphs
    compute in the dtype of their capture: read for it, the group is a replay and the move is named."""
    tower = fresh_tower()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(), CPU, torch.float32, adapter, graph_backend="cpu")
    monkeypatch.setattr(m.backend, "numerics_settings", dtype_dependent_numerics)
    m.capture(graph_pool=None)
    try:
        grid = [(1, 8, 8)]
        kwargs = {"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid}
        m.execute(kwargs)
        assert m.replays == 1
        tower.to(torch.float64)
        with caplog.at_level(logging.WARNING, logger="hwgraph.integrations.vllm"):
            with pytest.raises(RuntimeError, match=r"weights were moved since .* captured for torch.float32"):
                m.execute(kwargs)
        assert not [r for r in caplog.records if "numerics settings" in r.getMessage()]
        assert m.eager_reasons == {} and m.replays == 1
    finally:
        m.clear()


def test_a_budget_listed_twice_is_captured_once_and_not_reported_failed_while_it_replays(monkeypatch):
    """vLLM accepts encoder_cudagraph_token_budgets with repeats ([64, 64, 128]) and its capture loop visits each
    entry: the manager captured 64 twice, replacing the first graph without releasing it, and when the second
    attempt failed, capture_failures and the stats reported 64 as failed while its first graph replayed every group
    of up to 64 tokens."""
    tower = fresh_tower()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    config = vllm_config()
    config.compilation_config.encoder_cudagraph_token_budgets = [64, 64, 128]
    m = hv.SingleReplayEncoderCudaGraphManager(config, CPU, torch.float32, adapter, graph_backend="cpu")
    assert m.path_token_budgets["default"] == [64, 64, 128]  # vLLM keeps the repeat
    real, calls = m.backend.capture, []

    def capture(fn, pool=None):
        calls.append(fn)
        if len(calls) == 3:  # largest first: 128, 64, then 64 again
            raise RuntimeError("simulated capture failure")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    m.capture(graph_pool=None)
    try:
        assert len(calls) == 2
        assert m.captured_budgets() == [64, 128]
        stats = m.get_cumulative_stats()
        assert stats["capture_failures"] == {} and stats["num_budgets"] == 2
        grid = [(1, 8, 8)]
        m.execute({"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid})
        assert m.replays_per_budget == {64: 1}
    finally:
        m.clear()


def test_a_replay_after_the_towers_attention_kernel_changed_raises_naming_both_kernels():
    """As EncoderGraphManager: the graphs would go on running the captured kernel while eager groups ran the new one
    (the CPU backend's replays, which run the forward again, the new one too)."""
    def other_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
        return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)

    tower = fresh_tower()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(), CPU, torch.float32, adapter, graph_backend="cpu")
    m.capture(graph_pool=None)
    try:
        grid = [(1, 8, 8)]
        kwargs = {"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid}
        m.execute(kwargs)
        assert m.replays == 1
        tower.set_attention(other_sdpa)
        with pytest.raises(RuntimeError, match=r"attention kernel is now other_sdpa, not the one its encoder graphs "
                                               r"were captured with \(TORCH_SDPA\)"):
            m.execute(kwargs)
        assert m.replays == 1
        m.capture(graph_pool=None)  # captured again with the tower's kernel of now: replays
        m.execute(kwargs)
        assert m.replays == 2
    finally:
        m.clear()
