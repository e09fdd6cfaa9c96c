"""EncoderGraphManager under the caller's ambient torch state: grad and inference modes, autocast, the default device,
torch.compile around encode(), the global RNG, and the pytest plugin's thread setting."""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref

import pytest
import torch

from hwgraph import compile_mode
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.testing import plugin

SMALL = [(1, 4, 8)]  # 8 tokens: replayed in budget 8
LARGE = [(1, 8, 12)]  # 24 tokens: above the largest budget, eager


def tiny_tower(seed: int = 0) -> Qwen3OmniVisionTower:
    torch.manual_seed(seed)
    return Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()


@pytest.fixture(scope="module")
def tower():
    return tiny_tower()


def make_manager(tower, **kwargs):
    return EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu",
                               attention="TORCH_SDPA", **kwargs)


def pixels_for(tower, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g).to(tower.dtype)


def eager_outputs(tower, pixels, grid):
    with torch.inference_mode():
        return tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])


def assert_equal_to_eager(got, tower, pixels, grid):
    want = eager_outputs(tower, pixels, grid)
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            assert x.dtype == y.dtype == tower.dtype
            torch.testing.assert_close(x, y)


def encode_path(manager, pixels, grid):
    """``manager.encode`` and which path served it."""
    replays = manager.stats()["replays"]
    out = manager.encode(pixels, grid)
    return out, "replay" if manager.stats()["replays"] > replays else "eager"


# ---------------------------------------------------------------- grad and inference modes
def test_a_capture_in_inference_mode_serves_calls_outside_it(tower):
    """capture() in inference mode made the static buffers inference tensors: every replay outside it (a server
    thread, no_grad) raised "Inplace update to inference tensor outside InferenceMode", as did calibrate()."""
    with torch.inference_mode():
        m = make_manager(tower)
        m.capture()
    pixels = pixels_for(tower, SMALL)
    out, path = encode_path(m, pixels, SMALL)
    assert path == "replay"
    assert_equal_to_eager(out, tower, pixels, SMALL)
    with torch.no_grad():
        assert_equal_to_eager(m.encode(pixels, SMALL), tower, pixels, SMALL)
    served = []
    worker = threading.Thread(target=lambda: served.append(m.encode(pixels, SMALL)))
    worker.start()
    worker.join()
    assert_equal_to_eager(served[0], tower, pixels, SMALL)
    m.calibrate(warmup=0, samples=1)


@pytest.mark.parametrize("grid", [SMALL, LARGE], ids=["replay", "eager"])
def test_outputs_outside_inference_mode_are_normal_tensors_on_either_path(tower, grid):
    """The eager fallback returned inference tensors where a replay returned normal ones: an in-place update, or
    autograd through the outputs, raised only for groups no graph holds."""
    m = make_manager(tower)
    m.capture()
    pixels = pixels_for(tower, grid)
    out, path = encode_path(m, pixels, grid)
    assert path == ("replay" if grid is SMALL else "eager")
    assert_equal_to_eager(out, tower, pixels, grid)
    embeds = out[0].embeds
    assert not embeds.is_inference() and not embeds.requires_grad
    weight = torch.randn(embeds.shape[1], 3, requires_grad=True)
    (embeds @ weight).sum().backward()
    embeds.mul_(2)
    with torch.inference_mode():
        inside, _ = encode_path(m, pixels, grid)
    assert inside[0].embeds.is_inference()  # in inference mode, both paths hand out inference tensors


def test_pixels_with_an_autograd_history_stay_out_of_the_static_buffers(tower):
    """Pixels requiring grad made the static pixel buffer part of the caller's autograd graph: it kept the caller's
    tensors alive, and every later call added one node to its history (a leak without bound)."""
    m = make_manager(tower)
    m.capture()
    held = torch.ones(1000, requires_grad=True)
    alive = weakref.ref(held)
    pixels = pixels_for(tower, SMALL) + 0 * held.sum()
    out, path = encode_path(m, pixels, SMALL)
    assert path == "replay" and not out[0].embeds.requires_grad
    assert_equal_to_eager(out, tower, pixels.detach(), SMALL)
    del pixels, held
    gc.collect()
    assert alive() is None
    for seed in range(3):
        m.encode(pixels_for(tower, SMALL, seed), SMALL)
    for entry in m.graphs.values():
        assert entry.pixels.grad_fn is None and not entry.pixels.requires_grad


