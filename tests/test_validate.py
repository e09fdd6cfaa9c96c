"""``hwgraph validate`` on CPU: the report passes for the cpu backend and fails, naming the check, for a broken one;
the result collector's outcomes, and the conformance run it starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwgraph.testing.results import ResultCollector, failing_checks, run_conformance, suite_module
from hwgraph.validate import verdict

STALE = Path(__file__).parent / "plugins" / "stale"
FAST = ["--tokens", "4", "16", "--warmup", "0", "--samples", "1"]


def run_validate(args, env=None, timeout=300):
    env = {**os.environ, **(env or {})}
    env.pop("HWGRAPH_TEST_BACKENDS", None)
    env.pop("HWGRAPH_GRAPH_BACKEND", None)
    return subprocess.run([sys.executable, "-m", "hwgraph.cli", "validate", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.cpu_machine  # on an accelerator, validate chooses its backend and preset
def test_validate_on_cpu_writes_a_passing_report_with_plot(tmp_path):
    out = tmp_path / "report"
    result = run_validate(["--report", str(out), *FAST])
    assert result.returncode == 0, result.stdout + result.stderr
    assert {"report.md", "report.json", "latency.png", "conformance.log"} <= {p.name for p in out.iterdir()}
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "**PASS" in md and "Validated: **cpu**" in md and "| cpu | yes | emulated | **yes** |" in md
    for section in ("## Platform", "## Versions", "## Attention kernels", "## Conformance", "## Latency",
                    "## Graph memory per budget", "## Dispatch", "![latency against image tokens](latency.png)"):
        assert section in md, section
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] is True and report["backend"] == "cpu"
    counts = report["conformance"]["counts"]
    assert counts["passed"] >= 10 and counts["failed"] == counts["error"] == 0
    assert [r["group"] for r in report["bench"]["rows"]] == ["1x4", "1x16"]
    assert "PASS" in result.stdout and "report.md" in result.stdout
    # a third-party pytest plugin imported before validate's pytest.main (anyio) is no warning of the suite's
    assert "PytestAssertRewriteWarning" not in (out / "conformance.log").read_text()


@pytest.fixture(scope="module")
def stale_site(tmp_path_factory):
    """The deliberately broken plugin, installed as a separate distribution into its own folder."""
    tmp = tmp_path_factory.mktemp("stale")
    source = tmp / "src"
    shutil.copytree(STALE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    return target


def test_validate_fails_a_backend_whose_replays_go_stale_naming_the_checks(tmp_path, stale_site):
    out = tmp_path / "report"
    path = os.pathsep.join(filter(None, [str(stale_site), os.environ.get("PYTHONPATH")]))
    result = run_validate(["--backend", "stale", "--report", str(out), "--no-bench"], env={"PYTHONPATH": path})
    assert result.returncode == 1, result.stdout + result.stderr
    check = "TestReplayEqualsEager::test_single_image_replays_at_each_budget_and_equals_eager[stale-TORCH_SDPA-float32"
    assert f"conformance check failed: {check}-full]" in result.stderr
    assert "TestRetainedOutputs::" in result.stderr and "not close" in result.stderr
    report = json.loads((out / "report.json").read_text())
    outcomes = {r["check"]: r["outcome"] for r in report["conformance"]["results"]}
    # The manager's post-capture verification replays once and passes: only the suite's own checks catch it.
    assert outcomes["TestCapture::test_every_budget_captures_and_reports_its_memory[stale-TORCH_SDPA-float32]"] \
        == "passed"
    assert outcomes[f"{check}-padded]"] == "failed"
    md = (out / "report.md").read_text()
    assert "**FAIL" in md and f"`{check}-full]`" in md and "latency.png not written" in md


@pytest.mark.parametrize("argv, reason", [
    pytest.param(["--backend", "cuda"], "graph backend 'cuda' is unavailable: ", marks=pytest.mark.cpu_machine),
    (["--backend", "cpu", "--attention", "FLASH_ATTN"], "attention kernel FLASH_ATTN is unavailable: "),
], ids=["unavailable backend", "unavailable kernel"])
def test_a_benchmark_that_cannot_run_here_is_explained_without_a_traceback(tmp_path, argv, reason):
    from hwgraph.attention.registry import kernel_specs

    if "FLASH_ATTN" in argv and "FLASH_ATTN" not in {k.name for k in kernel_specs()}:
        pytest.skip("FLASH_ATTN comes with hwgraph-backend-cuda, which is not installed")
    out = tmp_path / "report"
    out.mkdir()
    (out / "latency.png").write_bytes(b"an earlier run's plot")
    result = run_validate(["--report", str(out), *argv, *FAST])
    assert result.returncode == 1, result.stdout + result.stderr  # nothing validated: no check ran
    assert not (out / "latency.png").exists()  # the report says none was drawn
    assert "Traceback" not in result.stderr, result.stderr
    assert f"latency.png not written: {reason}" in result.stdout
    md = (out / "report.md").read_text()
    assert f"No benchmark: {reason}" in md
    assert json.loads((out / "report.json").read_text())["bench_error"].startswith(reason)


def test_an_empty_backend_is_refused_not_taken_for_the_automatic_choice(tmp_path, capsys):
    """``--backend "$BACKEND"`` with the variable unset validated the automatic choice and could PASS. The refusal
    lists the names it takes, as ``hwgraph bench``'s does (it named none)."""
    from hwgraph import cli

    assert cli.main(["validate", "--backend", "", "--report", str(tmp_path / "r"), "--no-bench"]) == 2
    err = capsys.readouterr().err
    assert "--backend '': expected a graph backend name, one of cpu" in err
    assert "leave the option out" in err
    assert not (tmp_path / "r" / "report.json").exists()


