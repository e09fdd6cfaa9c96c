"""The vLLM integration on CPU: the adapter's eager forward checks pixels as the replay path does, and a grid
without a length is named. Runs in the default CPU run: without vLLM, a stand-in of the few vLLM names the
integration imports (the protocol's dataclasses and the manager's base class) is put in ``sys.modules`` for this
module's tests only; with vLLM installed, the real one is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types

import pytest
import torch

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

HAS_VLLM = importlib.util.find_spec("vllm") is not None
OURS = ("hwgraph.integrations.vllm", "hwgraph.integrations.vllm_manager", "hwgraph.integrations.vllm_version")


def stand_in_vllm() -> dict[str, types.ModuleType]:
    """Modules named as vLLM 0.33's, holding only what hwgraph.integrations.vllm imports from them."""

    @dataclasses.dataclass
    class EncoderCudaGraphConfig:
        modalities: list
        buffer_keys: list
        out_hidden_size: int
        padding_logics: dict = dataclasses.field(default_factory=dict)
        max_frames_per_video: int = 1
        paths: dict = dataclasses.field(default_factory=lambda: {"default": None})
        capture_axes: tuple = ()

    @dataclasses.dataclass
    class EncoderItemSpec:
        input_size: int
        output_tokens: int
        path_output_tokens: dict | None = None

    @dataclasses.dataclass
    class EncoderCudaGraphCaptureInputs:
        values: dict

    @dataclasses.dataclass
    class EncoderCudaGraphReplayBuffers:
        values: dict

    @dataclasses.dataclass
    class BudgetGraphMetadata:
        token_budget: int
        max_batch_size: int
        max_frames_per_batch: int
        graph: object
        input_buffers: dict
        output_buffer: object
        axis_keys: tuple = ()

    class EncoderCudaGraphManager:  # only a base class here: these tests build no manager
        pass

    modules = {name: types.ModuleType(name) for name in ("vllm", "vllm.v1", "vllm.v1.worker",
                                                         "vllm.v1.worker.encoder_cudagraph_defs",
                                                         "vllm.v1.worker.encoder_cudagraph")}
    modules["vllm"].__version__ = "0.33.0"
    defs = modules["vllm.v1.worker.encoder_cudagraph_defs"]
    for cls in (EncoderCudaGraphConfig, EncoderItemSpec, EncoderCudaGraphCaptureInputs, EncoderCudaGraphReplayBuffers):
        setattr(defs, cls.__name__, cls)
    manager = modules["vllm.v1.worker.encoder_cudagraph"]
    manager.BudgetGraphMetadata, manager.EncoderCudaGraphManager = BudgetGraphMetadata, EncoderCudaGraphManager
    return modules


@pytest.fixture(scope="module")
def hv():
    """hwgraph.integrations.vllm, imported against the stand-in where vLLM is absent; sys.modules (and the
    hwgraph.integrations package's attributes) are put back afterwards, so that other tests see no vLLM."""
    if HAS_VLLM:
        yield importlib.import_module("hwgraph.integrations.vllm")
        return
    import hwgraph.integrations as package

    fakes = stand_in_vllm()
    saved = {name: sys.modules.get(name) for name in (*fakes, *OURS)}
    attributes = {name: package.__dict__.get(name.rsplit(".", 1)[1]) for name in OURS}
    try:
        for name in OURS:
            sys.modules.pop(name, None)
        sys.modules.update(fakes)
        yield importlib.import_module("hwgraph.integrations.vllm")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name, value in attributes.items():
            attribute = name.rsplit(".", 1)[1]
            if value is None:
                package.__dict__.pop(attribute, None)
            else:
                setattr(package, attribute, value)


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()


@pytest.fixture(scope="module")
def adapter(hv, tower):
    return hv.Qwen3OmniEncoderCudaGraphAdapter(tower)


GRID = [(1, 8, 8), (1, 4, 4)]  # 80 patch rows, 20 tokens


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_eager_refuses_integer_pixels_as_the_replay_path_does(tower, adapter, dtype):
    """The eager forward cast pixel_values to the tower's dtype before the tower checked them, so raw integer pixels
    (uint8 values, not normalised floats) were encoded when the group ran eagerly (too many images, over budget, no
    graphs) and refused with a ValueError when the same group replayed."""
    kwargs = {"pixel_values": torch.randint(0, 255, (80, tower.patch_row_width), dtype=dtype), "image_grid_thw": GRID}
    message = rf"pixel_values must be a floating-point torch.Tensor \[patches, {tower.patch_row_width}\], got Tensor " \
              rf"of {dtype}"
    with pytest.raises(ValueError, match=message):
        adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, 4, 4)
    with pytest.raises(ValueError, match=message), torch.inference_mode():
        adapter.encoder_eager_forward(kwargs)


def test_eager_refuses_pixels_that_are_not_a_tensor_naming_what_it_got(tower, adapter):
    """A list of per-image rows raised AttributeError: 'list' object has no attribute 'to'."""
    kwargs = {"pixel_values": [torch.randn(64, tower.patch_row_width), torch.randn(16, tower.patch_row_width)],
              "image_grid_thw": GRID}
    with pytest.raises(ValueError, match=r"pixel_values must be a floating-point torch.Tensor .*got list"), \
            torch.inference_mode():
        adapter.encoder_eager_forward(kwargs)


