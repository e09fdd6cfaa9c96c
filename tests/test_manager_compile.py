"""Compiled replay (torch.compile per budget, then capture) on the CPU reference backend, where inductor runs."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import subprocess
import sys
import time
import weakref

import pytest
import torch
from packaging.version import Version

from hwgraph import compile_mode
from hwgraph.capability import Capability
from hwgraph.graphs.base import inductor_support
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

INDUCTOR = inductor_support(torch.device("cpu"))
needs_inductor = pytest.mark.skipif(not INDUCTOR.ok, reason=INDUCTOR.describe())


@needs_inductor
def test_compiled_replay_equals_eager_with_the_same_stats_and_fallback_rules():
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    m.capture()
    assert sorted(m.graphs) == [16] and m.stats()["capture_failures"] == {}
    assert m.stats()["capture_seconds_per_budget"][16] > 0
    assert 0 < m.stats()["compile_seconds_per_budget"][16] < m.stats()["capture_seconds_per_budget"][16]
    for seed, grid in enumerate([[(1, 4, 4), (1, 4, 8)], [(1, 8, 8)], [(1, 2, 2)], [(1, 8, 12)], [(2, 4, 4)]]):
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)
        with m.backend.sync_guard():
            got = m.encode(pixels, grid)
        want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
        for a, b in zip(got, want, strict=True):
            for x, y in zip(a.tensors(), b.tensors(), strict=True):
                torch.testing.assert_close(x, y)
    s = m.stats()
    assert s["replays_per_budget"] == {16: 3}
    assert s["eager_reasons"] == {"over budget": 1, "video": 1}
    assert s["hits"] == 4 and s["misses"] == 2
    compiled = weakref.ref(m._block_forward)
    m.close()
    gc.collect()
    assert compiled() is None, "close() kept the compiled block forward (and dynamo's cache of it)"


def my_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
    from hwgraph.attention.sdpa import sdpa_varlen

    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


@needs_inductor
def test_compiled_mode_compiles_one_block_per_shape_for_every_budget_without_hitting_the_recompile_limit():
    from torch._dynamo.utils import counters

    torch.manual_seed(1)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=6).eval()
    budgets = [1, 2, 4, 8, 16]  # 2 compiled block graphs each: 10, more than dynamo's default limit of 8
    counters.clear()
    for attention in ("TORCH_SDPA", my_sdpa):  # a second manager (other kernel) compiles as many graphs again
        m = EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=1, graph_backend="cpu", compile=True,
                                attention=attention)
        m.capture()
        assert sorted(m.graphs) == budgets and m.stats()["capture_failures"] == {}
        if attention == "TORCH_SDPA":
            m.close()
    # regional compilation: a 6-block tower traces one middle block and the last block per budget, not 6 blocks
    assert counters["stats"]["unique_graphs"] == 2 * 2 * len(budgets)
    for budget, grid in zip(budgets, [[(1, 2, 2)], [(1, 2, 4)], [(1, 4, 4)], [(1, 4, 8)], [(1, 8, 8)]], strict=True):
        pixels = torch.randn(budget * 4, tower.patch_row_width)
        got = m.encode(pixels, grid)[0]
        want = tower.forward(pixels, grid)
        for x, y in zip(got.tensors(), want.tensors(), strict=True):
            torch.testing.assert_close(x, y)
    assert m.stats()["replays_per_budget"] == dict.fromkeys(budgets, 1)
    m.close()


@needs_inductor
def test_compiled_mode_compiles_each_budget_once_for_all_its_slot_counts():
    from torch._dynamo.utils import counters

    torch.manual_seed(2)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=6).eval()

    def slot_bound_sdpa(q, k, v, cu_seqlens, max_seqlen, scale):
        return my_sdpa(q, k, v, cu_seqlens, max_seqlen, scale)

    slot_bound_sdpa.slot_bound = True
    counters.clear()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=4, graph_backend="cpu", compile=True,
                            attention=slot_bound_sdpa)
    m.capture()
    assert m.slot_counts == [1, 2, 4] and all(list(e.graphs) == [1, 2, 4] for e in m.graphs.values())
    assert m.stats()["capture_failures"] == {} and m.stats()["compile_failures"] == {}
    # cu_seqlens' length is dynamic: a middle and a last block per budget, not per budget and slot count
    assert counters["stats"]["unique_graphs"] == 2 * 2
    for n in (1, 2, 3, 4):
        grid = [(1, 2, 4)] * n
        pixels = torch.randn(8 * n, tower.patch_row_width)
        want = tower.forward(pixels, grid).split([2] * n)
        for got, w in zip(m.encode(pixels, grid), want, strict=True):
            for x, y in zip(got.tensors(), w.tensors(), strict=True):
                torch.testing.assert_close(x, y)
    assert m.stats()["replays_per_slots"] == {1: 1, 2: 1, 4: 2}
    m.close()


@needs_inductor
def test_compiled_mode_times_compiling_apart_from_capturing():
    from torch._dynamo.utils import counters

    torch.manual_seed(3)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=3, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    capture = m.backend.capture
    compiled_in_capture = []

    def recording_capture(fn, pool):
        before = counters["stats"]["unique_graphs"]
        graph = capture(fn, pool)
        compiled_in_capture.append(counters["stats"]["unique_graphs"] - before)
        return graph

    m.backend.capture = recording_capture
    asked_current_stream = []  # the compiled forward's first call runs on the current stream: prepare readies it
    m.backend.prepare = lambda fn, current_stream=False: asked_current_stream.append(current_stream)
    counters.clear()
    m.capture()
    s = m.stats()
    assert asked_current_stream == [True, True]
    assert counters["stats"]["unique_graphs"] == 2 * 2  # a middle and a last block per budget
    # every compilation happened in the timed first forward, none while capturing
    assert compiled_in_capture == [0] * len(m.budgets) * len(m.slot_counts)
    assert set(s["compile_seconds_per_budget"]) == {8, 16} and s["compile_failures"] == {}
    for budget, seconds in s["compile_seconds_per_budget"].items():
        assert 0 < seconds < s["capture_seconds_per_budget"][budget]
    check_against_eager(tower, m, [[(1, 4, 8)], [(1, 4, 4), (1, 4, 8)]])
    plain = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=2, graph_backend="cpu")
    plain.capture()
    assert plain.stats()["compile_seconds_per_budget"] == {} and plain.stats()["capture_seconds_per_budget"][8] > 0
    m.close()
    plain.close()


def check_against_eager(tower, m, grids, guard=False):
    """Each grid's replay (under the backend's sync guard, with ``guard``) equals the eager tower's, in the tower's
    dtype, with torch.testing's closeness for it."""
    for seed, grid in enumerate(grids):
        g = torch.Generator().manual_seed(seed)
        pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g).to(tower.dtype)
        with m.backend.sync_guard() if guard else contextlib.nullcontext():
            got = m.encode(pixels, grid)
        want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
        for a, b in zip(got, want, strict=True):
            for x, y in zip(a.tensors(), b.tensors(), strict=True):
                torch.testing.assert_close(x, y)


