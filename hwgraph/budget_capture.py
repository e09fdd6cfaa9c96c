"""One token budget's capture: a graph per sequence-slot count, all reading one set of static buffers.

``EncoderGraphManager`` decides which budgets to capture, compiled or plain, and what a failure means (a logged
eager fallback); this module makes one budget's graphs (``capture_budget``), holds them (``BudgetGraph``) and says
how close their replay must come to eager (``VERIFY_TOLERANCE``, ``relative_error``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hwgraph import budgets as budget_rules
from hwgraph import products
from hwgraph.compile_mode import compile_limits
from hwgraph.graphs.base import CapturedGraph

# Relative L2 error a verified capture may show against eager: rounding only. A stale or wrong replay is O(1).
VERIFY_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def measuring_seconds() -> float:
    """What the active product chooser has spent measuring so far (0 without one)."""
    return getattr(products.ACTIVE, "seconds", 0.0)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float32 (one host read: used at capture time, never on the replay path)."""
    diff = torch.linalg.vector_norm(got.float() - want.float())
    return float(diff / torch.linalg.vector_norm(want.float()).clamp_min(1e-30))


@dataclass
class BudgetGraph:
    """One captured budget: its static inputs and its graphs, one per sequence-slot count, all reading the same
    static buffers (a graph with fewer slots sees a prefix of ``cu_seqlens``). Each graph's ``outputs`` is its
    output buffer ``[1 + deepstack, budget, out]``."""

    budget: int
    num_patches: int
    pixels: torch.Tensor
    metadata: object  # the tower's device metadata, padded to every slot: the graphs' static inputs
    graphs: dict[int, CapturedGraph]  # slot count -> graph, ascending
    memory_bytes: int  # device memory the budget keeps: its graphs' (their pool's growth) and its static inputs
    capture_seconds: float  # the budget's whole startup: compiling (compiled captures) and capturing
    filled_grid: tuple | None = None  # the grid whose metadata the static buffers hold now (None: unknown)
    compile_seconds: float | None = None  # compiled captures: the part of capture_seconds spent compiling
    numerics: tuple = ()  # the backend's numerics_settings() when it was captured, which its replays keep
    numerics_warned: bool = False  # a replay refused for changed settings was logged

    def graph_for(self, num_seqs: int) -> tuple[int, CapturedGraph]:
        """The graph with the fewest slots holding ``num_seqs`` sequences, and its slot count; ``ValueError`` naming
        both when none holds them (the manager's dispatch never asks: it sends such groups eagerly)."""
        fitting = [n for n in self.graphs if n >= num_seqs]
        if not fitting:
            raise ValueError(f"no graph of budget {self.budget} holds num_seqs={num_seqs} sequences: its slot counts "
                             f"are {sorted(self.graphs)}")
        slots = min(fitting)
        return slots, self.graphs[slots]

    def input_bytes(self) -> int:
        """Device memory of the static input buffers (pixels and metadata) the budget's replays are filled into."""
        return storage_bytes(self.pixels, *self.metadata.tensors().values())

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.release()


