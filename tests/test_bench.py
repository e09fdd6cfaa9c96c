"""``hwgraph bench`` on CPU: group specs, budgets, the shape of its JSON and Markdown (tiny preset, 2 samples), and
the bookkeeping under it: latency statistics and sampling (``hwgraph.timing``), device busy time
(``hwgraph.profiling``), pinned host copies, and compiled mode's settings and fallbacks. Timings there are injected
(fake clocks, events and profilers): nothing here asserts how fast anything runs."""

from __future__ import annotations

import itertools
import json
import logging
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  (at collection: the first capture would otherwise spend 2 s importing it)
from torch.autograd import DeviceType

from hwgraph import cli, timing
from hwgraph.bench import BenchConfig, Group, covering_budgets, flatten_rows, parse_groups, run_bench
from hwgraph.bench_command import cmd_bench
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.platform import detect
from hwgraph.profiling import kernel_time
from hwgraph.report import bench_markdown
from hwgraph.testing.simulate import simulate_refused_mode_backend


def test_group_specs_parse_into_counts_and_tokens():
    assert parse_groups("1x49, 2x49,4X64") == [Group(1, 49), Group(2, 49), Group(4, 64)]
    assert Group(2, 49).total == 98 and Group(2, 49).label == "2x49"


@pytest.mark.parametrize("spec", ["", "49", "0x49", "1x0", "1x49,ax2", "1*49"])
def test_bad_group_specs_raise_naming_the_entry(spec):
    with pytest.raises(ValueError, match="group"):
        parse_groups(spec)


@pytest.mark.parametrize("tokens, grid", [(49, (1, 14, 14)), (64, (1, 16, 16)), (98, (1, 14, 28)),
                                          (1024, (1, 64, 64))])
def test_a_group_image_has_a_grid_of_exactly_its_tokens(tokens, grid):
    assert Group(1, tokens).grid(2) == [grid]


def test_budgets_double_from_64_to_cover_the_largest_group():
    assert covering_budgets(parse_groups("1x49,2x49,1x98,1x256,4x64,1x1024")) == [64, 128, 256, 512, 1024]
    assert covering_budgets(parse_groups("1x16,2x16")) == [64]


def test_kernel_time_sums_cpu_operator_time_on_cpu():
    x = torch.randn(64, 64)
    found = kernel_time(lambda: (x @ x).relu(), "cpu")
    assert found.source == "cpu operators" and found.ms is not None and found.ms > 0 and found.events > 0


@pytest.fixture(scope="module")
def result():
    cfg = BenchConfig(preset="tiny", groups=parse_groups("1x4,2x4"), device=torch.device("cpu"),
                      dtype=torch.float32, graph_backend="cpu", warmup=1, samples=2, calibrate=True, profile=True,
                      budgets=[8, 16])
    return run_bench(cfg)


def test_bench_times_transformers_eager_and_replay_per_group_with_ratios(result):
    assert result["groups"] == ["1x4", "2x4"] and result["preset"] == "tiny" and result["timer"] == "wall clock"
    rows = {(r["group"], r["kernel"]): r for r in result["rows"]}
    assert set(rows) == {("1x4", "TORCH_SDPA"), ("2x4", "TORCH_SDPA")}
    for r in rows.values():
        for column in ("transformers", "eager", "replay"):
            assert r[column]["samples"] == 2 and 0 < r[column]["median_ms"] <= r[column]["p95_ms"]
        assert r["speedup"]["replay_vs_eager"] == pytest.approx(r["eager"]["median_ms"] / r["replay"]["median_ms"])
        assert r["plain_replay"] is None  # only a compiled bench times plain replay beside it
        assert r["profile"]["eager_kernel_ms"] > 0 and r["profile"]["replay_kernel_ms"] > 0
    assert rows[("1x4", "TORCH_SDPA")]["budget"] == 8 and rows[("2x4", "TORCH_SDPA")]["budget"] == 8


def test_bench_reports_graph_memory_dispatch_calibration_and_every_kernel(result):
    per = result["per_kernel"]["TORCH_SDPA"]
    assert sorted(per["graph_memory_bytes"]) == [8, 16] and all(v > 0 for v in per["graph_memory_bytes"].values())
    assert per["stats"]["hits"] > 0 and per["stats"]["misses"] == 0
    assert per["stats"]["replays_per_slots"] == {2: per["stats"]["replays"]}  # TORCH_SDPA: one slot count
    assert "| replays per slot count |" in bench_markdown(result)
    assert set(result["calibration"]["findings"]) == {8, 16}
    assert result["calibration"]["timing"] == {"warmup": 3, "samples": 10}  # calibrate()'s, not the bench's
    assert {k["name"] for k in result["kernels"]} >= {"TORCH_SDPA", "TRITON_ATTN", "FLASH_ATTN"}
    assert all(k["reasons"] for k in result["kernels"] if not k["available"])
    assert result["environment"]["packages"]["torch"] and result["environment"]["platform"]["kind"] == detect().kind


