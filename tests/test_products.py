"""The tower's matrix products: ATen's by default, a backend's chooser only inside captures, plain or compiled
(``EncoderGraphManager(measure_products=True)``, ``hwgraph.products``)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn.functional as F

from hwgraph import products
from hwgraph.capability import Capability
from hwgraph.graphs.base import inductor_support
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower

INDUCTOR = inductor_support(torch.device("cpu"))


class RecordingChooser:
    """ATen's results, counting the products routed through it. With ``measure_seconds``, the first call of each
    shape sleeps that long and counts it as measuring (``seconds``), as a chooser that measures does."""

    def __init__(self, measure_seconds: float = 0.0):
        self.calls = 0
        self.seconds = 0.0
        self.measure_seconds = measure_seconds
        self.shapes = set()

    def measure(self, x, weight):
        self.calls += 1
        shape = (*x.shape, *weight.shape)
        if self.measure_seconds and shape not in self.shapes:
            self.shapes.add(shape)
            start = time.perf_counter()
            time.sleep(self.measure_seconds)
            self.seconds += time.perf_counter() - start

    def linear(self, x, weight, bias):
        self.measure(x, weight)
        return F.linear(x, weight, bias)

    def linear_gelu_tanh(self, x, weight, bias):
        self.measure(x, weight)
        return products.aten_linear_gelu_tanh(x, weight, bias)

    def mark(self) -> int:
        return self.calls

    def describe(self, since: int | None = None) -> str:
        return f"recording chooser: {self.calls - (since or 0)} products"


def test_without_a_chooser_the_products_are_atens():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    assert products.ACTIVE is None
    assert torch.equal(products.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(products.linear(x, w), F.linear(x, w))
    assert torch.equal(products.linear_gelu_tanh(x, w, b), F.gelu(F.linear(x, w, b), approximate="tanh"))


def test_chosen_by_routes_products_through_the_chooser_and_restores_the_previous_one():
    x, w, b = torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4)
    outer, inner = RecordingChooser(), RecordingChooser()
    with products.chosen_by(outer):
        products.linear(x, w, b)
        with pytest.raises(ValueError, match="inside"), products.chosen_by(inner):
            products.linear_gelu_tanh(x, w, b)
            raise ValueError("raised inside the inner context")
        assert products.ACTIVE is outer
        products.linear(x, w, b)
    assert products.ACTIVE is None
    assert (outer.calls, inner.calls) == (2, 1)


def test_chosen_by_in_two_threads_leaves_no_chooser_active_when_both_have_left(monkeypatch):
    """Two captures on two devices, each in its own thread, enter and leave ``chosen_by`` interleaved: the first in
    leaves first. Each restored what it found on entering, so the second, leaving last, put the first's chooser back
    for good: every later product in the process ran through it, outside any capture."""
    import threading

    monkeypatch.setattr(products, "ACTIVE", None)  # put back after the test, whatever it leaves
    first, second = RecordingChooser(), RecordingChooser()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def enter_first():
        with products.chosen_by(first):
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def enter_second():
        first_in.wait(10)
        with products.chosen_by(second):
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = products.ACTIVE

    threads = [threading.Thread(target=enter_first), threading.Thread(target=enter_second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert first_out.is_set() and "after the first left" in seen, "the threads did not interleave"
    assert seen["after the first left"] is second  # the one still open keeps its chooser
    assert products.ACTIVE is None
    x, w, b = torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4)
    products.linear(x, w, b)
    assert (first.calls, second.calls) == (0, 0)


def tiny_tower():
    torch.manual_seed(0)
    return Qwen3OmniVisionTower.from_preset("tiny").eval()


def check_equal_to_eager(manager, tower, grid):
    pixels = torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width)
    got = manager.encode(pixels, grid)
    want = tower.forward(pixels, grid).split([t * h * w // 4 for t, h, w in grid])
    for a, b in zip(got, want, strict=True):
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            torch.testing.assert_close(x, y)


def test_a_backend_without_a_chooser_captures_atens_products_and_says_why(caplog):
    tower = tiny_tower()
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m = EncoderGraphManager(tower, budgets=[16], graph_backend="cpu", measure_products=True)
        m.capture()
    why = "the cpu graph backend has no measured choice of matrix-product kernels; its graphs run ATen's"
    assert m.stats()["products"] == f"ATen's: {why}"
    assert why in caplog.text
    assert sorted(m.graphs) == [16]
    check_equal_to_eager(m, tower, [(1, 4, 8)])
    assert EncoderGraphManager(tower, budgets=[16], graph_backend="cpu").stats()["products"] is None
    m.close()


def test_a_chooser_that_fails_to_start_leaves_atens_products_and_every_budget_captured(monkeypatch, caplog):
    """The gate passed but making the chooser failed (cublasLtCreate out of memory): capture() raised before any
    budget was captured. It is now a logged fallback to ATen's products, as a refused chooser is."""
    def fails(self):
        raise RuntimeError("cublasLtCreate returned 3 (CUBLAS_STATUS_ALLOC_FAILED)")

    monkeypatch.setattr(CpuGraphBackend, "products_support", lambda self: Capability.available())
    monkeypatch.setattr(CpuGraphBackend, "product_chooser", fails)
    tower = tiny_tower()
    with caplog.at_level(logging.WARNING, logger="hwgraph.manager"):
        m = EncoderGraphManager(tower, budgets=[8, 16], graph_backend="cpu", measure_products=True)
        m.capture()
    assert sorted(m.graphs) == [8, 16] and m.stats()["capture_failures"] == {}
    assert "CUBLAS_STATUS_ALLOC_FAILED" in m.stats()["products"] and m.stats()["products"].startswith("ATen's")
    assert "the product chooser failed to start" in caplog.text
    check_equal_to_eager(m, tower, [(1, 4, 8)])
    m.close()