def test_the_verdict_fails_when_no_check_ran():
    conformance = {"exit_code": 0, "counts": {"passed": 0, "failed": 0, "error": 0, "skipped": 2},
                   "results": [{"check": "x", "outcome": "skipped", "message": "graph backend 'cuda' is unavailable"}]}
    ok, summary = verdict(conformance)
    assert not ok and "no conformance check ran" in summary and "cuda" in summary


@pytest.mark.parametrize("requested, ok", [(None, True), (["torch_sdpa"], True), (["TORCH_SDPA", "TRITON_ATTN"], False),
                                           (["TORCH_SDPA", "FLASH_ATTN"], False)])
def test_the_verdict_fails_a_kernel_asked_for_by_name_whose_checks_all_skipped(requested, ok):
    # `--attention TORCH_SDPA TRITON_ATTN` on CPU passed on TORCH_SDPA's checks alone, TRITON_ATTN's all skipped; a
    # kernel for another accelerator (FLASH_ATTN on a CPU backend) has no case at all
    skip = "attention kernel TRITON_ATTN is unavailable: on CPU TRITON_ATTN runs only under the Triton interpreter"
    results = [{"check": "TestA::t[cpu-TORCH_SDPA-float32]", "outcome": "passed", "message": ""},
               {"check": "TestA::t[cpu-TORCH_SDPA-float32-padded]", "outcome": "passed", "message": ""},
               {"check": "TestA::t[cpu-TRITON_ATTN-float32]", "outcome": "skipped", "message": skip},
               {"check": "TestA::t[cpu-TRITON_ATTN-float32-padded]", "outcome": "skipped", "message": skip}]
    conformance = {"exit_code": 0, "counts": {"passed": 2, "failed": 0, "error": 0, "skipped": 2}, "results": results}
    passed, summary = verdict(conformance, requested)
    assert passed is ok, summary
    if ok:
        assert summary == "PASS: 2 checks passed, 2 skipped"
    elif "TRITON_ATTN" in requested:
        assert summary == f"FAIL: attention kernel TRITON_ATTN was asked for and none of its checks ran ({skip})"
    else:
        assert summary == ("FAIL: attention kernel FLASH_ATTN was asked for and none of its checks ran (the suite "
                           "has no case for it on this machine)")


