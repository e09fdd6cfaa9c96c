"""``hwgraph bench`` on the command line: its options, every one checked before a tower is built (exit status 2, the
option, its value and what was expected named), and the command that runs ``hwgraph.bench.run_bench`` and prints the
report. The measurement itself is ``hwgraph.bench``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import torch

from hwgraph import budgets as budget_rules
from hwgraph.bench import (
    ACCELERATOR_GROUPS,
    ACCELERATOR_PRESET,
    CPU_GROUPS,
    CPU_PRESET,
    BenchConfig,
    default_device,
    parse_groups,
    run_bench,
)
from hwgraph.cli import at_least, check_kernels, check_patch_rows, parsed
from hwgraph.platform import checked_device
from hwgraph.report import partial_path, write_reports


def parse_device(spec: str) -> torch.device:
    """``--device``: a device string torch parses (``cpu``, ``cuda``, ``cuda:1``, ``npu:0``), else ``ValueError``."""
    return checked_device(spec, "--device", "a bench")


def check_backend(name: str | None, device: torch.device) -> None:
    """``ValueError`` when ``name`` (else ``$HWGRAPH_GRAPH_BACKEND``) is unknown or unavailable for ``device``."""
    from hwgraph.registry import SelectionError, backend_from_variable, backend_specs, choose_backend

    if name == "":  # a script's unset variable (--backend "$BACKEND"): not a request for the automatic choice
        raise ValueError(f"--backend '': expected a graph backend name, one of "
                         f"{', '.join(s.name for s in backend_specs())} (leave the option out for the best available)")
    if not (name or backend_from_variable()):  # set blank: unset, as the registry reads it
        return  # an automatic choice never fails: it falls back to the cpu reference backend, and says why
    try:
        choose_backend(name, device=device)  # the platform serving device
    except SelectionError as exc:
        raise ValueError(f"--backend: {exc}" if name else str(exc)) from None  # the variable's error names it


def check_graph_mode(backend: str | None, mode: str | None, device: torch.device) -> None:
    """``ValueError`` when ``mode`` is not a mode of the graph backend ``backend`` names (else the one chosen for
    ``device``); checked before a tower is built. Whether the mode can run here, the backend says when it is made."""
    from hwgraph.platform import platform_for
    from hwgraph.registry import choose_backend

    if mode is None:
        return
    refusal = choose_backend(backend, platform_for(device)).spec.mode_refusal(mode)  # check_backend has refused a
    if refusal:  # name that cannot be chosen
        raise ValueError(f"--graph-mode {mode!r}: {refusal}")


def check_backend_builds(name: str | None, mode: str | None, device: torch.device) -> None:
    """``ValueError`` when the graph backend every manager of the bench will make (``name``, else the automatic choice,
    in ``mode``, for ``device``) cannot be made: an explicit one whose class does not import, refuses ``device`` or
    refuses ``mode`` at construction (npu's aclgraph or torchair without their runtime), or ``mode`` given for a
    backend the automatic choice had to give up. The probe's gate and modes (``check_backend``,
    ``check_graph_mode``) do not see those; the managers would raise them after a tower is built. The probe logs
    nothing: the managers log the choice, and a fallback's warning, when they make the same backend."""
    from hwgraph import registry
    from hwgraph.registry import SelectionError, backend_from_variable, create_backend

    def silent(record: logging.LogRecord) -> bool:
        return False

    # the variable's errors name it (hwgraph.registry.named_by_variable)
    prefix = "--backend: " if name else ("" if backend_from_variable() else f"--graph-mode {mode!r}: ")
    registry.log.addFilter(silent)
    try:
        create_backend(name, device=device, mode=mode)
    except (SelectionError, ImportError) as exc:
        raise ValueError(f"{prefix}{exc}") from None
    except ValueError as exc:  # a mode meant for the backend the automatic choice could not use
        raise ValueError(f"--graph-mode {mode!r}: {exc}") from None
    finally:
        registry.log.removeFilter(silent)


