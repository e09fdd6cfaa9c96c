"""Bad arguments to the manager and the tower: a clear error naming the value and what was expected, raised before
anything changes (a tower may be shared by several managers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hwgraph import manager as manager_module
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.registry import SelectionError


@pytest.fixture
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval()


def manager(tower, **kwargs):
    return EncoderGraphManager(tower, **{"budgets": [16, 32], "max_images_per_graph": 2, "graph_backend": "cpu",
                                         **kwargs})


@pytest.mark.parametrize("kwargs, error, match", [
    ({"budgets": [0], "dtype": torch.float64}, ValueError, r"budgets must be positive, got \[0\]"),
    ({"budgets": [0], "attention": lambda *a: None}, ValueError, r"budgets must be positive"),
    ({"slot_counts": [9], "dtype": torch.float64}, ValueError, r"slot_counts must be ints in 1\.\.max_images"),
    ({"dtype": "float8", "attention": "TORCH_SDPA"}, ValueError, r"unknown dtype 'float8': expected one of float32"),
    ({"dtype": torch.complex64}, ValueError,
     r"dtype must be a floating-point torch\.dtype or its name, got torch\.complex64"),
    ({"dtype": torch.int32}, ValueError, r"dtype must be a floating-point torch\.dtype or its name, got torch\.int32"),
    # float8 is floating point: the tower was moved to it (lossy), then nothing ran
    ({"dtype": torch.float8_e4m3fn}, ValueError, r"got torch\.float8_e4m3fn: expected one of float32, bfloat16, "
                                                 r"float16 or torch\.float64"),
    # a kernel refused on the manager's platform or in its dtype: the tower was moved first, then the choice raised
    ({"dtype": torch.bfloat16, "attention": "FLASH_ATTN"}, SelectionError,
     r"'FLASH_ATTN' is unavailable: FLASH_ATTN runs on NVIDIA CUDA, this platform is cpu"),
    ({"dtype": torch.float64, "attention": "TRITON_ATTN"}, SelectionError,  # judged in the manager's dtype
     r"TRITON_ATTN supports dtypes float16, bfloat16, float32, got float64"),
    ({"dtype": torch.float64, "attention": "NO_SUCH_KERNEL"}, SelectionError, r"unknown attention kernel"),
    ({"device": "meta"}, ValueError, r"device 'meta' cannot run a graph manager: expected an accelerator device"),
    ({"device": "xpu:3", "dtype": torch.float64}, ValueError, r"device 'xpu:3'"),
    ({"attention": 5}, TypeError, r"attention must be a kernel name, 'auto', a callable or None, got 5"),
    ({"log_every": "x"}, ValueError, r"log_every must be an int >= 0 \(0: never log stats\), got 'x'"),
    ({"log_every": -1}, ValueError, r"log_every must be an int >= 0"),
    ({"max_images_per_graph": True}, ValueError, r"max_images_per_graph must be a positive int, got True"),
    # on/off options: a string such as "no" counted as on (calibrate="no" calibrated, compile="no" compiled)
    ({"calibrate": "no"}, ValueError, r"calibrate must be True, False or None, got 'no'"),
    ({"verify": "no"}, ValueError, r"verify must be True or False, got 'no'"),
    ({"compile": "no", "dtype": torch.float64}, ValueError, r"compile must be True or False, got 'no'"),
    ({"measure_products": 1}, ValueError, r"measure_products must be True or False, got 1"),
    ({"verify": None}, ValueError, r"verify must be True or False, got None"),
    # a 0-d array or tensor is iterable by type only: "iteration over a 0-d array", naming nothing
    ({"budgets": np.array(16)}, ValueError, r"budgets must be a list of ints \(merged-token counts\), got array\(16\)"),
    ({"budgets": torch.tensor(16)}, ValueError, r"budgets must be a list of ints .*got tensor\(16\)"),
    ({"slot_counts": np.array(2)}, ValueError, r"slot_counts must be a list of ints .*got array\(2\)"),
    # only None means the backend's first mode: an empty or falsy mode once became it silently
    ({"graph_mode": ""}, ValueError, r"graph backend 'cpu' has modes \['emulated'\], got mode=''"),
    ({"graph_mode": 0}, TypeError, r"graph backend 'cpu' takes a mode name \(one of \['emulated'\]\), got mode=0"),
    ({"graph_mode": False}, TypeError, r"takes a mode name \(one of \['emulated'\]\), got mode=False"),
    ({"graph_mode": ["emulated"]}, TypeError, r"takes a mode name .*got mode=\['emulated'\]"),
    # only None means the automatic choice: an empty name (a script's unset variable) once became it silently
    ({"graph_backend": "", "dtype": torch.float64}, ValueError, r"graph_backend='': expected a graph backend name"),
    ({"graph_backend": False}, TypeError, r"graph_backend=False: expected a graph backend name \(a str\)"),
])
def test_a_bad_argument_is_refused_by_name_and_leaves_the_tower_as_it_was(tower, kwargs, error, match):
    kernel, weights, dtype = tower.attention_kernel, tower.weights_key(), tower.dtype
    with pytest.raises(error, match=match):
        manager(tower, **kwargs)
    assert (tower.attention_kernel, tower.weights_key(), tower.dtype) == (kernel, weights, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given where torch sees no CUDA device")
def test_a_cuda_device_on_a_machine_without_one_is_refused_with_what_this_torch_sees(tower):
    with pytest.raises(ValueError, match=r"device 'cuda:9': this torch \(.*\) sees no cuda device"):
        manager(tower, device="cuda:9")


def test_a_dtype_may_be_named_and_max_images_may_be_a_numpy_int(tower):
    m = manager(tower, dtype="float32", max_images_per_graph=np.int64(2))
    assert m.dtype == torch.float32 and m.max_images == 2 and type(m.max_images) is int


@pytest.mark.parametrize("not_a_tower", [None, torch.nn.Linear(2, 2), "tiny"])
def test_something_that_is_not_a_tower_is_refused_by_type(not_a_tower):
    with pytest.raises(TypeError, match=r"tower must be an hwgraph vision tower \(e\.g\. Qwen3OmniVisionTower\), got "):
        EncoderGraphManager(not_a_tower, budgets=[16], graph_backend="cpu")
    if isinstance(not_a_tower, torch.nn.Module):
        assert next(not_a_tower.parameters()).dtype == torch.float32  # not moved


def test_a_towers_attention_of_the_wrong_type_is_refused_when_given_not_at_first_use():
    with pytest.raises(TypeError, match=r"attention must be a kernel name, 'auto', a callable or None, got 5"):
        Qwen3OmniVisionTower.from_preset("tiny", attention=5)
    t = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA")
    with pytest.raises(TypeError, match="got 5"):
        t.set_attention(5)
    assert t.attention_kernel == "TORCH_SDPA"


def test_calibrate_needs_captured_graphs_and_a_live_manager(tower):
    """calibrate() before capture() once dropped every budget (the manager then never captured anything), and after
    close() it ran on released graphs."""
    m = manager(tower)
    with pytest.raises(RuntimeError, match=r"calibrate\(\) needs captured graphs: call capture\(\) first"):
        m.calibrate()
    assert m.budgets == [16, 32]
    m.capture()
    assert sorted(m.graphs) == [16, 32]
    for bad in ({"samples": 0}, {"warmup": -1}, {"samples": 2.5}):
        with pytest.raises(ValueError, match=r"calibrate\(\): (samples|warmup) must be an int >= [01], got "):
            m.calibrate(**bad)
    m.close()
    with pytest.raises(RuntimeError, match=r"calibrate\(\) after close\(\)"):
        m.calibrate()


@pytest.mark.parametrize("attention, dtype", [("auto", torch.bfloat16), ("TORCH_SDPA", torch.float64),
                                              (None, None)])
def test_a_manager_asks_the_registry_for_its_kernel_once_and_the_tower_runs_that_kernel(tower, monkeypatch,
                                                                                       attention, dtype):
    """The manager chooses before it moves the tower (so a refused kernel leaves the tower as it was) and applies that
    choice after the move: the registry, whose gates may probe the device, is asked once per manager."""
    import hwgraph.attention.registry as registry

    asked = []
    real = registry.choose_attention

    def counting(*args, **kwargs):
        asked.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "choose_attention", counting)
    m = manager(tower, attention=attention, dtype=dtype)
    assert asked == [m.dtype]  # once, judged in the manager's dtype
    assert tower.dtype == m.dtype and tower.attention_fn is m._kernel
    # the same kernel a tower already in that dtype chooses for itself
    fresh = Qwen3OmniVisionTower.from_preset("tiny").to(m.dtype)
    fresh.set_attention(attention, graph_safe=True)
    assert tower.attention_kernel == fresh.attention_kernel


def test_a_grid_past_int32_cu_seqlens_is_refused_naming_its_rows():
    """cu_seqlens are int32: a grid of 2**32 patch rows wrapped its boundaries silently (after allocating tables for
    every row). It is refused first, and so is a budget's filling grid (its divisor search ran for hours at 10**20)."""
    from hwgraph.budgets import filling_grid
    from hwgraph.models.qwen3_omni.metadata import MAX_PATCH_ROWS, normalize_grid

    with pytest.raises(ValueError, match=r"holds 4294967296 patch rows in all; cu_seqlens are int32, so a call takes "
                                         r"at most 2147483647"):
        normalize_grid([(1, 65536, 65536)], 2)
    assert normalize_grid([(1, 2, MAX_PATCH_ROWS // 2 - 1)], 1) == ((1, 2, MAX_PATCH_ROWS // 2 - 1),)
    with pytest.raises(ValueError, match=r"1099511627776 tokens are 4398046511104 patch rows at merge size 2"):
        filling_grid(2**40, 2)
    assert filling_grid(2**20, 2) == (1, 2048, 2048)


def test_a_kernel_changed_under_the_manager_is_named_against_the_kernel_its_graphs_run(tower):
    """The refusal named the graphs' kernel by its Python function ("not the one this manager's graphs run
    (sdpa_varlen)") where the new one was named as a kernel; both are kernel names now."""
    m = manager(tower, dtype=torch.float32, attention="TORCH_SDPA")
    m.capture()
    sdpa = tower.attention_fn

    def other_kernel(*args, **kwargs):
        return sdpa(*args, **kwargs)

    tower.set_attention(other_kernel)
    grid = [(1, 4, 4)]
    with pytest.raises(RuntimeError, match=r"attention kernel is now other_kernel, not the one this manager's graphs "
                                           r"run \(TORCH_SDPA\)"):
        m.encode(torch.randn(16, tower.patch_row_width), grid)
    m.close()


def not_graph_safe(q, k, v, cu_seqlens, max_seqlen, scale):
    from hwgraph.attention.sdpa import sdpa_varlen

    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


not_graph_safe.graph_safe = False


def test_calibrate_without_graphs_says_why_there_are_none_when_capture_would_not_make_any(tower, monkeypatch):
    """After a calibration that kept no budget, or with a kernel that is not graph-safe, calibrate() told the caller
    to call capture() first, which captured nothing again (no budgets left; a refused kernel)."""
    m = manager(tower)
    m.capture()
    monkeypatch.setattr(m, "time_ms", lambda fns, warmup, samples: {"eager": 1.0, "replay": 2.0})
    assert not any(f["kept"] for f in m.calibrate().values())
    assert m.capture() == {}  # capture() cannot help: calibration dropped every budget
    with pytest.raises(RuntimeError, match=r"calibrate\(\) has no captured graphs: an earlier calibration kept no "
                                           r"budget \(no replay beat eager: stats\(\)\['calibration'\]\), so every "
                                           r"call runs eagerly; build a new manager to capture budgets again") as err:
        m.calibrate()
    assert "call capture() first" not in str(err.value)
    m.close()

    m = manager(tower)
    monkeypatch.setattr(manager_module, "capture_budget", lambda *a, **k: (_ for _ in ()).throw(MemoryError("full")))
    m.capture()
    with pytest.raises(RuntimeError, match=r"calibrate\(\) needs captured graphs: every budget's capture failed "
                                           r"\(\{16: 'MemoryError: full', 32: 'MemoryError: full'\}\); "
                                           r"call capture\(\) again to retry$"):
        m.calibrate()
    monkeypatch.undo()
    m.capture()  # and it does
    assert sorted(m.graphs) == [16, 32] and m.calibrate().keys() == {16, 32}
    m.close()

    m = manager(tower, attention=not_graph_safe)
    m.capture()
    with pytest.raises(RuntimeError, match=r"calibrate\(\) has no captured graphs: nothing can be captured: "
                                           r"attention kernel .* is not graph-safe"):
        m.calibrate()
    m.close()
