"""Markdown for ``hwgraph bench`` results: latency tables, graph memory, startup, kernel time, calibration,
dispatch."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

MIB = 2**20


def md_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; None cells show "-", and a cell's ``|`` and line breaks (an error message's) are escaped
    so that it stays in its row and column."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join("-" if c is None else table_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def table_cell(value) -> str:
    r"""``value`` as one markdown table cell: every line break (``\r`` too) a space, backslashes and pipes escaped
    (a ``\|`` already in the text would otherwise become an escaped backslash and a column break)."""
    return " ".join(str(value).splitlines()).replace("\\", "\\\\").replace("|", "\\|")


def ms(lat: dict | None) -> str | None:
    """``median / p95`` in ms."""
    if not lat:
        return None
    return f"{lat['median_ms']:.3f} / {lat['p95_ms']:.3f}"


def x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


def latency_table(result: dict) -> str:
    """One row per group and kernel; with ``--compile`` or ``--measure-products`` plain replay has its column."""
    plain = has_plain_replay(result)
    rows = []
    for r in result["rows"]:
        replay = ms(r["replay"])
        replay = f"{replay} (budget {r['budget']})" if replay else r["replay_note"]
        s = r["speedup"]
        rows.append([r["group"], r["tokens"], r["kernel"], ms(r["transformers"]), ms(r["eager"]),
                     *([ms(r.get("plain_replay")) or r.get("plain_note")] if plain else []), replay,
                     x(s["eager_vs_transformers"]), x(s["replay_vs_transformers"]), x(s["replay_vs_eager"]),
                     *([x(s.get("replay_vs_plain_replay"))] if plain else [])])
    kind, short = replay_kind(result)
    return md_table(["group", "tokens", "attention", "transformers eager", "hwgraph eager",
                     *(["hwgraph plain replay"] if plain else []), f"hwgraph {kind}" if plain else "hwgraph replay",
                     "eager vs transformers", "replay vs transformers", "replay vs eager",
                     *([f"{short} vs plain replay"] if plain else [])], rows)


def replay_kind(result: dict) -> tuple[str, str]:
    """What the replay column holds beside plain replay, long and short."""
    measured = measured_anywhere(result)
    if result.get("compile"):
        long, short = ("compiled replay", "compiled") if compiled_anywhere(result) else \
            ("replay (compile asked, captured uncompiled)", "uncompiled")
        if not result.get("measure_products"):
            return long, short
        return (f"{long} with measured products", f"{short}, measured products") if measured else \
            (f"{long} with ATen's products (measuring asked, refused)", f"{short}, ATen's products")
    if measured:
        return "replay with measured products", "measured products"
    return "replay (measured products asked, ATen's products)", "ATen's products"


def measured_anywhere(result: dict) -> bool:
    """``--measure-products`` was asked and some kernel's captures ran the backend's product chooser: not where
    the backend has none (``stats()['products_measured']``)."""
    return bool(result.get("measure_products")) and any(data["stats"].get("products_measured")
                                                        for data in result["per_kernel"].values())


def compiled_anywhere(result: dict) -> bool:
    """``--compile`` was asked and some kernel captured some budget after torch.compile: not where the backend
    cannot compile (``compile_skipped``) or every compiled capture failed and was captured plain."""
    if not result.get("compile"):
        return False
    for data in result["per_kernel"].values():
        stats = data["stats"]
        if stats.get("compile_skipped"):
            continue
        uncompiled = {str(b) for b in stats.get("compile_failures") or {}}
        if any(str(b) not in uncompiled for b in stats.get("capture_seconds_per_budget") or {}):
            return True
    return False


def mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.1f}" if nbytes >= MIB or nbytes == 0 else f"{nbytes / MIB:.3f}"


def memory_table(result: dict) -> str:
    budgets = result["budgets"]
    rows = []
    for kernel, data in result["per_kernel"].items():
        mem = {int(b): v for b, v in data["graph_memory_bytes"].items()}
        failures = data["stats"].get("capture_failures") or {}
        cells = [mib(mem[b]) if b in mem else ("failed" if b in failures or str(b) in failures else None)
                 for b in budgets]
        rows.append([kernel, *cells, mib(sum(mem.values()))])
    return md_table(["attention", *[str(b) for b in budgets], "total"], rows)


def startup_table(result: dict) -> str:
    """Seconds per budget at startup: compiling (compiled captures), the whole capture, and plain capture where it
    was captured beside; a budget whose capture failed says so, as the memory table does."""
    budgets = result["budgets"]
    before = [step for step, on in (("compiling", compiled_anywhere(result)),
                                    ("measuring products", measured_anywhere(result))) if on]
    main = f"{', '.join(before)} and capturing" if before else "capturing"

    def row(kernel: str, what: str, seconds: dict | None, failures: dict | None = None) -> list | None:
        failed = {int(b) for b in failures or {}}
        if not seconds and not failed:
            return None
        by_budget = {int(b): v for b, v in (seconds or {}).items()}
        return [kernel, what, *("failed" if b in failed else None if b not in by_budget else f"{by_budget[b]:.1f}"
                                for b in budgets), f"{sum(by_budget.values()):.1f}"]

    rows = []
    for kernel, data in result["per_kernel"].items():
        rows += [row(kernel, "compiling", data["stats"].get("compile_seconds_per_budget")),
                 row(kernel, main, data["stats"]["capture_seconds_per_budget"], data["stats"].get("capture_failures")),
                 row(kernel, "plain capture", data.get("plain_capture_seconds"), data.get("plain_capture_failures"))]
    return md_table(["attention", "startup", *[str(b) for b in budgets], "total"], [r for r in rows if r])


def dispatch_table(result: dict) -> str:
    rows = []
    for kernel, data in result["per_kernel"].items():
        s = data["stats"]
        rows.append([kernel, s["calls"], s["hits"], s["misses"], s["eager_groups"], s["padding_tokens"],
                     ", ".join(f"{b}: {n}" for b, n in sorted(s["replays_per_budget"].items(),
                                                              key=lambda kv: int(kv[0]))) or None,
                     ", ".join(f"{k}: {n}" for k, n in sorted(s.get("replays_per_slots", {}).items(),
                                                              key=lambda kv: int(kv[0]))) or None,
                     "; ".join(f"{b}: {why}" for b, why in s["capture_failures"].items()) or None,
                     compile_note(s)])
    return md_table(["attention", "calls", "hits (images)", "misses (images)", "eager groups", "padding tokens",
                     "replays per budget", "replays per slot count", "capture failures", "captured uncompiled"],
                    rows)


def compile_note(stats: dict) -> str | None:
    """Why compiled mode captured budgets without torch.compile (the backend cannot compile, or it failed)."""
    if stats.get("compile_skipped"):
        return f"all: {stats['compile_skipped']}"
    failures = stats.get("compile_failures") or {}
    return "; ".join(f"{b}: {why}" for b, why in failures.items()) or None


def profile_table(result: dict) -> str | None:
    rows = [[r["group"], r["kernel"], r["profile"].get("source"), fmt(r["profile"].get("eager_kernel_ms")),
             x(r["profile"].get("eager_over_kernels")), fmt(r["profile"].get("replay_kernel_ms")),
             x(r["profile"].get("replay_over_tower_kernels")), x(r["profile"].get("replay_over_replay_kernels"))]
            for r in result["rows"] if r.get("profile")]
    if not rows:
        return None
    return md_table(["group", "attention", "measured", "eager kernel ms", "eager / its kernels",
                     "replay kernel ms", "replay / tower kernels", "replay / its kernels"], rows)


def fmt(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}"


def calibration_section(cal: dict | None) -> str | None:
    if not cal:
        return None
    # a budget whose capture failed has no finding: its row says so (JSON keys are strings, hence int())
    failed = {int(b): why for b, why in cal.get("capture_failures", {}).items()}
    findings = [[int(b), fmt(f["eager_ms"]), fmt(f["replay_ms"]), "yes" if f["kept"] else "no"]
                for b, f in cal["findings"].items()]
    found = md_table(["budget", "eager ms", "replay ms", "kept"],
                     sorted(findings + [[b, "-", "-", f"no: capture failed ({why})"] for b, why in failed.items()]))
    rows = md_table(["group", "calibrated dispatch", "budget", "vs transformers"],
                    [[r["group"], " ".join(filter(None, [ms(r["replay"]), None if r["replay_note"] == "replay"
                                                          else f"({r['replay_note']})"])),
                      r["budget"], x(r["replay_vs_transformers"])]
                     for r in cal["rows"]])
    kept = ", ".join(str(b) for b in cal["kept_budgets"]) or "none"
    timing = ", ".join(f"{cal['timing'][k]} {label}" for k, label in (("warmup", "warm-ups"), ("samples", "samples"))
                       ) if cal.get("timing") else None
    timed = f"Each budget's eager and replay medians come from the manager's calibration ({timing}), not from the " \
            f"settings above." if timing else None
    return "\n\n".join(filter(None, [f"### Calibrated budgets ({cal['kernel']}): kept {kept}", timed, found, rows]))


BALANCED = "in orders in which each callable follows each other equally often"
INTERLEAVED = (" (per group, {reference}every kernel's eager and replay are sampled in turn, one call of each "
               f"per round, {BALANCED})")
INTERLEAVED_BESIDE_PLAIN = (" (per group, {reference}every kernel's eager, plain replay and {kind} are sampled "
                            f"in turn, one call of each per round, {BALANCED})")


def heading(result: dict) -> str:
    p = result["environment"]["platform"]
    on_cpu = result["device"].partition(":")[0] == "cpu"  # cpu:0 too: the platform's name is the accelerator's
    where = "cpu" if on_cpu else (result.get("device_name") or p["device_name"])
    return (f"## hwgraph bench: {result['preset']}, {result['dtype']}, {result['device']} ({where}), "
            f"graph backend {result['graph_backend']}{mode_note(result)}\n\n"
            f"{result['timer']}, {result['warmup']} warm-ups, {result['samples']} samples per cell; latency in ms "
            f"as median / p95; speedups are ratios of medians measured in this run"
            f"{interleaved_note(result)}. Budgets: "
            f"{', '.join(str(b) for b in result['budgets'])}"
            f"{compile_heading(result)}{products_heading(result)}. torch {p['torch_version']}, "
            f"transformers "
            f"{result['environment']['packages'].get('transformers')}."
            + ("" if result.get("graph_backend_accelerates") is not False else
               f" The {result['graph_backend']} graph backend emulates replay eagerly (exact graph semantics, no "
               f"speed-up): its replay columns show the emulation's cost, not a device graph's."))


def mode_note(result: dict) -> str:
    """The backend's graph mode, for a bench result or a validation report (reports from before modes were
    recorded have none)."""
    return f" (mode {result['graph_mode']})" if result.get("graph_mode") else ""


def products_heading(result: dict) -> str:
    if not result.get("measure_products") or measured_anywhere(result):
        return ""
    return " (--measure-products was asked, but every product ran ATen's call: the matrix products line says why)"


def compile_heading(result: dict) -> str:
    if not result.get("compile"):
        return ""
    if compiled_anywhere(result):
        return " (each captured after torch.compile, except where the dispatch table says otherwise)"
    return " (--compile was asked, but every budget was captured uncompiled: the dispatch table says why)"


def has_plain_replay(result: dict) -> bool:
    """A compiled bench, or one with measured products: plain replay was timed beside that replay, or says why not
    (the plain manager's capture failed)."""
    return any(r.get("plain_replay") or r.get("plain_note") for r in result["rows"])


def interleaved_note(result: dict) -> str:
    if not result.get("interleaved"):
        return ""
    reference = "transformers and " if any(r.get("transformers") for r in result["rows"]) else ""
    if has_plain_replay(result):
        return INTERLEAVED_BESIDE_PLAIN.format(reference=reference, kind=replay_kind(result)[0])
    return INTERLEAVED.format(reference=reference)


ATENS = "ATen's"


def products_lines(result: dict) -> str:
    """With ``--measure-products``: what chose each kernel's matrix products (``stats()['products']``)."""
    if not result.get("measure_products"):
        return ""
    return "\n\n".join(f"Matrix products ({kernel}): {data['stats'].get('products') or ATENS}"
                       for kernel, data in result["per_kernel"].items())


MEMORY_NOTE = ("Device memory each budget keeps: its graphs (what they add to the pool the budgets share) and "
               "the static input buffers its replays are filled into.\n\n")


def bench_markdown(result: dict) -> str:
    parts = [heading(result), "### Latency per image group\n\n" + latency_table(result),
             "### Graph memory per budget (MiB)\n\n" + MEMORY_NOTE + memory_table(result),
             "### Startup per budget (s)\n\n" + startup_table(result),
             "### Dispatch\n\n" + dispatch_table(result)]
    prof = profile_table(result)
    if prof:
        parts.append("### Kernel time (torch.profiler, one call)\n\n" + prof)
    chosen = products_lines(result)
    if chosen:
        parts.append(chosen)
    cal = calibration_section(result.get("calibration"))
    if cal:
        parts.append(cal)
    skipped = [k for k in result["kernels"] if not k["available"]]
    if skipped:
        parts.append("Attention kernels not run here: " + "; ".join(
            f"{k['name']} ({'; '.join(k['reasons'])})" for k in skipped))
    return "\n\n".join(parts)


def partial_path(path: Path) -> Path:
    """A new temporary file name for ``path``'s text before it is renamed into place: named for this process and
    this write, since another run writing into the same folder had its partial file overwritten, and deleted before
    its rename, and a pid alone is shared by two containers writing into one mounted folder (both pid 1) and by two
    threads (not ``mkstemp``'s: its files are private, and so the reports would be)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")


def keep_mode(path: Path, partial: Path) -> None:
    """Give ``partial`` the permissions of the file ``path`` it replaces, if there is one: a report kept private (0600)
    or shared with a group (0664) became the umask's (0644) when it was written again."""
    with contextlib.suppress(OSError):  # no file there yet: the umask's, as for any new file
        shutil.copymode(path, partial)


def write_reports(out: Path, texts: dict[str, str]) -> None:
    """Write each of ``texts`` (file name -> text) into ``out`` through a temporary file beside it, every one before
    any is renamed into place: a failure (a full disk) leaves neither a truncated report nor one without the other."""
    partials: dict[str, Path] = {}
    try:
        for name, text in texts.items():
            partial = partial_path(out / name)
            partial.touch(exist_ok=False)  # a name another write took: an error, not its file truncated or removed
            partials[name] = partial
            partial.write_text(text, encoding="utf-8")
            keep_mode(out / name, partial)
        for name, partial in partials.items():
            partial.replace(out / name)
    finally:
        for partial in partials.values():
            partial.unlink(missing_ok=True)
