"""``report.md`` of ``hwgraph validate``: verdict, platform, versions, backends and kernels with reasons, the
conformance results, the latency table, graph memory per budget and dispatch counts."""

from __future__ import annotations

from hwgraph.report import dispatch_table, interleaved_note, latency_table, md_table, memory_table, mode_note
from hwgraph.testing.results import failing_checks


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def platform_section(report: dict) -> str:
    p = report["info"]["platform"]
    rows = [[k, v] for k, v in p.items() if k != "notes"]
    rows += [["note", n] for n in p.get("notes") or ()]
    env = report["environment"]
    versions = md_table(["package", "version"], [[k, v or "not installed"] for k, v in
                                                 (env.get("packages") or {}).items()])
    python = f"Python {env['python']} on {env['host']}\n\n" if env else ""
    return f"## Platform\n\n{md_table(['field', 'value'], rows)}\n\n## Versions\n\n{python}{versions}"


def choices_section(report: dict) -> str:
    info = report["info"]
    backends = md_table(["graph backend", "available", "modes", "validated", "reasons"],
                        [[b["name"], yes(b["available"]), ", ".join(b["modes"]),
                          "**yes**" if b["name"] == report["backend"] else "", "; ".join(b["reasons"]) or "-"]
                         for b in info["graph_backends"]])
    kernels = md_table(["attention kernel", "available on this platform", "graph-safe", "platforms", "reasons"],
                       [[k["name"], yes(k["available"]), yes(k["graph_safe"]), "/".join(k["kinds"]),
                         "; ".join(k["reasons"]) or "-"] for k in info["attention_kernels"]])
    out = [f"## Graph backends\n\nValidated: **{report['backend']}** ({report['backend_reason']}).\n\n{backends}",
           f"## Attention kernels\n\n{kernels}"]
    bench = report.get("bench")
    if bench:
        out.append(f"For the benchmark's tower ({bench['preset']}, {bench['dtype']}, {bench['device']}):\n\n"
                   + md_table(["attention kernel", "available", "reasons"],
                              [[k["name"], yes(k["available"]), "; ".join(k["reasons"]) or "-"]
                               for k in bench["kernels"]]))
    for problem in info.get("problems") or ():
        out.append(f"Plugin problem: {problem}")
    return "\n\n".join(out)


def conformance_section(report: dict) -> str:
    conf = report["conformance"]
    c = conf["counts"]
    counts = (f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped "
              f"(pytest exit status {conf['exit_code']}; full output in conformance.log)")
    ran = [r for r in conf["results"] if r["outcome"] != "skipped"]
    ran.sort(key=lambda r: r["outcome"] == "passed")  # failures first
    rows = [[f"`{r['check']}`", r["outcome"] if r["outcome"] == "passed" else f"**{r['outcome'].upper()}**",
             r["message"] or "-"] for r in ran]
    parts = [f"## Conformance ({report['preset']} preset)", counts, md_table(["check", "outcome", "detail"], rows)]
    skips: dict[str, int] = {}
    for r in conf["results"]:
        if r["outcome"] == "skipped":
            skips[r["message"]] = skips.get(r["message"], 0) + 1
    if skips:
        parts.append("Skipped, by the reason the gates gave:\n\n" + md_table(
            ["checks", "reason"], [[n, reason or "-"] for reason, n in skips.items()]))
    return "\n\n".join(parts)


def bench_section(report: dict) -> str:
    bench = report.get("bench")
    if not bench:
        why = report.get("bench_error") or "skipped (--no-bench)"
        return f"## Latency\n\nNo benchmark: {why}. latency.png not written."
    plot = report["plot"]
    figure = "![latency against image tokens](latency.png)" if "path" in plot else \
        f"latency.png not written: {plot['skipped']}"
    note = "" if bench.get("graph_backend_accelerates") is not False else (
        f" The {bench['graph_backend']} backend emulates replay eagerly: no speed-up is expected from it.")
    return "\n\n".join([
        f"## Latency\n\n{bench['timer']}, {bench['warmup']} warm-ups, {bench['samples']} samples per cell; ms as "
        f"median / p95; speedups are ratios of medians from this run"
        f"{interleaved_note(bench)}.{note}",
        latency_table(bench), figure,
        "## Graph memory per budget (MiB)\n\n" + memory_table(bench),
        "## Dispatch: hits, misses, eager fallbacks\n\n" + dispatch_table(bench)])


def validation_markdown(report: dict) -> str:
    head = (f"# hwgraph validation report\n\n**{report['verdict']}** - graph backend {report['backend']}"
            f"{mode_note(report)}, preset "
            f"{report['preset']}, {report['seconds']} s.")
    failing = failing_checks(report["conformance"])
    if failing:
        head += "\n\nFailing checks:\n\n" + "\n".join(f"- `{r['check']}`: {r['message']}" for r in failing)
    return "\n\n".join([head, platform_section(report), choices_section(report), conformance_section(report),
                        bench_section(report)]) + "\n"
