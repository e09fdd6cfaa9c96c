"""The bench's reports, its timing order and its help: each test failed on the code before its fix."""

from __future__ import annotations

import json
import re

import torch

from hwgraph import cli
from hwgraph.bench import BenchConfig, parse_groups, run_bench
from hwgraph.report import calibration_section, heading


def tiny_bench(**kwargs):
    cfg = dict(preset="tiny", groups=parse_groups("1x4"), device=torch.device("cpu"), dtype=torch.float32,
               graph_backend="cpu", warmup=0, samples=1, kernels=["TORCH_SDPA"], budgets=[8], reference=False)
    return run_bench(BenchConfig(**{**cfg, **kwargs}))


def test_plain_replay_not_timed_because_the_replays_own_capture_failed_says_so(monkeypatch):
    """Where the main manager's capture of the group's budget failed (it replays a larger one) and the plain manager
    has it, the row said the plain capture of the larger budget had failed: the plain manager failed nothing."""
    from hwgraph import manager as manager_module

    managers = []

    class MainCaptureOf8Fails(manager_module.EncoderGraphManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            managers.append(self)

        def _capture_budget(self, budget, compiled=False):
            if budget == 8 and self is managers[0]:  # the main manager, built first
                raise RuntimeError("simulated: out of memory")
            return super()._capture_budget(budget, compiled)

    monkeypatch.setattr(manager_module, "EncoderGraphManager", MainCaptureOf8Fails)
    result = tiny_bench(budgets=[8, 16], measure_products=True)
    (row,) = result["rows"]
    per = result["per_kernel"]["TORCH_SDPA"]
    assert list(per["stats"]["capture_failures"]) == [8] and per["plain_capture_failures"] == {}
    assert row["budget"] == 16 and row["plain_replay"] is None
    assert row["plain_note"] == ("not timed: the replay runs budget 16 (its capture of budget 8 failed), and plain "
                                 "replay would run budget 8")


def test_the_calibrated_run_is_timed_before_the_profiler_runs(monkeypatch):
    """With --calibrate and --profile the calibration (its manager's timing of each budget) and the calibrated
    dispatch were timed after the main run's profiler, which on CUDA slows the launches after it."""
    from hwgraph import bench, manager, profiling

    events = []
    measure, kernel_time = bench.measure_interleaved, profiling.kernel_time
    monkeypatch.setattr(bench, "measure_interleaved", lambda *a, **k: (events.append("time"), measure(*a, **k))[1])
    monkeypatch.setattr(manager, "measure_interleaved",
                        lambda *a, **k: (events.append("calibrate"), measure(*a, **k))[1])
    monkeypatch.setattr(profiling, "kernel_time", lambda *a, **k: (events.append("profile"), kernel_time(*a, **k))[1])
    result = tiny_bench(profile=True, calibrate=True)
    assert events == ["time", "calibrate", "time", "profile", "profile"]  # the main run's eager and replay profiled
    assert result["rows"][0]["profile"]["eager_kernel_ms"] and result["calibration"]["rows"][0]["replay"]


def test_the_heading_of_a_bench_on_cpu_0_names_the_cpu_not_the_machines_gpu():
    """``--device cpu:0`` on a GPU machine was labelled with the platform's device, the GPU."""
    result = tiny_bench(device=torch.device("cpu:0"))
    result["environment"]["platform"]["device_name"] = "NVIDIA H200"
    assert heading(result).startswith("## hwgraph bench: tiny, float32, cpu:0 (cpu),")


def test_the_calibrate_help_says_every_budget_up_to_the_largest_winner_is_kept(capsys):
    """It said calibration keeps the budgets where replay wins: it keeps every budget up to the largest that wins
    (one where replay loses, below it, too), searching up to the calibration cap without --budgets."""
    parser = cli.build_parser()
    try:
        parser.parse_args(["bench", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "keep those where replay wins" not in text
    assert "keep every budget up to the largest whose replay beats eager; without --budgets, searched up to 2048" \
        in text


def recording_managers(monkeypatch, fail_calibrated_budget=None):
    """Every manager the bench builds, in order; each calibrating one records, as it captures, the other managers
    then open (not closed) and holding graphs. ``fail_calibrated_budget``: that budget's capture fails in it."""
    from hwgraph import manager as manager_module

    built, open_at_calibration = [], []

    class Recording(manager_module.EncoderGraphManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

        def capture(self):
            if self.calibrate_on_capture:
                open_at_calibration.append([m for m in built if m is not self and not m._closed and m.graphs])
            return super().capture()

        def _capture_budget(self, budget, compiled=False):
            if self.calibrate_on_capture and budget == fail_calibrated_budget:
                raise RuntimeError("simulated: out of memory")
            return super()._capture_budget(budget, compiled)

    monkeypatch.setattr(manager_module, "EncoderGraphManager", Recording)
    return built, open_at_calibration


def test_without_profile_the_calibrated_run_captures_once_the_main_managers_are_closed(monkeypatch):
    """The calibrated manager (budgets up to the calibration cap) captured while every main manager still held its
    graphs, also without --profile, which alone needs them after the timing."""
    built, open_at_calibration = recording_managers(monkeypatch)
    result = tiny_bench(calibrate=True, budgets=[8, 16])
    assert len(built) == 2 and open_at_calibration == [[]]
    assert result["rows"][0]["replay"] and result["calibration"]["rows"][0]["replay"]


def test_with_profile_the_plain_managers_are_closed_before_the_calibrated_run(monkeypatch):
    """With --profile the main managers must outlive the calibrated run (the profiler runs after it); the plain
    managers beside --measure-products are timed, never profiled, and held their graphs through it too."""
    built, open_at_calibration = recording_managers(monkeypatch)
    result = tiny_bench(calibrate=True, profile=True, measure_products=True, budgets=[8, 16])
    main, plain, calibrated = built
    assert main.measure_products and not plain.measure_products and calibrated.calibrate_on_capture
    assert open_at_calibration == [[main]]
    per = result["per_kernel"]["TORCH_SDPA"]
    assert set(per["plain_capture_seconds"]) == {8, 16} and per["plain_capture_failures"] == {}
    assert result["rows"][0]["plain_replay"]["samples"] == 1 and result["rows"][0]["profile"]["replay_kernel_ms"]


def test_a_budget_the_calibration_could_not_capture_is_reported_with_why(monkeypatch):
    """The calibrated manager's failed captures were dropped: its findings lacked the budget, with no reason."""
    recording_managers(monkeypatch, fail_calibrated_budget=16)
    cal = tiny_bench(calibrate=True, budgets=[8, 16])["calibration"]
    assert set(cal["findings"]) == {8}
    assert list(cal["capture_failures"]) == [16] and "simulated: out of memory" in cal["capture_failures"][16]
    # the Markdown report too, from the JSON form (budgets as strings): the budget had no row at all
    section = calibration_section(json.loads(json.dumps(cal)))
    assert "| 8 |" in section
    assert re.search(r"\| 16 \| - \| - \| no: capture failed \(.*simulated: out of memory.*\) \|", section)