def products_per_forward(tower) -> int:
    """The patch embedding, qkv, proj, fc1 and fc2 of every block, and two per merger."""
    return 1 + 4 * len(tower.blocks) + 2 * (1 + len(tower.deepstack_visual_indexes))


def test_a_chooser_the_caller_activated_takes_the_plain_captures_of_a_manager_without_its_own():
    tower = tiny_tower()
    chooser = RecordingChooser()
    with products.chosen_by(chooser):
        m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu", verify=False)
        m.capture()
    assert chooser.calls == 2 * products_per_forward(tower)  # the CPU backend's warm-up and capture
    assert m.stats()["products"] is None
    m.close()


@pytest.fixture
def recording_backend(monkeypatch):
    """The CPU reference backend, given a product chooser that records the products captured through it."""
    chooser = RecordingChooser()
    monkeypatch.setattr(CpuGraphBackend, "products_support", lambda self: Capability.available())
    monkeypatch.setattr(CpuGraphBackend, "product_chooser", lambda self: chooser)
    return chooser


def test_plain_captures_take_the_backends_chooser_and_eager_calls_stay_atens(recording_backend):
    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[8, 16], max_images_per_graph=1, graph_backend="cpu",
                            measure_products=True)
    m.capture()
    per_forward = products_per_forward(tower)
    runs = 2 * 2  # two budgets, each run twice by the CPU backend's capture: warm-up, then capture
    assert recording_backend.calls == runs * per_forward
    assert m.stats()["products"] == f"recording chooser: {runs * per_forward} products"
    assert products.ACTIVE is None
    check_equal_to_eager(m, tower, [(1, 4, 4)])  # a replay (the CPU backend re-runs the recorded callable)
    check_equal_to_eager(m, tower, [(1, 12, 12)])  # eager: over budget
    assert recording_backend.calls == runs * per_forward
    assert m.stats()["eager_reasons"] == {"over budget": 1}
    m.close()


def test_a_managers_products_report_what_the_shared_chooser_did_for_it_not_for_earlier_managers(recording_backend):
    """The backend's chooser is the process's, shared by its managers: a second manager's ``stats()['products']``
    once repeated the first's measuring as its own."""
    tower = tiny_tower()
    per_capture = 2 * products_per_forward(tower)  # one budget: the CPU backend's warm-up and capture
    reports = []
    for budgets in ([16], [8, 16]):
        m = EncoderGraphManager(tower, budgets=budgets, max_images_per_graph=1, graph_backend="cpu",
                                measure_products=True)
        m.capture()
        reports.append(m.stats()["products"])
        m.close()
    assert recording_backend.calls == 3 * per_capture
    assert reports == [f"recording chooser: {per_capture} products", f"recording chooser: {2 * per_capture} products"]


