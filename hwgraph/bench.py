"""``hwgraph bench``: transformers eager, hwgraph eager and hwgraph replay side by side, per image group, in one run.

Every latency is measured in this process with ``hwgraph.timing.measure_interleaved`` (device events on CUDA/ROCm,
wall clock elsewhere): median and p95 of ``samples`` calls after ``warmup`` calls. For each group, the transformers
encoder and, for every attention kernel, the hwgraph eager tower and the replay are sampled in turn (one call of
each per round, in seeded orders in which each callable follows each other equally often, since a replay right
after an eager forward runs slower than after another replay), so the ratios, between kernels too, compare calls
made under the same host and device conditions; speedups are ratios of those medians. A group ``NxT`` is N
single-frame images of T merged tokens each, encoded as one call. The command line is ``hwgraph.bench_command``.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass, field, replace

import torch

from hwgraph import budgets as budget_rules
from hwgraph.platform import device_runtime
from hwgraph.timing import measure_interleaved

log = logging.getLogger(__name__)

ACCELERATOR_GROUPS = "1x49,2x49,1x98,1x256,4x64,1x1024"
CPU_GROUPS = "1x16,2x16,1x49,4x16,1x64"
ACCELERATOR_PRESET = "qwen3-omni-30b-a3b"
CPU_PRESET = "tiny"


@dataclass(frozen=True)
class Group:
    """``count`` single-frame images of ``tokens`` merged tokens each, encoded in one call."""

    count: int
    tokens: int

    @property
    def label(self) -> str:
        return f"{self.count}x{self.tokens}"

    @property
    def total(self) -> int:
        return self.count * self.tokens

    def grid(self, merge: int) -> list[tuple[int, int, int]]:
        """``(1, h, w)`` patch grids with ``h * w / merge**2 == tokens`` (49 tokens, merge 2: 14x14 patches)."""
        return [budget_rules.filling_grid(self.tokens, merge)] * self.count


def ascii_digits(text: str) -> bool:
    """Only 0-9: ``str.isdigit`` also takes superscripts such as '²', which ``int`` then refuses."""
    return text.isascii() and text.isdigit()


def parse_groups(spec: str) -> list[Group]:
    """``"1x49,2x49,4x64"`` -> groups; ``ValueError`` naming the bad entry."""
    groups = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        count, sep, tokens = item.lower().partition("x")
        bad = f"bad group {item!r} in {spec!r}: expected COUNTxTOKENS with positive ints, e.g. 2x49"
        if not sep or not ascii_digits(count) or not ascii_digits(tokens):
            raise ValueError(bad)
        # leading zeros dropped, and a number longer than any call's patch rows refused before int() reads it
        # (int() refuses 4301 digits with a message about sys.set_int_max_str_digits, naming no group)
        count, tokens = count.lstrip("0") or "0", tokens.lstrip("0") or "0"
        longest = max(count, tokens, key=len)
        if len(longest) > len(str(budget_rules.MAX_PATCH_ROWS)):
            raise ValueError(f"group {item!r} in {spec!r} is too large: {longest} is past the "
                             f"{budget_rules.MAX_PATCH_ROWS} patch rows one call takes (int32 cu_seqlens)")
        if int(count) < 1 or int(tokens) < 1:
            raise ValueError(bad)
        group = Group(int(count), int(tokens))
        if group in groups:
            raise ValueError(f"group {group.label} repeats in {spec!r}: each group is one row of the table")
        groups.append(group)
    if not groups:
        raise ValueError(f"no groups in {spec!r}")
    return groups


def covering_budgets(groups: list[Group]) -> list[int]:
    """Budgets doubling from 64 up to the first that holds the largest group (the manager's auto rule)."""
    cap = budget_rules.MIN_AUTO_BUDGET
    while cap < max(g.total for g in groups):
        cap *= 2
    return budget_rules.auto_budgets(cap)


@dataclass
class BenchConfig:
    preset: str
    groups: list[Group]
    device: torch.device
    dtype: torch.dtype
    kernels: list[str] | None = None  # None: every kernel available here, best first
    graph_backend: str | None = None
    graph_mode: str | None = None  # None: the backend's first mode
    warmup: int = 10
    samples: int = 30
    calibrate: bool = False
    profile: bool = False
    reference: bool = True  # also time transformers' encoder
    compile: bool = False  # torch.compile the block forward (once per shape) before capturing each budget
    measure_products: bool = False  # capture the products with the backend's measured kernel choice
    seed: int = 0
    budgets: list[int] = field(default_factory=list)  # empty: covering_budgets(groups)


def default_device() -> torch.device:
    from hwgraph.platform import detect

    kind = detect().kind
    return torch.device({"cuda": "cuda", "rocm": "cuda", "npu": "npu"}.get(kind, "cpu"))


def build_tower(preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A randomly initialised tower, built on the device (the real preset is 1.08 GB in bf16)."""
    from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

    torch.manual_seed(seed)
    with torch.device(device):
        tower = Qwen3OmniVisionTower.from_preset(preset)
    return tower.to(dtype=dtype).eval()


def kernel_choices(tower, requested: list[str] | None) -> tuple[list[str], list[dict]]:
    """(kernels to run, every kernel with availability and reasons for the tower's device, dtype, head dim)."""
    from hwgraph.attention.registry import kernel_named, kernel_specs
    from hwgraph.platform import platform_for

    platform = platform_for(tower.device)
    table = []
    for spec in sorted(kernel_specs(), key=lambda k: -k.rank(platform)):
        cap = spec.capability(platform, tower.dtype, tower.head_dim)
        table.append({"name": spec.name, "available": cap.ok, "reasons": list(cap.reasons),
                      "graph_safe": spec.graph_safe, "kinds": list(spec.kinds)})
    if requested:
        names = [kernel_named(n).name for n in requested]  # unknown names raise, listing the known ones
        refused = {row["name"]: row["reasons"] for row in table if row["name"] in names and not row["available"]}
        if refused:
            from hwgraph.registry import SelectionError

            raise SelectionError("; ".join(f"attention kernel {n} is unavailable: {'; '.join(r)}"
                                           for n, r in refused.items()))
        return names, table
    return [row["name"] for row in table if row["available"] and platform.kind in row["kinds"]], table


def eager_call(tower, pixels, grid):
    with torch.inference_mode():
        return tower.forward(pixels, grid)


def group_inputs(tower, groups: list[Group], seed: int) -> dict:
    out = {}
    for i, group in enumerate(groups):
        grid = group.grid(tower.spatial_merge_size)
        gen = torch.Generator().manual_seed(seed + i)
        rows = sum(t * h * w for t, h, w in grid)
        pixels = torch.randn(rows, tower.patch_row_width, generator=gen).to(tower.device, tower.dtype)
        out[group.label] = (pixels, grid)
    return out


def reference_calls(tower, groups, inputs) -> dict:
    """Per group, a call of transformers' encoder with the tower's weights (``attn_implementation="sdpa"``)."""
    from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference

    encoder = reference_encoder(tower, attn_implementation="sdpa")

    def call(pixels, grid):
        with torch.inference_mode():  # as hwgraph's eager calls run: no grad-mode bookkeeping in either
            return run_reference(encoder, pixels, grid)

    return {group.label: functools.partial(call, *inputs[group.label]) for group in groups}


def warm_device(device: torch.device, seconds: float = 2.0) -> None:
    """Keep an accelerator busy for ``seconds`` before the first timed cell: an idle GPU starts at low clocks
    (345 MHz seen on the H200) and would make whichever cell runs first look slow."""
    if device.type == "cpu":
        return
    import time

    from hwgraph.timing import synchronize

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        synchronize(device)


def empty_cache(device: torch.device) -> None:
    fn = getattr(device_runtime(device), "empty_cache", None)
    if callable(fn):
        fn()


def kernel_view(tower, kernel: str):
    """``tower`` for one attention kernel: a shallow copy sharing its modules and weights, with its own kernel
    choice, so managers of several kernels (and eager calls with each) live side by side on one set of weights."""
    view = copy.copy(tower)
    view.set_attention(kernel)
    return view


def time_kernels(tower, kernels: list[str], groups, inputs, cfg: BenchConfig, progress, calibrate: bool = False,
                 reference: dict | None = None, before_profiling=None) -> list[dict]:
    """hwgraph eager and replay of every group with each attention kernel (one manager per kernel, budgets covering
    all), captured first, then timed group by group with every kernel's calls and the transformers call in
    ``reference`` (group label -> callable) sampled in turn: kernels timed one after another were not comparable
    (on the H200 whichever kernel ran second replayed a 49-token image 6-12% slower, ``docs/benchmarks.md``).
    ``before_profiling``: called once every group is timed and the plain managers are closed, before ``cfg.profile``'s
    profiler runs on the main managers (more timing, which the profiler would slow)."""
    from hwgraph.manager import EncoderGraphManager
    from hwgraph.profiling import kernel_time

    budgets = cfg.budgets or covering_budgets(groups)
    if calibrate and not cfg.budgets:  # look for the cap up to the manager's calibration limit
        budgets = budget_rules.auto_budgets(max(budget_rules.CALIBRATION_CAP, max(budgets)))
    max_images = min(max(g.count for g in groups), min(budgets))
    views = {k: kernel_view(tower, k) for k in kernels}

    def new_manager(kernel: str, compile: bool, measure_products: bool):
        return EncoderGraphManager(views[kernel], device=cfg.device, dtype=cfg.dtype, budgets=budgets,
                                   max_images_per_graph=max_images, graph_backend=cfg.graph_backend,
                                   graph_mode=cfg.graph_mode, attention=kernel, calibrate=calibrate, compile=compile,
                                   measure_products=measure_products)

    managers, plains = {}, {}
    try:
        for kernel in kernels:
            managers[kernel] = new_manager(kernel, cfg.compile, cfg.measure_products)
            managers[kernel].capture()
            # compiled replay, or replay with measured products, is timed side by side with plain replay, from a
            # manager captured without either
            if (cfg.compile or cfg.measure_products) and not calibrate:
                plains[kernel] = new_manager(kernel, False, False)
                plains[kernel].capture()
        rows = {kernel: {} for kernel in kernels}
        profiled = []  # (row, eager call, replay call or None): profiled once every group is timed
        for group in groups:
            pixels, grid = inputs[group.label]
            calls = {}
            if reference is not None:
                calls["transformers"] = reference[group.label]
            entries, plain_notes = {}, {}
            for kernel in kernels:
                entries[kernel] = managers[kernel].select_graph(grid, group.total)
                calls[f"{kernel} eager"] = lambda v=views[kernel], p=pixels, g=grid: eager_call(v, p, g)
                # Calibrated budgets: time what a caller gets, replay or the eager fallback the calibration left.
                if entries[kernel][0] is not None or calibrate:
                    calls[f"{kernel} replay"] = lambda m=managers[kernel], p=pixels, g=grid: m.encode(p, g)
                    if kernel in plains:
                        plain_notes[kernel] = plain_refusal(plains[kernel].select_graph(grid, group.total),
                                                            entries[kernel][0])
                        if plain_notes[kernel] is None:
                            plain = plains[kernel]
                            calls[f"{kernel} plain_replay"] = lambda m=plain, p=pixels, g=grid: m.encode(p, g)
            timed = measure_interleaved(calls, cfg.device, cfg.warmup, cfg.samples)
            for kernel in kernels:
                row = {name: timed[f"{kernel} {name}"].as_dict() if f"{kernel} {name}" in timed else None
                       for name in ("eager", "replay", "plain_replay")}
                row["transformers"] = timed["transformers"].as_dict() if reference is not None else None
                if cfg.profile:  # after every group is timed: on CUDA the profiler slows the launches after it
                    profiled.append((row, calls[f"{kernel} eager"], calls[f"{kernel} replay"] if row["replay"]
                                     else None))
                entry, why = entries[kernel]
                row["budget"] = entry.budget if entry is not None else None
                row["replay_note"] = "replay" if entry is not None else f"eager: {why}"
                if plain_notes.get(kernel):
                    row["plain_note"] = plain_notes[kernel]
                rows[kernel][group.label] = row
                progress.advance(note=f"{kernel} {group.label}")
        # Plain replay is timed, not profiled: its managers' graphs are released before anything more runs.
        plain_stats = {}
        for kernel in list(plains):
            plain_stats[kernel] = plains[kernel].stats()
            plains.pop(kernel).close()
        if before_profiling is not None:
            before_profiling()
        for row, eager, replay in profiled:
            row["profile"] = {"eager": kernel_time(eager, cfg.device).as_dict(),
                              "replay": kernel_time(replay, cfg.device).as_dict() if replay is not None else None}
        results = []
        for kernel in kernels:
            manager = managers[kernel]
            stats = manager.stats()
            results.append({"kernel": kernel, "backend": manager.backend.name, "mode": manager.backend.mode,
                            "accelerates": manager.backend.accelerates, "budgets": sorted(manager.graphs),
                            "rows": rows[kernel], "stats": stats,
                            "graph_memory_bytes": dict(sorted(stats["capture_bytes_per_budget"].items())),
                            "plain_capture_seconds": dict(sorted(
                                plain_stats[kernel]["capture_seconds_per_budget"].items()))
                            if kernel in plain_stats else None,
                            "plain_capture_failures": dict(plain_stats[kernel]["capture_failures"])
                            if kernel in plain_stats else None})
        return results
    finally:
        for manager in (*managers.values(), *plains.values()):
            manager.close()


def plain_refusal(plain: tuple, replayed) -> str | None:
    """Why plain replay is not timed beside a group's replay (``replayed``: its ``BudgetGraph``, or None where
    calibration left the group eager), given the plain manager's ``select_graph``; None: timed. Only a replay of the
    same budget compares: where the plain manager's capture of it failed, it would replay a larger budget (more
    padding), or run eagerly; where the replay's capture of the group's smallest budget failed, plain replay would
    run that smaller one."""
    entry, why = plain
    if entry is None:
        return f"not timed: plain capture eager ({why})"
    if replayed is not None and entry.budget > replayed.budget:
        return (f"not timed: the plain capture of budget {replayed.budget} failed, and plain replay would run "
                f"budget {entry.budget}")
    if replayed is not None and entry.budget < replayed.budget:  # the replay's own capture of the budget failed
        return (f"not timed: the replay runs budget {replayed.budget} (its capture of budget {entry.budget} failed), "
                f"and plain replay would run budget {entry.budget}")
    return None


def device_name(device: torch.device) -> str | None:
    """The name of the accelerator ``device`` is (the platform names the current one, which may differ)."""
    get_name = getattr(device_runtime(device), "get_device_name", None)
    return get_name(device) if get_name is not None else None


def ratio(num: dict | None, den: dict | None) -> float | None:
    if not num or not den or not den.get("median_ms"):
        return None
    return num["median_ms"] / den["median_ms"]


def profile_ratios(row: dict) -> dict:
    prof = row.get("profile")
    if not prof:
        return {}
    eager_k, replay_k = prof["eager"]["kernel_ms"], (prof["replay"] or {}).get("kernel_ms")
    out = {"eager_kernel_ms": eager_k, "replay_kernel_ms": replay_k, "source": prof["eager"]["source"],
           "eager_over_kernels": row["eager"]["median_ms"] / eager_k if eager_k else None,
           "replay_over_tower_kernels": row["replay"]["median_ms"] / eager_k if eager_k and row["replay"] else None,
           "replay_over_replay_kernels": row["replay"]["median_ms"] / replay_k if replay_k and row["replay"] else None}
    return out


def flatten_rows(groups, per_kernel: list[dict]) -> list[dict]:
    """One row per (group, kernel) with latencies and the speedups measured in this run."""
    rows = []
    for group in groups:
        for result in per_kernel:
            r = result["rows"][group.label]
            tf = r["transformers"]
            rows.append({
                "group": group.label, "images": group.count, "tokens": group.total, "kernel": result["kernel"],
                "transformers": tf, "eager": r["eager"], "replay": r["replay"], "budget": r["budget"],
                "plain_replay": r.get("plain_replay"), "plain_note": r.get("plain_note"),
                "replay_note": r["replay_note"],
                "speedup": {"eager_vs_transformers": ratio(tf, r["eager"]),
                            "replay_vs_transformers": ratio(tf, r["replay"]),
                            "replay_vs_eager": ratio(r["eager"], r["replay"]),
                            "replay_vs_plain_replay": ratio(r.get("plain_replay"), r["replay"])},
                "profile": profile_ratios(r),
            })
    return rows


def run_bench(cfg: BenchConfig, progress=None) -> dict:
    """Everything ``hwgraph bench`` reports, as a JSON-ready dict."""
    from hwgraph.progress import Progress
    from hwgraph.versions import environment

    tower = build_tower(cfg.preset, cfg.device, cfg.dtype, cfg.seed)
    kernels, kernel_table = kernel_choices(tower, cfg.kernels)
    groups = cfg.groups
    inputs = group_inputs(tower, groups, cfg.seed + 1000)
    steps = len(groups) * (len(kernels) + int(cfg.calibrate))
    progress = progress or Progress("bench")
    progress.set_total(steps)
    with progress:
        warm_device(cfg.device)
        reference = reference_calls(tower, groups, inputs) if cfg.reference else None
        calibrated_runs = []

        def time_calibrated():
            calibrated_runs.extend(time_kernels(tower, kernels[:1], groups, inputs, replace(cfg, profile=False),
                                                progress, calibrate=True, reference=reference))

        # The calibrated run after the main run's timing, its captures counting no startup of the main managers; with
        # --profile before the profiler, which slows later launches, while the managers it profiles hold their
        # graphs; without, once they are closed, so that its captures (up to the calibration cap) are not made
        # beside theirs.
        per_kernel = time_kernels(tower, kernels, groups, inputs, cfg, progress, reference=reference,
                                  before_profiling=time_calibrated if cfg.calibrate and cfg.profile else None) \
            if kernels else []
        if cfg.calibrate and not cfg.profile and kernels:
            time_calibrated()
        calibrated = calibrated_runs[0] if calibrated_runs else None
        reference = None  # not del: time_calibrated's closure names it
        empty_cache(cfg.device)  # the reference encoder's weights are garbage now
    result = {
        "environment": environment(),
        "preset": cfg.preset, "device": str(cfg.device), "device_name": device_name(cfg.device),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "timer": "device events" if cfg.device.type == "cuda" else "wall clock",
        "warmup": cfg.warmup, "samples": cfg.samples, "groups": [g.label for g in groups], "compile": cfg.compile,
        "measure_products": cfg.measure_products,
        "budgets": cfg.budgets or covering_budgets(groups),
        "graph_backend": per_kernel[0]["backend"] if per_kernel else cfg.graph_backend,
        "graph_mode": per_kernel[0]["mode"] if per_kernel else cfg.graph_mode,
        "graph_backend_accelerates": per_kernel[0]["accelerates"] if per_kernel else None,
        "kernels": kernel_table, "rows": flatten_rows(groups, per_kernel),
        "interleaved": True,
        "per_kernel": {r["kernel"]: {k: r[k] for k in ("budgets", "graph_memory_bytes", "plain_capture_seconds",
                                                       "plain_capture_failures", "stats")}
                       for r in per_kernel},
        "calibration": None,
    }
    if calibrated is not None:
        from hwgraph.manager import CALIBRATION_TIMING

        result["calibration"] = {
            "kernel": calibrated["kernel"], "findings": calibrated["stats"]["calibration"],
            "timing": dict(CALIBRATION_TIMING), "kept_budgets": calibrated["budgets"],
            # a budget whose capture failed has no finding: the search covered it, and this says why it is missing
            "capture_failures": dict(calibrated["stats"]["capture_failures"]),
            "rows": [{"group": g.label, "replay": calibrated["rows"][g.label]["replay"],
                      "budget": calibrated["rows"][g.label]["budget"],
                      "replay_note": calibrated["rows"][g.label]["replay_note"],
                      "replay_vs_transformers": ratio(calibrated["rows"][g.label]["transformers"],
                                                      calibrated["rows"][g.label]["replay"])}
                     for g in groups]}
    return result
