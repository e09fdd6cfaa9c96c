"""vLLM integration behaviour that a hand-made mutation audit found unchecked by test_vllm_adapter.py: the opt-in for
an unsupported vLLM, the host ``max_seqlen`` a captured graph keeps, the budget range under a small scheduler budget,
the "capture failed" reason at a budget's exact size, and the wiring of vLLM's v2 model state. Runs in .venv-vllm
(ci/test.sh vllm); the default CPU run has no vllm and skips this module.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: the vLLM integration tests run with ci/test.sh vllm")

from vllm.config import CompilationConfig, MultiModalConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from vllm.v1.worker import encoder_cudagraph as upstream  # noqa: E402

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


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()


@pytest.fixture(scope="module")
def adapter(tower):
    return hv.Qwen3OmniEncoderCudaGraphAdapter(tower)


@pytest.mark.parametrize("value", ["0", "true", "yes"])
def test_only_the_documented_value_opts_in_to_an_unsupported_vllm(monkeypatch, value):
    monkeypatch.setenv(hv.ALLOW_UNSUPPORTED_ENV, value)
    with pytest.raises(hv.UnsupportedVllmError, match=rf"set {hv.ALLOW_UNSUPPORTED_ENV}=1"):
        hv.check_vllm_version("0.34.0")


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


def test_the_budget_range_never_ends_below_its_start_under_a_small_scheduler_budget(adapter):
    small = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=32))  # below the 64 minimum
    assert adapter.get_encoder_cudagraph_budget_range(small) == (64, 64)


def test_a_group_of_exactly_a_failed_budgets_size_is_reported_as_a_capture_failure(adapter, monkeypatch):
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(BUDGETS, MAX_ITEMS), CPU, torch.float32, adapter,
                                               graph_backend="cpu")
    real, calls = m.backend.capture, []

    def capture(fn, pool=None):
        calls.append(fn)
        if len(calls) == 1:  # the first capture is the largest budget
            raise RuntimeError("simulated capture failure")
        return real(fn, pool)

    monkeypatch.setattr(m.backend, "capture", capture)
    m.capture(graph_pool=None)
    try:
        assert m.captured_budgets() == [64, 128] and list(m.capture_failures) == [256]
        kwargs = {"pixel_values": torch.zeros(1024, adapter.tower.patch_row_width), "image_grid_thw": [(1, 32, 32)]}
        decision = m.decide(adapter.get_encoder_cudagraph_item_specs(kwargs))  # 256 tokens: the failed budget holds it
        assert (decision.budget, decision.reason) == (None, "capture failed")
    finally:
        m.clear()


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