# ---------------------------------------------------------------- autocast
def test_autocast_around_capture_does_not_change_the_graphs(tower):
    """Captured under autocast, an fp32 manager's graphs held bf16 outputs: replays came back bf16 (eager calls
    fp32), and capture's own check passed, its eager forward running under the same autocast."""
    m = make_manager(tower)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.capture()
    assert all(g.outputs.dtype == torch.float32 for e in m.graphs.values() for g in e.graphs.values())
    for grid in (SMALL, LARGE):
        pixels = pixels_for(tower, grid)
        assert_equal_to_eager(m.encode(pixels, grid), tower, pixels, grid)


@pytest.mark.parametrize("grid", [SMALL, LARGE], ids=["replay", "eager"])
def test_autocast_around_encode_gives_the_manager_dtype_on_either_path(tower, grid):
    """Under the caller's autocast the eager fallback came back bf16 while a replay came back fp32 (on the CPU
    backend with bf16-rounded values in it): a graph replays what it captured, so neither path takes autocast."""
    m = make_manager(tower)
    m.capture()
    pixels = pixels_for(tower, grid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, path = encode_path(m, pixels, grid)
        assert torch.is_autocast_enabled("cpu")  # the caller's state is back once encode() returns
    assert path == ("replay" if grid is SMALL else "eager")
    assert_equal_to_eager(out, tower, pixels, grid)


# ---------------------------------------------------------------- torch.compile around encode()
def test_encode_inside_a_callers_compiled_function(tower):
    """encode() in a function the caller compiles (fullgraph=False): dynamo traced into the manager, its graphs
    and the host metadata, and compiling failed ("Cannot set version_counter for inference tensor")."""
    m = make_manager(tower)
    m.capture()

    def step(pixels, grid):
        return m.encode(pixels, grid)[0].embeds * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=False)
    for seed, grid in enumerate((SMALL, LARGE)):
        pixels = pixels_for(tower, grid, seed)
        torch.testing.assert_close(compiled(pixels, grid), eager_outputs(tower, pixels, grid)[0].embeds * 2)
    assert m.stats()["replays"] == 1 and m.stats()["eager_groups"] == 1


# ---------------------------------------------------------------- meta device
def test_a_manager_refuses_a_tower_on_the_meta_device_and_says_so():
    """A tower built under torch.device("meta") and not loaded: capture failed every budget with "pin_memory=True
    requires a CUDA or other accelerator backend", and encode() raised it."""
    with torch.device("meta"):
        tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0])
    with pytest.raises(ValueError, match="meta device.*load its weights"):
        make_manager(tower)


def test_meta_init_then_assign_load_gives_the_rotary_frequencies_real_values(tower):
    """Meta init, then load_state_dict(assign=True): the non-persistent rotary frequencies stayed on meta and the
    forward raised "Tensor on device meta is not on the expected device cpu!"."""
    with torch.device("meta"):
        loaded = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0])
    loaded.load_state_dict(tower.state_dict(), assign=True)
    loaded.eval()
    assert loaded.rotary_pos_emb.inv_freq.device.type == "cpu"
    torch.testing.assert_close(loaded.rotary_pos_emb.inv_freq, tower.rotary_pos_emb.inv_freq, rtol=0, atol=0)
    m = make_manager(loaded)
    m.capture()
    assert m.stats()["capture_failures"] == {}
    for grid in (SMALL, LARGE):
        pixels = pixels_for(tower, grid)
        assert_equal_to_eager(m.encode(pixels, grid), tower, pixels, grid)