def test_compiled_mode_on_a_backend_without_inductor_captures_plain_and_says_why(monkeypatch, caplog):
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", lambda: Capability.unavailable("no inductor for this device"))
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("torch.compile called"))
    asked_current_stream = []
    monkeypatch.setattr(m.backend, "prepare", lambda fn, current_stream=False: asked_current_stream.append(
        current_stream))
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    assert sorted(m.graphs) == [8, 16] and m.stats()["capture_failures"] == {}
    assert asked_current_stream == [False, False]  # captured plain: nothing runs on the current stream first
    assert m.stats()["compile_skipped"] == "no inductor for this device"
    assert "capturing without torch.compile" in caplog.text and "no inductor for this device" in caplog.text
    check_against_eager(tower, m, [[(1, 4, 8)], [(1, 4, 4), (1, 4, 8)]])
    assert m.stats()["replays_per_budget"] == {8: 1, 16: 1}


def test_a_failed_compiled_capture_falls_back_to_a_plain_capture_not_to_eager(monkeypatch, caplog):
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)

    def broken_compile(fn, **kwargs):
        def run(*args):
            time.sleep(0.2)  # compiling, then failing
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    s = m.stats()
    assert sorted(m.graphs) == [8, 16] and s["capture_failures"] == {} and s["compile_skipped"] is None
    assert set(s["compile_failures"]) == {8, 16}
    assert s["compile_seconds_per_budget"] == {} and set(s["capture_seconds_per_budget"]) == {8, 16}
    # each budget's whole startup: the failed compiled attempt (its first compiled forward sleeps) and the plain one
    assert all(seconds >= 0.2 for seconds in s["capture_seconds_per_budget"].values())
    assert all(m.graphs[b].capture_seconds == s["capture_seconds_per_budget"][b] for b in (8, 16))
    assert all("inductor exploded" in reason for reason in s["compile_failures"].values())
    assert "capturing it without torch.compile" in caplog.text
    check_against_eager(tower, m, [[(1, 4, 8)], [(1, 8, 8)]])
    assert m.stats()["eager_groups"] == 0