def writable_path(option: str, spec: str) -> Path:
    """``spec`` as a path whose folder exists (created now) and can be written, so a finished run's results are not
    lost to a bad path; ``ValueError`` naming the option and the path otherwise."""
    if not spec:
        raise ValueError(f"{option} {spec!r}: expected a file path")
    if os.path.basename(spec) in ("", ".", ".."):  # 'out/': Path drops the separator, and a file 'out' was written
        raise ValueError(f"{option} {spec!r} is a folder: expected a file path")
    path = Path(spec)
    made: list[Path] = []  # the folders made for it, deepest first: removed again where the path is refused
    try:
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            made.append(folder)
            folder = folder.parent
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        remove_folders(made)
        raise ValueError(f"{option} {spec!r}: cannot create its folder {str(path.parent)!r}: "
                         f"{exc.strerror or exc}") from None
    try:
        return checked_file(option, spec, path)
    except (ValueError, OSError) as exc:
        remove_folders(made)
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"{option} {spec!r}: cannot write there: {exc.strerror or exc}") from None


def remove_folders(folders: list[Path]) -> None:
    """Remove the empty ``folders``, deepest first (those ``writable_path`` made for a path it then refused); one that
    cannot be removed (never made: its name too long; not empty) is passed over."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def checked_file(option: str, spec: str, path: Path) -> Path:
    """``path``, whose folder exists, once it is known to be a file (or pipe) that can be written; ``ValueError``
    naming the option and the path otherwise (``OSError`` where the path cannot even be looked at: a name too
    long)."""
    if path.is_dir():
        raise ValueError(f"{option} {spec!r} is a folder: expected a file path")
    # a named pipe is opened only to write the results: its reader takes a check's close for their end (and with no
    # reader yet, the open waits for one before the run)
    if path.is_fifo():
        return path
    existed = path.exists()
    # a link to a file not made yet (latest.json -> runs/bench-2.json): its target is tried and removed, the link kept
    # (O_EXCL refuses any link, and unlinking the path would remove the link itself)
    target = Path(os.path.realpath(path)) if not existed and path.is_symlink() else path
    try:  # opened, not asked: os.access answers yes for nearly any path to root, and /proc refuses files anyway
        with open(target, "a" if existed else "x"):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {spec!r}: cannot write there: {exc.strerror or exc}") from None
    if not existed:
        target.unlink()
    return path


def standard_stream(path: Path):
    """``sys.stdout`` or ``sys.stderr`` where ``path`` is the file it writes to (``/dev/stdout``, ``/dev/stderr``, or
    the file a shell redirected it to); else None."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):  # no such path
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            own = os.fstat(stream.fileno())
        except (OSError, ValueError, AttributeError):  # a stream with no file behind it (closed, captured)
            continue
        if (found.st_dev, found.st_ino) == (own.st_dev, own.st_ino):
            return stream
    return None


