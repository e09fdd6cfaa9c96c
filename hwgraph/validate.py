"""``hwgraph validate``: the conformance suite and a short benchmark on what is detected, as one report.

Writes ``report.md``, ``report.json`` and ``latency.png`` (plus pytest's ``conformance.log``) into the report folder.
Exit status 1 when any conformance check fails or errors (each failing check is named on stderr) or the reports cannot
be written, 0 otherwise; 2, before anything runs, for a bad argument, a missing pytest or a graph backend that cannot
be chosen.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from hwgraph.report import write_reports

log = logging.getLogger(__name__)

ACCELERATOR_TOKENS = (16, 64, 256, 1024)
CPU_TOKENS = (16, 64, 256)


PYTEST_MISSING = "the conformance suite needs pytest, which is not installed: pip install 'hwgraph[test]'"


def pytest_available() -> bool:
    """Whether pytest imports: ``hwgraph validate`` runs the conformance suite with it (the ``test`` extra)."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return False
    return True


def check_arguments(args) -> None:
    """``ValueError`` naming the option, its value and what was expected; called before anything runs."""
    from hwgraph.cli import at_least, check_kernels, parsed
    from hwgraph.dtypes import parse_dtype
    from hwgraph.models.qwen3_omni.config import preset_config

    if not args.report:  # Path("") is the current folder: its report.md would be replaced
        raise ValueError(f"--report {args.report!r}: expected a folder path")
    for tokens in args.tokens or ():
        at_least("--tokens", tokens, 1)
    repeated = sorted({t for t in args.tokens or () if args.tokens.count(t) > 1})
    if repeated:  # each size is one row of the latency table, as ``hwgraph bench --groups`` insists
        raise ValueError(f"--tokens {' '.join(map(str, args.tokens))}: {repeated[0]} repeats; give each size once")
    at_least("--samples", args.samples, 1)
    at_least("--warmup", args.warmup, 0)
    if args.dtype is not None:
        parsed("--dtype", parse_dtype, args.dtype)
    if args.preset is not None:
        parsed("--preset", preset_config, args.preset)
    check_kernels(args.attention)


def choose_backend_name(name: str | None) -> tuple[str, str]:
    """(backend to validate, why): ``name`` as given, so that the report says why it is unavailable here, else the
    one hwgraph chooses (``$HWGRAPH_GRAPH_BACKEND`` included). ``SelectionError`` naming the option or variable for
    a name no installed package brings, and for an unusable ``$HWGRAPH_GRAPH_BACKEND``."""
    from hwgraph.registry import SelectionError, backend_specs, choose_backend, spec_named

    if name == "":  # a script's unset variable (--backend "$BACKEND"): not a request for the automatic choice
        raise SelectionError(f"--backend '': expected a graph backend name, one of "
                             f"{', '.join(s.name for s in backend_specs())} (leave the option out for the best "
                             f"available)")
    if name:
        try:
            spec_named(name)  # a typo is not worth a report: the error lists the known backends
        except SelectionError as exc:
            raise SelectionError(f"--backend: {exc}") from None
        return name, "explicit (--backend)"
    selected = choose_backend()  # an automatic choice never raises: only the variable's, which its error names
    return selected.spec.name, selected.reason


def check_mode(backend: str, mode: str | None) -> None:
    """``ValueError`` naming ``--graph-mode`` when ``backend`` (installed: ``choose_backend_name`` checked) has no such
    mode. Whether the mode can run here is the suite's and the benchmark's to say."""
    from hwgraph.registry import spec_named

    refusal = spec_named(backend).mode_refusal(mode)
    if refusal:
        raise ValueError(f"--graph-mode {mode!r}: {refusal}")


def run_mode(backend: str, mode: str | None) -> str:
    """The graph mode the suite and the benchmark ran ``backend`` in: ``mode``, else the backend's first (the report
    said none where ``--graph-mode`` was left out)."""
    from hwgraph.registry import spec_named

    return mode or spec_named(backend).modes[0]


def bench_refusal(backend: str, device: torch.device) -> str | None:
    """Why the benchmark cannot run ``backend`` on ``device`` (it is unavailable here), or None. The report says so
    instead of building a tower only to have the manager refuse the backend. The backend is judged on this machine's
    platform first, as the conformance suite and ``hwgraph info`` judge it (on a CUDA machine, 'npu' is refused
    because the accelerator is CUDA, not for want of torch_npu as a CPU-only machine would say), then on the
    platform serving ``device``, as the manager will."""
    from hwgraph.platform import detect, platform_for
    from hwgraph.registry import SelectionError, choose_backend

    for platform in (detect(), platform_for(device)):
        try:
            choose_backend(backend, platform)
        except SelectionError as exc:
            return str(exc)
    return None


