"""The ``hwgraph`` command line: ``info``, ``bench``, ``validate``, and the checks their options share."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger(__name__)


def table(rows: list[list[str]], headers: list[str]) -> str:
    """A plain-text table; the last column may be long (reasons) and is not padded. A line break in it (a crashed
    gate's error) continues under that column, so the rows below keep their place."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    indent = " " * sum(w + 2 for w in widths)
    lines = []
    for row in [headers, ["-" * w for w in widths] + ["-" * len(headers[-1])], *rows]:
        first, *more = str(row[-1]).splitlines() or [""]
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)] + [first]
        lines.append("  ".join(cells).rstrip())
        lines += [(indent + line).rstrip() for line in more]
    return "\n".join(lines)


def info_data() -> dict:
    """What ``hwgraph info`` prints. ``selected_backend`` is what a manager would take: None, and
    ``selection_reason`` the error, when no graph backend can be chosen (``$HWGRAPH_GRAPH_BACKEND`` names an unknown
    or unavailable one, or one whose class does not import); the CPU reference backend, with the reason, where the
    automatic choice's class does not import."""
    from hwgraph.attention.registry import list_kernels
    from hwgraph.platform import detect
    from hwgraph.registry import (
        SelectionError,
        choose_backend,
        constructed,
        discovered,
        list_backends,
        loaded_class,
    )

    platform = detect()
    try:  # what a manager takes: a forced choice whose class does not import fails, an automatic one falls back
        selected, cls = loaded_class(choose_backend(platform=platform))
        try:  # made in its default mode, as a manager makes it: a class may refuse that mode
            selected = constructed(selected, cls)[0]
        except SelectionError:
            raise
        except Exception:  # about the default device, which a manager does not take for granted: logged (-vv)
            log.debug("graph backend %r: constructing it failed", selected.spec.name, exc_info=True)
        selected_name, selection_reason = selected.spec.name, selected.reason
    except (SelectionError, ImportError) as exc:  # info exists to say why: the tables below say it for every one
        selected_name, selection_reason = None, str(exc)  # only a forced choice raises: the variable's, named
    backends = [
        {"name": spec.name, "available": cap.ok, "reasons": list(cap.reasons), "kinds": list(spec.kinds),
         "modes": list(spec.modes), "priority": spec.priority, "class": spec.class_path,
         "selected": spec.name == selected_name}
        for spec, cap in list_backends(platform)
    ]
    kernels = [
        {"name": spec.name, "available": cap.ok, "reasons": list(cap.reasons), "kinds": list(spec.kinds),
         "dtypes": [str(d).removeprefix("torch.") for d in spec.dtypes], "head_dims": list(spec.head_dims),
         "graph_safe": spec.graph_safe, "priority": spec.rank(platform)}
        for spec, cap in list_kernels(platform)
    ]
    return {"platform": platform.as_dict(), "graph_backends": backends, "selected_backend": selected_name,
            "selection_reason": selection_reason, "attention_kernels": kernels, "problems": list(discovered()[1])}


def format_info(data: dict) -> str:
    p = data["platform"]
    out = ["Platform",
           table([[k, "" if v is None else str(v)] for k, v in p.items() if k != "notes"], ["field", "value"])]
    for note in p.get("notes") or ():
        out.append(f"note: {note}")
    out += ["", "Graph backends",
            table([[("* " if b["selected"] else "  ") + b["name"], "yes" if b["available"] else "no",
                    ",".join(b["modes"]), "; ".join(b["reasons"]) or "-"] for b in data["graph_backends"]],
                  ["backend", "available", "modes", "reasons"]),
            f"selected: {data['selected_backend'] or 'none'} ({data['selection_reason']})",
            "", "Attention kernels",
            table([[k["name"], "yes" if k["available"] else "no", "/".join(k["kinds"]),
                    "yes" if k["graph_safe"] else "no", "; ".join(k["reasons"]) or "-"]
                   for k in data["attention_kernels"]], ["kernel", "available", "platforms", "graph-safe", "reasons"])]
    for problem in data["problems"]:
        out.append(f"problem: {problem}")
    return "\n".join(out)


