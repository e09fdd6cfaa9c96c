"""Measured cuBLASLt algorithms for the tower's matrix products in captured graphs (``hwgraph.products``).

ATen runs a product with a bias (``F.linear``; fc1's ``torch._addmm_activation`` with the tanh GELU as epilogue)
through ``cublasLtMatmul`` with the first algorithm ``cublasLtMatmulAlgoGetHeuristic`` returns, which the heuristic
ranks by an estimate. On the H200 another of its candidates is faster for some of the tower's shapes (fc2 at 1024
rows: 18.2 against 21.0 µs; qkv, proj and fc1 at 4096 rows: 5-8% at the power limit; ``benchmarks/cublaslt_algos.py``).
PyTorch's TunableOp measures alternatives only on ROCm builds.

The heuristic's list is not all cuBLASLt can run. Each candidate's algorithm also takes the other tiles and cluster
shapes it lists among its capabilities, and some of those are faster still: fc1 + GELU at 4096 rows 59.2 µs with
128x128 tiles in 2x1 clusters, against ATen's 72.3 and the heuristic's best 69-75 (``benchmarks/cublaslt_space.py``).

``MeasuredProducts`` is the CUDA plugin's product chooser. At a shape's first call outside a capture (the manager's
warm-up) it gathers the heuristic's candidates without a workspace (the graphs capture without one) and those
configurations (``cublaslt.LtProduct.configurations``), drops any that cuBLASLt rejects or that is less accurate than
ATen's call against the float64 product, and ranks the rest in the rounds of ``RANKING``: one call each
(``MeasuredProducts.sweep``), then the 64 fastest with 3 calls each, then the 16 fastest of those with 5 calls each,
best of two passes. It times the ``SHORTLIST`` fastest of the last round and ATen's call in interleaved replays of
CUDA graphs, captured without a cuBLASLt workspace as the manager's are (``graphed_as_captured``). The fastest is
kept for the process, and in the cache between processes (``hwgraph_cuda.product_cache``); ATen's call stays where
nothing beats it by ``MARGIN``. cuBLASLt is called through ctypes on the ``libcublasLt`` that torch has loaded
(``hwgraph_cuda.cublaslt``): nothing is built. The descriptors of the ``DESCRIPTORS`` products last used are kept;
older ones are destroyed.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hwgraph.attention.varlen_inputs import records_grad
from hwgraph.budget_capture import relative_error
from hwgraph.capability import Capability
from hwgraph.graphs.torch_cuda import environment_defaults
from hwgraph.products import aten_linear_gelu_tanh
from hwgraph.timing import graphed_calls, measure_interleaved, ready_side_stream, side_stream
from hwgraph_cuda import cublaslt
from hwgraph_cuda.graphs import CudaGraphBackend
from hwgraph_cuda.product_cache import ChoiceCache, cache_path

log = logging.getLogger(__name__)

SWEEP_CHUNK = 64  # configurations launched behind one sleep in the sweep
FIRST_HOST_US_PER_CALL = 40.0  # host time assumed to launch one call in a sweep (and its share of an event),
# until measured: twice the 17 µs measured on the H200's host (``benchmarks/launch_queue.py``)
SLEEP_CYCLES_PER_US = 2_500  # above any SM clock in MHz: a sleep of this many cycles a µs lasts at least that long
SHORTLIST = 4  # the ranking's fastest, timed again against ATen's call in graphs
RANKING = ((1, 1, 64), (3, 1, 16), (5, 2, SHORTLIST))  # rounds of sweeps: (back-to-back calls per configuration,
# passes, fastest kept for the next round); the first round (the sweep) takes every accurate configuration, the
# later ones (the screen) the previous round's kept. With a 3-call sweep keeping 16, the screen's four fastest were
# among the sweep's first 9 in 34 of 35 shapes and its first 16 in all, and its 64th configuration took at least 1.16
# times the fastest's time (H200, ``benchmarks/products_startup.py --dump``).
CALLS = 20  # product calls per timed graph
MARGIN = 0.01  # a candidate replaces ATen's call only if it is this much faster
PHASES = ("configurations", "errors", "sweep", "screen", "timing")  # the parts of measuring a shape (``describe``)
DESCRIPTORS = 4096  # products whose cuBLASLt descriptors are kept (``MeasuredProducts.descriptor``): one per weight,
# bias and row count, so the 27-block tower captured at 9 budgets (64 to 16384 tokens) uses 9 x 117 = 1053 of them
# (patch embedding, 4 per block, 2 per merger): this keeps about four such towers', where unbounded every new tower
# (or weights moved to new addresses) added its own for the process's life


def products_support(device: torch.device) -> Capability:
    if device.type != "cuda":
        return Capability.unavailable(f"measured products run on CUDA devices, not {device.type}")
    lib, reason = cublaslt.cublaslt()
    return Capability.available() if lib is not None else Capability.unavailable(reason)


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def graphed_as_captured(fns: dict) -> dict:
    """``graphed_calls(fn, CALLS)`` of each of ``fns``, captured under the CUDA plugin's ``capture_environment`` as
    the manager's graphs are. PyTorch reads ``CUBLASLT_WORKSPACE_SIZE`` at each cuBLASLt call, and with a workspace
    ATen's call to a larger product captures a dynamically scheduled kernel and a memset node, which the manager's
    graphs do not hold (``hwgraph_cuda.graphs``). Each runs once first on ``graphed_calls``' stream with the
    process's setting, as the manager's warm-up does, so that stream's workspaces are made at full size before a
    capture asks for none."""
    stream = side_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns.values():
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    with environment_defaults(CudaGraphBackend.capture_environment):
        return {key: graphed_calls(fn, CALLS) for key, fn in fns.items()}


class PhaseClock:
    """Seconds since the last lap, added to ``totals[phase]`` and to this clock's own seconds of ``phase`` at each
    ``lap``; ``str`` lists this clock's seconds per phase (a phase lapped again, as the screen's rounds are, sums)."""

    def __init__(self, totals: dict[str, float]):
        self.totals, self.laps, self.last = totals, {}, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self.last
        self.totals[phase] += now - self.last
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in self.laps.items()) or "nothing"


@dataclass
class Choice:
    algo: cublaslt.Algo | None  # None: ATen's call
    config: str | None  # the algorithm's configuration (``cublaslt.describe_algo``)
    aten_us: float
    chosen_us: float
    recalled: bool = False  # taken from the cache of an earlier process, not measured in this one

    def entry(self) -> dict:
        """The cache's record: the algorithm as its bytes (cuBLASLt's ``cublasLtMatmulAlgo_t`` is plain data, valid
        with the same library, which the cache's setting names), its configuration for people, and the timings."""
        return {"algo": None if self.algo is None else bytes(self.algo).hex(), "config": self.config,
                "aten_us": self.aten_us, "chosen_us": self.chosen_us}


