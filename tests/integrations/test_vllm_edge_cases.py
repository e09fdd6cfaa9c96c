"""Edge cases of the vLLM integration against vLLM 0.33's own code: inputs vLLM may pass the protocol, and encoder
data parallelism (``mm_encoder_tp_mode="data"``) with the tower, the embeddings and the manager in different dtypes.
Runs in .venv-vllm (ci/test.sh vllm); the default CPU run has no vllm and skips this module.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed: the vLLM integration tests run with ci/test.sh vllm")

from vllm.config import CompilationConfig, MultiModalConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from vllm.v1.worker import encoder_cudagraph as upstream  # noqa: E402

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


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()  # float32


@pytest.fixture(scope="module")
def adapter(tower):
    return hv.Qwen3OmniEncoderCudaGraphAdapter(tower)


def captured_manager(model, dtype=torch.float32):
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(), CPU, dtype, model, graph_backend="cpu")
    m.capture(graph_pool=None)
    return m


def vllms_manager(model, graphs_from):
    """vLLM's own EncoderCudaGraphManager replaying the CPU reference backend's graphs of ``graphs_from`` (vLLM's own
    capture needs CUDA)."""
    m = upstream.EncoderCudaGraphManager(vllm_config(), CPU, graphs_from.dtype, model)
    m.budget_graphs, m.graph_pool = graphs_from.budget_graphs, graphs_from.graph_pool
    return m


def pixels_for(tower, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


def gathered_dtypes(manager, kwargs, monkeypatch):
    """What each of two tensor-parallel ranks sends to vLLM's all-gather for ``kwargs`` under encoder DP."""
    manager.use_dp = True
    monkeypatch.setattr(upstream, "get_tensor_model_parallel_world_size", lambda: 2)
    sent = {}
    for rank in (0, 1):
        monkeypatch.setattr(upstream, "get_tensor_model_parallel_rank", lambda r=rank: r)
        monkeypatch.setattr(upstream, "tensor_model_parallel_all_gather",
                            lambda t, dim=0, r=rank: (sent.__setitem__(r, t.dtype), torch.cat([t, t]))[1])
        manager.execute(kwargs)
    return sent


class WithoutAcceptsExtension:
    """A model that forwards the protocol to the adapter but not hwgraph's ``encoder_cudagraph_accepts``."""

    supports_encoder_cudagraph = True

    def __init__(self, adapter):
        self.tower, self._adapter = adapter.tower, adapter

    def __getattr__(self, name):
        if name == "encoder_cudagraph_accepts":
            raise AttributeError(name)
        return getattr(self._adapter, name)