def cmd_info(args) -> int:
    data = info_data()
    print(json.dumps(data, indent=2) if args.json else format_info(data))
    return 0 if data["selected_backend"] else 1  # scripts notice that nothing here can run


INFO_EPILOG = ("Exit status 0 when a graph backend is selected; 1 when none can be ($HWGRAPH_GRAPH_BACKEND names "
               "an unknown or unavailable backend): the tables are printed all the same, with the reasons.")


# Checks that ``bench`` and ``validate`` options share: each raises ``ValueError`` naming the option, its value and
# what was expected, which the command prints before exiting 2, before anything is built.
def at_least(option: str, value: int | None, low: int) -> None:
    """``ValueError`` naming ``option`` and ``value`` when an integer option is below ``low`` (None: not given)."""
    if value is not None and value < low:
        raise ValueError(f"{option} {value} is out of range: expected an integer >= {low}")


def parsed(option: str, parse, value):
    """``parse(value)``, its ``ValueError`` prefixed with the option that gave the value."""
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def check_patch_rows(option: str, label: str, tokens: int, preset: str) -> None:
    """``ValueError`` naming ``option`` and ``label`` when ``tokens`` merged tokens of ``preset``'s tower (known: the
    caller parsed it) are more patch rows than one call takes (``budgets.patch_rows_refusal``). Past them a run
    failed only once it began (or hung, searching a grid's sides for 10**20 tokens)."""
    from hwgraph.budgets import patch_rows_refusal
    from hwgraph.models.qwen3_omni.config import preset_config

    refusal = patch_rows_refusal(tokens, preset_config(preset).spatial_merge_size)
    if refusal:
        raise ValueError(f"{option} {label}: {refusal}")


def check_kernels(names: list[str] | None) -> None:
    """``ValueError`` naming the first attention kernel in ``names`` that no installed package brings, or one named
    twice (in any case): each kernel is one row of the tables and one manager."""
    from hwgraph.attention.registry import kernel_named
    from hwgraph.registry import SelectionError

    try:
        canonical = [kernel_named(name).name for name in names or ()]
    except SelectionError as exc:
        raise ValueError(f"--attention: {exc}") from None
    repeated = sorted({name for name in canonical if canonical.count(name) > 1})
    if repeated:
        raise ValueError(f"--attention {' '.join(names)}: {repeated[0]} repeats; give each kernel once")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hwgraph", description="The hwgraph command line: info, bench, validate.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log at info level; -vv at debug level (e.g. the traceback of a gate that raised)")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="the platform, graph backends and attention kernels, with reasons",
                          description="The platform, every graph backend and attention kernel, and why any is "
                                      "unavailable.", epilog=INFO_EPILOG)
    info.add_argument("--json", action="store_true", help="print JSON instead of tables")
    info.set_defaults(func=cmd_info)
    for register in optional_commands():
        register(sub)
    return parser


def optional_commands():
    """``bench`` and ``validate`` register themselves from their own modules."""
    from hwgraph import bench_command, validate

    return [bench_command.register_cli, validate.register_cli]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level={0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code = args.func(args)
        sys.stdout.flush()  # a pipe's stdout is block-buffered: a gone reader's error comes here, not at exit
        return code
    except BrokenPipeError:  # the reader went away (``hwgraph info --json | head``): stop quietly, as a tool killed
        # by SIGPIPE would; stdout goes to /dev/null so that flushing it at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    except KeyboardInterrupt as exc:  # Ctrl-C: one line, not a traceback, and the status a shell gives SIGINT
        print(f"hwgraph {args.command}: interrupted" + (f": {exc}" if str(exc) else ""), file=sys.stderr)
        return INTERRUPTED


BROKEN_PIPE = 128 + 13  # the status a shell reports for a command killed by SIGPIPE
INTERRUPTED = 128 + 2  # ... and by SIGINT (Ctrl-C)


if __name__ == "__main__":
    sys.exit(main())