def test_bench_command_prints_markdown_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    code = cli.main(["bench", "--groups", "1x4", "--warmup", "0", "--samples", "1", "--budgets", "8",
                     "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| group | tokens | attention | transformers eager | hwgraph eager | hwgraph replay |" in out
    assert "| 1x4 | 4 | TORCH_SDPA |" in out and "Graph memory per budget" in out and str(path) in out
    assert "### Startup per budget (s)" in out and "| TORCH_SDPA | capturing |" in out
    assert "sampled in turn" in out
    data = json.loads(path.read_text())
    assert data["rows"][0]["group"] == "1x4" and data["budgets"] == [8] and data["interleaved"] is True


def test_bench_writes_its_json_before_printing_so_a_closed_stdout_does_not_lose_it(tmp_path, monkeypatch):
    # `hwgraph bench --json f | head -1`: the print raised BrokenPipeError before the results reached the file
    from hwgraph import report

    def closed_stdout(result):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(report, "bench_markdown", closed_stdout)
    path = tmp_path / "bench.json"
    args = cli.build_parser().parse_args(["bench", "--groups", "1x4", "--warmup", "0", "--samples", "1", "--budgets",
                                          "8", "--no-transformers", "--json", str(path)])
    with pytest.raises(BrokenPipeError):  # cmd_bench itself: cli.main would point this process's stdout at devnull
        cmd_bench(args)
    assert json.loads(path.read_text())["rows"][0]["group"] == "1x4"


def test_bench_prints_its_tables_when_the_json_cannot_be_written_after_the_run(tmp_path, monkeypatch, capsys):
    path = tmp_path / "bench.json"

    def full(self, *args, **kwargs):  # checked writable before the run; the disk filled meanwhile
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    assert cli.main(["bench", "--groups", "1x4", "--warmup", "0", "--samples", "1", "--budgets", "8",
                     "--no-transformers", "--json", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "| 1x4 |" in out
    assert f"--json {str(path)!r}: could not write the results: [Errno 28] No space left on device" in err


def test_bench_command_rejects_a_bad_group_spec(capsys):
    assert cli.main(["bench", "--groups", "1x"]) == 2
    assert "bad group" in capsys.readouterr().err


def test_bench_command_refuses_an_unavailable_kernel_with_its_reasons(capsys):
    # Whether a known kernel runs depends on the tower's dtype and head dim: checked once the tower exists.
    assert cli.main(["bench", "--device", "cpu", "--groups", "1x4", "--attention", "FLASH_ATTN"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hwgraph bench: attention kernel FLASH_ATTN is unavailable: ") and "cpu" in err


def test_dispatch_table_says_why_budgets_were_captured_uncompiled():
    from hwgraph.report import dispatch_table

    stats = {"calls": 1, "hits": 1, "misses": 0, "eager_groups": 0, "padding_tokens": 0,
             "replays_per_budget": {64: 1}, "capture_failures": {}}
    result = {"per_kernel": {
        "A": {"stats": {**stats, "compile_skipped": "inductor generates no NPU code", "compile_failures": {}}},
        "B": {"stats": {**stats, "compile_skipped": None, "compile_failures": {64: "RuntimeError: boom"}}},
        "C": {"stats": {**stats, "compile_skipped": None, "compile_failures": {}}},
    }}
    lines = dispatch_table(result).splitlines()
    assert lines[0].endswith("| captured uncompiled |")
    assert lines[2].endswith("| all: inductor generates no NPU code |")
    assert lines[3].endswith("| 64: RuntimeError: boom |")
    assert lines[4].endswith("| - |")


def test_the_dispatch_table_lists_replays_per_budget_in_budget_order_from_the_json_form_too():
    """The report functions take the JSON form (budgets as strings) as the in-process one: replays per budget were
    sorted as strings there, "128: 3, 16: 2, 8: 1", while the slot counts beside them were sorted as numbers."""
    from hwgraph.report import dispatch_table

    stats = {"calls": 6, "hits": 6, "misses": 0, "eager_groups": 0, "padding_tokens": 0,
             "replays_per_budget": {8: 1, 16: 2, 128: 3}, "replays_per_slots": {2: 6}, "capture_failures": {},
             "compile_skipped": None, "compile_failures": {}}
    for form in (stats, json.loads(json.dumps(stats))):
        row = dispatch_table({"per_kernel": {"A": {"stats": form}}}).splitlines()[2]
        assert "| 8: 1, 16: 2, 128: 3 | 2: 6 |" in row, row


def test_a_multi_line_capture_failure_stays_in_its_row_and_column_of_the_dispatch_table():
    from hwgraph.report import dispatch_table

    stats = {"calls": 1, "hits": 0, "misses": 1, "eager_groups": 1, "padding_tokens": 0, "replays_per_budget": {},
             "capture_failures": {64: "CaptureError: CUDA error: out of memory\nCUDA kernel errors | reported late"},
             "compile_skipped": None, "compile_failures": {}}
    lines = dispatch_table({"per_kernel": {"A": {"stats": stats}}}).splitlines()
    assert len(lines) == 3
    assert "| 64: CaptureError: CUDA error: out of memory CUDA kernel errors \\| reported late | - |" in lines[2]


def test_startup_table_gives_compile_capture_and_plain_seconds_per_budget():
    from hwgraph.report import startup_table

    def result(compile, measure_products, stats, plain):
        return {"budgets": [64, 256], "compile": compile, "measure_products": measure_products,
                "per_kernel": {"K": {"stats": stats, "plain_capture_seconds": plain}}}

    compiled = startup_table(result(True, False, {"compile_seconds_per_budget": {"64": 2.25, "256": 6.0},
                                                  "capture_seconds_per_budget": {"64": 2.75, "256": 6.5}},
                                    {"64": 0.5, "256": 0.25})).splitlines()
    assert compiled[0] == "| attention | startup | 64 | 256 | total |"
    assert compiled[2:] == ["| K | compiling | 2.2 | 6.0 | 8.2 |", "| K | compiling and capturing | 2.8 | 6.5 | 9.2 |",
                            "| K | plain capture | 0.5 | 0.2 | 0.8 |"]
    # a budget whose capture failed has no time; a plain bench has one row
    plain = startup_table(result(False, False, {"compile_seconds_per_budget": {},
                                                "capture_seconds_per_budget": {256: 1.5}}, None)).splitlines()
    assert plain[2:] == ["| K | capturing | - | 1.5 | 1.5 |"]
    # one whose failure is recorded says so, as the memory table and the plain capture row do (it said "-")
    failed = startup_table(result(False, False, {"capture_seconds_per_budget": {256: 1.5},
                                                 "capture_failures": {"64": "CaptureError: out of memory"}},
                                  None)).splitlines()
    assert failed[2:] == ["| K | capturing | failed | 1.5 | 1.5 |"]
    measured = startup_table(result(False, True, {"capture_seconds_per_budget": {64: 20.0, 256: 1.0},
                                                  "products_measured": True}, {64: 0.5, 256: 0.5})).splitlines()
    assert [line.split(" | ")[1] for line in measured[2:]] == ["measuring products and capturing", "plain capture"]
    refused = startup_table(result(False, True, {"capture_seconds_per_budget": {64: 2.0, 256: 1.0},
                                                 "products_measured": False}, {64: 0.5, 256: 0.5})).splitlines()
    assert [line.split(" | ")[1] for line in refused[2:]] == ["capturing", "plain capture"]  # nothing was measured
    both = startup_table(result(True, True, {"compile_seconds_per_budget": {64: 1.0, 256: 2.0},
                                             "capture_seconds_per_budget": {64: 21.0, 256: 3.0},
                                             "products_measured": True}, {64: 0.5, 256: 0.5})).splitlines()
    assert [line.split(" | ")[1] for line in both[2:]] == [
        "compiling", "compiling, measuring products and capturing", "plain capture"]


def test_a_bench_with_measured_products_names_its_replay_and_what_chose_the_products():
    from hwgraph.report import products_lines, replay_kind

    def result(compile, measure_products, **compile_stats):
        captured = {"capture_seconds_per_budget": {"64": 1.0}, **compile_stats}
        return {"compile": compile, "measure_products": measure_products, "per_kernel": {
            "K": {"stats": {"products": "measured cuBLASLt algorithms: 7 shapes", "products_measured": True,
                            **captured}},
            "L": {"stats": {"products": None, "products_measured": False, **captured}}}}

    assert replay_kind(result(True, False)) == ("compiled replay", "compiled")
    assert replay_kind(result(False, True)) == ("replay with measured products", "measured products")
    assert replay_kind(result(True, True)) == ("compiled replay with measured products", "compiled, measured products")
    # asked to compile, but nothing was: the backend cannot, or every compiled capture failed and was captured plain
    for uncompiled in ({"compile_skipped": "no inductor here"}, {"compile_failures": {"64": "boom"}}):
        assert replay_kind(result(True, False, **uncompiled)) == ("replay (compile asked, captured uncompiled)",
                                                                  "uncompiled")
    # asked to measure, but the backend has no chooser (CPU, ROCm, NPU): its products are ATen's
    refused = {"products": "ATen's: the cpu graph backend has no measured choice", "products_measured": False}
    refused_result = {"compile": False, "measure_products": True, "per_kernel": {"K": {"stats": refused}}}
    assert replay_kind(refused_result) == ("replay (measured products asked, ATen's products)", "ATen's products")
    assert replay_kind({**refused_result, "compile": True, "per_kernel": {"K": {"stats": {
        **refused, "capture_seconds_per_budget": {"64": 1.0}}}}}) == (
        "compiled replay with ATen's products (measuring asked, refused)", "compiled, ATen's products")
    assert products_lines(result(True, True)).splitlines() == [
        "Matrix products (K): measured cuBLASLt algorithms: 7 shapes", "", "Matrix products (L): ATen's"]
    assert products_lines(result(True, False)) == ""


def test_a_bench_asked_to_measure_products_on_a_backend_without_a_chooser_says_the_products_were_atens():
    """The CPU reference backend (like ROCm's and the NPU's) has no product chooser: the columns once said
    "replay with measured products" and the startup table "measuring products and capturing" all the same."""
    from hwgraph.report import bench_markdown

    result = tiny_bench(measure_products=True)
    stats = result["per_kernel"]["TORCH_SDPA"]["stats"]
    assert stats["products_measured"] is False and stats["products"].startswith("ATen's: ")
    text = bench_markdown(result)
    assert "measured products" not in text.replace("measured products asked", "")
    assert "hwgraph replay (measured products asked, ATen's products)" in text
    assert "every product ran ATen's call" in text and "| TORCH_SDPA | capturing |" in text


def test_a_compiled_bench_on_a_backend_that_cannot_compile_says_nothing_was_compiled(monkeypatch):
    from hwgraph.capability import Capability
    from hwgraph.graphs.cpu import CpuGraphBackend

    monkeypatch.setattr(CpuGraphBackend, "compile_support", lambda self: Capability.unavailable("no inductor here"))
    text = bench_markdown(run_bench(BenchConfig(
        preset="tiny", groups=parse_groups("1x4"), device=torch.device("cpu"), dtype=torch.float32,
        graph_backend="cpu", warmup=0, samples=1, kernels=["TORCH_SDPA"], budgets=[8], reference=False,
        compile=True)))
    assert "--compile was asked, but every budget was captured uncompiled" in text
    assert "compiled replay" not in text and "after torch.compile" not in text and "compiling" not in text
    assert "hwgraph replay (compile asked, captured uncompiled)" in text and "all: no inductor here" in text


def test_the_graph_mode_reaches_every_manager_and_the_report_names_it():
    result = run_bench(BenchConfig(
        preset="tiny", groups=parse_groups("1x4"), device=torch.device("cpu"), dtype=torch.float32,
        graph_backend="cpu", graph_mode="emulated", warmup=0, samples=1, kernels=["TORCH_SDPA"], budgets=[8],
        reference=False))
    assert result["graph_mode"] == "emulated" and result["per_kernel"]["TORCH_SDPA"]["stats"]["graph_mode"] == \
        "emulated"
    assert "graph backend cpu (mode emulated)\n" in bench_markdown(result)
    with pytest.raises(ValueError, match=r"graph backend 'cpu' has modes \['emulated'\], got mode='full'"):
        run_bench(BenchConfig(preset="tiny", groups=parse_groups("1x4"), device=torch.device("cpu"),
                              dtype=torch.float32, graph_backend="cpu", graph_mode="full", warmup=0, samples=1,
                              kernels=["TORCH_SDPA"], budgets=[8], reference=False))


def test_interleaved_timing_takes_one_call_of_each_callable_per_round_in_shuffled_orders():
    from hwgraph.timing import measure_interleaved

    def run(**kwargs):
        calls = []
        fns = {name: (lambda n=name: calls.append(n)) for name in "abc"}
        timed = measure_interleaved(fns, "cpu", warmup=2, samples=12, **kwargs)
        assert set(timed) == set("abc") and all(len(lat.samples_ms) == 12 for lat in timed.values())
        assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-ups per callable
        rounds = [tuple(calls[i:i + 3]) for i in range(6, len(calls), 3)]
        assert len(rounds) == 12 and all(sorted(r) == list("abc") for r in rounds)  # one call of each per round
        return rounds

    shuffled = run()
    assert len(set(shuffled)) > 1 and {r[0] for r in shuffled} == set("abc")  # no callable keeps one position
    assert run() == shuffled  # seeded: the same orders every run
    assert run(seed=None) == [tuple("abc")] * 12  # seed=None: the given order


@pytest.mark.parametrize("n", [2, 3, 4, 5, 9])
def test_round_orders_let_each_callable_follow_each_other_equally_often(n):
    """A shuffle balances this only on average: at the bench's one seed, a compiled bench's plain replay followed
    an eager call (transformers' or hwgraph's) in 19 of its 30 rounds and the compiled replay in 8, the same in
    every group and run, and a replay right after an eager forward runs 1-7% slower on the H200."""
    from collections import Counter

    from hwgraph.timing import round_orders, williams_orders

    for row in williams_orders(n):
        assert sorted(row) == list(range(n))
    pairs = Counter((a, b) for row in williams_orders(n) for a, b in zip(row, row[1:], strict=False))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert set(pairs.values()) == {1 if n % 2 == 0 else 2}
    places = Counter((x, i) for row in williams_orders(n) for i, x in enumerate(row))
    assert len(set(places.values())) == 1  # each callable takes each place equally often
    names = ["transformers", "K eager", "K replay", "K plain_replay"]
    orders = round_orders(names, 30, seed=0)
    assert len(orders) == 30 and all(sorted(o) == sorted(names) for o in orders)
    after_eager = Counter(o[i + 1] for o in orders for i in range(3) if o[i] in names[:2])
    assert abs(after_eager["K replay"] - after_eager["K plain_replay"]) <= 1, after_eager
    assert round_orders(names, 30, seed=0) == orders and round_orders(names, 3, seed=None) == [names] * 3


@pytest.mark.parametrize("kwargs, match", [({"samples": 0}, r"samples must be an int >= 1 \(timed rounds\), got 0"),
                                           ({"samples": 2.5}, r"got 2\.5"),
                                           ({"warmup": -1}, r"warmup must be an int >= 0 \(untimed calls of each\), "
                                                            r"got -1")])
def test_interleaved_timing_refuses_bad_counts_before_calling_anything(kwargs, match):
    """samples=0 ran every warm-up, then failed with statistics' StatisticsError when the result was read."""
    from hwgraph.timing import measure_interleaved

    calls = []
    with pytest.raises(ValueError, match=match):
        measure_interleaved({"a": lambda: calls.append(1)}, "cpu", **{"warmup": 1, "samples": 1, **kwargs})
    assert calls == []
    # numpy's ints count, as calibrate() (which passes its own on) accepts them
    timed = measure_interleaved({"a": lambda: calls.append(1)}, "cpu", warmup=np.int64(1), samples=np.int64(2))
    assert len(timed["a"].samples_ms) == 2 and len(calls) == 3


def test_plain_replay_is_timed_only_at_the_budget_the_replay_runs(monkeypatch):
    """Where the plain manager's capture of the group's budget failed, it replayed a larger one (more padding), and
    the row compared the two as "vs plain replay" under the replay's budget."""
    from hwgraph import manager as manager_module

    managers = []

    class PlainCaptureOf8Fails(manager_module.EncoderGraphManager):
        def _capture_budget(self, budget, compiled=False):
            if budget == 8 and self in managers[1:]:  # the plain manager, built second
                raise RuntimeError("simulated: out of memory")
            return super()._capture_budget(budget, compiled)

    monkeypatch.setattr(manager_module, "EncoderGraphManager", PlainCaptureOf8Fails)
    real_init = PlainCaptureOf8Fails.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        managers.append(self)

    monkeypatch.setattr(PlainCaptureOf8Fails, "__init__", init)
    (row,) = tiny_bench(budgets=[8, 16], measure_products=True)["rows"]
    assert len(managers) == 2 and list(managers[1].stats()["capture_failures"]) == [8]
    assert row["budget"] == 8 and row["replay"] is not None
    assert row["plain_replay"] is None and row["speedup"]["replay_vs_plain_replay"] is None
    assert row["plain_note"] == ("not timed: the plain capture of budget 8 failed, and plain replay would run "
                                 "budget 16")


def test_the_profiler_runs_after_every_group_is_timed(monkeypatch):
    """It ran after each group's timing, so every later group was timed after it: on CUDA the profiler (CUPTI)
    slows later launches (pytorch/pytorch#144455)."""
    from hwgraph import bench, profiling

    events = []
    measure, kernel_time = bench.measure_interleaved, profiling.kernel_time
    monkeypatch.setattr(bench, "measure_interleaved", lambda *a, **k: (events.append("time"), measure(*a, **k))[1])
    monkeypatch.setattr(profiling, "kernel_time", lambda *a, **k: (events.append("profile"), kernel_time(*a, **k))[1])
    result = tiny_bench(groups=parse_groups("1x4,2x4"), profile=True)
    assert events == ["time", "time", "profile", "profile", "profile", "profile"]
    assert all(row["profile"]["eager_kernel_ms"] and row["profile"]["replay_kernel_ms"] for row in result["rows"])


def test_bench_samples_every_kernel_in_the_same_rounds(monkeypatch):
    """Kernels timed one after another were not comparable (on the H200 the second replayed a 49-token image 6-12%
    slower): each group's calls of every kernel, and its transformers call, are sampled in one interleaved set."""
    from dataclasses import replace

    from hwgraph import bench
    from hwgraph.attention import registry
    from hwgraph.attention.sdpa import TORCH_SDPA
    from hwgraph.timing import measure_interleaved

    builtin = registry.builtin_kernels
    twin = replace(TORCH_SDPA, name="SDPA_TWIN", priority=-1)
    monkeypatch.setattr(registry, "builtin_kernels", lambda: (*builtin(), twin))
    sets = []

    def recording(fns, *args, **kwargs):
        sets.append(sorted(fns))
        return measure_interleaved(fns, *args, **kwargs)

    monkeypatch.setattr(bench, "measure_interleaved", recording)
    cfg = BenchConfig(preset="tiny", groups=parse_groups("1x4,2x4"), device=torch.device("cpu"), dtype=torch.float32,
                      graph_backend="cpu", warmup=0, samples=1, kernels=["TORCH_SDPA", "SDPA_TWIN"], budgets=[8])
    result = run_bench(cfg)
    calls = sorted(["transformers", "TORCH_SDPA eager", "TORCH_SDPA replay", "SDPA_TWIN eager", "SDPA_TWIN replay"])
    assert sets == [calls, calls]  # one set per group
    rows = {(r["group"], r["kernel"]): r for r in result["rows"]}
    assert set(rows) == {(g, k) for g in ("1x4", "2x4") for k in ("TORCH_SDPA", "SDPA_TWIN")}
    for group in ("1x4", "2x4"):  # one transformers timing per group, shared by the kernels' rows
        assert rows[(group, "TORCH_SDPA")]["transformers"] == rows[(group, "SDPA_TWIN")]["transformers"]
    for kernel in ("TORCH_SDPA", "SDPA_TWIN"):  # each manager ran its own kernel on the shared weights
        stats = result["per_kernel"][kernel]["stats"]
        assert stats["attention"] == kernel and stats["hits"] == 3 and stats["misses"] == 0


def test_busy_time_counts_kernels_that_overlap_on_two_streams_once():
    from types import SimpleNamespace

    from hwgraph.profiling import busy_us

    def kernel(start, end):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end))

    # blocks on one stream, a DeepStack merger on another overlapping two of them, then a gap and one more kernel
    events = [kernel(0, 10), kernel(10, 20), kernel(5, 15), kernel(30, 35), kernel(31, 33)]
    assert busy_us(events) == 25.0
    assert busy_us([]) == 0.0


# ---------------------------------------------------------------- timing
def test_latency_median_and_p95_are_order_statistics_of_the_samples():
    lat = timing.Latency((5.0, 1.0, 3.0, 2.0, 100.0))
    assert lat.median == 3.0  # not the mean (22.2): one slow call does not move it
    descending = timing.Latency(tuple(float(v) for v in range(30, 0, -1)))  # 30 samples, given slowest first
    # p95 of 30: the sample of rank ceil(0.95 * 30) = 29, i.e. 29 ms
    assert descending.p95 == 29.0 and descending.median == 15.5
    assert descending.as_dict() == {"median_ms": 15.5, "p95_ms": 29.0, "samples": 30}
    assert timing.Latency((4.0,)).p95 == 4.0


@pytest.mark.parametrize("n, rank", [(1, 1), (20, 19), (30, 29), (31, 30), (51, 49), (60, 57), (71, 68), (100, 95)])
def test_p95_is_the_nearest_rank_percentile_whatever_the_sample_count(n, rank):
    """It was the sample at round(0.95 * (n - 1)), which rounds halves to even: the lower of two candidates at 31
    samples (rank 29, which 6.5% of the samples exceed) and the upper at 51."""
    samples = timing.Latency(tuple(float(v) for v in range(n, 0, -1)))
    assert samples.p95 == float(rank)
    assert sum(s > samples.p95 for s in samples.samples_ms) <= 0.05 * n


def test_interleaved_samples_leave_the_warm_up_calls_out(monkeypatch):
    # each callable's first two calls are slow warm-ups; one_sample reports what the call returns as its time
    monkeypatch.setattr(timing, "one_sample", lambda fn, device: fn())
    counts = {"a": itertools.count(), "b": itertools.count()}
    fns = {name: (lambda n=name: 1000.0 if next(counts[n]) < 2 else 1.0) for name in counts}
    timed = timing.measure_interleaved(fns, "cpu", warmup=2, samples=5)
    assert {name: lat.samples_ms for name, lat in timed.items()} == {"a": (1.0,) * 5, "b": (1.0,) * 5}
    assert {name: next(c) for name, c in counts.items()} == {"a": 7, "b": 7}  # 2 warm-ups + 5 samples each


def test_a_wall_clock_sample_includes_waiting_for_the_device(monkeypatch):
    now = [0.0]
    order = []

    def advance(seconds, what):
        order.append(what)
        now[0] += seconds

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(timing, "synchronize", lambda device: advance(0.004, "sync"))  # queued device work: 4 ms
    ms = timing.one_sample(lambda: advance(0.001, "call"), torch.device("meta"))  # a non-CUDA device
    assert order == ["call", "sync"] and ms == pytest.approx(5.0)


def fake_cuda_devices(monkeypatch, state: dict, event_cls) -> None:
    """``torch.cuda.Event`` as ``event_cls``, and ``torch.cuda.device(d)`` making ``d``'s index ``state["device"]``
    while it is entered."""
    class FakeDevice:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.previous, state["device"] = state["device"], self.index

        def __exit__(self, *exc):
            state["device"] = self.previous

    monkeypatch.setattr(torch.cuda, "Event", event_cls)
    monkeypatch.setattr(torch.cuda, "device", FakeDevice)


def test_a_cuda_sample_records_both_events_on_the_timed_device(monkeypatch):
    state = {"device": 0, "clock": 0.0}
    events = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None
            events.append(self)

        def record(self):
            self.at = (state["device"], state["clock"])

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at[1] - self.at[1]

    fake_cuda_devices(monkeypatch, state, FakeEvent)
    ms = timing.one_sample(lambda: state.update(clock=state["clock"] + 2.5), torch.device("cuda:1"))
    assert ms == 2.5  # start to end, not end to start
    assert [e.at for e in events] == [(1, 0.0), (1, 2.5)]  # both on cuda:1, though cuda:0 is current
    assert state["device"] == 0


def test_warm_ups_run_on_the_timed_device_as_the_samples_do(monkeypatch):
    """The warm-up calls ran outside ``torch.cuda.device(device)`` while the samples ran inside it: a callable that
    reads the current device (its stream, its generator) warmed up on another GPU than the one it was timed on."""
    state = {"device": 0}
    seen = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    fake_cuda_devices(monkeypatch, state, FakeEvent)
    monkeypatch.setattr(timing, "synchronize", lambda device: seen.append(("sync", state["device"])))
    timed = timing.measure_interleaved({"a": lambda: seen.append(("a", state["device"])),
                                        "b": lambda: seen.append(("b", state["device"]))},
                                       torch.device("cuda:1"), warmup=2, samples=3)
    assert [timed[name].samples_ms for name in "ab"] == [(1.0,) * 3] * 2
    calls = [entry for entry in seen if entry[0] != "sync"]
    assert len(calls) == 2 * (2 + 3)
    assert {device for _, device in calls} == {1}  # warm-ups included, though cuda:0 is current
    assert state["device"] == 0


# ---------------------------------------------------------------- profiling
def ranges(*pairs):
    return [SimpleNamespace(time_range=SimpleNamespace(start=s, end=e)) for s, e in pairs]


def test_busy_time_is_the_union_of_ranges_in_any_order():
    from hwgraph.profiling import busy_us

    assert busy_us(ranges((10, 20), (0, 10))) == 20.0  # listed out of start order
    assert busy_us(ranges((0, 10), (5, 15))) == 15.0  # a range starting inside another extends it
    assert busy_us(ranges((0, 10), (2, 5))) == 10.0  # a nested range adds nothing
    assert busy_us(ranges((20, 30), (0, 5), (3, 8), (25, 40))) == 28.0


class FakeProfile:
    """Stands in for ``torch.profiler.profile``: yields ``events`` and notes when it is active."""

    def __init__(self, events, state, fail=None):
        self._events, self.state, self.fail = events, state, fail

    def __enter__(self):
        if self.fail:
            raise self.fail
        self.state["profiling"] = True
        return self

    def __exit__(self, *exc):
        self.state["profiling"] = False

    def events(self):
        return self._events


def fake_profiler(monkeypatch, events, fail=None):
    from hwgraph import profiling

    state = {"profiling": False, "activities": None}

    def make(activities):
        state["activities"] = activities
        return FakeProfile(events, state, fail)

    monkeypatch.setattr(profiling, "profile", make)
    monkeypatch.setattr(profiling, "synchronize", lambda device: None)
    return state


def test_cpu_kernel_time_sums_operators_self_time_after_an_unprofiled_warm_up(monkeypatch):
    from hwgraph.profiling import kernel_time

    ops = [SimpleNamespace(device_type=DeviceType.CPU, self_cpu_time_total=300.0, cpu_time_total=1000.0),
           SimpleNamespace(device_type=DeviceType.CPU, self_cpu_time_total=700.0, cpu_time_total=700.0)]
    state = fake_profiler(monkeypatch, ops)
    calls = []
    found = kernel_time(lambda: calls.append(state["profiling"]), "cpu", warmup=2)
    assert calls == [False, False, True]  # two warm-ups outside the profiler, then the profiled call
    # self time: an operator's children are not counted again inside their parent
    assert (found.ms, found.events, found.source) == (1.0, 2, "cpu operators")


@pytest.mark.parametrize("warmup", [0, 1])
def test_an_exception_of_the_profiled_call_is_raised_not_reported_as_the_profilers(monkeypatch, warmup):
    # it was logged as "torch.profiler failed" and returned as an unavailable kernel time
    from hwgraph.profiling import kernel_time

    fake_profiler(monkeypatch, [])
    calls = []

    def fails_when_profiled():
        calls.append(len(calls))
        if len(calls) > warmup:
            raise ValueError("the benchmarked call's own bug")

    with pytest.raises(ValueError, match="the benchmarked call's own bug"):
        kernel_time(fails_when_profiled, "cpu", warmup=warmup)


def test_kernel_time_on_a_privateuse1_device_counts_its_device_activity(monkeypatch):
    from torch.profiler import ProfilerActivity

    from hwgraph.profiling import kernel_time

    events = [SimpleNamespace(device_type=DeviceType.CPU, time_range=SimpleNamespace(start=0, end=10_000)),
              *[SimpleNamespace(device_type=DeviceType.PrivateUse1, time_range=r.time_range)
                for r in ranges((0, 400), (300, 1000), (2000, 2500))]]
    state = fake_profiler(monkeypatch, events)
    found = kernel_time(lambda: None, torch.device("privateuseone"))  # how the NPU reports its kernels
    assert ProfilerActivity.PrivateUse1 in state["activities"]
    assert (found.ms, found.events, found.source) == (1.5, 3, "device kernels")


def test_a_profiler_that_cannot_start_is_reported_not_raised(monkeypatch, caplog):
    from hwgraph.profiling import kernel_time

    fake_profiler(monkeypatch, [], fail=RuntimeError("profiler busy"))
    with caplog.at_level(logging.WARNING, logger="hwgraph.profiling"):
        found = kernel_time(lambda: None, "cpu")
    assert (found.ms, found.events) == (None, 0)
    assert found.source == "unavailable: RuntimeError: profiler busy" and "profiler busy" in caplog.text


# ---------------------------------------------------------------- bench bookkeeping
def test_speedups_are_ratios_of_medians_in_the_right_direction():
    lat = {name: {"median_ms": v, "p95_ms": v, "samples": 3}
           for name, v in (("tf", 6.0), ("eager", 3.0), ("replay", 1.0), ("plain", 2.0))}
    per_kernel = [{"kernel": "K", "rows": {"1x4": {"transformers": lat["tf"], "eager": lat["eager"],
                                                    "replay": lat["replay"], "plain_replay": lat["plain"],
                                                    "budget": 8, "replay_note": "replay"}}}]
    row, = flatten_rows(parse_groups("1x4"), per_kernel)
    assert row["speedup"] == {"eager_vs_transformers": 2.0, "replay_vs_transformers": 6.0, "replay_vs_eager": 3.0,
                              "replay_vs_plain_replay": 2.0}


def tiny_bench(**kwargs):
    cfg = dict(preset="tiny", groups=parse_groups("1x4"), device=torch.device("cpu"), dtype=torch.float32,
               graph_backend="cpu", warmup=0, samples=1, kernels=["TORCH_SDPA"], budgets=[8], reference=False)
    return run_bench(BenchConfig(**{**cfg, **kwargs}))


def test_a_group_over_every_budget_is_reported_eager_with_its_reason_not_as_a_replay():
    from hwgraph.report import latency_table

    result = tiny_bench(groups=parse_groups("1x4,1x12"))
    rows = {r["group"]: r for r in result["rows"]}
    assert rows["1x4"]["replay"]["samples"] == 1 and rows["1x4"]["replay_note"] == "replay"
    assert rows["1x12"]["replay"] is None and rows["1x12"]["budget"] is None
    assert rows["1x12"]["replay_note"] == "eager: over budget"
    assert rows["1x12"]["speedup"]["replay_vs_eager"] is None
    table = latency_table(result)
    assert "| 1x12 | 12 | TORCH_SDPA | - |" in table and "| eager: over budget |" in table
    stats = result["per_kernel"]["TORCH_SDPA"]["stats"]
    assert stats["eager_groups"] == 0 and stats["hits"] == 1  # the bench times eager itself, not the manager


def test_profiled_replay_profiles_the_replay(monkeypatch):
    from hwgraph import profiling

    monkeypatch.setattr(profiling, "kernel_time",
                        lambda fn, device: (fn(), profiling.KernelTime(1.0, 1, "fake"))[1])
    result = tiny_bench(profile=True)
    stats = result["per_kernel"]["TORCH_SDPA"]["stats"]
    assert stats["replays"] == 2  # one timed sample, one profiled call
    assert result["rows"][0]["profile"]["replay_kernel_ms"] == 1.0


def test_a_compiled_bench_times_plain_replay_from_an_uncompiled_manager_and_reports_its_capture(monkeypatch):
    from hwgraph import manager as manager_module
    from hwgraph.capability import Capability

    built = []

    class Recording(manager_module.EncoderGraphManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

            self.backend.compile_support = Capability.available  # inductor or not: identity compile below

        def close(self):
            self.final_stats = self.stats()
            super().close()

    monkeypatch.setattr(manager_module, "EncoderGraphManager", Recording)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # no inductor: the bookkeeping is under test
    result = tiny_bench(compile=True)
    assert [m.compile for m in built] == [True, False]
    compiled, plain = built
    per = result["per_kernel"]["TORCH_SDPA"]
    assert per["stats"]["compile_seconds_per_budget"].keys() == {8}
    assert per["plain_capture_seconds"] == plain.final_stats["capture_seconds_per_budget"]
    assert per["stats"]["capture_seconds_per_budget"] == compiled.final_stats["capture_seconds_per_budget"]
    assert plain.final_stats["compile_seconds_per_budget"] == {}
    assert result["rows"][0]["plain_replay"]["samples"] == 1


def test_plain_replay_is_timed_only_where_the_plain_manager_replays_and_its_failures_are_reported(monkeypatch):
    """The plain manager beside --compile or --measure-products may fail a capture that the main one did not: its
    encode() is then eager, and was once timed and labelled as plain replay (with a false speedup)."""
    from hwgraph import manager as manager_module
    from hwgraph.report import bench_markdown

    built = []

    class PlainFails(manager_module.EncoderGraphManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)
            if len(built) == 2:  # the plain manager, built after the main one
                def no_room(fn, pool=None):
                    raise RuntimeError("out of memory")
                self.backend.capture = no_room

    monkeypatch.setattr(manager_module, "EncoderGraphManager", PlainFails)
    result = tiny_bench(measure_products=True)
    (row,) = result["rows"]
    assert row["replay"]["samples"] == 1 and row["plain_replay"] is None
    assert row["plain_note"] == "not timed: plain capture eager (capture failed)"
    assert row["speedup"]["replay_vs_plain_replay"] is None
    per = result["per_kernel"]["TORCH_SDPA"]
    assert set(per["plain_capture_failures"]) == {8} and "out of memory" in per["plain_capture_failures"][8]
    text = bench_markdown(result)
    assert "not timed: plain capture eager (capture failed)" in text
    assert "| TORCH_SDPA | plain capture | failed |" in text


# ---------------------------------------------------------------- report
def lat(median, p95):
    return {"median_ms": median, "p95_ms": p95, "samples": 3}


def report_result(accelerates=False):
    stats = {"calls": 2, "hits": 2, "misses": 0, "eager_groups": 0, "padding_tokens": 4,
             "replays_per_budget": {8: 2}, "capture_failures": {"16": "CaptureError: boom"},
             "compile_skipped": None, "compile_failures": {}, "capture_seconds_per_budget": {"8": 0.5}}
    rows = []
    for kernel, speed in (("K", 1.0), ("L", 2.0)):
        r = {"group": "1x4", "images": 1, "tokens": 4, "kernel": kernel, "transformers": lat(6.0, 7.0),
             "eager": lat(3.0 * speed, 4.0 * speed), "replay": lat(1.0, 1.5), "budget": 8, "replay_note": "replay",
             "plain_replay": None, "profile": {}}
        r["speedup"] = {"eager_vs_transformers": 6.0 / (3.0 * speed), "replay_vs_transformers": 6.0,
                        "replay_vs_eager": 3.0 * speed, "replay_vs_plain_replay": None}
        rows.append(r)
    return {"environment": {"platform": {"device_name": "-", "torch_version": "2.x"},
                            "packages": {"transformers": "4.x"}},
            "preset": "tiny", "device": "cpu", "dtype": "float32", "timer": "wall clock", "warmup": 1,
            "samples": 3, "groups": ["1x4"], "compile": False, "measure_products": False, "budgets": [8, 16],
            "graph_backend": "cpu", "graph_backend_accelerates": accelerates,
            "kernels": [{"name": "K", "available": True, "reasons": []},
                        {"name": "FLASH_ATTN", "available": False, "reasons": ["needs CUDA"]}],
            "rows": rows, "interleaved": True,
            "per_kernel": {k: {"budgets": [8], "graph_memory_bytes": {"8": 2**20}, "plain_capture_seconds": None,
                               "stats": stats} for k in ("K", "L")},
            "calibration": {"kernel": "K", "kept_budgets": [8],
                            "findings": {"8": {"eager_ms": 3.0, "replay_ms": 1.0, "kept": True},
                                         "16": {"eager_ms": 5.0, "replay_ms": 9.0, "kept": False}},
                            "rows": [{"group": "1x4", "replay": lat(1.0, 1.5), "budget": 8, "replay_note": "replay",
                                      "replay_vs_transformers": 6.0}]}}


def test_latency_table_has_a_row_per_group_and_kernel_with_cells_under_their_headers():
    from hwgraph.report import latency_table

    lines = latency_table(report_result()).splitlines()
    assert lines[0] == ("| group | tokens | attention | transformers eager | hwgraph eager | hwgraph replay | "
                        "eager vs transformers | replay vs transformers | replay vs eager |")
    assert lines[2:] == [
        "| 1x4 | 4 | K | 6.000 / 7.000 | 3.000 / 4.000 | 1.000 / 1.500 (budget 8) | 2.00x | 6.00x | 3.00x |",
        "| 1x4 | 4 | L | 6.000 / 7.000 | 6.000 / 8.000 | 1.000 / 1.500 (budget 8) | 1.00x | 6.00x | 6.00x |"]


def test_bench_markdown_reports_settings_failed_budgets_calibration_emulation_and_skipped_kernels():
    from hwgraph.report import bench_markdown, memory_table

    text = bench_markdown(report_result())
    assert "wall clock, 1 warm-ups, 3 samples per cell" in text
    assert "The cpu graph backend emulates replay eagerly" in text
    assert "emulates replay" not in bench_markdown(report_result(accelerates=True))
    assert memory_table(report_result()).splitlines()[2] == "| K | 1.0 | failed | 1.0 |"  # JSON's string keys
    assert "| 8 | 3.000 | 1.000 | yes |" in text and "| 16 | 5.000 | 9.000 | no |" in text
    assert "### Calibrated budgets (K): kept 8" in text
    assert "Attention kernels not run here: FLASH_ATTN (needs CUDA)" in text
    # the calibration's own sampling, not the bench's, and no transformers claimed where none was timed
    timed = report_result()
    timed["calibration"]["timing"] = {"warmup": 3, "samples": 10}
    assert "from the manager's calibration (3 warm-ups, 10 samples), not from the settings above" in bench_markdown(
        timed)
    assert "per group, transformers and every kernel's eager and replay are sampled in turn" in text
    without = report_result()
    for r in without["rows"]:
        r["transformers"] = None
    assert "per group, every kernel's eager and replay are sampled in turn" in bench_markdown(without)


def test_the_heading_names_the_benched_gpu_not_the_current_one(monkeypatch):
    """On a machine with two kinds of GPU, ``--device cuda:1`` was labelled with GPU 0's name (the platform's)."""
    from hwgraph.bench import device_name
    from hwgraph.report import heading

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: ["NVIDIA H200", "NVIDIA L4"][device.index])
    assert device_name(torch.device("cuda", 1)) == "NVIDIA L4" and device_name(torch.device("cpu")) is None
    result = report_result()
    result["environment"]["platform"]["device_name"] = "NVIDIA H200"
    result.update(device="cuda:1", device_name="NVIDIA L4")
    assert heading(result).startswith("## hwgraph bench: tiny, float32, cuda:1 (NVIDIA L4),")


# ---------------------------------------------------------------- pinned host copies
def test_pinned_copy_allocates_pinned_memory_of_the_same_dtype_and_fills_it(monkeypatch):
    from hwgraph import hostmem

    asked = []

    def empty(shape, **kwargs):
        asked.append(dict(kwargs))
        kwargs.pop("pin_memory", None)  # no pinned allocator without an accelerator
        return torch.full(shape, -7, **kwargs)

    monkeypatch.setattr(hostmem, "torch", SimpleNamespace(empty=empty))
    src = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    out = hostmem.pinned_copy(src)
    assert asked == [{"dtype": torch.int32, "pin_memory": True}]
    assert out.dtype == torch.int32 and torch.equal(out, src) and out.data_ptr() != src.data_ptr()


# ---------------------------------------------------------------- compiled mode
def test_compile_limits_fit_every_budget_and_fail_loudly_then_restore_dynamos_settings():
    from hwgraph.compile_mode import compile_limits

    config = torch._dynamo.config
    before = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    with compile_limits(7):
        assert config.recompile_limit >= 2 * 7 and config.fail_on_recompile_limit_hit is True
    with compile_limits(1):
        assert config.recompile_limit >= 8  # never below dynamo's default
    assert (config.recompile_limit, config.fail_on_recompile_limit_hit) == before


def test_block_forward_is_compiled_static_on_its_own_code_object(monkeypatch):
    from hwgraph.compile_mode import compile_block_forward

    def block(x, y=2):
        return x * y

    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: (asked.append((fn, kwargs)), fn)[1])
    compiled = compile_block_forward(block)
    (fn, kwargs), = asked
    assert kwargs == {"dynamic": False, "fullgraph": True}  # a graph break fails the capture (recorded)
    assert fn is not block and fn.__code__ is not block.__code__ and compiled(3) == 6 and compiled(3, 4) == 12


def tiny_tower(seed=0):
    torch.manual_seed(seed)
    return Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()


def check_against_eager(tower, m, grid):
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width)
    want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
    for a, b in zip(m.encode(pixels, grid), want, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            torch.testing.assert_close(x, y)


def test_a_compiled_capture_that_replays_wrongly_is_refused_and_captured_plain(monkeypatch, caplog):
    from hwgraph.capability import Capability
    from hwgraph.manager import EncoderGraphManager

    def wrong_compile(fn, **kwargs):  # a miscompiled block: its output is off by a factor of two
        def run(*args):
            x, normed = fn(*args)
            return x * 2, normed
        return run

    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=2, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)
    monkeypatch.setattr(torch, "compile", wrong_compile)
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m.capture()
    s = m.stats()
    assert sorted(m.graphs) == [8, 16] and s["capture_failures"] == {}
    assert set(s["compile_failures"]) == {8, 16}
    assert all("replay differs from eager" in why for why in s["compile_failures"].values())
    check_against_eager(tower, m, [(1, 4, 8)])
    m.close()


def test_compiled_mode_compiles_the_block_forward_once_for_every_budget(monkeypatch):
    from hwgraph.capability import Capability
    from hwgraph.manager import EncoderGraphManager

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: (compiled.append(fn), fn)[1])
    tower = tiny_tower(1)
    m = EncoderGraphManager(tower, budgets=[4, 8, 16], max_images_per_graph=1, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)
    m.capture()
    assert len(compiled) == 1 and set(m.stats()["compile_seconds_per_budget"]) == {4, 8, 16}
    m.close()


def test_calibration_drops_the_compile_seconds_of_the_budgets_it_releases(monkeypatch):
    from hwgraph.capability import Capability
    from hwgraph.manager import EncoderGraphManager

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    tower = tiny_tower(2)
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=1, graph_backend="cpu", compile=True)
    monkeypatch.setattr(m.backend, "compile_support", Capability.available)
    m.capture()
    times = iter([{"eager": 2.0, "replay": 1.0}, {"eager": 2.0, "replay": 3.0}])  # budget 8 wins, 16 loses
    monkeypatch.setattr(m, "time_ms", lambda fns, warmup=3, samples=10: next(times))
    m.calibrate()
    s = m.stats()
    assert sorted(m.graphs) == [8]
    assert set(s["compile_seconds_per_budget"]) == {8} and set(s["capture_seconds_per_budget"]) == {8}
    m.close()


