"""``hwgraph bench`` on CPU: group specs, budgets, and the shape of its JSON and Markdown (tiny preset, 2 samples)."""

from __future__ import annotations

import json

import pytest
import torch

from hwgraph import cli
from hwgraph.bench import BenchConfig, Group, covering_budgets, parse_groups, run_bench
from hwgraph.platform import detect
from hwgraph.profiling import kernel_time
from hwgraph.report import bench_markdown


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
    measured = startup_table(result(False, True, {"capture_seconds_per_budget": {64: 20.0, 256: 1.0}},
                                    {64: 0.5, 256: 0.5})).splitlines()
    assert [line.split(" | ")[1] for line in measured[2:]] == ["measuring products and capturing", "plain capture"]
    both = startup_table(result(True, True, {"compile_seconds_per_budget": {64: 1.0, 256: 2.0},
                                             "capture_seconds_per_budget": {64: 21.0, 256: 3.0}},
                                {64: 0.5, 256: 0.5})).splitlines()
    assert [line.split(" | ")[1] for line in both[2:]] == [
        "compiling", "compiling, measuring products and capturing", "plain capture"]


def test_a_bench_with_measured_products_names_its_replay_and_what_chose_the_products():
    from hwgraph.report import products_lines, replay_kind

    def result(compile, measure_products, **compile_stats):
        captured = {"capture_seconds_per_budget": {"64": 1.0}, **compile_stats}
        return {"compile": compile, "measure_products": measure_products, "per_kernel": {
            "K": {"stats": {"products": "measured cuBLASLt algorithms: 7 shapes", **captured}},
            "L": {"stats": {"products": None, **captured}}}}

    assert replay_kind(result(True, False)) == ("compiled replay", "compiled")
    assert replay_kind(result(False, True)) == ("replay with measured products", "measured products")
    assert replay_kind(result(True, True)) == ("compiled replay with measured products", "compiled, measured products")
    # asked to compile, but nothing was: the backend cannot, or every compiled capture failed and was captured plain
    for uncompiled in ({"compile_skipped": "no inductor here"}, {"compile_failures": {"64": "boom"}}):
        assert replay_kind(result(True, False, **uncompiled)) == ("replay (compile asked, captured uncompiled)",
                                                                  "uncompiled")
    assert products_lines(result(True, True)).splitlines() == [
        "Matrix products (K): measured cuBLASLt algorithms: 7 shapes", "", "Matrix products (L): ATen's"]
    assert products_lines(result(True, False)) == ""


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