def test_eager_still_casts_floating_pixels_to_the_towers_dtype(tower, adapter):
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(80, tower.patch_row_width, generator=g, dtype=torch.float64)
    with torch.inference_mode():
        got = adapter.encoder_eager_forward({"pixel_values": pixels, "image_grid_thw": GRID})
        want = adapter.concat(tower.forward(pixels.to(tower.dtype), GRID))
    assert got.dtype == tower.dtype and got.shape == (20, adapter.out_hidden_size)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("grid", [torch.tensor(3), 5], ids=["0-d tensor", "int"])
def test_a_grid_without_rows_is_named_not_a_typeerror_from_len(adapter, grid):
    """host_grid took len() of the grid first: a 0-d tensor raised TypeError 'len() of a 0-d tensor', an int
    "object of type 'int' has no len()", instead of normalize_grid's ValueError naming the grid."""
    kwargs = {"pixel_values": torch.zeros(4, adapter.tower.patch_row_width), "image_grid_thw": grid}
    with pytest.raises(ValueError, match="grid_thw"):
        adapter.get_encoder_cudagraph_item_specs(kwargs)


def test_an_empty_grid_is_still_no_items(adapter):
    for grid in ([], torch.zeros(0, 3, dtype=torch.int64)):
        kwargs = {"pixel_values": torch.zeros(0, adapter.tower.patch_row_width), "image_grid_thw": grid}
        assert adapter.get_encoder_cudagraph_item_specs(kwargs) == []


def test_replay_buffers_refuse_pixel_values_of_none(adapter):
    """None reached the replay buffers as None, which vLLM's copy skips: the graph replayed the previous group's pixels
    (tests/integrations/test_vllm_edge_cases.py shows it through the manager)."""
    kwargs = {"pixel_values": None, "image_grid_thw": GRID}
    with pytest.raises(ValueError, match=r"pixel_values must be a floating-point torch.Tensor .*got NoneType"):
        adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, 4, 4)


def test_select_names_a_pixel_tensor_of_the_wrong_rank_by_its_shape(tower, adapter):
    """select compared only the row count: [1, 80, width] was named as '1 rows', not as the wrong shape."""
    kwargs = {"pixel_values": torch.zeros(1, 80, tower.patch_row_width), "image_grid_thw": GRID}
    with pytest.raises(ValueError, match=rf"\[patches, {tower.patch_row_width}\].*got shape \(1, 80, "):
        adapter.select_encoder_cudagraph_items(kwargs, [0])


def test_image_embeds_come_out_in_the_towers_dtype(tower, adapter):
    """As vLLM's Qwen models cast them (image_embeds.type(self.visual.dtype)): passed through as given, float64
    embeddings reached vLLM's encoder-DP all-gather beside float32 features."""
    embeds = torch.randn(20, adapter.out_hidden_size, dtype=torch.float64)
    kwargs = {"image_embeds": embeds, "image_grid_thw": GRID}
    with torch.inference_mode():
        eager = adapter.encoder_eager_forward(kwargs)
    dest = {}
    adapter.postprocess_encoder_output({}, [0, 1], [16, 4], dest, batch_mm_kwargs=kwargs)
    for got in (eager, torch.cat([dest[0], dest[1]])):
        assert got.dtype == tower.dtype
        torch.testing.assert_close(got, embeds.to(tower.dtype), rtol=0, atol=0)


def test_replay_buffers_name_a_group_with_more_frames_than_the_graphs_slots(tower, adapter):
    """One (t=5) grid has 5 attention sequences; graphs captured for 4 slots: pad_cu_seqlens refused it later, naming
    only the buffers' shapes."""
    kwargs = {"pixel_values": torch.zeros(40, tower.patch_row_width), "image_grid_thw": [(5, 2, 4)]}
    with pytest.raises(ValueError, match=r"grids \[\(5, 2, 4\)\] have 5 frames .*more than the 4 sequence slots"):
        adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, 4, 4)
    assert adapter.prepare_encoder_cudagraph_replay_buffers(kwargs, 4, 5).values["cu_seqlens"].shape == (6,)


def test_the_adapter_refuses_a_tower_that_is_not_an_hwgraph_tower_naming_it(hv, tower):
    """transformers' encoder (or vLLM's own ``self.visual``) was taken as the tower: the error came later, from inside
    vLLM's manager, as "AttributeError: 'Qwen3OmniMoeVisionEncoder' object has no attribute 'out_hidden_size'"."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    with pytest.raises(TypeError, match=r"tower must be an hwgraph vision tower \(e.g. Qwen3OmniVisionTower\), got "
                                        r"Qwen3OmniMoeVisionEncoder without "):
        hv.Qwen3OmniEncoderCudaGraphAdapter(Qwen3OmniMoeVisionEncoder(tower.config))
    with pytest.raises(TypeError, match=r"got NoneType without "):
        hv.Qwen3OmniEncoderCudaGraphAdapter(None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eager_takes_host_pixels_for_a_gpu_tower_as_the_replay_path_does(hv, tower):
    """The replay path copies host pixels into the graph's device buffer; the eager forward handed them to the GPU
    tower as they came, which failed with a device mismatch once a group ran eagerly (vLLM's own tower moves them)."""
    gpu = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()
    gpu.load_state_dict(tower.state_dict())
    gpu = gpu.to("cuda")
    adapter = hv.Qwen3OmniEncoderCudaGraphAdapter(gpu)
    pixels = torch.randn(80, tower.patch_row_width, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = adapter.encoder_eager_forward({"pixel_values": pixels, "image_grid_thw": GRID})
        want = adapter.encoder_eager_forward({"pixel_values": pixels.cuda(), "image_grid_thw": GRID})
    assert got.device == want.device == gpu.device
    torch.testing.assert_close(got, want, rtol=0, atol=0)