def test_bench_logs_a_fallback_once_per_manager_not_again_for_its_own_probe(monkeypatch, caplog):
    # the bench makes the graph backend once before building a tower, to refuse one that cannot be made; that probe
    # logged the automatic choice's fallback warning a second time (one manager, two warnings)
    simulate_refused_mode_backend(monkeypatch)
    caplog.set_level(logging.WARNING, logger="hwgraph")
    assert cli.main(["bench", "--groups", "1x4", "--attention", "TORCH_SDPA", "--samples", "2", "--warmup", "0",
                     "--no-transformers"]) == 0
    fallbacks = [r for r in caplog.records if r.levelno == logging.WARNING
                 and "refusedmode graph mode 'aclgraph' is unavailable" in r.getMessage()]
    assert len(fallbacks) == 1, [r.getMessage() for r in fallbacks]
    from hwgraph import registry

    assert not registry.log.filters  # the probe's filter is gone: the next choice is logged


def test_a_markdown_cell_keeps_to_its_row_and_column_whatever_its_line_breaks_and_backslashes():
    """Only "|" and "\\n" were escaped: a lone "\\r" (a line ending in CommonMark) split the row, and a "\\|" in a
    message became an escaped backslash and a column break."""
    from hwgraph.report import md_table

    table = md_table(["budget", "failure"], [[128, "RuntimeError: a\r\nb\rc"], [256, "path C:\\x\\| or a|b"]])
    lines = table.split("\n")
    assert "\r" not in table and len(lines) == 4
    assert lines[2] == "| 128 | RuntimeError: a b c |"
    assert lines[3] == "| 256 | path C:\\\\x\\\\\\| or a\\|b |"
    # a GFM cell break is a "|" after an even number of backslashes: the row's two ends and the one between
    for line in lines[2:]:
        breaks = [i for i, ch in enumerate(line) if ch == "|" and (i - len(line[:i].rstrip("\\"))) % 2 == 0]
        assert len(breaks) == 3, line