def test_a_failed_compiled_captures_tensors_are_freed_before_the_plain_capture(monkeypatch):
    """The plain retry ran inside the except clause, whose exception held the failed attempt's frames and with them
    what it had allocated (on a GPU, a budget's activations in the pool the retry captures into)."""
    import weakref

    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=1, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)
    real, left, alive_at_retry = m._capture_budget, [], []

    def capture_budget(budget, compiled=False):
        if compiled:
            activations = torch.empty(1024)
            left.append(weakref.ref(activations))
            raise RuntimeError("out of memory while compiling")
        alive_at_retry.append(left[0]() is not None)
        return real(budget)

    monkeypatch.setattr(m, "_capture_budget", capture_budget)
    m.capture()
    assert sorted(m.graphs) == [8] and set(m.stats()["compile_failures"]) == {8}
    assert alive_at_retry == [False], "the failed compiled attempt's tensors were alive during the plain capture"
    m.close()


@needs_inductor
def test_failures_are_those_of_the_last_capture_compiled_ones_included(monkeypatch):
    """A budget whose compiled and plain captures both failed stays eager; a later capture() that compiles and
    captures it clears both reasons, as it clears a plain capture's."""
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu", compile=True)
    real = m.backend.capture

    def broken(fn, pool=None):
        raise RuntimeError("the device said no")

    monkeypatch.setattr(m.backend, "capture", broken)
    m.capture()
    s = m.stats()
    assert m.graphs == {} and set(s["capture_failures"]) == set(s["compile_failures"]) == {16}
    monkeypatch.setattr(m.backend, "capture", real)
    m.capture()
    s = m.stats()
    assert sorted(m.graphs) == [16] and s["capture_failures"] == {} and s["compile_failures"] == {}
    assert set(s["compile_seconds_per_budget"]) == {16}
    m.close()


def test_inductor_support_names_what_is_missing(monkeypatch):
    assert "generates no code for meta devices" in inductor_support(torch.device("meta")).describe()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "needs a C++ compiler" in inductor_support(torch.device("cpu")).describe()
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/cc/bin/{name}")
    assert inductor_support(torch.device("cpu")).ok