@pytest.mark.cpu_machine  # TRITON_ATTN runs on the CUDA backend's machines (the verdict's own test runs anywhere)
def test_validate_fails_a_requested_kernel_that_cannot_run_here(tmp_path, capsys):
    from hwgraph import cli

    code = cli.main(["validate", "--report", str(tmp_path / "r"), "--attention", "TORCH_SDPA", "TRITON_ATTN",
                     "--no-bench"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    # its checks err naming the gate's reasons, as the suite's own pytest run fails them (they were all skipped there)
    assert out.startswith("FAIL: ") and "conformance check(s) failed" in out, out
    assert "[cpu-TRITON_ATTN-float32" in err and "attention kernel TRITON_ATTN is unavailable: " in err, err


def test_the_generated_suite_module_names_backend_preset_and_kernels():
    text = suite_module("rocm", "tiny", ["triton_attn"], "bfloat16")
    assert "from hwgraph.testing.suite import *" in text
    assert "HWGRAPH_BACKEND = 'rocm'" in text and "HWGRAPH_ATTENTION = ('TRITON_ATTN',)" in text
    assert "HWGRAPH_DTYPE = 'bfloat16'" in text


def report(nodeid, when, outcome, longrepr=None, duration=0.25):
    return pytest.TestReport(nodeid, ("m.py", 1, nodeid), {}, outcome, longrepr, when, duration=duration)


def test_the_collector_reports_skips_with_their_reason_and_setup_or_teardown_failures_as_errors():
    collector = ResultCollector()
    skipped_case = "m.py::TestCapture::test_x[cpu-TRITON_ATTN-float32]"
    reason = "attention kernel TRITON_ATTN is unavailable: on CPU TRITON_ATTN runs only under the Triton interpreter"
    events = [
        report(skipped_case, "setup", "skipped", ("m.py", 149, f"Skipped: {reason}")),
        report(skipped_case, "teardown", "passed"),
        report("m.py::T::broken_fixture", "setup", "failed", "RuntimeError: capture failed"),
        report("m.py::T::broken_fixture", "teardown", "passed"),
        report("m.py::T::leaks", "setup", "passed"),
        report("m.py::T::leaks", "call", "passed"),
        report("m.py::T::leaks", "teardown", "failed", "AssertionError: pool not released"),
        report("m.py::T::wrong", "setup", "passed"),
        report("m.py::T::wrong", "call", "failed", "AssertionError: not close"),
        report("m.py::T::ok", "setup", "passed"),
        report("m.py::T::ok", "call", "passed"),
    ]
    for event in events:
        collector.pytest_runtest_logreport(event)
    got = {r.check: (r.outcome, r.message) for r in collector.results.values()}
    assert got == {
        "TestCapture::test_x[cpu-TRITON_ATTN-float32]": ("skipped", reason),
        "T::broken_fixture": ("error", "RuntimeError: capture failed"),
        "T::leaks": ("error", "teardown: AssertionError: pool not released"),
        "T::wrong": ("failed", "AssertionError: not close"),
        "T::ok": ("passed", ""),
    }
    assert collector.counts() == {"passed": 1, "failed": 1, "error": 2, "skipped": 1}
    results = {"results": [r.as_dict() for r in collector.results.values()]}
    assert [r["check"] for r in failing_checks(results)] == ["T::broken_fixture", "T::leaks", "T::wrong"]


SUITE_SETTINGS = {"HWGRAPH_TEST_BACKENDS": "rocm", "HWGRAPH_TEST_ATTENTION": "TRITON_ATTN",
                  "HWGRAPH_TEST_PRESET": "qwen3-omni-30b-a3b", "HWGRAPH_TEST_DTYPE": "bfloat16",
                  "HWGRAPH_TEST_GRAPH_MODE": "bogus",
                  # pytest's own: "-k Declaration" left one check to count, and a broken backend passed validate
                  "PYTEST_ADDOPTS": "-k Declaration", "PYTEST_PLUGINS": "hwgraph_no_such_plugin"}


def test_run_conformance_runs_the_explicit_backend_without_the_environments_settings(tmp_path, monkeypatch):
    """``hwgraph validate --backend cpu`` with a vendor's HWGRAPH_TEST_* settings left in the environment must still
    run the cpu cases (not skip them all as excluded), with validate's own defaults (HWGRAPH_TEST_ATTENTION once
    narrowed "every available kernel" to one, HWGRAPH_TEST_DTYPE replaced the dtype, a bad HWGRAPH_TEST_GRAPH_MODE
    got past validate's check), and leave the variables as it found them."""
    seen = []

    def main(args, plugins=()):
        seen.append({name: os.environ.get(name) for name in SUITE_SETTINGS})
        return 0

    for name, value in SUITE_SETTINGS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pytest, "main", main)
    result = run_conformance(tmp_path, "cpu", "tiny")
    assert seen == [dict.fromkeys(SUITE_SETTINGS)] and result["exit_code"] == 0
    assert {name: os.environ[name] for name in SUITE_SETTINGS} == SUITE_SETTINGS


@pytest.mark.cpu_machine  # on an accelerator, validate chooses its backend and preset
def test_validate_checks_every_kernel_in_its_default_dtype_whatever_the_suites_environment(tmp_path):
    """The whole command on the CPU, with the suite's settings for another run left in the environment."""
    result = run_validate(["--report", str(tmp_path / "r"), "--no-bench"], env=SUITE_SETTINGS)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    results = report["conformance"]["results"]
    passed = [r["check"] for r in results if r["outcome"] == "passed"]
    assert len(passed) >= 10 and all("[cpu-TORCH_SDPA-float32" in c for c in passed), passed
    assert any("[cpu-TRITON_ATTN-float32" in r["check"] for r in results)  # every kernel is listed (skipped here)


class FakeTerminal:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_the_progress_bar_draws_only_on_a_terminal():
    from hwgraph.progress import Progress

    for tty in (True, False):
        stream = FakeTerminal(tty)
        with Progress("conformance", total=4, stream=stream) as bar:
            bar.advance(note="TestCapture")
        assert ("conformance [#######" in stream.text and "1/4" in stream.text) is tty
        assert (stream.text == "") is not tty


def test_the_progress_bar_stays_one_bounded_line_and_is_cleared_on_exit():
    from hwgraph.progress import Progress

    stream = FakeTerminal(True)
    with Progress("conformance", stream=stream, width=8) as bar:
        bar.set_total(4)
        assert "0/4" in stream.text.split("\r")[-1]  # a new total is drawn at once
        bar.advance(note="TestCapture")
        bar.advance(note="TestReplay" * 20)
        assert "[####....] 2/4" in stream.text.split("\r")[-1]
        bar.advance(3)  # more checks reported than collected: the bar stays full, not longer
        assert "[########] 5/4" in stream.text.split("\r")[-1]
    lines = stream.text.split("\r")[1:]
    assert all(len(line) <= 110 for line in lines)  # a long note must not wrap the terminal line
    assert stream.text.endswith("\r" + " " * 110 + "\r")  # later output starts on a clean line


@pytest.mark.parametrize("exit_code, counts, failed, ok, summary", [
    (1, {"passed": 3, "failed": 1, "error": 1, "skipped": 0}, ["failed", "error"], False,
     "FAIL: 2 conformance check(s) failed"),
    (3, {"passed": 3, "failed": 0, "error": 0, "skipped": 0}, [], False,
     "FAIL: pytest exited with status 3 (see conformance.log)"),
    (0, {"passed": 3, "failed": 0, "error": 0, "skipped": 2}, [], True, "PASS: 3 checks passed, 2 skipped"),
], ids=["failures and errors", "pytest internal error", "pass"])
def test_the_verdict_counts_failed_and_errored_checks_and_distrusts_an_abnormal_pytest_exit(exit_code, counts, failed,
                                                                                          ok, summary):
    results = [{"check": f"T::{i}", "outcome": o, "message": "x"} for i, o in enumerate(failed)]
    results += [{"check": "T::ok", "outcome": "passed", "message": ""}] * counts["passed"]
    assert verdict({"exit_code": exit_code, "counts": counts, "results": results}) == (ok, summary)


def validate_args(*argv):
    from hwgraph import cli

    return cli.build_parser().parse_args(["validate", *argv])


def test_the_benchmark_defaults_depend_on_the_device_and_explicit_options_win(monkeypatch):
    from hwgraph import bench
    from hwgraph.progress import Progress
    from hwgraph.validate import ACCELERATOR_TOKENS, CPU_TOKENS, run_benchmark

    configs = []
    monkeypatch.setattr(bench, "run_bench", lambda cfg, progress: configs.append(cfg) or {})
    for device in ("cpu", "cuda"):
        run_benchmark(validate_args(), "cpu", torch.device(device), Progress)
    cpu, gpu = configs
    assert (cpu.warmup, cpu.samples, cpu.dtype, [g.tokens for g in cpu.groups]) == (3, 10, torch.float32,
                                                                                   list(CPU_TOKENS))
    assert (gpu.warmup, gpu.samples, gpu.dtype, [g.tokens for g in gpu.groups]) == (10, 30, torch.bfloat16,
                                                                                   list(ACCELERATOR_TOKENS))
    assert cpu.reference and cpu.kernels is None and cpu.graph_backend == "cpu"
    args = validate_args("--warmup", "0", "--samples", "2", "--dtype", "bfloat16", "--tokens", "8",
                         "--attention", "TORCH_SDPA", "--no-transformers")
    run_benchmark(args, "cpu", torch.device("cpu"), Progress)
    cfg = configs[-1]
    assert (cfg.warmup, cfg.samples, cfg.dtype, [g.label for g in cfg.groups]) == (0, 2, torch.bfloat16, ["1x8"])
    assert not cfg.reference and cfg.kernels == ["TORCH_SDPA"]


def test_validate_runs_the_suite_on_the_accelerator_its_backend_serves(monkeypatch):
    from hwgraph.registry import backend_specs
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu
    from hwgraph.validate import device_for_backend

    if "cuda" not in {s.name for s in backend_specs()}:
        pytest.skip("the cuda graph backend comes with hwgraph-backend-cuda, which is not installed")
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    assert device_for_backend("cuda") == torch.device("cuda")
    assert device_for_backend("cpu") == torch.device("cpu")  # the CPU reference backend, on a GPU machine
    assert device_for_backend("rocm") == torch.device("cpu")  # not this machine's accelerator: the report says why


def lat(median: float) -> dict:
    return {"median_ms": median, "p95_ms": median * 1.25}


def bench_row(kernel, tokens, eager, replay=None, transformers=None, images=1) -> dict:
    return {"group": f"{images}x{tokens // images}", "images": images, "tokens": tokens, "kernel": kernel,
            "transformers": transformers and lat(transformers), "eager": lat(eager), "replay": replay and lat(replay),
            "budget": 64 if replay else None, "replay_note": "replay" if replay else "eager: over budget",
            "speedup": {"eager_vs_transformers": None, "replay_vs_transformers": None, "replay_vs_eager": None}}


def bench_result(rows, accelerates=False) -> dict:
    """What ``run_bench`` returns, reduced to what the validation report and the plot read."""
    stats = {"calls": 1, "hits": 1, "misses": 0, "eager_groups": 0, "padding_tokens": 0, "replays_per_budget": {64: 1},
             "capture_failures": {}}
    return {"preset": "tiny", "dtype": "float32", "device": "cpu", "timer": "wall clock", "warmup": 0, "samples": 1,
            "interleaved": True, "graph_backend": "cpu", "graph_backend_accelerates": accelerates, "budgets": [64],
            "kernels": [{"name": "TORCH_SDPA", "available": True, "reasons": []},
                        {"name": "FLASH_ATTN", "available": False, "reasons": ["FLASH_ATTN runs on NVIDIA CUDA"]}],
            "rows": rows, "per_kernel": {k: {"graph_memory_bytes": {"64": 2**20}, "stats": stats}
                                         for k in dict.fromkeys(r["kernel"] for r in rows)}}


def drawn_lines(monkeypatch, result, path):
    """``latency_plot``'s answer and the lines it drew, by label: (tokens, medians, colour)."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    import matplotlib.pyplot  # here: latency_plot imports it only when it has rows to draw
    from matplotlib.figure import Figure

    from hwgraph.plot import latency_plot

    figures, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: figures.append(fig) or savefig(fig, *a, **kw))
    note = latency_plot(result, path)
    assert matplotlib.pyplot.get_fignums() == []  # every figure closed: validate may run in a long process
    if not figures:
        return note, None, {}
    (ax,) = figures[0].axes
    return note, [int(t) for t in ax.get_xticks()], {
        line.get_label(): ([int(v) for v in line.get_xdata()], list(line.get_ydata()), line.get_color())
        for line in ax.get_lines()}


def test_the_latency_plot_draws_each_kernels_eager_and_replay_over_single_images_sorted_by_tokens(monkeypatch,
                                                                                                  tmp_path):
    rows = [bench_row("K", 64, 8.0, None, 20.0), bench_row("K", 16, 4.0, 1.0, 10.0),
            bench_row("L", 16, 5.0, 2.0, 10.0), bench_row("L", 64, 9.0, 3.0, 20.0),
            bench_row("K", 32, 6.0, 1.5, 15.0, images=2)]
    note, ticks, lines = drawn_lines(monkeypatch, bench_result(rows), tmp_path / "latency.png")
    assert note is None and (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ticks == [16, 64]  # the two-image group is not a point of this plot
    assert lines == {"K eager": ([16, 64], [4.0, 8.0], "C0"), "K replay": ([16], [1.0], "C0"),
                     "L eager": ([16, 64], [5.0, 9.0], "C1"), "L replay": ([16, 64], [2.0, 3.0], "C1"),
                     "transformers eager": ([16, 64], [10.0, 20.0], "black")}
    # without the transformers reference (--no-transformers) there is no line for it
    note, _, lines = drawn_lines(monkeypatch, bench_result([bench_row("K", 16, 4.0, 1.0)]), tmp_path / "b.png")
    assert note is None and set(lines) == {"K eager", "K replay"}


def test_the_latency_plot_says_why_it_was_not_drawn(monkeypatch, tmp_path):
    rows = [bench_row("K", 32, 6.0, 1.5, images=2)]
    note, _, lines = drawn_lines(monkeypatch, bench_result(rows), tmp_path / "latency.png")
    assert lines == {} and note == "no single-image groups were measured" and not (tmp_path / "latency.png").exists()
    from hwgraph.plot import latency_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    note = latency_plot(bench_result([bench_row("K", 16, 4.0, 1.0)]), tmp_path / "latency.png")
    assert note.startswith("matplotlib is not installed (") and "pip install 'hwgraph[plot]'" in note
    assert not (tmp_path / "latency.png").exists()


def passing_conformance(*args, **kwargs) -> dict:
    return {"exit_code": 0, "counts": {"passed": 1, "failed": 0, "error": 0, "skipped": 0}, "log": "",
            "results": [{"check": "TestCapture::test_x[cpu]", "outcome": "passed", "message": "", "seconds": 0.1}]}


@pytest.fixture
def validate_in_process(monkeypatch):
    """``hwgraph validate argv`` in this process with a passing suite and ``run_bench`` answering ``bench``: a result
    dict, or an exception to raise. Returns (exit status, stdout)."""
    from hwgraph import bench as bench_module
    from hwgraph import cli
    from hwgraph.testing import results

    monkeypatch.delenv("HWGRAPH_GRAPH_BACKEND", raising=False)
    monkeypatch.setattr(results, "run_conformance", passing_conformance)

    def run(argv, bench, capsys):
        def run_bench(cfg, progress):
            if isinstance(bench, Exception):
                raise bench
            return bench

        monkeypatch.setattr(bench_module, "run_bench", run_bench)
        code = cli.main(["validate", *argv])
        return code, capsys.readouterr().out

    return run


def test_a_stopped_validate_leaves_no_earlier_runs_verdict_in_its_folder(monkeypatch, tmp_path):
    """Stopped (Ctrl-C, a CI job's time limit), a run left the previous run's PASS report.json and report.md beside
    its own conformance.log: an artifact upload would publish a stale PASS."""
    from hwgraph import cli
    from hwgraph.testing import results

    monkeypatch.delenv("HWGRAPH_GRAPH_BACKEND", raising=False)
    out = tmp_path / "report"
    out.mkdir()
    for name, text in [("report.json", '{"ok": true}'), ("report.md", "**PASS**"), ("latency.png", "old")]:
        (out / name).write_text(text)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(results, "run_conformance", stopped)
    assert cli.main(["validate", "--backend", "cpu", "--report", str(out), "--no-bench"]) == cli.INTERRUPTED
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_second_conformance_run_in_one_process_runs_its_own_module(tmp_path, monkeypatch):
    """pytest keeps the imported suite module in sys.modules under its file's name: a second run (another kernel,
    another dtype) ran the first run's checks."""
    from hwgraph.testing import results

    for name, text in [("first", "def test_first():\n    pass\n"), ("second", "def test_second():\n    pass\n")]:
        monkeypatch.setattr(results, "suite_module", lambda *args, text=text: text)
        result = run_conformance(tmp_path / name, "cpu", "tiny")
        assert [r["check"] for r in result["results"]] == [f"test_{name}"]


INTERRUPTED_SUITE = "def test_interrupted():\n    raise KeyboardInterrupt\n"


def test_ctrl_c_in_the_conformance_suite_stops_validate_before_its_benchmark(monkeypatch, tmp_path, capsys):
    """pytest catches Ctrl-C and returns status 2: validate then ran its whole benchmark (minutes on a GPU) and wrote
    a FAIL report, instead of stopping."""
    from hwgraph import bench as bench_module
    from hwgraph import cli
    from hwgraph.testing import results

    monkeypatch.delenv("HWGRAPH_GRAPH_BACKEND", raising=False)
    monkeypatch.setenv("HWGRAPH_TEST_DTYPE", "bfloat16")  # set aside while the suite runs, and restored after
    monkeypatch.setattr(results, "suite_module", lambda *args: INTERRUPTED_SUITE)
    benched = []
    monkeypatch.setattr(bench_module, "run_bench", lambda *args, **kwargs: benched.append(args))
    out = tmp_path / "report"
    assert cli.main(["validate", "--backend", "cpu", "--report", str(out), *FAST]) == cli.INTERRUPTED
    assert benched == [] and not (out / "report.json").exists()
    assert "hwgraph validate: interrupted: the conformance suite was interrupted" in capsys.readouterr().err
    assert os.environ["HWGRAPH_TEST_DTYPE"] == "bfloat16"


@pytest.mark.parametrize("suite", ["import pytest\npytest.exit('stop', returncode=2)\n", "this is not python\n",
                                   "import pytest\ndef test_stops():\n    pytest.exit('stop', returncode=2)\n"],
                         ids=["exit while collecting", "not python", "exit in a test"])
def test_a_suite_stopped_by_pytest_exit_or_a_collection_error_is_a_result_not_an_interrupt(tmp_path, monkeypatch,
                                                                                           suite):
    """Both end with pytest's "interrupted" status too; only Ctrl-C stops the caller."""
    from hwgraph.testing import results

    monkeypatch.setattr(results, "suite_module", lambda *args: suite)
    result = run_conformance(tmp_path, "cpu", "tiny")
    assert result["exit_code"] == 2 and verdict(result)[0] is False


def test_validate_reports_the_benchmark_its_kernels_and_the_emulation_and_lists_the_plot(validate_in_process,
                                                                                          tmp_path, capsys):
    out = tmp_path / "ci" / "h200" / "report"  # made with its parents
    bench = bench_result([bench_row("TORCH_SDPA", 16, 4.0, 1.0, 10.0)])
    code, stdout = validate_in_process(["--backend", "cpu", "--report", str(out), *FAST], bench, capsys)
    assert code == 0
    assert f"report: {out / 'report.md'} (also report.json, latency.png, conformance.log)" in stdout
    assert "latency.png not written" not in stdout and (out / "latency.png").exists()
    md = (out / "report.md").read_text()
    assert ("For the benchmark's tower (tiny, float32, cpu):\n\n| attention kernel | available | reasons |\n"
            "|---|---|---|\n| TORCH_SDPA | yes | - |\n| FLASH_ATTN | no | FLASH_ATTN runs on NVIDIA CUDA |") in md
    assert ("wall clock, 0 warm-ups, 1 samples per cell; ms as median / p95; speedups are ratios of medians from "
            "this run (per group, transformers and every kernel's eager and replay are sampled in turn, one call of "
            "each per round, in orders in which each callable follows each other equally often). The cpu backend "
            "emulates replay eagerly: no speed-up is expected from it.") in md
    assert "{reference}" not in md  # the unformatted note once stood here (found by a plugin author's walkthrough)
    assert "![latency against image tokens](latency.png)" in md
    bench["graph_backend_accelerates"] = True
    validate_in_process(["--backend", "cpu", "--report", str(out), *FAST], bench, capsys)
    assert "emulates replay" not in (out / "report.md").read_text()


def test_a_plot_that_cannot_be_written_is_a_reason_and_validate_still_writes_its_reports(
        validate_in_process, monkeypatch, tmp_path, capsys):
    """savefig raised (a full disk) out of latency_plot and validate: after the whole suite and benchmark, no
    report.json or report.md, and a half-written latency.png beside them."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    import errno

    from matplotlib.figure import Figure

    def full_disk(fig, path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG\r\n\x1a\n partial")  # what was written before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    out = tmp_path / "report"
    code, stdout = validate_in_process(["--backend", "cpu", "--report", str(out), *FAST],
                                       bench_result([bench_row("TORCH_SDPA", 16, 4.0, 1.0, 10.0)]), capsys)
    assert code == 0
    assert (f"latency.png not written: could not write {out / 'latency.png'}: OSError: [Errno 28] No space left"
            in stdout)
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]  # the suite is faked: no log
    assert "could not write" in json.loads((out / "report.json").read_text())["plot"]["skipped"]


def test_validate_hands_its_graph_mode_to_the_suite_and_the_benchmark_and_reports_it(validate_in_process,
                                                                                     monkeypatch, tmp_path, capsys):
    from hwgraph import bench as bench_module
    from hwgraph.testing import results

    seen = {}

    def conformance(*args, **kwargs):
        seen["suite"] = kwargs.get("graph_mode")
        return passing_conformance()

    def run_bench(cfg, progress):
        seen["bench"] = cfg.graph_mode
        return bench_result([bench_row("TORCH_SDPA", 16, 4.0, 1.0, 10.0)])

    from hwgraph import cli

    out = tmp_path / "report"
    monkeypatch.setattr(results, "run_conformance", conformance)  # after the fixture's own
    monkeypatch.setattr(bench_module, "run_bench", run_bench)
    assert cli.main(["validate", "--backend", "cpu", "--graph-mode", "emulated", "--report", str(out), *FAST]) == 0
    assert seen == {"suite": "emulated", "bench": "emulated"}
    assert "- graph backend cpu (mode emulated), preset" in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["graph_mode"] == "emulated"
    assert 'HWGRAPH_GRAPH_MODE = \'emulated\'' in suite_module("cpu", "tiny", None, None, "emulated")


def test_validate_without_a_graph_mode_reports_the_mode_the_backend_ran_in(validate_in_process, tmp_path, capsys):
    """Left out, ``--graph-mode`` made the report say no mode (``"graph_mode": null``), though the suite and the
    benchmark ran the backend's first one ("emulated" on cpu), as ``hwgraph bench``'s heading says."""
    out = tmp_path / "report"
    code, _ = validate_in_process(["--backend", "cpu", "--report", str(out), "--no-bench", *FAST], None, capsys)
    assert code == 0
    assert json.loads((out / "report.json").read_text())["graph_mode"] == "emulated"
    assert "- graph backend cpu (mode emulated), preset" in (out / "report.md").read_text()

def test_a_benchmark_that_crashes_is_reported_with_its_error_and_the_suites_verdict_stands(validate_in_process,
                                                                                            tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "latency.png").write_bytes(b"an earlier run's plot")
    code, stdout = validate_in_process(["--backend", "cpu", "--report", str(out), *FAST],
                                       RuntimeError("out of memory"), capsys)
    assert code == 0  # the conformance suite passed; the report says why it has no latency table
    assert f"report: {out / 'report.md'} (also report.json, conformance.log)" in stdout
    assert "latency.png not written: RuntimeError: out of memory" in stdout and not (out / "latency.png").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["bench_error"] == "RuntimeError: out of memory" and report["plot"] == {
        "skipped": "RuntimeError: out of memory"}
    assert "No benchmark: RuntimeError: out of memory. latency.png not written." in (out / "report.md").read_text()


def test_the_validation_report_tabulates_platform_versions_choices_and_checks_failures_first():
    from hwgraph.validation_report import validation_markdown

    results = [{"check": "T::ok", "outcome": "passed", "message": ""},
               {"check": "T::wrong", "outcome": "failed", "message": "expected 1 | got 2\nat line 3"},
               {"check": "T::broken", "outcome": "error", "message": "RuntimeError: capture failed"},
               {"check": "T::wrong2", "outcome": "failed", "message": "not close"}]
    results += [{"check": f"T::skip{i}", "outcome": "skipped", "message": m}
                for i, m in enumerate(["needs CUDA", "needs CUDA", "needs ROCm"])]
    # a gate that raised a CUDA error carries its multi-line message into the reasons
    cuda_error = "the cuda gate failed: RuntimeError: CUDA error: no kernel image | sm_120\nCUDA kernel errors ..."
    report = {
        "verdict": "FAIL: 3 conformance check(s) failed", "ok": False, "backend": "cpu",
        "backend_reason": "explicit (--backend)", "preset": "tiny", "seconds": 1.5,
        "environment": {"python": "3.12.1", "host": "Linux 6.1 x86_64",
                        "packages": {"torch": "2.13.0", "aiter": None}},
        "info": {"platform": {"kind": "cpu", "arch": None, "notes": ["torch.cuda failed to count devices (a\nb)"]},
                 "graph_backends": [{"name": "cpu", "available": True, "modes": ["emulated"], "reasons": []},
                                    {"name": "cuda", "available": False, "modes": ["full"], "reasons": [cuda_error]}],
                 "attention_kernels": [
                     {"name": "TORCH_SDPA", "available": True, "graph_safe": True, "kinds": ["cpu", "cuda"],
                      "reasons": []},
                     {"name": "EAGER_ONLY", "available": True, "graph_safe": False, "kinds": ["cpu"], "reasons": []},
                     {"name": "FLASH_ATTN", "available": False, "graph_safe": True, "kinds": ["cuda"],
                      "reasons": [cuda_error]}],
                 "problems": ["entry point 'broken' (broken:probe) failed to load: ImportError: x"]},
        "conformance": {"exit_code": 1, "counts": {"passed": 1, "failed": 2, "error": 1, "skipped": 3},
                        "results": results},
        "bench": None, "bench_error": None, "plot": {"skipped": "benchmark skipped"}}
    md = validation_markdown(report)
    assert ("Failing checks:\n\n- `T::wrong`: expected 1 | got 2\nat line 3\n- `T::broken`: RuntimeError: capture "
            "failed\n- `T::wrong2`: not close\n\n## Platform") in md
    assert "| arch | - |\n| note | torch.cuda failed to count devices (a b) |" in md
    assert "Python 3.12.1 on Linux 6.1 x86_64\n\n| package | version |\n|---|---|\n| torch | 2.13.0 |\n" \
           "| aiter | not installed |" in md
    escaped = "the cuda gate failed: RuntimeError: CUDA error: no kernel image \\| sm_120 CUDA kernel errors ..."
    assert f"| cuda | no | full |  | {escaped} |" in md
    assert "| EAGER_ONLY | yes | no | cpu | - |" in md and f"| FLASH_ATTN | no | yes | cuda | {escaped} |" in md
    assert "Plugin problem: entry point 'broken' (broken:probe) failed to load: ImportError: x" in md
    assert "1 passed, 2 failed, 1 errors, 3 skipped (pytest exit status 1; full output in conformance.log)" in md
    assert ("| `T::wrong` | **FAILED** | expected 1 \\| got 2 at line 3 |\n| `T::broken` | **ERROR** | RuntimeError: "
            "capture failed |\n| `T::wrong2` | **FAILED** | not close |\n| `T::ok` | passed | - |\n") in md
    assert "| checks | reason |\n|---|---|\n| 2 | needs CUDA |\n| 1 | needs ROCm |" in md
    assert "No benchmark: skipped (--no-bench). latency.png not written." in md
    for line in md.splitlines():  # every table row keeps its cells: no reason breaks it
        if line.startswith("| "):
            assert line.endswith(" |"), line


def test_the_benchmark_builds_nothing_for_a_backend_unavailable_here(validate_in_process, tmp_path, capsys):
    from hwgraph.platform import detect
    from hwgraph.registry import list_backends

    unavailable = [(spec.name, cap.reasons) for spec, cap in list_backends(detect()) if not cap.ok]
    if not unavailable:
        pytest.skip("every installed graph backend is available here")
    name, reasons = unavailable[0]
    out = tmp_path / "report"
    never = AssertionError("the benchmark ran for a backend that is unavailable here")
    _, stdout = validate_in_process(["--backend", name, "--report", str(out), *FAST], never, capsys)
    reason = f"graph backend '{name}' is unavailable: {'; '.join(reasons)}"
    assert f"latency.png not written: {reason}" in stdout
    assert json.loads((out / "report.json").read_text())["bench_error"] == reason


def test_on_a_gpu_machine_the_benchmark_refuses_another_vendors_backend_for_the_machines_reason(
        validate_in_process, monkeypatch, tmp_path, capsys):
    """On a CUDA machine, 'npu' is unavailable because the accelerator is CUDA, as the suite and ``hwgraph info``
    say; the benchmark, which would run it on the CPU, once gave the CPU-only machine's reason (install torch_npu)."""
    from hwgraph.registry import SelectionError, spec_named
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

    try:
        spec_named("npu")
    except SelectionError:
        pytest.skip("the npu graph backend comes with hwgraph-backend-npu, which is not installed")
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    out = tmp_path / "report"
    never = AssertionError("the benchmark ran for a backend that is unavailable here")
    _, stdout = validate_in_process(["--backend", "npu", "--report", str(out), *FAST], never, capsys)
    reason = ("graph backend 'npu' is unavailable: this machine's accelerator is cuda, not an Ascend NPU: use the "
              "cuda backend")
    assert f"latency.png not written: {reason}" in stdout
    assert json.loads((out / "report.json").read_text())["bench_error"] == reason
