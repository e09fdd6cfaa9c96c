"""The command line refuses bad input up front (exit 2, the value and what was expected named, nothing built), and
``hwgraph info`` still explains a machine where no graph backend can be chosen."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hwgraph import bench, bench_command, cli
from hwgraph.dtypes import parse_dtype
from hwgraph.registry import GRAPH_BACKEND_ENV
from hwgraph.testing.simulate import REFUSED_MODE_CLASS, simulate_refused_mode_backend


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """No forced backend from the caller's environment, and any attempt to build a tower or run the suite fails."""
    monkeypatch.delenv(GRAPH_BACKEND_ENV, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("bad arguments must be refused before anything is built or run")

    monkeypatch.setattr(bench, "build_tower", refuse)
    monkeypatch.setattr(bench_command, "run_bench", refuse)  # where ``hwgraph bench`` looks it up
    monkeypatch.setattr(bench, "run_bench", refuse)  # where ``hwgraph validate``'s benchmark looks it up
    monkeypatch.setattr("hwgraph.testing.results.run_conformance", refuse)


def refused(argv: list[str], capsys) -> str:
    """Run ``hwgraph argv`` in this process; it must exit 2 with a one-line message. Returns that message."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hwgraph {argv[0]}: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("torch.float16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_the_three_tower_dtypes_parse_by_name(name, dtype):
    assert parse_dtype(name) is dtype


@pytest.mark.parametrize("name", ["int8", "float64", "bool", "bf16", "Float32", ""])
def test_any_other_dtype_is_refused_naming_it_and_the_accepted_names(name):
    with pytest.raises(ValueError, match=f"unknown dtype '{name}': expected one of float32, bfloat16, float16"):
        parse_dtype(name)


@pytest.mark.parametrize("name", ["float64", "torch.float64", torch.float64])
def test_a_towers_dtype_takes_float64_by_name_as_by_dtype(name):
    """graph_dtype took torch.float64 but refused "float64", with a message that did not list it."""
    from hwgraph.dtypes import graph_dtype

    assert graph_dtype(name) is torch.float64
    for bad in ("int8", torch.int8):
        with pytest.raises(ValueError, match="expected one of float32, bfloat16, float16 or (torch.)?float64"):
            graph_dtype(bad)


@pytest.mark.parametrize("argv, expected", [
    (["--device", "bogus"], ["--device 'bogus' is not a torch device", "cuda:1"]),
    (["--device", "cuda:x"], ["--device 'cuda:x' is not a torch device"]),
    (["--dtype", "int8"], ["--dtype", "'int8'", "float32, bfloat16, float16"]),
    (["--dtype", "float64"], ["'float64'", "float32, bfloat16, float16"]),
    (["--preset", "qwen3-omni-7b"], ["--preset", "'qwen3-omni-7b'", "tiny"]),
    (["--attention", "TORCH_SDPA", "FLASH_ATTENTION"], ["--attention", "'FLASH_ATTENTION'", "TORCH_SDPA"]),
    (["--backend", "cudagraph"], ["--backend", "'cudagraph'", "known: cpu"]),
    # a script's unset variable: it ran the automatic choice (or $HWGRAPH_GRAPH_BACKEND's), exit 0
    (["--backend", ""], ["--backend '': expected a graph backend name, one of cpu", "leave the option out"]),
    (["--backend", "cpu", "--graph-mode", "full"], ["--graph-mode 'full': graph backend 'cpu' has modes emulated"]),
    (["--budgets", "64", "0"], ["--budgets 0 is out of range: expected an integer >= 1"]),
    (["--budgets", "-64"], ["--budgets -64", ">= 1"]),
    (["--budgets", "64", "128", "64"], ["--budgets: budgets must not repeat, got duplicates [64]"]),
    (["--groups", "1x49,2x8,1X49"], ["--groups", "group 1x49 repeats in '1x49,2x8,1X49'"]),
    (["--device", "meta"], ["--device 'meta' cannot run a bench", "cpu"]),
    (["--samples", "0"], ["--samples 0 is out of range: expected an integer >= 1"]),
    (["--warmup", "-1"], ["--warmup -1 is out of range: expected an integer >= 0"]),
    (["--groups", "1x"], ["--groups", "bad group '1x'", "COUNTxTOKENS"]),
    (["--groups", "2x49,0x16"], ["bad group '0x16'"]),
    (["--groups", ","], ["--groups", "no groups in ','"]),
    (["--groups", "\u00b2x4"], ["--groups", "bad group '\u00b2x4'", "COUNTxTOKENS"]),  # int() refused '²'
    # one manager per name: the second replaced the first, which was never closed, and its rows repeated
    (["--attention", "TORCH_SDPA", "torch_sdpa"], ["--attention TORCH_SDPA torch_sdpa: TORCH_SDPA repeats"]),
    # past int32 cu_seqlens: it failed once the run began (hung first at 10**20, searching a grid's sides)
    (["--preset", "tiny", "--groups", "2x300000000"], ["--groups 2x300000000: 600000000 tokens are 2400000000 patch "
                                                       "rows", "at most 2147483647 (int32 cu_seqlens)"]),
    (["--preset", "tiny", "--budgets", "99999999999999999999"], ["--budgets 99999999999999999999:", "int32"]),
])
def test_bench_refuses_a_bad_option_naming_its_value(argv, expected, capsys):
    err = refused(["bench", *argv], capsys)
    for part in expected:
        assert part in err, err


def test_bench_refuses_a_forced_backend_from_the_environment_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "bogus")
    err = refused(["bench"], capsys)
    assert f"${GRAPH_BACKEND_ENV}: unknown graph backend 'bogus'" in err


@pytest.mark.cpu_machine
def test_bench_refuses_an_unavailable_backend_with_its_reasons(capsys):
    err = refused(["bench", "--backend", "cuda"], capsys)
    why = "CPU-only build" if torch.version.cuda is None else "build but no NVIDIA GPU is visible"
    assert "graph backend 'cuda' is unavailable: " in err and why in err


def test_bench_refuses_a_gpu_backend_for_a_cpu_device_saying_so_on_a_gpu_machine(monkeypatch, capsys):
    """It said the cuda backend was unavailable as no NVIDIA GPU was visible, judging the CPU job, on an H200."""
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    err = refused(["bench", "--backend", "cuda", "--device", "cpu"], capsys)
    assert "--backend: graph backend 'cuda' captures on cuda devices; got device 'cpu'" in err


@pytest.mark.cpu_machine
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_bench_refuses_a_device_this_torch_cannot_reach(device, capsys):
    err = refused(["bench", "--device", device], capsys)
    assert f"--device '{device}': this torch ({torch.__version__}) sees no cuda device" in err


def test_bench_refuses_a_device_index_past_the_machines_devices(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = refused(["bench", "--device", "cuda:2"], capsys)
    assert "--device 'cuda:2': this machine has 2 cuda device(s), indices 0..1" in err


def test_bench_refuses_a_json_path_it_could_not_write_before_running(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = refused(["bench", "--json", str(blocker / "bench.json")], capsys)
    assert f"--json '{blocker / 'bench.json'}': cannot create its folder" in err
    err = refused(["bench", "--json", str(tmp_path)], capsys)
    assert f"--json '{tmp_path}' is a folder: expected a file path" in err
    err = refused(["bench", "--json", ""], capsys)  # was ignored: no file written, exit 0
    assert "--json '': expected a file path" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, a folder that refuses new files")
def test_bench_refuses_a_json_path_whose_folder_refuses_files_before_running(capsys):
    """os.access says yes to root for /proc: the whole bench ran, then writing the JSON raised and lost the results."""
    err = refused(["bench", "--json", "/proc/hwgraph-bench.json"], capsys)
    assert "--json '/proc/hwgraph-bench.json': cannot write there" in err
    assert not Path("/proc/hwgraph-bench.json").exists()


def test_bench_accepts_good_options_and_creates_the_json_folder(tmp_path):
    args = cli.build_parser().parse_args(["bench", "--device", "cpu", "--dtype", "torch.bfloat16", "--preset", "tiny",
                                          "--attention", "torch_sdpa", "--backend", "cpu", "--budgets", "128", "64",
                                          "--groups", "1x4, 2x8", "--warmup", "0", "--samples", "1"])
    cfg = bench_command.config_from_args(args)
    assert (str(cfg.device), cfg.dtype, cfg.preset, cfg.budgets) == ("cpu", torch.bfloat16, "tiny", [64, 128])
    assert [g.label for g in cfg.groups] == ["1x4", "2x8"] and cfg.kernels == ["torch_sdpa"]
    path = bench_command.writable_path("--json", str(tmp_path / "new" / "bench.json"))
    assert path.parent.is_dir() and not path.exists()


@pytest.mark.parametrize("argv, expected", [
    (["--tokens", "16", "0"], ["--tokens 0 is out of range: expected an integer >= 1"]),
    (["--samples", "0"], ["--samples 0 is out of range: expected an integer >= 1"]),
    (["--warmup", "-2"], ["--warmup -2 is out of range: expected an integer >= 0"]),
    (["--dtype", "int8"], ["--dtype", "'int8'", "float32, bfloat16, float16"]),
    (["--preset", "huge"], ["--preset", "'huge'", "tiny"]),
    (["--attention", "SDPA"], ["--attention", "'SDPA'", "TORCH_SDPA"]),
    (["--backend", "bogus"], ["--backend: unknown graph backend 'bogus'", "known: cpu"]),
    (["--backend", "cpu", "--graph-mode", "torchair"],
     ["--graph-mode 'torchair': graph backend 'cpu' has modes emulated"]),
    (["--tokens", "16", "4", "16"], ["--tokens 16 4 16: 16 repeats; give each size once"]),
    (["--attention", "TORCH_SDPA", "torch_sdpa"], ["--attention TORCH_SDPA torch_sdpa: TORCH_SDPA repeats"]),
    (["--report", ""], ["--report '': expected a folder path"]),  # the current folder: its report.md replaced
    # past int32 cu_seqlens: refused only by the benchmark, after the whole suite had run
    (["--preset", "tiny", "--tokens", "16", "600000000"],
     ["--tokens 600000000: 600000000 tokens are 2400000000 patch rows", "at most 2147483647 (int32 cu_seqlens)"]),
])
def test_validate_refuses_a_bad_option_before_anything_runs(argv, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --report '' was the current folder: a regression must not write into the checkout
    report = tmp_path / "report"
    err = refused(["validate", "--report", str(report), *argv], capsys)
    for part in expected:
        assert part in err, err
    assert not report.exists() and not (tmp_path / "report.md").exists()


def test_validate_says_why_no_backend_can_be_chosen(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "bogus")
    err = refused(["validate", "--report", str(tmp_path / "report")], capsys)
    assert f"${GRAPH_BACKEND_ENV}: unknown graph backend 'bogus'" in err  # not --backend: the variable chose it


def test_validate_refuses_a_report_folder_it_cannot_create(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = refused(["validate", "--report", str(blocker / "report")], capsys)
    assert f"--report '{blocker / 'report'}': cannot create the folder or write in it" in err


def test_validate_refuses_a_report_folder_that_exists_but_takes_no_files(tmp_path, capsys, monkeypatch):
    """A folder that exists and refuses new files (as /sys/kernel does, even for root, whose access() check says
    yes) once ran the whole suite and then failed with a PermissionError traceback, exit 1."""
    from hwgraph import validate

    def refuses(dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(validate.tempfile, "TemporaryFile", refuses)
    err = refused(["validate", "--report", str(tmp_path)], capsys)
    assert f"--report '{tmp_path}': cannot create the folder or write in it: Permission denied" in err


def test_info_explains_a_forced_backend_that_cannot_be_selected_and_exits_1(monkeypatch, capsys):
    monkeypatch.setenv(GRAPH_BACKEND_ENV, "bogus")
    assert cli.main(["info"]) == 1
    out = capsys.readouterr().out
    assert f"selected: none (${GRAPH_BACKEND_ENV}: unknown graph backend 'bogus'; known: cpu" in out
    assert "Graph backends" in out and "Attention kernels" in out and "TORCH_SDPA" in out
    assert cli.main(["info", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["selected_backend"] is None and "'bogus'" in data["selection_reason"]
    assert not any(b["selected"] for b in data["graph_backends"])


@pytest.mark.parametrize("forced", [False, True])
def test_info_selects_what_a_manager_would_when_the_best_backends_class_does_not_import(monkeypatch, capsys, forced):
    """info marked such a backend selected, while every manager fell back to the CPU reference backend (automatic)
    or raised (forced)."""
    from hwgraph import registry
    from hwgraph.capability import Capability

    # it serves this machine's kind and outranks the vendor plugins (priority 100), so it is the automatic choice on
    # a GPU machine too (the test once assumed a CPU machine and failed on the H200)
    broken = registry.BackendSpec("broken", "hwgraph_no_such_module.graphs:Backend", (registry.detect().kind,),
                                  lambda p: Capability.available(), priority=1000)
    real = registry.discovered()
    monkeypatch.setattr(registry, "discovered", lambda: ((*real[0], broken), real[1]))
    if forced:
        monkeypatch.setenv(GRAPH_BACKEND_ENV, "broken")
    assert cli.main(["info", "--json"]) == (1 if forced else 0)
    data = json.loads(capsys.readouterr().out)
    assert data["selected_backend"] == (None if forced else "cpu")
    assert "declares class_path 'hwgraph_no_such_module.graphs:Backend', which does not load" in \
        data["selection_reason"]
    assert [b["name"] for b in data["graph_backends"] if b["selected"]] == ([] if forced else ["cpu"])


@pytest.mark.parametrize("forced", [False, True])
def test_info_selects_what_a_manager_would_when_the_best_backend_refuses_its_default_mode(monkeypatch, capsys,
                                                                                         forced):
    """npu's gate accepts a torch_npu without torch.npu.NPUGraph, and its class then refuses its default mode,
    aclgraph: info marked npu selected while every manager fell back to the CPU reference backend (automatic) or
    raised (forced)."""
    from hwgraph.registry import create_backend

    simulate_refused_mode_backend(monkeypatch)
    if forced:
        monkeypatch.setenv(GRAPH_BACKEND_ENV, "refusedmode")
    else:
        assert create_backend().name == "cpu"  # what a manager takes
    assert cli.main(["info", "--json"]) == (1 if forced else 0)
    data = json.loads(capsys.readouterr().out)
    assert data["selected_backend"] == (None if forced else "cpu")
    assert "refusedmode graph mode 'aclgraph' is unavailable: no graph API" in data["selection_reason"]
    assert [b["name"] for b in data["graph_backends"] if b["selected"]] == ([] if forced else ["cpu"])
    assert cli.main(["info"]) == (1 if forced else 0)
    assert ("selected: none" if forced else "selected: cpu (falling back") in capsys.readouterr().out


@pytest.mark.parametrize("argv, class_path, expected", [
    # the automatic choice refuses the mode and falls back to the cpu backend: the manager's ValueError was a traceback
    (["--graph-mode", "aclgraph"], REFUSED_MODE_CLASS,
     "--graph-mode 'aclgraph': graph mode 'aclgraph' is not a mode of the cpu reference backend"),
    # an explicit backend whose class refuses its mode: refused only after the tower was built
    (["--backend", "refusedmode"], REFUSED_MODE_CLASS,
     "--backend: refusedmode graph mode 'aclgraph' is unavailable: no graph API"),
    # an explicit backend whose class does not import: the ImportError was a traceback
    (["--backend", "refusedmode", "--graph-mode", "other"], "hwgraph_no_such_module:Backend",
     "--backend: graph backend 'refusedmode' declares class_path 'hwgraph_no_such_module:Backend', which does not"),
])
def test_bench_refuses_a_backend_or_mode_that_cannot_be_made_here_before_building_anything(monkeypatch, capsys, argv,
                                                                                           class_path, expected):
    simulate_refused_mode_backend(monkeypatch, class_path)
    assert expected in refused(["bench", "--groups", "1x4", *argv], capsys)


def backend_rows(text: str) -> dict[str, list[str]]:
    """The rows of the graph-backend table of ``hwgraph info``: backend name -> [marker, available, modes]."""
    table = text.split("Graph backends\n", 1)[1].split("\nselected: ", 1)[0].splitlines()[2:]
    return {line[2:].split()[0]: [line[:2].strip(), *line[2:].split()[1:3]] for line in table}


def test_info_marks_the_selected_backend_on_a_gpu_machine_where_the_cpu_backend_is_available_too(monkeypatch,
                                                                                                  capsys):
    from hwgraph.registry import backend_specs
    from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

    if "cuda" not in {s.name for s in backend_specs()}:
        pytest.skip("the cuda graph backend comes with hwgraph-backend-cuda, which is not installed")
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("NVIDIA H200", 9, 0))
    assert cli.main(["info"]) == 0
    rows = backend_rows(capsys.readouterr().out)
    assert rows["cuda"] == ["*", "yes", "full"] and rows["cpu"] == ["", "yes", "emulated"]
    assert rows["rocm"][:2] == ["", "no"]
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["name"] for b in data["graph_backends"] if b["selected"]] == ["cuda"] == [data["selected_backend"]]
    assert {b["name"]: b["available"] for b in data["graph_backends"]}["cpu"] is True


def test_info_prints_the_platforms_notes_and_the_plugins_problems(monkeypatch, capsys):
    import dataclasses

    from hwgraph import platform, registry

    note = "torch.cuda failed to count devices (driver too old)"
    problem = "entry point 'broken' (broken:probe) failed to load: ImportError: no module named broken"
    real_detect, real_discovered = platform.detect, registry.discovered
    monkeypatch.setattr(platform, "detect", lambda: dataclasses.replace(real_detect(), notes=(note,)))
    monkeypatch.setattr(registry, "discovered", lambda: (real_discovered()[0], (problem,)))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"note: {note}" in out.splitlines() and f"problem: {problem}" in out.splitlines()
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["platform"]["notes"] == [note] and data["problems"] == [problem]


def test_a_multi_line_reason_continues_under_the_reasons_column_of_info(monkeypatch, capsys):
    """A crashed gate's reason can hold line breaks: its further lines start under the reasons column, and the rows
    below it stay whole."""
    from hwgraph.attention import registry as attention_registry
    from hwgraph.capability import Capability

    reason = "TRITON_ATTN's gate raised RuntimeError: CUDA error: unknown error\nCompile with TORCH_USE_CUDA_DSA"
    real = attention_registry.list_kernels

    def crashed(platform=None):
        return [(spec, Capability.unavailable(reason) if spec.name == "TRITON_ATTN" else cap)
                for spec, cap in real(platform)]

    monkeypatch.setattr(attention_registry, "list_kernels", crashed)
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.split("Attention kernels\n", 1)[1].splitlines()
    column = lines[0].index("reasons")
    at = next(i for i, line in enumerate(lines) if line.startswith("TRITON_ATTN "))
    assert lines[at][column:] == "TRITON_ATTN's gate raised RuntimeError: CUDA error: unknown error"
    assert lines[at + 1] == " " * column + "Compile with TORCH_USE_CUDA_DSA"
    names = {line.split()[0] for line in lines[2:] if line and not line.startswith(" ")}
    assert names == {spec.name for spec, _ in real(None)}


def test_no_command_is_a_usage_error_naming_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: command" in err and "{info,bench,validate}" in err


@pytest.mark.parametrize("argv, level", [(["-v", "info"], logging.INFO), (["info"], logging.WARNING),
                                         (["-vv", "info"], logging.DEBUG), (["-v", "-v", "-v", "info"], logging.DEBUG)])
def test_verbose_logs_at_info_level_and_twice_at_debug_level(monkeypatch, capsys, argv, level):
    # under pytest the root logger has handlers already, so basicConfig would not show its level: record it
    seen = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: seen.append(kwargs["level"]))
    assert cli.main(argv) == 0
    assert seen == [level]


def test_the_report_environment_names_installed_versions_and_none_for_missing_packages(monkeypatch):
    import platform as host
    from importlib.metadata import version

    from hwgraph import versions
    from hwgraph.registry import backend_specs

    monkeypatch.setattr(versions, "PACKAGES", ("torch", "hwgraph-no-such-distribution"))
    env = versions.environment()
    plugins = {s.distribution: version(s.distribution) for s in backend_specs() if s.distribution}
    assert env["packages"] == {"torch": version("torch"), "hwgraph-no-such-distribution": None, **plugins}
    assert env["python"] == host.python_version() and env["platform"]["kind"] in {"cpu", "cuda", "rocm", "npu"}


def test_info_exits_0_when_a_backend_is_selected(capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["selected_backend"] in {b["name"] for b in data["graph_backends"] if b["selected"]}


WITHOUT_PYTEST = textwrap.dedent("""
    import contextlib, io, json, sys
    sys.modules["pytest"] = None  # as if the test extra were not installed: importing pytest raises ImportError
    from hwgraph import cli
    from hwgraph.bench_command import config_from_args
    cfg = config_from_args(cli.build_parser().parse_args(["bench", "--device", "cpu", "--dtype", "float16",
                                                          "--groups", "1x4", "--attention", "TORCH_SDPA"]))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["validate", "--report", sys.argv[1]])
    print(json.dumps({"dtype": str(cfg.dtype), "groups": [g.label for g in cfg.groups], "code": code,
                      "err": err.getvalue()}))
