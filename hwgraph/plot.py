"""``latency.png``: eager and replay latency against image tokens, one colour per attention kernel (matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from hwgraph.report import keep_mode, partial_path


def matplotlib_missing() -> str | None:
    """Why no plot can be drawn here, or None."""
    try:
        import matplotlib  # noqa: F401
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "matplotlib":
            return f"matplotlib is not installed ({type(exc).__name__}: {exc}); pip install 'hwgraph[plot]'"
        # installed but broken (a numpy it was not built for, a missing dependency): installing it again won't do
        return f"matplotlib is installed but failed to import ({type(exc).__name__}: {exc})"
    return None


def latency_plot(result: dict, path: Path) -> str | None:
    """Draw ``hwgraph bench`` single-image rows; returns None when written, else the reason it was not."""
    missing = matplotlib_missing()
    if missing:
        return missing
    rows = [r for r in result["rows"] if r["images"] == 1]
    if not rows:
        return "no single-image groups were measured"
    try:
        draw(result, rows, path)
    except Exception as exc:  # a full disk, an unwritable folder, a broken matplotlib: a reason, not a lost report
        return f"could not write {path}: {type(exc).__name__}: {exc}"
    return None


def draw(result: dict, rows: list[dict], path: Path) -> None:
    """Plot ``rows`` into ``path``, through a temporary file beside it: a failure leaves no half-written plot."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path)
    partial = partial_path(path)  # this write's: another run plotting into the same folder keeps its own
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    try:
        kernels = list(dict.fromkeys(r["kernel"] for r in rows))
        for i, kernel in enumerate(kernels):
            mine = sorted((r for r in rows if r["kernel"] == kernel), key=lambda r: r["tokens"])
            color = f"C{i}"
            ax.plot([r["tokens"] for r in mine], [r["eager"]["median_ms"] for r in mine], "--o", color=color,
                    label=f"{kernel} eager")
            replayed = [r for r in mine if r["replay"]]
            if replayed:
                ax.plot([r["tokens"] for r in replayed], [r["replay"]["median_ms"] for r in replayed], "-s",
                        color=color, label=f"{kernel} replay")
        ref = sorted({r["tokens"]: r for r in rows if r["transformers"]}.values(), key=lambda r: r["tokens"])
        if ref:
            ax.plot([r["tokens"] for r in ref], [r["transformers"]["median_ms"] for r in ref], ":^", color="black",
                    label="transformers eager")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["tokens"] for r in rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("merged image tokens (one image)")
        ax.set_ylabel(f"median latency, ms ({result['timer']})")
        ax.set_title(f"{result['preset']} {result['dtype']} on {result['device']}, graph backend "
                     f"{result['graph_backend']}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(partial, format=path.suffix.lstrip(".") or "png")
        keep_mode(path, partial)
        partial.replace(path)
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