@dataclass(frozen=True)
class Mark:
    """A ``MeasuredProducts``' totals at ``mark()``: ``describe(since=mark)`` reports what it did after."""

    shapes: int  # choices made, in order
    seconds: float
    phases: dict[str, float]


# The version of how choices are measured, in every cache entry's setting: bump it whenever what a measurement
# decides changes (RANKING, MARGIN, CALLS, the configurations tried, how ATen's call is timed), so that choices an
# earlier method made (ATen's call among them, recalled unchecked) are measured again rather than kept for good.
METHOD_VERSION = 2


class MeasuredProducts:
    """The product chooser of CUDA graphs (``hwgraph.products.ProductChooser``) on one GPU: per shape (rows, K, N,
    dtype, epilogue), the measured fastest of cuBLASLt's candidates, or one an earlier process measured on the same
    GPU with the same libraries (``ChoiceCache``; checked for accuracy again). It takes 2-D products with a bias, all
    in bf16 or fp16, contiguous and 256-byte aligned, that autograd does not record (``takes``); anything else, and a
    shape first met inside a capture (measuring needs synchronisation), runs ATen's call."""

    def __init__(self, lib, device: torch.device, path: Path | None = None):
        self.lib, self.device = lib, device
        with torch.cuda.device(device):
            self.handle = ctypes.c_void_p()
            cublaslt.check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
            major, minor = torch.cuda.get_device_capability(device)
            setting = (f"{torch.cuda.get_device_name(device)} (sm_{major}{minor}), "
                       f"cuBLASLt {lib.cublasLtGetVersion()}, torch {torch.__version__}, method {METHOD_VERSION}")
        self.cache = ChoiceCache(path, setting)
        self.descriptors: OrderedDict[tuple, cublaslt.LtProduct] = OrderedDict()  # least recently used first
        self.choices: dict[tuple, Choice] = {}
        self.seconds = 0.0
        self.phases = dict.fromkeys(PHASES, 0.0)  # seconds of measuring, per phase (``measure``)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.takes(x, weight, bias):
            return F.linear(x, weight, bias)
        return self.product(x, weight, bias, gelu=False)

    def linear_gelu_tanh(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.takes(x, weight, bias):
            return aten_linear_gelu_tanh(x, weight, bias)
        return self.product(x, weight, bias, gelu=True)

    def takes(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether its cuBLASLt call can run this product. Not while autograd records through it (``records_grad``):
        that call has no backward, so its result would come back without a history and the gradients go missing."""
        if (bias is None or x.dim() != 2 or x.device != self.device or x.dtype not in cublaslt.DATA_TYPES
                or x.shape[0] == 0 or records_grad(x, weight, bias)):
            return False
        tensors = (x, weight, bias)
        return (weight.dim() == 2 and x.shape[1] == weight.shape[1] and bias.shape == (weight.shape[0],)
                and all(t.dtype == x.dtype and t.device == x.device and t.is_contiguous()
                        and t.data_ptr() % cublaslt.ALIGNMENT == 0 for t in tensors))

    def product(self, x, weight, bias, gelu: bool) -> torch.Tensor:
        rows, (n, k) = x.shape[0], weight.shape
        shape = (rows, k, n, x.dtype, gelu)
        # cuBLASLt launches in the current device's context: the chooser's device, whichever the caller has current
        with torch.cuda.device(self.device):
            choice = self.choices.get(shape)
            if choice is None:
                if torch.cuda.is_current_stream_capturing():
                    return self.aten(x, weight, bias, gelu)
                start = time.perf_counter()
                choice = self.recall(x, weight, bias, gelu) or self.measure(x, weight, bias, gelu)
                self.seconds += time.perf_counter() - start
                self.choices[shape] = choice
            if choice.algo is None:
                return self.aten(x, weight, bias, gelu)
            return self.descriptor(weight, bias, rows, gelu).run(choice.algo, x, weight, x.new_empty(rows, n))

    @staticmethod
    def aten(x, weight, bias, gelu: bool) -> torch.Tensor:
        return aten_linear_gelu_tanh(x, weight, bias) if gelu else F.linear(x, weight, bias)

    def descriptor(self, weight, bias, rows: int, gelu: bool) -> cublaslt.LtProduct:
        """The product's descriptors, made at its first call and kept while it is among the ``DESCRIPTORS`` last
        used; the least recently used beyond those is destroyed (``cublaslt.LtProduct.close``). Each caller uses what
        this returns at once, before another lookup could evict it. (ATen destroys its own cuBLASLt descriptors as
        each call returns, captured calls included.)"""
        key = (weight.data_ptr(), bias.data_ptr(), tuple(weight.shape), weight.dtype, rows, gelu)
        product = self.descriptors.get(key)
        if product is not None:
            self.descriptors.move_to_end(key)
            return product
        product = self.descriptors[key] = cublaslt.LtProduct(self.lib, self.handle, weight, bias, rows, gelu)
        while len(self.descriptors) > DESCRIPTORS:
            self.descriptors.popitem(last=False)[1].close()
        return product

    @staticmethod
    def label(x, weight, gelu: bool) -> str:
        return f"{x.shape[0]} x {weight.shape[1]} -> {weight.shape[0]}{' + GELU' if gelu else ''} ({x.dtype})"

    @staticmethod
    def accuracy(x, weight, bias, gelu: bool) -> tuple[torch.Tensor, float]:
        """The float64 product, and the relative error a candidate may have: ATen's, 1.5 times, plus 1e-4.
        ``ValueError`` where ATen's error is not finite (a NaN among the operands, a product past the dtype's range):
        no configuration can be graded on such operands (every one would be outside a NaN bound, within an inf one)."""
        exact = x.double() @ weight.double().t() + bias.double()
        exact = F.gelu(exact, approximate="tanh") if gelu else exact
        error = relative_error(MeasuredProducts.aten(x, weight, bias, gelu), exact)
        if not math.isfinite(error):
            raise ValueError(f"ATen's relative error against the float64 product is {error} on these operands, not "
                             f"finite (a NaN or inf among them, or a product past {x.dtype}'s range): they grade no "
                             f"configuration")
        return exact, 1.5 * error + 1e-4

    def recall(self, x, weight, bias, gelu: bool) -> Choice | None:
        """The cached choice for this shape, if there is one, cuBLASLt still accepts its algorithm and it is still as
        accurate as ATen's call. Whatever fails in checking it (the entry, cuBLASLt, the run) is logged: a miss."""
        label = self.label(x, weight, gelu)
        try:
            entry = self.cache.get(label)
            if entry is None:
                return None
            aten_us, chosen_us = float(entry["aten_us"]), float(entry["chosen_us"])
            if entry["algo"] is None:
                return Choice(None, None, aten_us, chosen_us, recalled=True)
            algo = cublaslt.Algo.from_buffer_copy(bytes.fromhex(entry["algo"]))
            descriptor = self.descriptor(weight, bias, x.shape[0], gelu)
            if not descriptor.accepts(algo):
                reason = "cuBLASLt no longer accepts its algorithm for these operands"
            else:
                exact, bound = self.accuracy(x, weight, bias, gelu)
                # NaN where the run writes nothing: a fresh block may be the one ATen's result was just freed from
                if relative_error(descriptor.run(algo, x, weight, x.new_full(exact.shape, math.nan)), exact) <= bound:
                    return Choice(algo, cublaslt.describe_algo(self.lib, algo), aten_us, chosen_us, recalled=True)
                reason = "its algorithm is less accurate than ATen's call"
        except Exception as exc:  # a choice that cannot be checked is measured again
            reason = f"{type(exc).__name__}: {exc}"
        log.info("the cached choice for %s does not hold (%s); measuring again", label, reason)
        return None

    def measure(self, x, weight, bias, gelu: bool) -> Choice:
        """Rank the heuristic's candidates and the other configurations as accurate as ATen's call (``RANKING``), then
        time the ``SHORTLIST`` fastest and ATen's call interleaved; keep the fastest (see ``MARGIN``). A failure of the
        measurement, a shape none of whose configurations ran, or operands that grade none (``accuracy``) leave the
        shape on ATen's call, logged and not cached. Runs on the chooser's device (``product``)."""
        label, clock = self.label(x, weight, gelu), PhaseClock(self.phases)
        try:
            descriptor = self.descriptor(weight, bias, x.shape[0], gelu)
            candidates = descriptor.candidates()
            algos = [c.algo for c in candidates] + descriptor.configurations(candidates)
            clock.lap("configurations")
            exact, bound = self.accuracy(x, weight, bias, gelu)
            scratch = x.new_empty(exact.shape)
            ran = self.errors(descriptor, algos, x, weight, exact, scratch)
            if not ran:  # nothing to compare ATen's call with: no choice for the cache
                raise RuntimeError(f"none of the {len(algos)} configurations cuBLASLt offered ran")
            accurate = [a for a, error in ran if error <= bound]
            clock.lap("errors")
            ranked = accurate
            for round_, (round_calls, passes, keep) in enumerate(RANKING):
                ranked = self.sweep(descriptor, ranked, x, weight, scratch, round_calls, passes)[:keep]
                clock.lap("screen" if round_ else "sweep")
            calls = {"aten": functools.partial(self.aten, x, weight, bias, gelu)}
            calls |= {i: functools.partial(descriptor.run, a, x, weight, scratch) for i, a in enumerate(ranked)}
            graphs = graphed_as_captured(calls)
            timed = measure_interleaved({key: graph.replay for key, graph in graphs.items()}, self.device,
                                        warmup=3, samples=10)
            del graphs
            clock.lap("timing")
        except Exception as exc:  # a shape that cannot be measured keeps ATen's call
            log.warning("measuring cuBLASLt algorithms for %s failed, it keeps ATen's: %s: %s", label,
                        type(exc).__name__, exc)
            return Choice(None, None, float("nan"), float("nan"))
        us = {key: latency.median * 1e3 / CALLS for key, latency in timed.items()}
        best = min(us, key=us.get)
        if best == "aten" or us[best] > us["aten"] * (1 - MARGIN):
            choice = Choice(None, None, us["aten"], us["aten"])
        else:
            choice = Choice(ranked[best], cublaslt.describe_algo(self.lib, ranked[best]), us["aten"], us[best])
        log.info("matrix product %s: %d of %d configurations as accurate as ATen's call (%.1f µs); %s; measured in "
                 "%s", label, len(accurate), len(algos), choice.aten_us,
                 "kept" if choice.algo is None else f"{choice.config}: {choice.chosen_us:.1f} µs instead", clock)
        self.cache.put(label, choice.entry())
        return choice

    @staticmethod
    def errors(descriptor: cublaslt.LtProduct, algos: list[cublaslt.Algo], x, weight, exact,
               out) -> list[tuple[cublaslt.Algo, float]]:
        """Each configuration's ``relative_error`` against ``exact``, computed on the device with one host read.
        Configurations that cuBLASLt accepted but will not run without a workspace are left out. ``out`` is set to NaN
        before each run, so a configuration that leaves any of it unwritten is not graded on the previous one's
        result: its error is NaN, never within a bound."""
        want, ran, norms = exact.float(), [], []
        for algo in algos:
            out.fill_(math.nan)
            try:
                norms.append(torch.linalg.vector_norm(descriptor.run(algo, x, weight, out).float() - want))
            except RuntimeError:  # cublasLtMatmul's status: nothing was launched
                continue
            ran.append(algo)
        if not ran:
            return []
        errors = (torch.stack(norms) / torch.linalg.vector_norm(want).clamp_min(1e-30)).tolist()
        return list(zip(ran, errors, strict=True))

    @classmethod
    def sweep(cls, descriptor: cublaslt.LtProduct, algos: list[cublaslt.Algo], x, weight, out,
              calls: int = RANKING[0][0], passes: int = 1) -> list[cublaslt.Algo]:
        """``algos`` fastest first, by ``sweep_times``."""
        ms = cls.sweep_times(descriptor, algos, x, weight, out, calls, passes)
        return [algos[i] for i in sorted(range(len(algos)), key=ms.__getitem__)]

    @staticmethod
    def sweep_times(descriptor: cublaslt.LtProduct, algos: list[cublaslt.Algo], x, weight, out,
                    calls: int = RANKING[0][0], passes: int = 1) -> list[float]:
        """Each configuration's ms for ``calls`` back-to-back calls, by CUDA events between consecutive
        configurations; the shortest of ``passes`` passes (``sweep_pass``)."""
        ms, host_us = [math.inf] * len(algos), FIRST_HOST_US_PER_CALL * calls
        torch.cuda._sleep(1)  # the sleep kernel is loaded before any launching is timed
        for _ in range(passes):
            host_us = MeasuredProducts.sweep_pass(descriptor, algos, calls, host_us, ms, x, weight, out)
        return ms

    @staticmethod
    def sweep_pass(descriptor: cublaslt.LtProduct, algos: list[cublaslt.Algo], calls: int, host_us: float,
                   ms: list[float], x, weight, out) -> float:
        """One pass of ``sweep``: lowers ``ms[i]`` to the time of ``algos[i]``'s calls if shorter, and returns the host
        µs a configuration's launching took, doubled (the next pass's first sleep).

        The calls are launched ``SWEEP_CHUNK`` configurations at a time, each chunk on an idle device behind one
        ``torch.cuda._sleep`` at least twice as long as launching the previous chunk took (the first chunk assumes
        ``host_us`` a configuration). The device then runs the chunk's calls back to back, and each interval times
        one configuration's kernels. A chunk whose launching outlasted its sleep (the device may have waited for the
        host) is swept again with longer sleeps, twice at most. One host read a chunk. (A chunk is far smaller than
        the device's launch queue, about 1000 launches on the H200, so launching it never waits for the device:
        ``benchmarks/launch_queue.py``.)"""
        pending = list(range(len(algos)))
        for _ in range(3):
            late = []
            for start in range(0, len(pending), SWEEP_CHUNK):
                chunk, slept = pending[start:start + SWEEP_CHUNK], [timing_event(), timing_event()]
                slept[0].record()
                torch.cuda._sleep(int(SLEEP_CYCLES_PER_US * host_us * len(chunk)))
                slept[1].record()
                began, marks = time.perf_counter(), [slept[1]]
                for i in chunk:
                    for _ in range(calls):
                        descriptor.run(algos[i], x, weight, out)
                    marks.append(timing_event())
                    marks[-1].record()
                launch_us = (time.perf_counter() - began) * 1e6
                marks[-1].synchronize()
                for i, (a, b) in zip(chunk, itertools.pairwise(marks), strict=True):
                    ms[i] = min(ms[i], a.elapsed_time(b))
                if launch_us >= 1e3 * slept[0].elapsed_time(slept[1]):
                    late += chunk
                host_us = 2 * launch_us / len(chunk)
            if not late:
                break
            log.debug("sweeping %d configurations again: launching them outlasted their sleep", len(late))
            pending, host_us = late, 2 * host_us
        return host_us

    def mark(self) -> Mark:
        """What the chooser has done so far, for ``describe(since=...)``."""
        return Mark(len(self.choices), self.seconds, dict(self.phases))

    def describe(self, since: Mark | None = None) -> str:
        """What it chose, in a line: the shapes it measured or recalled and the seconds that took, in this process
        so far, or since ``since`` (a ``mark()``), then how many shapes the process has in all. The chooser is the
        process's: a manager that describes its capture without a mark taken when it began reports an earlier
        manager's shapes and seconds as its own."""
        start = since or Mark(0, 0.0, dict.fromkeys(self.phases, 0.0))
        choices = list(itertools.islice(self.choices.values(), start.shapes, None))  # only ever added, in order
        other = [c for c in choices if c.algo is not None]
        recalled = sum(c.recalled for c in choices)
        saved = sum(c.aten_us - c.chosen_us for c in other)
        phases = ", ".join(f"{name} {seconds - start.phases.get(name, 0.0):.1f} s"
                           for name, seconds in self.phases.items())
        cached = (f"{recalled} from the cache {self.cache.path}" if self.cache.path is not None else
                  "no cache between processes: HWGRAPH_CACHE_DIR is empty, or there is no home folder")
        described = (f"measured cuBLASLt algorithms: {len(choices)} shapes in {self.seconds - start.seconds:.1f} s "
                     f"({cached}; measuring: {phases}); {len(other)} run another "
                     f"configuration than ATen's, {saved:.1f} µs faster per call of each together")
        return described if since is None else f"{described}; {len(self.choices)} shapes in this process in all"

    def aten_calls(self) -> None:
        """ATen's calls that measuring times on ``side_stream`` (``graphed_as_captured``), once each on small bf16
        operands on the chooser's device: ``F.linear`` and, with the GELU epilogue, ``torch._addmm_activation``."""
        a = torch.ones(16, 16, device=self.device, dtype=torch.bfloat16)
        for gelu in (False, True):
            self.aten(a, a, a[0], gelu)


@functools.cache
def measured_products(index: int) -> MeasuredProducts:
    """The process's chooser for GPU ``index``: each shape is measured once, whichever manager captures it first.
    It is handed out with ``side_stream(index)`` readied by ATen's calls that measuring times there
    (``ready_side_stream``): a manager asks for its chooser before it reads any budget's memory baseline
    (``EncoderGraphManager.capture``), so that stream's cuBLAS workspaces, kept for the process, count in no
    budget's graph memory."""
    lib, reason = cublaslt.cublaslt()
    if lib is None:
        raise RuntimeError(f"measured products are unavailable: {reason}")
    chooser = MeasuredProducts(lib, torch.device("cuda", index), cache_path())
    ready_side_stream(index, chooser.aten_calls)
    return chooser
