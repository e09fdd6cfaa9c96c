"""EncoderGraphManager: capture the tower once per token budget, replay a step when one graph holds it all.

Dispatch is the single-replay policy: a call's images replay together in the smallest captured graph that holds
them all (image count and merged tokens); otherwise the whole group runs as one eager call. Video grids (t > 1)
go eager. Outputs handed back are copies: a later replay never overwrites them and padded rows never leak.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from hwgraph import budgets as budget_rules
from hwgraph.attention.base import check_attention_request
from hwgraph.budget_capture import VERIFY_TOLERANCE, BudgetGraph, capture_budget, relative_error
from hwgraph.compile_mode import compile_block_forward, dynamo_enabled, inductor_rounds_as_eager, pin_triton_cache_dir
from hwgraph.dtypes import graph_dtype
from hwgraph.graphs.base import CapturedGraph, CaptureError
from hwgraph.hostmem import pinned_copy
from hwgraph.platform import check_materialised, checked_device, device_runtime, platform_for
from hwgraph.registry import create_backend
from hwgraph.timing import measure_interleaved

log = logging.getLogger(__name__)

CALIBRATION_TIMING = {"warmup": 3, "samples": 10}  # calibrate()'s default warm-ups and samples per budget
PADDED_CACHE_SIZE = 64  # padded, pinned host metadata kept for this many recent (grid, budget) pairs


def caller_state_off(device: torch.device):
    """The caller's autograd recording and autocast off, for the manager's work: a graph replays what it captured,
    whatever the caller has on, so capture, eager calls and (emulated) replays all compute plainly in the manager's
    dtype, and pixels with an autograd history never join the graphs' static buffers. Entered only where on."""
    stack = contextlib.ExitStack()
    if torch.is_grad_enabled():
        stack.enter_context(torch.no_grad())
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        stack.enter_context(torch.autocast(device.type, enabled=False))
    return stack


@dataclass
class ManagerStats:
    hits: int = 0  # images served by a replay
    misses: int = 0  # images run eagerly
    replays: int = 0
    eager_groups: int = 0
    eager_reasons: dict = field(default_factory=dict)  # why groups went eager -> count
    padding_tokens: int = 0  # budget tokens replayed that held no image
    replays_per_budget: dict = field(default_factory=dict)
    replays_per_slots: dict = field(default_factory=dict)  # slot count of the graph replayed -> replays
    capture_bytes_per_budget: dict = field(default_factory=dict)  # device memory the budget keeps: its graphs and
    # its static input buffers; not what the streams it ran on keep for the process (cuBLAS's per-stream
    # workspaces: GraphBackend.prepare makes them first)
    capture_seconds_per_budget: dict = field(default_factory=dict)  # compiling and measuring products included
    compile_seconds_per_budget: dict = field(default_factory=dict)  # compiled captures: the first compiled forward,
    # less the product chooser's measuring in it; a process's first compiled budget also pays dynamo's and
    # inductor's one-time start-up there
    capture_failures: dict = field(default_factory=dict)  # budget -> reason; like compile_failures, it keeps the
    # budgets calibration removed: why they were not timed (the bench's calibration section says so)
    compile_skipped: str | None = None  # compile=True on a backend without inductor: why it captured uncompiled
    # (None once no graph it captured so is held)
    compile_failures: dict = field(default_factory=dict)  # budget -> why its compiled capture fell back to plain
    products: str | None = None  # measure_products=True: what chose the products' kernels, or why ATen did
    products_measured: bool = False  # measure_products=True and the backend's chooser ran the captures' products
    calibration: dict = field(default_factory=dict)  # budget -> {"eager_ms", "replay_ms", "kept"}

    def as_dict(self) -> dict:
        # deep: calibration's per-budget dicts are nested, and a caller's copy must not reach the manager's own
        return copy.deepcopy(self.__dict__)


TOWER_METHODS = ("parameters", "set_attention", "attention_choice", "apply_attention_choice", "weights_key",
                 "weights_moved", "prepare_metadata", "forward_with_metadata")


def check_tower(tower) -> None:
    """``TypeError`` naming what ``tower`` is when it is not an hwgraph tower (``Qwen3OmniVisionTower``)."""
    missing = [name for name in TOWER_METHODS if not callable(getattr(tower, name, None))]
    if missing:
        raise TypeError(f"tower must be an hwgraph vision tower (e.g. Qwen3OmniVisionTower), got "
                        f"{type(tower).__name__} without {', '.join(missing)}")