def test_inductor_is_refused_on_gpus_under_the_triton_interpreter(monkeypatch):
    """Under TRITON_INTERPRET inductor's Triton kernels run on the host: every compiled capture on a GPU failed and
    the budgets were captured uncompiled. The CPU's inductor generates C++, which the interpreter does not touch."""
    pytest.importorskip("triton", reason="inductor on GPUs needs triton; the refusal follows its module check")
    gpu = torch.device("cuda", 0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton's knobs read the variable at each look
    assert inductor_support(gpu).ok
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    support = inductor_support(gpu)
    assert not support.ok and "TRITON_INTERPRET is set" in support.describe()
    assert "unset TRITON_INTERPRET" in support.describe()
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/cc/bin/{name}")
    assert inductor_support(torch.device("cpu")).ok


@pytest.mark.parametrize("imported", [True, False], ids=["inductor-imported", "inductor-not-imported"])
def test_inductor_support_looks_for_the_compilers_inductor_runs_not_any_on_path(monkeypatch, imported):
    """With c++ and clang++ on PATH but no g++ (and CXX unset), inductor_support said available and every compiled
    capture failed "InvalidCxxCompiler: No working C++ compiler found in torch._inductor.config.cpp.cxx: (None,
    'g++')", then captured plain; now the manager captures plain up front, saying why (compile_skipped)."""
    import shutil

    import torch._inductor.config as inductor_config

    def compilers(*cxx):  # inductor's config as CXX sets it on import (monkeypatch breaks its proxy's attributes)
        return inductor_config.patch({"cpp.cxx": cxx}) if imported else contextlib.nullcontext()

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("CXX", raising=False)
    if not imported:
        monkeypatch.delitem(sys.modules, "torch._inductor.config", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name in ("c++", "clang++") else None)
    with compilers(None, "g++"):
        support = inductor_support(torch.device("cpu"))
    assert not support.ok
    assert "it runs g++ (torch._inductor.config.cpp.cxx" in support.describe()
    # the compiler CXX names, as inductor reads it (its config, once imported)
    if not imported:
        monkeypatch.setenv("CXX", "clang++")
    with compilers(None, "clang++"):
        assert inductor_support(torch.device("cpu")).ok


@needs_inductor
def test_compiled_bench_times_plain_replay_side_by_side_and_reports_both():
    from hwgraph.bench import BenchConfig, parse_groups, run_bench
    from hwgraph.report import bench_markdown

    cfg = BenchConfig(preset="tiny", groups=parse_groups("1x4,2x4"), device=torch.device("cpu"),
                      dtype=torch.float32, graph_backend="cpu", warmup=1, samples=2, budgets=[8], compile=True,
                      kernels=["TORCH_SDPA"])
    result = run_bench(cfg)
    for r in result["rows"]:
        for column in ("transformers", "eager", "plain_replay", "replay"):
            assert r[column]["samples"] == 2 and r[column]["median_ms"] > 0
        assert r["speedup"]["replay_vs_plain_replay"] == pytest.approx(
            r["plain_replay"]["median_ms"] / r["replay"]["median_ms"])
    text = bench_markdown(result)
    assert ("| transformers eager | hwgraph eager | hwgraph plain replay | hwgraph compiled replay |" in text
            and text.count("| compiled vs plain replay |") == 1)
    assert "plain replay and compiled replay are sampled in turn" in text
    per = result["per_kernel"]["TORCH_SDPA"]
    assert set(per["plain_capture_seconds"]) == {8} and set(per["stats"]["compile_seconds_per_budget"]) == {8}
    assert all(f"| TORCH_SDPA | {what} |" in text for what in ("compiling", "compiling and capturing", "plain capture"))


def test_triton_cache_folder_is_pinned_to_inductors_before_any_kernel_compiles(monkeypatch):
    """Inductor switches TRITON_CACHE_DIR for the whole process when it first loads one of its Triton kernels; a
    second process, loading cached graphs, switched later than the first had and compiled hwgraph's kernels again
    (6 of them on the H200). Compiled mode sets inductor's folder first, and leaves a folder the user chose."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    from hwgraph.compile_mode import pin_triton_cache_dir

    # a copy of the environment without the variable: what the function sets does not outlive the test
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"})
    assert pin_triton_cache_dir(torch.device("cpu")) is None and "TRITON_CACHE_DIR" not in os.environ
    assert pin_triton_cache_dir(torch.device("cuda", 1)) == triton_cache_dir(1) == os.environ["TRITON_CACHE_DIR"]
    assert triton_cache_dir(1).endswith(os.path.join("triton", "1"))
    os.environ["TRITON_CACHE_DIR"] = "/chosen"
    assert pin_triton_cache_dir(torch.device("cuda", 0)) == "/chosen" and os.environ["TRITON_CACHE_DIR"] == "/chosen"
    os.environ["TRITON_CACHE_DIR"] = ""  # was kept, and Triton then refused to compile ("Could not create or locate
    assert pin_triton_cache_dir(torch.device("cuda", 0)) == triton_cache_dir(0) != ""  # cache dir")
    assert os.environ["TRITON_CACHE_DIR"] == triton_cache_dir(0)


PIN_WITHOUT_AN_INDUCTOR_FOLDER = """
import os, sys, torch
from hwgraph.compile_mode import pin_triton_cache_dir
assert pin_triton_cache_dir(torch.device("cuda", 0)) == sys.argv[1] == os.environ["TRITON_CACHE_DIR"]
"""


@needs_inductor
def test_an_inductor_cache_folder_that_cannot_be_made_pins_tritons_default_folder(tmp_path):
    """Importing inductor makes its cache folder: the OSError escaped ``capture()`` instead of failing the compiled
    captures, which fall back. Triton's default folder is pinned instead (inductor would otherwise switch the process
    to its unusable one as it loaded a kernel). In a child: the failed import leaves dynamo half-imported there."""
    pytest.importorskip("triton", reason="Triton's default cache folder is Triton's to name")
    (tmp_path / "file").write_text("a file where a folder should be")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "file" / "inductor")
    env["TRITON_HOME"] = str(tmp_path / "home")
    default = str(tmp_path / "home" / ".triton" / "cache")
    done = subprocess.run([sys.executable, "-c", PIN_WITHOUT_AN_INDUCTOR_FOLDER, default], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Triton's cache folder for compiled mode is Triton's default, {default}: inductor's cannot be used: " \
        in done.stderr and "Not a directory" in done.stderr


@needs_inductor
def test_only_a_compiled_capture_pins_the_triton_cache_folder_for_its_device(monkeypatch):
    from hwgraph import manager as manager_module

    pinned = []
    monkeypatch.setattr(manager_module, "pin_triton_cache_dir", pinned.append)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    EncoderGraphManager(tower, budgets=[8], max_images_per_graph=1, graph_backend="cpu").capture()
    assert pinned == []
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=1, graph_backend="cpu", compile=True)
    m.capture()
    assert pinned == [torch.device("cpu")] and sorted(m.graphs) == [8]


@needs_inductor
def test_the_triton_cache_folder_is_pinned_before_the_rounding_probe_compiles(monkeypatch):
    """The bf16 rounding probe is an inductor compile: on a GPU it loads a Triton kernel, and inductor then set the
    process's Triton folder itself, unchecked, before the pin that would have refused an unwritable one."""
    from hwgraph import manager as manager_module

    order = []
    monkeypatch.setattr(manager_module, "pin_triton_cache_dir", lambda device: order.append("pin"))

    def probe(device, dtype):
        order.append("probe")
        return Capability.unavailable("not probed in this test")

    monkeypatch.setattr(manager_module, "inductor_rounds_as_eager", probe)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=1, graph_backend="cpu", compile=True,
                            dtype=torch.bfloat16)
    m.capture()
    assert order == ["pin", "probe"] and m.stats()["compile_skipped"] == "not probed in this test"