""")


def test_bench_parses_its_options_without_pytest_and_validate_says_to_install_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != GRAPH_BACKEND_ENV}
    result = subprocess.run([sys.executable, "-c", WITHOUT_PYTEST, str(tmp_path / "report")], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["dtype"] == "torch.float16" and data["groups"] == ["1x4"]
    assert data["code"] == 2
    assert data["err"] == ("hwgraph validate: the conformance suite needs pytest, which is not installed: "
                           "pip install 'hwgraph[test]'\n")
    assert not (tmp_path / "report").exists()


def test_help_is_plain_text():
    assert "``" not in cli.build_parser().format_help()


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``hwgraph info --json | head -1``: the closed pipe ends the command with SIGPIPE's status, no traceback.
    Without ``PYTHONUNBUFFERED`` (a shell's pipe, tox's cpu env) stdout is block-buffered and the error came only at
    the exit flush: status 120 and "Exception ignored" (found running ``tox -e cpu``)."""
    env = {k: v for k, v in os.environ.items() if k not in (GRAPH_BACKEND_ENV, "PYTHONUNBUFFERED")}
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read(); from hwgraph import cli; "
                                                    "sys.exit(cli.main(['info', '--json']))"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    child.stdout.close()  # the reader is gone before the command writes
    _, err = child.communicate(b"", timeout=300)
    assert child.returncode == cli.BROKEN_PIPE and b"Traceback" not in err and b"Exception ignored" not in err, err

