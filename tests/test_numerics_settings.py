"""Numerics settings that a captured graph keeps from its capture (CUDA's TF32 and reduced-precision reductions,
torch_npu's HF32): a graph captured under other settings than the process's now is not replayed, and capture()
captures it again. The real effect (a TF32 replay beside IEEE eager calls) is tested on a GPU in the CUDA plugin."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from hwgraph.budgets import NUMERICS_CHANGED, settings_changes
from hwgraph.graphs.torch_cuda import MATMUL_SETTINGS, matmul_settings
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

GRID = [(1, 4, 8)]  # 8 tokens: budget 8


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()


def pixels_for(tower, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


@pytest.fixture
def manager(tower):
    """A CPU manager whose backend reports one setting, ``setting["value"]``, as a device backend reports TF32."""
    setting = {"value": "ieee"}
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu",
                            attention="TORCH_SDPA")
    m.backend.numerics_settings = lambda dtype: (("matmul precision", setting["value"]), ("other", 1))
    m.setting = setting
    yield m
    m.close()


def served_by_replay(m, pixels, grid) -> tuple[list, bool]:
    replays = m.stats()["replays"]
    out = m.encode(pixels, grid)
    return out, m.stats()["replays"] == replays + 1


def assert_equal_to_eager(tower, got, pixels, grid):
    with torch.inference_mode():
        want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            torch.testing.assert_close(x, y)


def test_a_graph_captured_under_other_settings_runs_eagerly_with_the_reason(manager, tower, caplog):
    manager.capture()
    assert all(entry.numerics == (("matmul precision", "ieee"), ("other", 1)) for entry in manager.graphs.values())
    pixels = pixels_for(tower, GRID)
    assert served_by_replay(manager, pixels, GRID)[1]
    manager.setting["value"] = "tf32"
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        for _ in range(3):
            out, replayed = served_by_replay(manager, pixels, GRID)
            assert not replayed
            assert_equal_to_eager(tower, out, pixels, GRID)
    warnings = [r.getMessage() for r in caplog.records if "numerics settings" in r.getMessage()]
    assert warnings == ["budget 8 was captured under other numerics settings than now (matmul precision: 'ieee' -> "
                        "'tf32'): its groups run eagerly until capture() captures it again"]  # once, not per call
    assert manager.stats()["eager_reasons"] == {NUMERICS_CHANGED: 3}
    assert manager.select_graph(((1, 4, 8),), 8) == (None, NUMERICS_CHANGED)
    # Back to the capture's settings: replayed again.
    manager.setting["value"] = "ieee"
    assert served_by_replay(manager, pixels, GRID)[1]


def test_capture_again_recaptures_only_the_budgets_of_other_settings(manager, tower, caplog):
    manager.capture()
    before = dict(manager.graphs)
    manager.setting["value"] = "tf32"
    with caplog.at_level(logging.INFO, logger="hwgraph.manager"):
        manager.capture()
    assert sorted(manager.graphs) == [8, 16]
    assert all(manager.graphs[b] is not before[b] for b in (8, 16))
    assert all(entry.numerics[0] == ("matmul precision", "tf32") for entry in manager.graphs.values())
    assert any("budget 16 was captured under other numerics settings (matmul precision: 'ieee' -> 'tf32'): "
               "capturing it again" in r.getMessage() for r in caplog.records)
    assert all(graph.outputs is None for entry in before.values() for graph in entry.graphs.values())  # released
    pixels = pixels_for(tower, GRID, seed=1)
    out, replayed = served_by_replay(manager, pixels, GRID)
    assert replayed
    assert_equal_to_eager(tower, out, pixels, GRID)
    # Settings unchanged: capture() keeps the graphs it has.
    again = dict(manager.graphs)
    manager.capture()
    assert all(manager.graphs[b] is again[b] for b in (8, 16))


def test_the_cpu_backend_keeps_no_settings(tower):
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=2, graph_backend="cpu", attention="TORCH_SDPA")
    assert m.backend.numerics_settings(torch.float32) == ()  # its replays run the forward: they follow the settings
    m.close()


def test_settings_changes_names_each_changed_setting():
    assert settings_changes((("a", 1), ("b", "x")), (("a", 1), ("b", "y"))) == "b: 'x' -> 'y'"
    assert settings_changes((("a", 1),), (("a", 2), ("c", True))) == "a: 1 -> 2, c: None -> True"
    assert settings_changes((), ()) == ""


def test_cuda_matmul_settings_follow_every_api_without_raising():
    """In a fresh process (torch's TF32 APIs refuse legacy reads once both were used, for the whole process):
    TF32 set through the new API, the legacy one and set_float32_matmul_precision, and the bf16 and fp16 reductions,
    each change the reading of their dtype only. Needs no GPU: the settings are torch's global context."""
    script = textwrap.dedent("""
        import torch
        from hwgraph.graphs.torch_cuda import matmul_settings
        m = torch.backends.cuda.matmul
        f32, bf16, f16 = (matmul_settings(d) for d in (torch.float32, torch.bfloat16, torch.float16))
        changes = []
        def changed(label):
            now = [matmul_settings(d) for d in (torch.float32, torch.bfloat16, torch.float16)]
            changes.append((label, [a != b for a, b in zip((f32, bf16, f16), now)]))
        m.fp32_precision = "tf32"; changed("new tf32")
        m.fp32_precision = "ieee"; m.fp32_precision = "none"; changed("back")
        torch.set_float32_matmul_precision("high"); changed("set_float32_matmul_precision high")
        torch.set_float32_matmul_precision("highest"); m.fp32_precision = "none"; changed("back")
        m.allow_tf32 = True; changed("legacy allow_tf32")
        m.fp32_precision = "none"; changed("back")
        torch.backends.fp32_precision = "tf32"; changed("generic tf32")
        torch.backends.fp32_precision = "none"
        m.allow_bf16_reduced_precision_reduction = False; changed("bf16 reduction")
        m.allow_bf16_reduced_precision_reduction = True
        m.allow_fp16_reduced_precision_reduction = False; changed("fp16 reduction")
        print(changes)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout) == [  # noqa: S307 - our own script's printed list
        ("new tf32", [True, False, False]), ("back", [False, False, False]),
        ("set_float32_matmul_precision high", [True, False, False]), ("back", [False, False, False]),
        ("legacy allow_tf32", [True, False, False]), ("back", [False, False, False]),
        ("generic tf32", [True, False, False]), ("bf16 reduction", [False, True, False]),
        ("fp16 reduction", [False, False, True])]


def test_matmul_settings_name_what_they_read():
    names = [name for name, _ in matmul_settings(torch.bfloat16)]
    assert names == [f"torch.backends.cuda.matmul.{n}" for n in MATMUL_SETTINGS[torch.bfloat16]]
    assert [name for name, _ in matmul_settings(torch.float32)][-1] == "torch.backends.fp32_precision"
    assert matmul_settings(torch.float64) == ()