def device_for_backend(name: str) -> torch.device:
    """The device the suite runs this backend on (the accelerator it serves, else the CPU)."""
    from hwgraph.platform import detect, device_type
    from hwgraph.registry import SelectionError, spec_named

    platform = detect()
    try:
        kinds = spec_named(name).kinds
    except SelectionError:
        return torch.device("cpu")  # the suite reports the unknown backend; the benchmark says why it could not run
    return torch.device(device_type(platform.kind) if platform.kind in kinds else "cpu")


def verdict(conformance: dict, requested: list[str] | None = None) -> tuple[bool, str]:
    """PASS when no check failed, some passed, and each kernel of ``requested`` (``--attention``) passed some: one
    asked for by name whose checks were all skipped (unavailable here, say) fails the run rather than passing it."""
    from hwgraph.attention.registry import kernel_named
    from hwgraph.dtypes import DTYPES
    from hwgraph.testing.results import failing_checks

    counts = conformance["counts"]
    failing = failing_checks(conformance)
    if failing:
        return False, f"FAIL: {len(failing)} conformance check(s) failed"
    if counts["passed"] == 0:
        reasons = sorted({r["message"] for r in conformance["results"] if r["outcome"] == "skipped"})
        return False, "FAIL: no conformance check ran" + (f" ({'; '.join(reasons)})" if reasons else "")
    dtype_names = "|".join(map(re.escape, DTYPES))  # the dtypes a case id ends its kernel with (ConformanceCase.id)
    for name in (kernel_named(n).name for n in requested or ()):
        # a case id is "backend[-mode]-KERNEL-dtype[-param]": the kernel is what stands before the dtype, so that a
        # kernel "FA" is not credited with "FA-2"'s checks, nor a name holding "+" or "(" read as a pattern
        case = re.compile(rf"\[[^\]]*-{re.escape(name)}-(?:{dtype_names})[\]-]")
        own = [r for r in conformance["results"] if case.search(r["check"])]
        if not any(r["outcome"] == "passed" for r in own):
            reasons = sorted({r["message"] for r in own if r["outcome"] == "skipped"})
            why = "; ".join(reasons) if reasons else "the suite has no case for it on this machine"
            return False, f"FAIL: attention kernel {name} was asked for and none of its checks ran ({why})"
    if conformance["exit_code"] not in (0, 5):
        return False, f"FAIL: pytest exited with status {conformance['exit_code']} (see conformance.log)"
    return True, f"PASS: {counts['passed']} checks passed, {counts['skipped']} skipped"


def run_benchmark(args, backend: str, device: torch.device, progress_cls) -> dict:
    from hwgraph.bench import BenchConfig, Group, run_bench
    from hwgraph.dtypes import parse_dtype

    tokens = args.tokens or (CPU_TOKENS if device.type == "cpu" else ACCELERATOR_TOKENS)
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cpu" else 10)
    samples = args.samples if args.samples is not None else (10 if device.type == "cpu" else 30)
    cfg = BenchConfig(preset=args.preset, groups=[Group(1, t) for t in tokens], device=device,
                      dtype=parse_dtype(args.dtype) if args.dtype else
                      (torch.float32 if device.type == "cpu" else torch.bfloat16),
                      kernels=args.attention, graph_backend=backend, graph_mode=args.graph_mode, warmup=warmup,
                      samples=samples,
                      reference=not args.no_transformers)
    return run_bench(cfg, progress=progress_cls("benchmark"))