def write_json(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it, renamed into place: a failure (a full disk) leaves
    neither a truncated file nor an earlier run's results half overwritten. A symlink (``/dev/stdout``, a
    ``latest.json``), a path that is no regular file (a pipe), or one in a folder that takes no new file, is written
    in place: renaming would replace the link or the pipe by a file. The process's own standard output or error is
    written through ``sys.stdout`` or ``sys.stderr``: a file it is redirected to, opened again, was truncated and
    written from its start (the lines logged before the results lost), and what was printed after the results wrote
    over them."""
    stream = standard_stream(path)
    if stream is not None:
        stream.write(text + "\n")
        stream.flush()
        return
    if path.is_symlink() or (path.exists() and not path.is_file()):
        path.write_text(text)
        return
    probe = partial_path(path)
    try:
        probe.touch()
    except OSError:  # writable_path checked the path itself, not its folder
        path.write_text(text)
        return
    probe.unlink(missing_ok=True)
    write_reports(path.parent, {path.name: text})


def config_from_args(args) -> BenchConfig:
    """The run ``args`` ask for. Every option is checked here, before a tower is built: ``ValueError`` naming the
    option, its value and what was expected."""
    from hwgraph.dtypes import parse_dtype
    from hwgraph.models.qwen3_omni.config import preset_config

    at_least("--warmup", args.warmup, 0)
    at_least("--samples", args.samples, 1)
    for budget in args.budgets or ():
        at_least("--budgets", budget, 1)
    if args.budgets:  # repeats
        parsed("--budgets", lambda values: budget_rules.validate_budgets(values, 1), args.budgets)
    device = parse_device(args.device) if args.device is not None else default_device()
    on_cpu = device.type == "cpu"
    preset = args.preset if args.preset is not None else (CPU_PRESET if on_cpu else ACCELERATOR_PRESET)
    parsed("--preset", preset_config, preset)  # an unknown preset raises, listing them
    spec = ",".join(args.groups) if args.groups is not None else (CPU_GROUPS if on_cpu else ACCELERATOR_GROUPS)
    groups = parsed("--groups", parse_groups, spec)
    for option, label, tokens in ([("--groups", g.label, g.total) for g in groups]
                                  + [("--budgets", str(b), b) for b in args.budgets or ()]):
        check_patch_rows(option, label, tokens, preset)
    dtype = parsed("--dtype", parse_dtype, args.dtype) if args.dtype is not None else \
        (torch.float32 if on_cpu else torch.bfloat16)
    check_kernels(args.attention)
    check_backend(args.backend, device)
    check_graph_mode(args.backend, args.graph_mode, device)
    check_backend_builds(args.backend, args.graph_mode, device)
    return BenchConfig(
        preset=preset, groups=groups, device=device, dtype=dtype,
        kernels=args.attention, graph_backend=args.backend, graph_mode=args.graph_mode, warmup=args.warmup,
        samples=args.samples,
        calibrate=args.calibrate, profile=args.profile, reference=not args.no_transformers, compile=args.compile,
        measure_products=args.measure_products, budgets=sorted(args.budgets) if args.budgets else [])


def cmd_bench(args) -> int:
    from hwgraph.registry import SelectionError
    from hwgraph.report import bench_markdown

    try:
        cfg = config_from_args(args)
        json_path = writable_path("--json", args.json) if args.json is not None else None
    except ValueError as exc:
        print(f"hwgraph bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_bench(cfg)
    except SelectionError as exc:  # a requested kernel that cannot run this tower's dtype or head dim here
        print(f"hwgraph bench: {exc}", file=sys.stderr)
        return 2
    json_error = None
    if json_path is not None:  # first: a reader that closes stdout early (| head) must not cost the results
        try:
            write_json(json_path, json.dumps(result, indent=2, default=str))
        except OSError as exc:  # checked before the run, but a disk may fill meanwhile: the tables still print
            json_error = exc
    print(bench_markdown(result))
    if json_error is not None:
        print(f"hwgraph bench: --json {str(json_path)!r}: could not write the results: {json_error}", file=sys.stderr)
        return 1
    if json_path is not None:
        print(f"\nJSON report: {json_path}")
    return 0


def add_bench_arguments(parser) -> None:
    parser.add_argument("--preset", help=f"tower preset (default: {CPU_PRESET} on CPU, {ACCELERATOR_PRESET} elsewhere)")
    # append, extend: a repeated option adds to the list (argparse's default kept only the last one's, dropping the
    # rest)
    parser.add_argument("--groups", action="append", help=f"image groups COUNTxTOKENS,... (default: "
                                                          f"{ACCELERATOR_GROUPS}; on CPU {CPU_GROUPS})")
    parser.add_argument("--attention", nargs="+", action="extend", metavar="NAME",
                        help="attention kernels (default: every available)")
    parser.add_argument("--backend", help="graph backend (default: the best available here)")
    parser.add_argument("--graph-mode", help="the graph backend's mode (default: its first; npu: aclgraph or "
                                             "torchair; hwgraph info lists each backend's modes)")
    parser.add_argument("--device", help="torch device (default: the detected accelerator, else cpu)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16; float32 on CPU)")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up calls per cell (default 10)")
    parser.add_argument("--samples", type=int, default=30, help="timed calls per cell (default 30)")
    parser.add_argument("--budgets", type=int, nargs="+", action="extend",
                        help="token budgets (default: doubling from 64 to cover the largest group)")


def register_cli(sub) -> None:
    p = sub.add_parser("bench", help="transformers eager vs hwgraph eager vs hwgraph replay, per image group",
                       epilog="Exit status 0 when the benchmark ran and its reports were written; 1 when it ran "
                              "but --json could not be written (the tables still print); 2 for a bad option "
                              "(checked before a tower is built) or a requested backend or kernel that cannot run "
                              "here.")
    add_bench_arguments(p)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--calibrate", action="store_true",
                   help="also calibrate budgets with the first kernel (keep every budget up to the largest whose "
                        "replay beats eager; without --budgets, searched up to "
                        f"{budget_rules.CALIBRATION_CAP} tokens)")
    p.add_argument("--profile", action="store_true", help="also sum device kernel time per call with torch.profiler")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers reference encoder")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the block forward (once per block shape) before capturing each budget")
    p.add_argument("--measure-products", action="store_true",
                   help="capture the matrix products with the graph backend's measured kernel choice (CUDA: the "
                        "fastest cuBLASLt configuration per shape), timed beside plain replay")
    p.set_defaults(func=cmd_bench)