def test_compiled_capture_under_a_meta_default_device(monkeypatch):
    """compile=True on bf16: inductor's rounding probe made its input with a bare arange, a meta tensor under the
    caller's torch.set_default_device("meta"), and capture() raised "Cannot copy out of meta tensor"."""
    monkeypatch.setattr(compile_mode, "_ROUNDING_PROBES", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the probe's inputs are what is checked here
    tower = tiny_tower().to(torch.bfloat16)
    m = make_manager(tower, compile=True)
    with torch.device("meta"):
        m.capture()
    assert sorted(m.graphs) == [8, 16] and m.stats()["compile_skipped"] is None
    pixels = pixels_for(tower, SMALL)
    assert_equal_to_eager(m.encode(pixels, SMALL), tower, pixels, SMALL)


# ---------------------------------------------------------------- process-global state left as it was
def test_capture_and_calibrate_leave_the_global_rng_alone(tower):
    """capture() and calibrate() drew their random pixels from torch's global generator: a caller's seeded draws
    after them depended on how many budgets were captured."""
    torch.manual_seed(123)
    want = torch.rand(4)
    m = make_manager(tower)
    torch.manual_seed(123)
    m.capture()
    m.calibrate(warmup=0, samples=1)
    torch.testing.assert_close(torch.rand(4), want, rtol=0, atol=0)


def test_the_pytest_plugin_leaves_other_suites_torch_threads_alone(monkeypatch):
    """The plugin loads in every pytest session of an environment with hwgraph (entry point pytest11), and under
    xdist it set torch's thread count for other projects' suites too."""
    saved = torch.get_num_threads()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setattr(plugin.os, "cpu_count", lambda: 12)  # the share (3) differs from the 2 set below on any host
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delitem(sys.modules, plugin.SUITE_MODULE, raising=False)
    monkeypatch.setattr(plugin, "rewrite_suite_asserts", lambda: None)
    config = types.SimpleNamespace(addinivalue_line=lambda *args: None, getini=lambda name: False)
    try:
        torch.set_num_threads(2)
        plugin.pytest_configure(config)
        plugin.pytest_collection_modifyitems(config, [])
        assert torch.get_num_threads() == 2  # no hwgraph suite collected: untouched
        monkeypatch.setitem(sys.modules, plugin.SUITE_MODULE, types.ModuleType(plugin.SUITE_MODULE))
        plugin.pytest_collection_modifyitems(config, [])
        assert torch.get_num_threads() == 12 // 4 != 2  # hwgraph's suite: shared
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------- the caller's changes to cached metadata
@pytest.mark.parametrize("change", [
    pytest.param(lambda meta, other: meta.pos_weights.mul_(0), id="in-place-op"),
    pytest.param(lambda meta, other: meta.first_seqs(1).cu_seqlens.add_(1), id="through-a-view"),
    # to() on the tensors' own device hands back the cached object: a caller using it as static buffers
    pytest.param(lambda meta, other: meta.to("cpu").copy_from(other), id="copy_from"),
])
def test_a_callers_in_place_change_to_prepared_metadata_does_not_reach_later_calls(tower, change):
    """prepare_metadata hands out its cached tensors: a caller's in-place change to them (or copy_from into them, as
    into static buffers) changed every later call of that grid, eager and replayed, silently."""
    grid = [(1, 4, 8)]
    pixels = pixels_for(tower, grid)
    want = [t.clone() for t in eager_outputs(tower, pixels, grid)[0].tensors()]
    m = make_manager(tower)
    m.capture()
    meta = tower.prepare_metadata(grid)
    tables = {name: t.clone() for name, t in meta.tensors().items()}
    change(meta, tower.prepare_metadata([(1, 8, 4)]))
    again = tower.prepare_metadata(grid)
    assert again.grid_thw == ((1, 4, 8),)
    for name, t in again.tensors().items():
        torch.testing.assert_close(t, tables[name], rtol=0, atol=0, msg=f"{name} of the cached metadata changed")
    for got in (eager_outputs(tower, pixels, grid)[0], encode_path(m, pixels, grid)[0][0]):
        for x, y in zip(got.tensors(), want, strict=True):
            torch.testing.assert_close(x, y)
    assert tower.prepare_metadata(grid) is again  # built once again, then cached as before