def cmd_validate(args) -> int:
    from hwgraph.bench import ACCELERATOR_PRESET, CPU_PRESET
    from hwgraph.cli import check_patch_rows, info_data
    from hwgraph.plot import latency_plot
    from hwgraph.progress import Progress
    from hwgraph.registry import SelectionError
    from hwgraph.testing.results import failing_checks, run_conformance
    from hwgraph.validation_report import validation_markdown
    from hwgraph.versions import environment

    if not pytest_available():
        print(f"hwgraph validate: {PYTEST_MISSING}", file=sys.stderr)
        return 2
    out = Path(args.report)
    try:
        check_arguments(args)
        backend, why = choose_backend_name(args.backend)
        check_mode(backend, args.graph_mode)
        device = device_for_backend(backend)
        args.preset = args.preset or (CPU_PRESET if device.type == "cpu" else ACCELERATOR_PRESET)
        for tokens in args.tokens or ():  # refused now, not after the suite has run
            check_patch_rows("--tokens", str(tokens), tokens, args.preset)
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # a folder found, not made, may refuse files: know before the run
            pass
    except (ValueError, SelectionError) as exc:
        print(f"hwgraph validate: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hwgraph validate: --report {args.report!r}: cannot create the folder or write in it: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    for name in ("report.json", "report.md", "latency.png"):  # an earlier run's verdict must not outlive this run
        with contextlib.suppress(OSError):                    # when it is stopped (Ctrl-C, a CI job's time limit)
            (out / name).unlink(missing_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hwgraph-validate-") as tmp, Progress("conformance") as bar:
        conformance = run_conformance(Path(tmp), backend, args.preset, args.attention, args.dtype, progress=bar,
                                      log_path=out / "conformance.log", graph_mode=args.graph_mode)
    ok, summary = verdict(conformance, args.attention)
    bench, bench_error = None, None
    if not args.no_bench:
        bench_error = bench_refusal(backend, device)
    if not args.no_bench and bench_error is None:
        try:
            bench = run_benchmark(args, backend, device, Progress)
        except SelectionError as exc:  # a requested kernel unavailable here: the report and stdout say why
            bench_error = str(exc)
        except Exception as exc:  # the report still says what conformance found, and why no latency table
            log.exception("benchmark failed")
            bench_error = f"{type(exc).__name__}: {exc}"
    plot_note = latency_plot(bench, out / "latency.png") if bench else (bench_error or "benchmark skipped")
    if plot_note is not None:  # a plot that failed part-way must not sit beside a report that says none was drawn
        with contextlib.suppress(OSError):
            (out / "latency.png").unlink(missing_ok=True)
    report = {"verdict": summary, "ok": ok, "backend": backend, "backend_reason": why,
              "graph_mode": run_mode(backend, args.graph_mode), "preset": args.preset,
              "attention": args.attention, "environment": environment(), "info": info_data(),
              "conformance": conformance, "bench": bench, "bench_error": bench_error,
              "plot": {"path": "latency.png"} if plot_note is None else {"skipped": plot_note},
              "seconds": round(time.perf_counter() - started, 1)}
    try:
        write_reports(out, {"report.json": json.dumps(report, indent=2, default=str),
                            "report.md": validation_markdown(report)})
        unwritten = None
    except OSError as exc:  # a full disk after the whole run: the verdict and why, not a traceback (nor a half PASS)
        unwritten = f"--report {args.report!r}: could not write report.json and report.md: {exc.strerror or exc}"
    if unwritten is None:
        print(f"{summary}\nreport: {out / 'report.md'} (also report.json"
              f"{', latency.png' if plot_note is None else ''}, conformance.log)")
    else:
        print(summary)
    if plot_note is not None:
        print(f"latency.png not written: {plot_note}")
    for r in failing_checks(conformance):
        print(f"hwgraph validate: conformance check {r['outcome']}: {r['check']}: {r['message']}", file=sys.stderr)
    if unwritten is not None:  # a CI job that keeps the report must not pass without it
        print(f"hwgraph validate: {unwritten}", file=sys.stderr)
        return 1
    return 0 if ok else 1


def register_cli(sub) -> None:
    p = sub.add_parser("validate", help="conformance suite + short benchmark -> report.md, report.json, latency.png",
                       epilog="Exit status 0 when the suite passes; 1 when a check fails, none ran, none of a "
                              "kernel named by --attention ran, or the report cannot be written; 2, before anything "
                              "runs, for a bad option, a missing pytest (pip install 'hwgraph[test]') or a graph "
                              "backend that cannot be chosen.")
    p.add_argument("--report", default="hwgraph-report", metavar="DIR", help="output folder (default hwgraph-report)")
    p.add_argument("--backend", help="graph backend to validate (default: the one hwgraph chooses here)")
    p.add_argument("--graph-mode", help="its graph mode (default: its first; npu: aclgraph or torchair)")
    # extend: a repeated option adds to the list (argparse's default kept only the last one's, dropping the rest)
    p.add_argument("--attention", nargs="+", action="extend", metavar="NAME",
                   help="attention kernels (default: every available)")
    p.add_argument("--preset", help="tower preset for the suite and the benchmark (default: tiny on CPU, "
                                    "qwen3-omni-30b-a3b on accelerators)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--tokens", type=int, nargs="+", action="extend",
                   help=f"single-image sizes to benchmark, merged tokens (default "
                        f"{' '.join(map(str, ACCELERATOR_TOKENS))}; CPU {' '.join(map(str, CPU_TOKENS))})")
    p.add_argument("--warmup", type=int, help="warm-up calls per cell (default 10; CPU 3)")
    p.add_argument("--samples", type=int, help="timed calls per cell (default 30; CPU 10)")
    p.add_argument("--no-bench", action="store_true", help="conformance only")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers reference in the benchmark")
    p.set_defaults(func=cmd_validate)