# ------------------------------------------------------------------------------------------------ bad pixels
def test_pixel_values_of_none_are_refused_not_replayed_on_the_previous_groups_pixels(tower, adapter):
    """pixel_values=None reached the replay buffers as None, which vLLM's copy skips: the graph replayed the pixels
    the previous group left in its buffer and handed back that group's features, silently."""
    m = captured_manager(adapter)
    try:
        grid = [(1, 8, 8)]
        first = m.execute({"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid})
        assert m.replays == 1 and len(first) == 1
        kwargs = {"pixel_values": None, "image_grid_thw": grid}
        message = rf"pixel_values must be a floating-point torch.Tensor \[patches, {tower.patch_row_width}\], " \
                  r"got NoneType"
        with pytest.raises(ValueError, match=message):
            m.execute(kwargs)
        with pytest.raises(ValueError, match=message):  # vLLM's packing selects first: AttributeError on .shape
            upstream.EncoderCudaGraphManager._execute_local(m, kwargs)
        assert m.replays == 1
    finally:
        m.clear()


@pytest.mark.parametrize("pixels, got", [(lambda t: pixels_for(t, [(1, 8, 8)])[None], r"got shape \(1, 64, 96\)"),
                                         (lambda t: list(pixels_for(t, [(1, 8, 8)])), "got list")],
                         ids=["3-d tensor", "list of rows"])
def test_vllms_packing_names_pixels_of_the_wrong_form_as_the_single_replay_path_does(tower, adapter, pixels, got):
    """select_encoder_cudagraph_items (vLLM's packing and DP sharding call it first) compared only the row count: a
    [1, patches, width] tensor was 'pixel_values has 1 rows but grids ... need 64', a list an AttributeError."""
    kwargs = {"pixel_values": pixels(tower), "image_grid_thw": [(1, 8, 8)]}
    m = captured_manager(adapter)
    try:
        for run in (m.execute, lambda kw: upstream.EncoderCudaGraphManager._execute_local(m, kw)):
            with pytest.raises(ValueError, match=rf"pixel_values must be .*{got}"):
                run(kwargs)
    finally:
        m.clear()


def test_a_group_with_more_frames_than_the_graphs_slots_is_named(tower, adapter):
    """Image grids with t > 1 under vLLM's packing: four items of five frames each filled 20 sequences into graphs of
    4 slots, and pad_cu_seqlens refused it naming only '(21,) does not fit the captured buffer (5,)'."""
    grid = [(5, 2, 4)] * 4  # 2 tokens per frame, 40 tokens: the 64 budget holds them, its 4 slots do not
    kwargs = {"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid}
    message = r"grids \[(\(5, 2, 4\), ){3}\(5, 2, 4\)\] have 20 frames .* more than the 4 sequence slots"
    with pytest.raises(ValueError, match=message):
        adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, MAX_ITEMS, MAX_ITEMS)
    m = captured_manager(adapter)
    try:
        with pytest.raises(ValueError, match=message):
            upstream.EncoderCudaGraphManager._execute_local(m, kwargs)
        got = m.execute(kwargs)  # the single-replay manager runs t > 1 eagerly
        assert [t.shape[0] for t in got] == [10] * 4 and m.eager_reasons == {"video": 1}
    finally:
        m.clear()


# ------------------------------------------------------------------------------------------------ encoder DP, dtypes
def test_under_encoder_dp_image_embeds_are_gathered_in_the_managers_dtype(tower, adapter, monkeypatch):
    """The single-replay manager cast its output to its dtype before postprocess, but for a group of image_embeds
    (a model that does not forward encoder_cudagraph_accepts) postprocess hands back the embeddings themselves: the
    rank holding them sent float32 to the all-gather, the empty rank bfloat16."""
    m = captured_manager(WithoutAcceptsExtension(adapter), dtype=torch.bfloat16)
    try:
        kwargs = {"image_embeds": torch.randn(16, adapter.out_hidden_size), "image_grid_thw": torch.tensor([(1, 8, 8)])}
        assert gathered_dtypes(m, kwargs, monkeypatch) == {0: torch.bfloat16, 1: torch.bfloat16}
    finally:
        m.clear()


def test_under_encoder_dp_pixels_replayed_in_another_dtype_are_gathered_in_the_managers_dtype(tower, adapter,
                                                                                              monkeypatch):
    m = captured_manager(adapter, dtype=torch.bfloat16)
    try:
        grid = [(1, 8, 8)]
        kwargs = {"pixel_values": pixels_for(tower, grid, seed=4), "image_grid_thw": grid}
        assert gathered_dtypes(m, kwargs, monkeypatch) == {0: torch.bfloat16, 1: torch.bfloat16}
        assert m.replays == 1  # rank 0 replayed; rank 1 had no image
        m.use_dp = False
        with torch.inference_mode():
            want = adapter.encoder_eager_forward(kwargs)
        [got] = m.execute(kwargs)  # the replayed rows, uncast and cloned out of the graph's buffer
        torch.testing.assert_close(got, want)
        buffer = m.budget_graphs["default"][64].output_buffer
        assert got.data_ptr() != buffer.data_ptr()
    finally:
        m.clear()


def test_vllms_own_manager_under_encoder_dp_gathers_image_embeds_in_the_towers_dtype(tower, adapter, monkeypatch):
    """With the tower in the model's dtype (what encoder DP under vLLM's own manager needs), float64 embeddings went
    out as float64 from the rank holding them and as float32 from the empty one. vLLM's Qwen models cast them to the
    vision tower's dtype (image_embeds.type(self.visual.dtype)); so does the adapter."""
    graphs = captured_manager(adapter)
    try:
        m = vllms_manager(adapter, graphs)
        embeds = torch.randn(16, adapter.out_hidden_size, dtype=torch.float64)
        kwargs = {"image_embeds": embeds, "image_grid_thw": torch.tensor([(1, 8, 8)])}
        assert gathered_dtypes(m, kwargs, monkeypatch) == {0: torch.float32, 1: torch.float32}
        m.use_dp = False
        [got] = m.execute(kwargs)
        assert got.dtype == tower.dtype
        torch.testing.assert_close(got, embeds.float(), rtol=0, atol=0)
    finally:
        graphs.clear()


# ------------------------------------------------------------------------------------------------ vLLM's own tower
VLLMS_TOWER = r'''
import copy, sys, torch
from types import SimpleNamespace
from vllm.config import CompilationConfig, MultiModalConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.v1.worker import encoder_cudagraph as upstream
from hwgraph.integrations import vllm as hv
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

config = SimpleNamespace(
    compilation_config=CompilationConfig(cudagraph_mm_encoder=True, encoder_cudagraph_token_budgets=[64, 128, 256],
                                         encoder_cudagraph_max_vision_items_per_batch=4),
    model_config=SimpleNamespace(multimodal_config=MultiModalConfig(limit_per_prompt={"image": 8, "video": 0})),
    parallel_config=ParallelConfig(),
    scheduler_config=SchedulerConfig(max_model_len=8192, is_encoder_decoder=False, max_num_batched_tokens=8192))
GRIDS = [[(1, 8, 8), (1, 4, 12), (1, 2, 2)], [(1, 40, 40)], [(1, 16, 32), (1, 16, 36), (1, 4, 4), (1, 40, 40)]]
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + sys.argv[1])
    initialize_model_parallel(1)
    from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3Omni_VisionTransformer
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        tower = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval().to(dtype)
        vision = copy.deepcopy(tower.config)  # the fields vLLM's tower reads that transformers' config lacks
        vision.image_size, vision.apply_vit_abs_pos_embed = tower.num_grid_per_side * vision.patch_size, True
        visual = Qwen3Omni_VisionTransformer(vision, norm_eps=1e-6, prefix="visual")
        assert visual.load_weights(tower.state_dict().items()) == {n for n, _ in visual.named_parameters()}
        visual = visual.to(dtype).eval()
        for module in visual.modules():  # vLLM's CPU GEMM dispatch needs vllm._C, which its CUDA build lacks
            if hasattr(module, "quant_method"):
                module.cpu_linear = torch.nn.functional.linear
        adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
        m = hv.SingleReplayEncoderCudaGraphManager(config, torch.device("cpu"), torch.bfloat16, adapter,
                                                   graph_backend="cpu")
        m.capture()
        for seed, grid in enumerate(GRIDS):
            pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width,
                                 generator=torch.Generator().manual_seed(seed))
            kwargs = {"pixel_values": pixels, "image_grid_thw": torch.tensor(grid)}
            with torch.inference_mode():  # as the thinker's _process_image_input calls it
                want = visual(pixels.type(visual.dtype), grid_thw=torch.tensor(grid))
                sizes = [t * h * w // 4 for t, h, w in grid]
                runs = {"eager": [adapter.encoder_eager_forward(kwargs)], "single-replay": m.execute(kwargs),
                        "vllm's packing": upstream.EncoderCudaGraphManager._execute_local(m, kwargs)}
            for name, got in runs.items():
                assert [t.shape[0] for t in got] in ([sum(sizes)], sizes), (name, grid)
                got = torch.cat(got)
                assert got.dtype == want.dtype == dtype and got.shape == want.shape, (name, got.shape, want.shape)
                tolerance = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
                for part, (a, b) in enumerate(zip(adapter.split(got).tensors(), adapter.split(want).tensors())):
                    torch.testing.assert_close(a, b, **tolerance, msg=lambda s: f"{name} {grid} part {part}: {s}")
        assert m.replays > 0 and m.eager_groups > 0
        m.clear()
print("ok")
'''


def test_every_path_returns_what_vllms_own_qwen3_omni_tower_returns(tmp_path):
    """vLLM 0.33's own Qwen3-Omni image tower (Qwen3Omni_VisionTransformer, as the thinker's _process_image_input
    calls it), loaded with the hwgraph tower's weights, against the adapter's eager forward, the single-replay manager
    and vLLM's packing: the same [tokens, out_hidden * 4] rows (embeddings, then DeepStack after each index in order),
    in the tower's dtype. A subprocess: vLLM's CPU platform and distributed state stay out of this process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    result = subprocess.run([sys.executable, "-c", VLLMS_TOWER, str(tmp_path / "dist")], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def fresh_tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()  # float32


def dtype_dependent_numerics(dtype):
    """As the CUDA backend's numerics_settings (matmul_settings): which settings apply depends on the dtype."""
    return (("matmul precision", "ieee"),) if dtype == torch.float32 else ()


def replayed_once(m, tower) -> dict:
    """Captures ``m`` and replays one 64-token image; returns that call's kwargs."""
    m.capture(graph_pool=None)
    grid = [(1, 8, 8)]
    kwargs = {"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid}
    m.execute(kwargs)
    assert m.replays == 1
    return kwargs


def test_a_replay_after_a_dtype_move_raises_naming_the_move_not_a_numerics_change(monkeypatch, caplog):
    """The numerics settings were read for the tower's dtype of now: after tower.to(float64) on a backend whose
    settings depend on the dtype (CUDA's), decide() called it 'numerics settings changed since capture', logged a
    warning about settings nobody changed and ran eagerly, where a device move of the same weights raised. The graphs
    compute in the dtype of their capture: read for it, the group is a replay and the move is named."""
    tower = fresh_tower()
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(tower)
    m = hv.SingleReplayEncoderCudaGraphManager(vllm_config(), CPU, torch.float32, adapter, graph_backend="cpu")
    monkeypatch.setattr(m.backend, "numerics_settings", dtype_dependent_numerics)
    try:
        kwargs = replayed_once(m, tower)
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
    try:
        kwargs = replayed_once(m, tower)
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


# ------------------------------------------------------------------------------------------------ logged fallbacks
def test_the_first_eager_group_of_each_reason_is_logged_with_the_reason(tower, adapter, caplog):
    """Groups over the largest budget or with more images than a replay holds ran eagerly without a word: vLLM logs
    only its hit rate, at debug level, so a deployment whose images all exceed 256 tokens never replayed and never
    said why (the reasons were only in get_cumulative_stats()). The first group of each reason is logged, naming it."""
    m = captured_manager(adapter)
    try:
        groups = {"over budget": [(1, 40, 40)], "too many images": [(1, 4, 4)] * 5}
        with caplog.at_level(logging.INFO, logger="hwgraph.integrations.vllm"):
            for _ in range(2):
                for grid in groups.values():
                    m.execute({"pixel_values": pixels_for(tower, grid), "image_grid_thw": grid})
        assert m.eager_reasons == {"over budget": 2, "too many images": 2}
        logged = [r for r in caplog.records if r.name.startswith("hwgraph") and "eagerly" in r.getMessage()]
        assert [r.levelno for r in logged] == [logging.INFO] * 2  # once per reason
        over, many = (r.getMessage() for r in logged)
        assert "1 image(s), 400 tokens" in over and "over budget" in over and "[64, 128, 256]" in over
        assert "5 image(s), 20 tokens" in many and "too many images" in many and "at most 4 images" in many
    finally:
        m.clear()