def test_compile_skipped_goes_once_no_graph_captured_uncompiled_for_it_is_held(monkeypatch):
    """compile_skipped ("all budgets captured uncompiled, because ...") stayed after a later capture() had captured
    every budget again, compiled or after a failed compiled capture."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # what is checked here is the bookkeeping
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", lambda: Capability.unavailable("no inductor today"))
    m.capture()
    assert m.stats()["compile_skipped"] == "no inductor today"
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)
    m.capture()  # captures nothing: the plain graphs are still the ones held
    assert m.stats()["compile_skipped"] == "no inductor today"
    real_numerics, real_capture = m.backend.numerics_settings, m._capture_budget

    def capture_budget(budget, compiled=False):
        if compiled and budget == 16:
            raise RuntimeError("inductor exploded")
        return real_capture(budget, compiled)

    monkeypatch.setattr(m.backend, "numerics_settings", lambda dtype: (*real_numerics(dtype), ("test", "changed")))
    monkeypatch.setattr(m, "_capture_budget", capture_budget)
    m.capture()  # both budgets again: 8 compiled, 16 plain after its compiled capture failed
    s = m.stats()
    assert s["compile_skipped"] is None and list(s["compile_seconds_per_budget"]) == [8]
    assert list(s["compile_failures"]) == [16] and sorted(m.graphs) == [8, 16]


# ------------------------------------------------------------------ compiled vs plain parity (an audit's findings)
def tiny_tower(seed=0, **kw):
    torch.manual_seed(seed)
    return Qwen3OmniVisionTower.from_preset("tiny", **{"depth": 2, "deepstack_visual_indexes": [0], **kw}).eval()


@needs_inductor
def test_an_inductor_failure_is_a_recorded_compile_failure_even_where_dynamo_suppresses_errors(monkeypatch):
    """suppress_errors (TORCHDYNAMO_SUPPRESS_ERRORS=1) swallowed the failure: stats said compiled, no reason kept."""
    import torch._inductor.compile_fx as compile_fx_module

    def boom(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(compile_fx_module, "compile_fx", boom)
    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=1, graph_backend="cpu", compile=True)
    with torch._dynamo.config.patch(suppress_errors=True):  # as TORCHDYNAMO_SUPPRESS_ERRORS=1 sets it
        m.capture()
    s = m.stats()
    assert set(s["compile_failures"]) == {8} and "inductor exploded" in s["compile_failures"][8]
    assert s["compile_seconds_per_budget"] == {} and sorted(m.graphs) == [8]
    m.close()


@needs_inductor
def test_a_kernel_that_breaks_the_graph_fails_the_compiled_capture_instead_of_sharing_caches(monkeypatch):
    """A graph break in the kernel: dynamo traced VisionAttention.forward as a frame of its own, whose cache every
    manager shares, so other managers' compilations counted against this one's recompile limit (5th manager failed),
    and the kernel ran outside the compiled graph with nothing recorded."""
    from hwgraph.attention.sdpa import sdpa_varlen_op

    def breaking(q, k, v, cu_seqlens, max_seqlen, scale):
        torch._dynamo.graph_break()
        return sdpa_varlen_op(q, k, v, cu_seqlens, max_seqlen, float(scale))

    tower = tiny_tower(depth=1)
    m = EncoderGraphManager(tower, budgets=[4], max_images_per_graph=1, graph_backend="cpu", compile=True,
                            attention=breaking)
    m.capture()
    assert "graph_break" in m.stats()["compile_failures"].get(4, ""), m.stats()["compile_failures"]
    check_against_eager(tower, m, [[(1, 2, 8)]], guard=True)
    m.close()


@needs_inductor
def test_a_compiled_manager_whose_towers_kernel_another_manager_changed_does_not_recompile_on_replay():
    """Manager b set my_sdpa on the shared tower; a's CPU replay re-ran dynamo with the new kernel: its guards failed,
    it recompiled on the replay path, and under the sync guard inductor's constant folding raised HostSyncError
    (plain mode replayed). Expected: refused up front, as for moved weights (or replayed without recompiling)."""
    from torch._dynamo.utils import counters

    tower = tiny_tower()
    a = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True,
                            attention="TORCH_SDPA")
    a.capture()
    b = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=2, graph_backend="cpu", compile=True,
                            attention=my_sdpa)
    b.capture()
    counters.clear()
    with pytest.raises(RuntimeError, match="attention kernel"):
        check_against_eager(tower, a, [[(1, 8, 8)]], guard=True)
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled on a's replay path
    check_against_eager(tower, b, [[(1, 4, 8)]], guard=True)


@needs_inductor
def test_compiled_bf16_replay_equals_eager_as_closely_as_plain_replay():
    """Invariant 3 (bf16: torch.testing's closeness). Plain replay of a filled budget equals eager; compiled replay
    failed assert_close on every output (inductor keeps bf16 intermediates in float32). With emulated casts it equals
    eager where inductor's CPU code honours them (torch 2.13); where it does not (torch 2.11, on the H200's host),
    compiled replay still failed on every output, so the manager captures plain there and says why."""
    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True,
                            dtype=torch.bfloat16)
    m.capture()
    s = m.stats()
    assert sorted(m.graphs) == [8, 16] and s["compile_failures"] == {}
    rounding = compile_mode.inductor_rounds_as_eager(torch.device("cpu"), torch.bfloat16)
    assert s["compile_skipped"] == (None if rounding.ok else rounding.describe())
    if Version(torch.__version__).release >= (2, 13):  # inductor's C++ code emulates eager's casts from here on
        assert rounding.ok, rounding.describe()
    elif Version(torch.__version__).release < (2, 11):  # torch 2.10's C++ vec code fails on emulated casts
        assert not rounding.ok and "inductor failed to compile a bfloat16 probe on cpu" in rounding.describe()
    elif Version(torch.__version__).release < (2, 12):
        assert not rounding.ok and "does not round bfloat16 intermediates on cpu" in rounding.describe()
    check_against_eager(tower, m, [[(1, 4, 8)], [(1, 8, 8)], [(1, 4, 4), (1, 4, 4)]], guard=True)
    m.close()


@needs_inductor
def test_a_compiled_bf16_replay_that_recompiles_after_the_process_state_moved_still_equals_eager():
    """The CPU backend replays by running the compiled forward again; dynamo's guards cover process-wide state
    (the thread count, deterministic algorithms), so a change after capture recompiled on the replay path, outside
    ``compile_limits``: without emulated casts, and the bf16 replay missed eager's closeness on 16-28% of its
    elements."""
    from torch._dynamo.utils import counters

    rounding = compile_mode.inductor_rounds_as_eager(torch.device("cpu"), torch.bfloat16)
    if not rounding.ok:
        pytest.skip(f"bf16 is captured plain here: {rounding.describe()}")
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=4, graph_backend="cpu", compile=True,
                            dtype=torch.bfloat16)
    m.capture()
    assert m.stats()["compile_skipped"] is None and m.stats()["compile_failures"] == {}
    check_against_eager(tower, m, [[(1, 8, 8)]])
    threads = torch.get_num_threads()
    torch.set_num_threads(threads - 1 if threads > 1 else 2)
    try:
        counters.clear()
        check_against_eager(tower, m, [[(1, 8, 8)]])
        assert counters["stats"]["unique_graphs"] > 0  # it did recompile on the replay path, under the limits
    finally:
        torch.set_num_threads(threads)
    m.close()

def inductor_without_emulated_casts(monkeypatch):
    """compile_mode's settings with inductor's emulated casts off (as torch 2.11's C++ code behaved), and no probe
    result kept from earlier tests."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(compile_mode, "_ROUNDING_PROBES", {})
    real_limits = compile_mode.compile_limits

    @contextlib.contextmanager
    def without_emulated_casts(num_budgets):
        with real_limits(num_budgets), inductor_config.patch({"emulate_precision_casts": False}):
            yield

    monkeypatch.setattr(compile_mode, "compile_limits", without_emulated_casts)


@needs_inductor
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_rounding_probe_tells_an_inductor_that_rounds_only_at_the_end(monkeypatch, dtype):
    inductor_without_emulated_casts(monkeypatch)
    found = compile_mode.inductor_rounds_as_eager(torch.device("cpu"), dtype)
    name = str(dtype).removeprefix("torch.")
    assert not found.ok
    assert f"does not round {name} intermediates on cpu as eager does" in found.describe()
    assert compile_mode.inductor_rounds_as_eager(torch.device("cpu"), dtype) is found  # probed once per process
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("float32 needs no probe"))
    assert compile_mode.inductor_rounds_as_eager(torch.device("cpu"), torch.float32).ok