class EncoderGraphManager:
    """Captures ``tower.forward_with_metadata`` per token budget and dispatches groups of images.

    ``budgets`` are merged-token counts (any iterable of ints; validated: positive, no repeats,
    ``max_images_per_graph`` not above the smallest). ``None`` infers them: doubling from 64 up to ``max_budget``,
    whose default is 2048 where ``calibrate`` is on and 256 where it is off. ``calibrate`` times each budget's replay
    against eager after capturing and keeps every budget up to the largest whose replay wins, so the cap is
    calibrated on the device (``calibrate()``). Its default is on for inferred budgets on a backend that
    accelerates, and off for given budgets and on the CPU reference backend, whose replay only emulates.

    ``compile=True`` compiles the tower's block forward with ``torch.compile(dynamic=False)`` (one compilation per
    block shape, shared by the blocks) before capturing each budget (startup cost:
    ``stats()['capture_seconds_per_budget']``, of which ``compile_seconds_per_budget`` is the budget's first compiled
    forward, where dynamo traces and inductor compiles, less any measuring of products in it); where the backend
    cannot compile (``compile_support()``, e.g. NPU) or the process disables ``torch.compile``
    (``TORCH_COMPILE_DISABLE=1``), where inductor's code would not round the tower's bf16/fp16
    intermediates as eager does (``compile_mode.inductor_rounds_as_eager``: the CPU's up to torch 2.11), or a budget's
    compiled capture fails, that capture is plain, and ``stats()`` says why (``compile_skipped``, ``compile_failures``).

    ``graph_backend``: a backend name (default ``$HWGRAPH_GRAPH_BACKEND``, else the best available for ``device``);
    ``graph_mode``: one of that backend's ``modes`` (default its first; e.g. npu: ``aclgraph``, or ``torchair``,
    which compiles every capture with torchair). A mode the backend lacks raises ``ValueError`` naming its modes; one
    it cannot run here raises ``SelectionError`` with the reasons.

    ``attention``: a kernel name, ``"auto"`` or a callable, set on the tower for good (``tower.set_attention``), since
    its eager calls must run what its graphs run; None keeps the tower's current request, which a manager built
    earlier on the same tower may have set. Automatic choice takes the best graph-safe kernel (on NPU, TORCH_SDPA:
    the NPU kernel is not graph-safe); a kernel given by name that is not graph-safe runs every call eagerly.

    ``device`` and ``dtype`` (default: the tower's) move the tower in place when they differ from its own. Managers
    sharing one tower must therefore agree on both: moving it allocates new weights, and a manager whose graphs
    read the old ones raises ``RuntimeError`` at its next call instead of replaying them
    (``tower.weights_key()``).

    ``slot_counts``: with a kernel whose cost grows with empty ``cu_seqlens`` slots (``KernelSpec.slot_bound``:
    FLASH_ATTN, TRITON_ATTN, ROCM_AITER_FA), each budget is captured once per slot count, all graphs sharing its
    static buffers, and a group replays the one with the fewest slots holding its images. ``None``: powers of two
    below ``max_images_per_graph`` and that number for such kernels, else ``max_images_per_graph`` alone; explicit
    counts must lie in 1..``max_images_per_graph``, which is always added.

    ``measure_products=True``: captures run the tower's matrix products as the backend's ``product_chooser()``
    picks them, by measurement at each shape's first call outside a capture (a plain capture's warm-up, a compiled
    capture's first compiled forward; CUDA: the fastest cuBLASLt configuration per shape,
    ``hwgraph_cuda.products``). Compiled captures hold them as opaque custom ops (``hwgraph.products``). Eager
    calls keep ATen's; where the backend cannot choose (``products_support()``), every capture does, and
    ``stats()['products']`` says why, as it says what chose them otherwise.
    """

    def __init__(self, tower, device=None, dtype=None, budgets=None, max_images_per_graph=None,
                 graph_backend=None, attention=None, calibrate=None, max_budget=None, verify=True,
                 log_every=1000, compile=False, slot_counts=None, measure_products=False, graph_mode=None):
        check_tower(tower)
        check_materialised(tower)
        check_attention_request(attention)
        budget_rules.check_flag("calibrate", calibrate, allow_none=True)
        for name, flag in (("verify", verify), ("compile", compile), ("measure_products", measure_products)):
            budget_rules.check_flag(name, flag)
        if not budget_rules.is_int(log_every) or log_every < 0:
            raise ValueError(f"log_every must be an int >= 0 (0: never log stats), got {log_every!r}")
        first = next(tower.parameters())
        device = checked_device(device, "device", "a graph manager") if device is not None else first.device
        dtype = graph_dtype(dtype) if dtype is not None else first.dtype
        # Every argument is checked before the tower is changed (moved, given a kernel): the tower may be shared.
        platform = platform_for(device)
        backend = create_backend(graph_backend, device=device, mode=graph_mode, platform=platform)
        if device.index is None and backend.device.type == device.type and backend.device.index is not None:
            # "cuda" is the GPU current now, as the backend resolved it: encode() keeps to it (its copies, streams and
            # eager calls) if the caller makes another GPU current later
            device = backend.device
        if calibrate is None:
            calibrate = budgets is None and backend.accelerates
        if budgets is None:
            cap = budget_rules.CALIBRATION_CAP if calibrate else budget_rules.DEFAULT_CAP
            budgets = budget_rules.auto_budgets(cap if max_budget is None else budget_rules.check_cap(max_budget))
        elif max_budget is not None:
            raise ValueError(f"max_budget={max_budget!r} caps inferred budgets; with budgets={budgets!r} given, "
                             f"leave it unset")
        budgets = budget_rules.int_list("budgets", budgets, "merged-token counts")
        if max_images_per_graph is None:
            max_images_per_graph = min([budget_rules.DEFAULT_MAX_IMAGES, *budgets])
        self.budgets = budget_rules.validate_budgets(budgets, max_images_per_graph)
        # refused now, not as a logged capture failure of that budget once capture() runs
        too_large = budget_rules.patch_rows_refusal(self.budgets[-1], tower.spatial_merge_size)
        if too_large:
            raise ValueError(f"budget {self.budgets[-1]} is too large: {too_large}")
        self.max_images = max_images_per_graph = int(max_images_per_graph)
        if slot_counts is not None:
            slot_counts = budget_rules.validate_slot_counts(slot_counts, max_images_per_graph)

        # the kernel too: moving the tower (lossy to a narrower dtype) and then refusing its kernel there changed it
        choice = tower.attention_choice(attention, platform=platform, graph_safe=True, dtype=dtype)

        self.tower, self.device, self.dtype, self.platform, self.backend = tower, device, dtype, platform, backend
        if first.device != self.device or first.dtype != self.dtype:
            tower.to(device=self.device, dtype=self.dtype)
        tower.eval()
        # chosen above for this platform and dtype (the head dim does not move): applied, not chosen a second time
        tower.apply_attention_choice(choice)
        self._kernel = tower.attention_fn  # what the graphs run (see _check_tower)
        # its name, for stats(): the tower's may change later (another manager, set_attention), and reading it after
        # a move chooses a kernel again, on the tower
        self._kernel_name = tower.attention_kernel
        tower.weights_moved()  # a move since the key was last read (a weight given new .data) counted first
        self._weights = tower.weights_key()  # where the weights the graphs read live (see _check_tower)
        self.calibrate_on_capture = calibrate
        if slot_counts is None:
            slot_counts = budget_rules.default_slot_counts(max_images_per_graph) \
                if self.tower.attention_spec.slot_bound else [max_images_per_graph]
        self.slot_counts = budget_rules.validate_slot_counts(slot_counts, max_images_per_graph)
        self.verify = verify
        self.compile = compile
        self.measure_products = measure_products
        self._chooser = None  # measure_products=True: the backend's product chooser, once capture() found one
        self._products_mark = None  # the chooser's mark() when this manager took it
        self.log_every = log_every
        self.graphs: dict[int, BudgetGraph] = {}
        self.pool = None
        self._stats = ManagerStats()
        self._calls = 0
        self._padded: dict = {}  # (grid, budget) -> padded host metadata, least recently used first
        self._block_forward = None  # compile=True: the compiled block forward, shared by every budget
        self._closed = False
        # The graphs share their static buffers' pool: one encode() at a time fills, replays and copies out (threads),
        # and each waits on the device for the last one's copy out (streams: see _replay). stats() takes its turn too;
        # reentrant, so that a logging handler reading stats() inside a call's own log record does not deadlock.
        self._lock = threading.RLock()
        runtime = device_runtime(self.device)
        self._runtime = runtime if hasattr(runtime, "Event") and hasattr(runtime, "current_stream") else None
        self._buffers_read = None  # recorded after the last replay's copy out, on its stream
        self._rng = torch.Generator().manual_seed(0)  # capture's random inputs: the caller's global RNG stays as it was

    def _random_pixels(self, rows: int) -> torch.Tensor:
        """Random pixel rows for capture, verification and calibration, from the manager's own generator."""
        return torch.randn(rows, self.tower.patch_row_width, generator=self._rng, device="cpu").to(self.device,
                                                                                                    self.dtype)

    # ---------------------------------------------------------------- capture
    @property
    def merge_area(self) -> int:
        return self.tower.spatial_merge_size ** 2

    def capture_refusal(self) -> str | None:
        """Why this backend/kernel pair must stay eager, or None."""
        if not self.tower.attention_spec.graph_safe:
            return f"attention kernel {self.tower.attention_kernel} is not graph-safe"
        return None

    def _check_tower(self, what: str) -> None:
        """``RuntimeError`` when the tower's weights were moved (``to``, ``half``, another manager's dtype or device, a
        parameter replaced: ``tower.weights_key()``) since this manager was built: its graphs would read freed
        memory, its eager calls the wrong dtype."""
        if self._closed:
            raise RuntimeError(f"{what} after close()")
        if self.tower.weights_key() != self._weights:
            raise RuntimeError(
                f"{what}: the tower's weights were moved since this manager was built for {self.dtype} on "
                f"{self.device} (the tower is now {self.tower.dtype} on {self.tower.device}; another manager with "
                f"another dtype or device, or tower.to(), moves it, and so does a parameter or buffer given a new "
                f"tensor or new .data, or its storage resized), so its graphs would read freed memory. close() this "
                f"manager and build a new one on the tower as it is now")
        if self.tower.attention_fn is not self._kernel:
            # Its eager calls would run the other kernel, and the CPU backend's replays (and compiled code's guards)
            # too: a compiled replay recompiled on the replay path.
            raise RuntimeError(
                f"{what}: the tower's attention kernel is now {self.tower.attention_kernel}, not the one this "
                f"manager's graphs run ({self._kernel_name}): another manager on the "
                f"same tower chose another kernel, or tower.set_attention() was called. close() this manager and "
                f"build one per kernel, on its own tower (e.g. hwgraph.bench.kernel_view)")

    def capture(self) -> dict[int, BudgetGraph]:
        """Capture every budget, largest first, into one shared pool; failures leave that budget eager.

        Like ``torch.cuda.graph`` (whose default capture mode is global), ``capture()`` must not overlap device work
        of other threads in the process: the capture stream is the process's (one per device; the DeepStack mergers'
        side stream is the calling thread's), and with ``measure_products`` the product chooser is active for the
        whole process while it runs (``products.chosen_by``). ``encode()`` may be called from any thread once it has
        returned."""
        with self._lock, caller_state_off(self.device):
            return self._capture()

    def _capture(self) -> dict[int, BudgetGraph]:
        self._check_tower("capture()")
        refusal = self.capture_refusal()
        if refusal:
            log.warning("no graphs captured, every call runs eagerly: %s", refusal)
            for b in self.budgets:
                self._stats.capture_failures[b] = refusal
            return self.graphs
        if self.pool is None:  # a pool handle may be falsy (an int id)
            self.pool = self.backend.new_pool()
        if self.compile:  # before anything compiles, the rounding probe included: one Triton cache folder for all
            pin_triton_cache_dir(self.backend.device)
        compiled = self.compile and self._compile_supported()
        if self.measure_products and self._chooser is None:
            self._chooser = self._product_chooser()
            # the chooser is the process's: this manager's stats describe what it did from here on
            self._products_mark = self._chooser.mark() if self._chooser is not None else None
            self._stats.products_measured = self._chooser is not None
        numerics = self.backend.numerics_settings(self.dtype)
        for budget in sorted(self.budgets, reverse=True):
            if budget in self.graphs:
                if self.graphs[budget].numerics == numerics:
                    continue
                log.info("budget %d was captured under other numerics settings (%s): capturing it again", budget,
                         budget_rules.settings_changes(self.graphs[budget].numerics, numerics))
                # its last replay, queued on another stream, may still read the buffers released here: the capture's
                # own buffers, allocated on this stream next, may take their memory
                self._after_last_replay()
                self.graphs.pop(budget).release()
                self._forget_costs(budget)
            try:
                self.graphs[budget] = self._capture_budget_compiled(budget) if compiled else \
                    self._capture_budget(budget)
                self.graphs[budget].numerics = numerics
                self._stats.capture_failures.pop(budget, None)  # an earlier capture() may have failed it
            except Exception as exc:  # a failed capture is a logged fallback, never a wrong answer
                reason = f"{type(exc).__name__}: {exc}"
                self._stats.capture_failures[budget] = reason
                log.warning("capture of budget %d failed on %s/%s, it stays eager: %s", budget,
                            self.backend.name, self.tower.attention_kernel, reason)
                self.backend.synchronize()
        if compiled and not any(entry.compile_seconds is None and budget not in self._stats.compile_failures
                                for budget, entry in self.graphs.items()):
            # an earlier capture() skipped compiling (e.g. under TORCH_COMPILE_DISABLE=1); no graph it captured plain
            # is held now
            self._stats.compile_skipped = None
        if self._chooser is not None:
            self._stats.products = self._chooser.describe(since=self._products_mark)
            log.info("matrix products on %s: %s", self.backend.name, self._stats.products)
        if self.calibrate_on_capture and self.graphs:
            self.calibrate()
        log.info("captured budgets %s (slot counts %s) on %s/%s; memory per budget (MiB): %s", sorted(self.graphs),
                 self.slot_counts, self.backend.name, self.tower.attention_kernel,
                 {b: round(g.memory_bytes / 2**20, 1) for b, g in sorted(self.graphs.items())})
        return self.graphs

    def _compile_supported(self) -> bool:
        """compile=True on a backend where inductor cannot run, in a process where torch.compile is disabled, or where
        inductor's code would not round this dtype's intermediates as eager does (the CPU's up to torch 2.11): plain
        capture, with the reason logged and kept."""
        support = self.backend.compile_support()
        if support.ok:
            support = dynamo_enabled()
        if support.ok:
            support = inductor_rounds_as_eager(self.backend.device, self.dtype)
        if not support.ok:
            self._stats.compile_skipped = support.describe()
            log.warning("compile=True on %s: %s; capturing without torch.compile", self.backend.name,
                        support.describe())
        return support.ok

    def _product_chooser(self):
        """measure_products=True: the backend's product chooser, or None with the reason logged and kept."""
        support = self.backend.products_support()
        if not support.ok:
            self._stats.products = f"ATen's: {support.describe()}"
            log.warning("measure_products=True on %s: %s; capturing ATen's matrix products", self.backend.name,
                        support.describe())
            return None
        try:
            return self.backend.product_chooser()
        except Exception as exc:  # e.g. cublasLtCreate failing after the gate passed: ATen's products, as refused
            reason = f"{type(exc).__name__}: {exc}"
            self._stats.products = f"ATen's: the product chooser failed to start: {reason}"
            log.warning("measure_products=True on %s: the product chooser failed to start (%s); capturing ATen's "
                        "matrix products", self.backend.name, reason)
            return None

    def _capture_budget_compiled(self, budget: int) -> BudgetGraph:
        """A compiled capture; if compiling or capturing it fails, the plain capture of that budget, logged. The
        budget's capture seconds then count the failed attempt too: they are its whole startup."""
        start = time.perf_counter()
        try:
            entry = self._capture_budget(budget, compiled=True)
            self._stats.compile_failures.pop(budget, None)  # an earlier capture() may have failed it
            return entry
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        # Past the except clause, so the failed attempt's exception is gone, and with it (through its traceback's
        # frames) the tensors it allocated in the shared pool, before the same budget is captured again.
        self._stats.compile_failures[budget] = reason
        log.warning("compiled capture of budget %d failed on %s/%s, capturing it without torch.compile: %s",
                    budget, self.backend.name, self.tower.attention_kernel, reason)
        self.backend.synchronize()
        entry = self._capture_budget(budget)
        entry.capture_seconds = self._stats.capture_seconds_per_budget[budget] = time.perf_counter() - start
        return entry

    def _compiled_block_forward(self):
        """The tower's block forward compiled once (``torch.compile(dynamic=False)``) and shared by every block and
        budget: identical blocks reuse one compiled graph per shape (two per budget: the last block differs; the
        slot count is a dynamic dimension), so compilation traces one block instead of the whole tower. Fixed
        shapes per budget; inductor fuses the small kernels, then the backend captures the result (its warm-up run
        compiles). Attention stays one opaque torch.library op inside the compiled graph."""
        if self._block_forward is None:
            self._block_forward = compile_block_forward(self.tower.block_forward())
        return self._block_forward

    def _capture_budget(self, budget: int, compiled: bool = False) -> BudgetGraph:
        """Capture ``budget`` once per slot count (``budget_capture.capture_budget``), each graph verified against
        eager when ``verify`` is on; its memory and seconds join the stats."""
        entry = capture_budget(self.tower, self.backend, self.pool, budget, device=self.device,
                               slot_counts=self.slot_counts, max_images=self.max_images,
                               random_pixels=self._random_pixels, chooser=self._chooser,
                               block_forward=self._compiled_block_forward() if compiled else None,
                               num_budgets=len(self.budgets), verify=self._verify if self.verify else None)
        self._stats.capture_bytes_per_budget[budget] = entry.memory_bytes
        self._stats.capture_seconds_per_budget[budget] = entry.capture_seconds
        if entry.compile_seconds is not None:
            self._stats.compile_seconds_per_budget[budget] = entry.compile_seconds
        return entry

    def _verify(self, entry: BudgetGraph, graph: CapturedGraph, host, grid) -> None:
        """Replay once on fresh inputs and compare with eager: a capture that replays wrongly is refused."""
        pixels = self._random_pixels(entry.num_patches)
        self._fill(entry, pixels, host)
        graph.replay()
        with torch.inference_mode():
            eager = self.tower.forward(pixels, grid)
        want = torch.stack(eager.tensors())
        got = graph.outputs[:, : want.shape[1]]
        error = relative_error(got, want)
        if not error <= VERIFY_TOLERANCE.get(self.dtype, 1e-4):
            raise CaptureError(f"replay differs from eager after capture: relative error {error:.3g} "
                               f"(tolerance {VERIFY_TOLERANCE.get(self.dtype, 1e-4)} for {self.dtype})")

    # ---------------------------------------------------------------- dispatch
    def select_graph(self, grid: tuple[tuple[int, int, int], ...], tokens: int) -> tuple[BudgetGraph | None, str]:
        """The smallest captured graph holding every image, or None and why the group goes eager: also when that
        graph was captured under other numerics settings than the backend's now (``numerics_settings``, e.g. CUDA's
        TF32 setting changed since), since its replay would keep the old ones."""
        budget, why = budget_rules.single_replay_budget(self.graphs, len(grid), tokens, self.max_images,
                                                        video=any(t != 1 for t, _, _ in grid),
                                                        failed=[b for b in self._stats.capture_failures
                                                                if b in self.budgets])
        if budget is None:
            return None, why
        entry = self.graphs[budget]
        numerics = self.backend.numerics_settings(self.dtype)
        if entry.numerics != numerics:
            if not entry.numerics_warned:
                entry.numerics_warned = True
                log.warning("budget %d was captured under other numerics settings than now (%s): its groups run "
                            "eagerly until capture() captures it again", budget,
                            budget_rules.settings_changes(entry.numerics, numerics))
            return None, budget_rules.NUMERICS_CHANGED
        return entry, why

    # In a caller's compiled code: a graph break, never traced (host work, a lock, graphs' replays).
    @torch.compiler.disable(reason="EncoderGraphManager.encode() replays device graphs and runs host work: it runs "
                                   "eagerly, as a graph break (fullgraph=False)")
    def encode(self, pixel_values: torch.Tensor, grid_thw) -> list:
        """Encode one step's images; returns one ``VisionOutput`` per image, in the caller's order.

        ``pixel_values``: ``[patches, patch_row_width]`` rows of every image in order; ``grid_thw``: ``(t, h, w)``
        patch grids (host list or int tensor on the host). Work queues on the caller's current stream. Calls from
        several threads run one at a time, and a replay on one stream waits on the device for the previous replay's
        copy out on another: the graphs' static buffers are the manager's. The caller's autocast and autograd do not
        apply (a graph replays what it captured): outputs are in the manager's dtype, and inference tensors only when
        the caller is in inference mode, whichever path served them.
        """
        with self._lock, caller_state_off(self.device):
            self._check_tower("encode()")
            if pixel_values is None:  # prepare_metadata checks pixels only when given some
                raise ValueError(f"pixel_values must be a floating-point torch.Tensor [patches, "
                                 f"{self.tower.patch_row_width}], got None")
            host = self.tower.prepare_metadata(grid_thw, pixel_values)  # pixels checked before the tables are built
            grid = host.grid_thw  # normalised: a tuple of (t, h, w) int triples
            tokens = int(host.num_tokens)
            entry, why = self.select_graph(grid, tokens)
            if entry is None:
                outputs = self._eager(pixel_values, host, why, len(grid))
            else:
                outputs = self._replay(entry, pixel_values, host, tokens, len(grid))
            self._calls += 1  # a served call: one replay or one eager group (a call that raised counts in neither)
            if self.log_every and self._calls % self.log_every == 0:
                log.info("encoder graph stats after %d calls: %s", self._calls, self._stats_snapshot())
            return outputs

    def _eager(self, pixel_values, host, why: str, count: int) -> list:
        # no_grad (encode's), not inference mode: outputs like the replay path's copies, which a caller outside
        # inference mode may update in place or use with autograd
        out = self.tower.forward_with_metadata(self._to_device(pixel_values), host)
        self._stats.misses += count
        self._stats.eager_groups += 1
        self._stats.eager_reasons[why] = self._stats.eager_reasons.get(why, 0) + 1
        return out.split(list(host.token_counts))

    def _replay(self, entry: BudgetGraph, pixel_values, host, tokens: int, count: int) -> list:
        slots, graph = entry.graph_for(host.num_seqs)
        stream = self._after_last_replay()
        try:
            self._fill(entry, pixel_values, host)
            graph.replay()
            # One copy out of the graph's buffer: the next replay overwrites it, and rows past `tokens` are padding.
            group = graph.outputs[:, :tokens].clone()
            # every weight looked at while the device runs the replay; the key compared whatever this look found, as
            # another manager's look on the same tower may have found a move first
            self.tower.weights_moved()
            self._check_tower("encode()")  # raises where the replay read the old addresses
        finally:
            # also when a step raised (the copy out of the graph ran out of memory): what it queued still writes or
            # reads the buffers, and the metadata it filled is skipped by the next call as already there
            self._buffers_read_on(stream)
        self._stats.hits += count
        self._stats.replays += 1
        self._stats.padding_tokens += entry.budget - tokens
        self._stats.replays_per_budget[entry.budget] = self._stats.replays_per_budget.get(entry.budget, 0) + 1
        self._stats.replays_per_slots[slots] = self._stats.replays_per_slots.get(slots, 0) + 1
        return self.tower.output_type(group[0], tuple(group[1:])).split(list(host.token_counts))

    def _after_last_replay(self):
        """The caller's current stream (None without streams), made to wait on the device for the last replay's fill,
        replay and copy out, which may have queued on another stream: the graphs' buffers are shared, and the
        metadata that ``_fill`` skips as already filled is there only then."""
        stream = self._runtime.current_stream(self.device) if self._runtime is not None else None
        if stream is not None and self._buffers_read is not None:
            stream.wait_event(self._buffers_read)
        return stream

    def _buffers_read_on(self, stream) -> None:
        """Mark the end of the work on ``stream`` that fills and reads the graphs' buffers (``_after_last_replay``)."""
        if stream is not None:
            if self._buffers_read is None:
                self._buffers_read = self._runtime.Event()
            self._buffers_read.record(stream)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device or tensor.device.type == self.device.type == "cpu":
            # already there ("cpu" and "cpu:0" are one device): a cast at most, which names no device, since a
            # blocking .to(device) is a copy to the host on the emulated device (its sync guard rejects it)
            return tensor.to(dtype=self.dtype)
        if tensor.device.type == "cpu" and self.device.type != "cpu":
            tensor = pinned_copy(tensor, self.dtype)  # an async H2D copy; a pageable one would block the host
        # To the host, a non-blocking copy lands in pinned memory and returns before the data has: the CPU forward
        # would read it half-copied (a CPU manager given GPU pixels).
        return tensor.to(self.device, self.dtype, non_blocking=self.device.type != "cpu")

    def _fill(self, entry: BudgetGraph, pixel_values: torch.Tensor, host) -> None:
        """Copy this call's inputs into the graph's static buffers (no device-to-host reads).

        Metadata depends only on the grid: when the buffers already hold this grid's (only ``_fill`` writes them)
        the copy is skipped, and padded host metadata is kept per (grid, budget) for grids seen recently, so a
        repeated image size costs no host work beyond the pixel copy."""
        patches = pixel_values.shape[0]
        if pixel_values.device.type == "cpu" and self.device.type != "cpu":
            # As the eager path does. From pageable memory the driver stages the copy itself: on the H200 a 600 KB
            # copy did not wait for earlier work (docs/benchmarks.md, session 39), but a pinned source never does.
            pixel_values = pinned_copy(pixel_values, entry.pixels.dtype)  # cast there, not into pageable memory
        entry.pixels[:patches].copy_(pixel_values, non_blocking=self.device.type != "cpu")  # as in _to_device
        grid = host.grid_thw
        if entry.filled_grid == grid:
            return
        key = (grid, entry.budget)
        padded = self._padded.pop(key, None)
        if padded is None:
            padded = host.padded(entry.num_patches, self.max_images)
            if self.device.type != "cpu":
                padded = padded.pin_memory()  # a pageable host-to-device copy would wait for the stream to drain
        self._padded[key] = padded  # most recently used last
        while len(self._padded) > PADDED_CACHE_SIZE:
            self._padded.pop(next(iter(self._padded)))
        entry.filled_grid = None  # in case the copy fails half-way
        entry.metadata.copy_from(padded)
        entry.filled_grid = grid

    # ---------------------------------------------------------------- calibration
    def time_ms(self, fns: dict, warmup: int = 3, samples: int = 10) -> dict[str, float]:
        """Median milliseconds of each of ``fns`` on this backend (device events on accelerators, wall clock on CPU),
        sampled side by side in balanced rounds (``measure_interleaved``), so that neither is favoured by when it
        ran."""
        return {name: lat.median for name, lat in
                measure_interleaved(fns, self.device, warmup=warmup, samples=samples).items()}

    def calibrate(self, warmup: int = CALIBRATION_TIMING["warmup"],
                  samples: int = CALIBRATION_TIMING["samples"]) -> dict:
        """Time each captured budget's replay against eager here; the cap becomes the largest budget whose replay
        wins, and every budget up to it is kept (the rest are released, and with no winner every call runs
        eagerly). Returns the findings, per budget: ``eager_ms``, ``replay_ms``, ``kept``. Needs captured graphs
        (``capture()`` calibrates itself when ``calibrate`` is on)."""
        for name, value, low in (("warmup", warmup, 0), ("samples", samples, 1)):
            if not budget_rules.is_int(value) or value < low:
                raise ValueError(f"calibrate(): {name} must be an int >= {low}, got {value!r}")
        # its replays fill the graphs' buffers, as encode() does; close() waits for it
        with self._lock, caller_state_off(self.device):
            self._check_tower("calibrate()")
            if not self.graphs:
                raise RuntimeError(f"calibrate() {self._no_graphs_reason()}")
            return self._calibrate(warmup, samples)

    def _no_graphs_reason(self) -> str:
        """Why there is no captured graph to calibrate, and what would make one: ``capture()`` only where it could."""
        refusal = self.capture_refusal()
        if refusal:
            return f"has no captured graphs: nothing can be captured: {refusal}, so every call runs eagerly"
        if not self.budgets:  # an earlier calibration released every budget, which capture() does not bring back
            return ("has no captured graphs: an earlier calibration kept no budget (no replay beat eager: "
                    "stats()['calibration']), so every call runs eagerly; build a new manager to capture budgets "
                    "again")
        failed = {b: why for b, why in sorted(self._stats.capture_failures.items()) if b in self.budgets}
        if failed:
            return f"needs captured graphs: every budget's capture failed ({failed}); call capture() again to retry"
        return ("needs captured graphs: call capture() first (no budget is captured, so there is no replay to time "
                "against eager)")

    def _calibrate(self, warmup: int, samples: int) -> dict:
        # its replays fill the buffers an encode() on another stream may still be reading, and leave them holding
        # its own grids, as encode()'s replays do
        stream = self._after_last_replay()
        findings = {}
        for budget in sorted(self.graphs):
            entry = self.graphs[budget]
            grid = [budget_rules.filling_grid(budget, self.tower.spatial_merge_size)]
            host = self.tower.prepare_metadata(grid)
            pixels = self._random_pixels(entry.num_patches)

            def eager(pixels=pixels, host=host):
                with torch.inference_mode():
                    self.tower.forward_with_metadata(pixels, host)

            def replay(entry=entry, pixels=pixels, host=host):
                self._fill(entry, pixels, host)
                entry.graph_for(host.num_seqs)[1].replay()

            try:
                timed = self.time_ms({"eager": eager, "replay": replay}, warmup, samples)
            finally:  # a timing that raised may have filled and replayed too (see _replay)
                self._buffers_read_on(stream)
            eager_ms, replay_ms = timed["eager"], timed["replay"]
            findings[budget] = {"eager_ms": eager_ms, "replay_ms": replay_ms}
        cap = max((b for b, f in findings.items() if f["replay_ms"] < f["eager_ms"]), default=None)
        for budget, f in findings.items():
            f["kept"] = cap is not None and budget <= cap
            if not f["kept"]:
                self.graphs.pop(budget).release()
                self._forget_costs(budget)
        self.budgets = sorted(b for b in self.budgets if cap is not None and b <= cap)
        self._stats.calibration = findings
        log.info("calibration on %s/%s: %s; cap %s", self.backend.name, self.tower.attention_kernel,
                 {b: (round(f["eager_ms"], 3), round(f["replay_ms"], 3), f["kept"]) for b, f in findings.items()},
                 cap)
        if cap is None:
            log.warning("calibration on %s/%s: no budget's replay beat eager; every call runs eagerly",
                        self.backend.name, self.tower.attention_kernel)
        return copy.deepcopy(findings)  # the caller's to change, not the manager's stats

    def _forget_costs(self, *budgets: int) -> None:
        """Drop the memory and seconds of released budgets (all of them, given none) from the stats, which describe
        the graphs held."""
        for per_budget in (self._stats.capture_bytes_per_budget, self._stats.capture_seconds_per_budget,
                           self._stats.compile_seconds_per_budget):
            for budget in budgets or list(per_budget):
                per_budget.pop(budget, None)

    # ---------------------------------------------------------------- bookkeeping
    def stats(self) -> dict:
        """A copy of the counters, taken between calls: safe from any thread while others encode (a copy taken during
        a call raised "dictionary changed size during iteration", or counted a group before its call)."""
        with self._lock:
            return self._stats_snapshot()

    def _stats_snapshot(self) -> dict:
        out = self._stats.as_dict()
        out.update(budgets=sorted(self.graphs), slot_counts=list(self.slot_counts), graph_backend=self.backend.name,
                   graph_mode=self.backend.mode, attention=self._kernel_name, calls=self._calls,
                   images=self._stats.hits + self._stats.misses)
        return out

    def close(self) -> None:
        """Release every graph, its static buffers and the pool (after an encode() in flight has finished)."""
        with self._lock:
            # first: the last replay may still be reading the buffers on the device, and memory released before it
            # has may be handed to another allocation on their stream at once
            self.backend.synchronize()
            for entry in self.graphs.values():
                entry.release()
            self.graphs.clear()
            self._padded.clear()
            self.pool = None
            # compile=True: the compiled code and dynamo's cache of it (the tower's guards) go too (a closed manager
            # captures nothing again: capture() after close() raises)
            self._block_forward = None
            self._forget_costs()  # as calibrate() does for the budgets it releases
            self.backend.empty_cache()  # cuBLAS's per-stream workspaces stay: other live graphs may use them
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