@pytest.mark.skipif(not INDUCTOR.ok, reason=INDUCTOR.describe())
def test_compiled_products_call_the_chooser_active_when_they_run():
    def f(x, w, b):
        return products.linear_gelu_tanh(products.linear(x, w, b).relu(), w, b) * 2

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    compiled = torch.compile(f, dynamic=False, fullgraph=True)  # fullgraph: no break around the products
    want = f(x, w, b)
    first, second = RecordingChooser(), RecordingChooser()
    with products.chosen_by(first):
        torch.testing.assert_close(compiled(x, w, b), want)
        compiled(x, w, b)
    with products.chosen_by(second):  # same graph, the chooser active when it runs
        torch.testing.assert_close(compiled(x, w, b), want)
    torch.testing.assert_close(compiled(x, w, b), want)  # none active: ATen's
    assert (first.calls, second.calls) == (4, 2)


@pytest.mark.skipif(not INDUCTOR.ok, reason=INDUCTOR.describe())
def test_compiled_captures_take_the_backends_chooser_and_time_compiling_apart_from_measuring(monkeypatch):
    chooser = RecordingChooser(measure_seconds=0.1)
    monkeypatch.setattr(CpuGraphBackend, "products_support", lambda self: Capability.available())
    monkeypatch.setattr(CpuGraphBackend, "product_chooser", lambda self: chooser)
    tower = tiny_tower()
    m = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=1, graph_backend="cpu", compile=True,
                            measure_products=True)
    m.capture()
    stats = m.stats()
    assert stats["compile_failures"] == {} and sorted(m.graphs) == [16]
    # the first compiled forward, then the CPU backend's warm-up and capture: every product, the compiled blocks'
    # included, ran through the chooser
    assert chooser.calls == 3 * products_per_forward(tower)
    assert stats["products"] == f"recording chooser: {chooser.calls} products"
    assert products.ACTIVE is None
    # measuring (a sleep per shape, in the first compiled forward) is not compiling
    assert chooser.seconds >= 0.1 * len(chooser.shapes) >= 0.4
    assert 0 < stats["compile_seconds_per_budget"][16]
    assert stats["compile_seconds_per_budget"][16] + chooser.seconds <= stats["capture_seconds_per_budget"][16]
    check_equal_to_eager(m, tower, [(1, 4, 8)])
    assert chooser.calls == 3 * products_per_forward(tower)  # replays and eager calls keep ATen's
    m.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_products_that_autograd_records_are_atens_with_a_chooser_active(compiled):
    """A chooser's kernels have no backward (the CUDA plugin's cuBLASLt call, the compiled custom ops): with one active,
    a compiled forward whose weights record gradients failed ("no autograd formula was registered"), and an eager
    one handed the chooser products whose gradients it dropped. Products that autograd records are ATen's; the
    chooser is asked for the others only."""
    def f(x, w, b):
        return products.linear_gelu_tanh(products.linear(x, w, b).relu(), w, b) * 2

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    run = torch.compile(f, backend="aot_eager", dynamic=False, fullgraph=True) if compiled else f
    chooser = RecordingChooser()
    with products.chosen_by(chooser):
        got = run(x, w.requires_grad_(), b)
        got.square().sum().backward()
        grad, w.grad = w.grad, None
        assert chooser.calls == 0
        with torch.no_grad():  # nothing records: the chooser's
            run(x, w, b)
        assert chooser.calls == 2
    f(x, w, b).square().sum().backward()
    torch.testing.assert_close(grad, w.grad)


@pytest.mark.parametrize("name", ["linear", "linear_gelu_tanh"])
def test_a_chooser_closed_by_another_thread_mid_call_leaves_the_call_on_the_chooser_it_read(monkeypatch, name):
    """The products read ``ACTIVE`` once to decide and again to call: another thread's ``chosen_by`` block closing
    between the two reads made an eager call fail with AttributeError on None."""
    calls = []

    class Chooser:
        def linear(self, x, weight, bias):
            calls.append("linear")
            return F.linear(x, weight, bias)

        def linear_gelu_tanh(self, x, weight, bias):
            calls.append("linear_gelu_tanh")
            return products.aten_linear_gelu_tanh(x, weight, bias)

    monkeypatch.setattr(products, "ACTIVE", Chooser())
    real_records_grad = products.records_grad

    def records_grad_then_the_block_closes(*tensors):
        out = real_records_grad(*tensors)
        products.ACTIVE = None  # what the other thread's exit leaves
        return out

    monkeypatch.setattr(products, "records_grad", records_grad_then_the_block_closes)
    x, w, b = torch.randn(2, 4), torch.randn(3, 4), torch.randn(3)
    with torch.inference_mode():
        out = getattr(products, name)(x, w, b)
    want = F.linear(x, w, b)
    torch.testing.assert_close(out, want if "gelu" not in name else F.gelu(want, approximate="tanh"))
    assert calls == [name]