@needs_inductor
def test_compiled_bf16_where_inductor_rounds_only_at_the_end_captures_plain_and_says_why(monkeypatch, caplog):
    """A manager whose compiled replays would not equal eager (inductor's CPU code up to torch 2.11) captures plain,
    replays equal to eager, and says why; the float32 manager beside it still compiles."""
    inductor_without_emulated_casts(monkeypatch)
    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True,
                            dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    s = m.stats()
    assert sorted(m.graphs) == [8, 16] and s["capture_failures"] == {} and s["compile_failures"] == {}
    assert "does not round bfloat16 intermediates on cpu as eager does" in s["compile_skipped"]
    assert s["compile_seconds_per_budget"] == {} and "capturing without torch.compile" in caplog.text
    check_against_eager(tower, m, [[(1, 4, 8)], [(1, 4, 4), (1, 4, 4)]], guard=True)
    m.close()
    f32 = EncoderGraphManager(tiny_tower(), budgets=[8], max_images_per_graph=2, graph_backend="cpu", compile=True)
    f32.capture()
    assert f32.stats()["compile_skipped"] is None and set(f32.stats()["compile_seconds_per_budget"]) == {8}
    f32.close()


@needs_inductor
def test_a_kernel_that_specializes_on_the_slot_count_compiles_where_there_is_one_slot_count():
    """cu_seqlens' length was marked dynamic even with one slot count: a kernel that loops over it failed with
    ConstraintViolationError and the budget was captured plain."""
    from hwgraph.attention.sdpa import sdpa_varlen

    def looping(q, k, v, cu_seqlens, max_seqlen, scale):
        slots = len([i for i in range(cu_seqlens.shape[0] - 1)])  # sizes something by the slot count
        return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale) * (1.0 if slots else 0.0)

    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=1, graph_backend="cpu", compile=True,
                            attention=looping)
    m.capture()
    assert m.slot_counts == [1] and m.stats()["compile_failures"] == {}
    check_against_eager(tower, m, [[(1, 4, 8)]], guard=True)