def capture_budget(tower, backend, pool, budget: int, *, device: torch.device, slot_counts, max_images: int,
                   random_pixels: Callable[[int], torch.Tensor], chooser=None, block_forward=None,
                   num_budgets: int = 1, verify: Callable | None = None) -> BudgetGraph:
    """Capture ``budget`` merged tokens once per slot count in ``slot_counts``, most slots first, every graph
    reading the same static buffers (metadata padded to ``max_images`` sequences on ``device``, pixels from
    ``random_pixels(patches)``) and sharing ``pool``.

    ``block_forward``: a compiled capture's compiled block forward, whose first call, before capturing, is timed as
    ``compile_seconds``, under dynamo's limits sized for ``num_budgets``; None: a plain capture. ``chooser``: the
    product chooser the captures run their matrix products as. ``verify(entry, graph, host, grid)`` checks each
    graph after capture. A failed or wrong graph releases the budget's others and raises."""
    compiled = block_forward is not None
    num_patches = budget * tower.spatial_merge_size ** 2
    grid = [budget_rules.filling_grid(budget, tower.spatial_merge_size)]
    host = tower.prepare_metadata(grid)
    # Normal tensors even when the caller captures in inference mode: encode() fills them in place, and may run
    # outside it (another thread, no_grad), where an inference tensor refuses in-place updates.
    with torch.inference_mode(False):
        static_meta = host.padded(num_patches, max_images).to(device)
        pixels = random_pixels(num_patches)
    entry = BudgetGraph(budget, num_patches, pixels, static_meta, {}, 0, 0.0)

    def slot_forward(slots: int):
        meta = static_meta.first_seqs(slots)
        if compiled and len(slot_counts) > 1:
            # Only the attention op (opaque to inductor) reads cu_seqlens' length: one compiled block per
            # budget serves every slot count, instead of a recompilation per count.
            torch._dynamo.mark_dynamic(meta.cu_seqlens, 0)

        def forward() -> torch.Tensor:
            # A compiled forward runs under dynamo's limits and inductor's rounding at every call: the first, which
            # compiles, each capture, and each replay of a backend that replays by running forward again (the CPU
            # reference backend), which recompiles there when the process's state moved since (torch.set_num_threads,
            # deterministic algorithms); that compilation rounded bf16 unlike eager and fell back to eager silently
            # past the recompile limit. A plain forward never reads them (that imports dynamo: 1-5 s counted as the
            # first plain budget's capture time).
            with compile_limits(num_budgets) if compiled else contextlib.nullcontext():
                out = tower.forward_with_metadata(pixels, meta, block_forward=block_forward)
            return torch.stack(out.tensors())
        return forward

    forwards = {slots: slot_forward(slots) for slots in sorted(slot_counts, reverse=True)}
    # What the backend keeps for the process once the streams a capture runs on have been used (the compiled
    # forward's first call below runs on the current one) is made now, by an eager forward (compiling is timed
    # below), so that it is not counted as this budget's memory.
    eager_meta = static_meta.first_seqs(max(forwards))
    backend.prepare(lambda: tower.forward_with_metadata(pixels, eager_meta).tensors(), current_stream=compiled)
    backend.synchronize()
    # Capturing empties the allocator's cache (torch.cuda.graph does): empty it first, so the difference below
    # is what this budget's graphs hold, not cached blocks released on the way in.
    backend.empty_cache()
    before = backend.memory_in_use()
    start = time.perf_counter()
    # The products run as the chooser picks them, or else as the one the caller has active
    # (``products.chosen_by``); compiled graphs call it through its custom ops.
    choice = products.chosen_by(chooser) if chooser is not None else contextlib.nullcontext()
    try:
        with torch.inference_mode(), choice:
            if compiled:
                # The first call traces and compiles (or loads inductor's cached graphs). Made here, before
                # capturing, it is the budget's compile time, less what a product chooser spent measuring
                # shapes it met first. It runs on the current stream, which ``prepare`` has readied too, and
                # the blocks it leaves cached are emptied when capturing begins (torch.cuda.graph does).
                measuring = measuring_seconds()
                next(iter(forwards.values()))()
                backend.synchronize()
                entry.compile_seconds = time.perf_counter() - start - (measuring_seconds() - measuring)
            for slots, forward in forwards.items():
                entry.graphs[slots] = backend.capture(forward, pool)
        backend.synchronize()
        entry.graphs = dict(sorted(entry.graphs.items()))
        entry.capture_seconds = time.perf_counter() - start
        # Emptied first: a backend's own check of the capture (ROCm's eager rerun, check_replay) leaves blocks in
        # the allocator's cache, which are not the graphs'. Read before verifying, whose forwards do the same.
        backend.empty_cache()
        entry.memory_bytes = backend.memory_in_use() - before + entry.input_bytes()
        if verify is not None:
            for graph in entry.graphs.values():
                verify(entry, graph, host, grid)
    except Exception:
        entry.release()
        raise
    return entry


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