def test_the_code_copy_keeps_keyword_only_defaults_and_refuses_what_it_cannot_copy():
    import functools

    def block(x, scale=2.0, *, eps=0.5):
        return x * scale + eps

    copy = compile_mode.own_code_copy(block)
    assert copy.__code__ is not block.__code__ and copy.__qualname__ == block.__qualname__
    assert copy(1.0) == block(1.0) == 2.5  # eps was lost: "missing 1 required keyword-only argument"
    with pytest.raises(TypeError, match=r"own_code_copy needs a plain Python function .* got partial"):
        compile_mode.own_code_copy(functools.partial(block, scale=3.0))  # was AttributeError: no __code__


@pytest.mark.parametrize("how", ["TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE"])
def test_compiled_mode_where_dynamo_is_disabled_captures_plain_and_says_why(monkeypatch, caplog, how):
    """torch._dynamo.config.disable (TORCH_COMPILE_DISABLE=1) or TORCHDYNAMO_DISABLE=1 (read at each torch.compile)
    makes torch.compile hand back the function itself: the manager 'compiled' every budget, stats() gave each a
    compile time and no reason, and the bench's compiled column was plain replay."""
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    m = EncoderGraphManager(tower, budgets=[8], max_images_per_graph=2, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)  # wherever inductor would run
    if how == "TORCHDYNAMO_DISABLE":
        monkeypatch.setenv(how, "1")
    # config.patch, not monkeypatch: monkeypatch's undo deleted the entry, which hid it from dynamo for the process
    with torch._dynamo.config.patch(disable=how == "TORCH_COMPILE_DISABLE"), \
            caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    s = m.stats()
    assert sorted(m.graphs) == [8] and s["capture_failures"] == {} and s["compile_seconds_per_budget"] == {}
    assert how in (s["compile_skipped"] or ""), s["compile_skipped"]
    assert "torch.compile is disabled in this process" in s["compile_skipped"]
    assert "capturing without torch.compile" in caplog.text
    check_against_eager(tower, m, [[(1, 4, 8)]])
