"""The CPU reference backend emulates graph semantics exactly: static inputs, static outputs, no host reads."""

from __future__ import annotations

import gc
import operator
import sys
import threading
import weakref

import pytest
import torch

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend, RejectHostReads

# every tensor method a sync guard may replace while it is active
GUARDED_METHODS = ("item", "tolist", "cpu", "numpy", "to", "__bool__", "__int__", "__float__", "__index__",
                   "__getitem__", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal",
                   "allclose", "is_nonzero", "repeat_interleave", "type", "bincount", "histc", "copy_", "device")
# and torch functions (those taking numbers among them: all of them, tests/test_cpu_sync_guard_cpp_reads.py)
GUARDED_FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
                     "is_nonzero", "where", "repeat_interleave", "bincount", "histc", "arange", "full", "zeros",
                     "linspace", "masked_fill", "narrow", "tensor", "as_tensor", "add", "cat")


@pytest.fixture
def backend():
    return CpuGraphBackend()


@pytest.fixture
def static_input():
    return torch.zeros(4, 8)


def captured_affine(backend, static_input):
    weight = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 10
    graph = backend.capture(lambda: (static_input @ weight, static_input.sum(dim=1)))
    return graph, weight


def test_replay_reflects_new_contents_of_the_input_buffer(backend, static_input):
    graph, weight = captured_affine(backend, static_input)
    new = torch.randn(4, 8)
    static_input.copy_(new)
    graph.replay()
    torch.testing.assert_close(graph.outputs[0], new @ weight)
    torch.testing.assert_close(graph.outputs[1], new.sum(dim=1))


def test_replay_without_copying_new_inputs_returns_the_old_answer(backend, static_input):
    graph, weight = captured_affine(backend, static_input)
    first = torch.randn(4, 8)
    static_input.copy_(first)
    graph.replay()
    graph.replay()  # nothing new copied in: the same answer again, neither accumulated nor reset
    torch.testing.assert_close(graph.outputs[0], first @ weight)
    torch.testing.assert_close(graph.outputs[1], first.sum(dim=1))


def test_outputs_are_the_same_tensor_objects_across_replays(backend, static_input):
    graph, _ = captured_affine(backend, static_input)
    before = [id(t) for t in graph.outputs]
    pointers = [t.data_ptr() for t in graph.outputs]
    static_input.copy_(torch.randn(4, 8))
    graph.replay()
    graph.replay()
    assert [id(t) for t in graph.outputs] == before
    assert [t.data_ptr() for t in graph.outputs] == pointers


def test_an_output_read_before_the_next_replay_is_overwritten_by_it(backend, static_input):
    graph, _ = captured_affine(backend, static_input)
    static_input.fill_(1.0)
    graph.replay()
    held = graph.outputs[1]  # a caller that keeps the graph's buffer instead of cloning it
    static_input.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(held, torch.full((4,), 16.0))


@pytest.mark.parametrize("host_read", [
    pytest.param(lambda t: t.sum().item(), id="item"),
    pytest.param(lambda t: t.tolist(), id="tolist"),
    pytest.param(lambda t: t.cpu(), id="cpu"),
    pytest.param(lambda t: bool(t.sum()), id="bool"),
    pytest.param(lambda t: int(t.sum()), id="int"),
    pytest.param(lambda t: float(t.sum()), id="float"),
    # the emulated device is the CPU: a blocking copy to "cpu" is the device-to-host copy .cpu() is
    pytest.param(lambda t: t.to("cpu"), id="to-str"),
    pytest.param(lambda t: t.to(torch.device("cpu")), id="to-device"),
    pytest.param(lambda t: t.to(device="cpu"), id="to-device-keyword"),
    pytest.param(lambda t: t.to("cpu", torch.float16), id="to-device-and-dtype"),
    pytest.param(lambda t: t.to("cpu", non_blocking=False, copy=True), id="to-blocking-copy"),
    # a tensor used as a Python index reads its value on the host
    pytest.param(lambda t: range(t.sum().long()), id="range"),
    pytest.param(lambda t: [0, 1, 2, 3][t.sum().long()], id="list-subscript"),
    pytest.param(lambda t: operator.index(t.sum().long()), id="operator.index"),
])
def test_sync_guard_rejects_each_host_read(backend, host_read):
    tensor = torch.ones(3)
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a device-to-host"):
        host_read(tensor)


@pytest.mark.parametrize("size_read", [
    pytest.param(lambda t: t[t > 0], id="boolean-mask-index"),
    pytest.param(lambda t: t[None][:, t > 0], id="boolean-mask-in-a-tuple-index"),
    pytest.param(lambda t: t.nonzero(), id="nonzero"),
    pytest.param(lambda t: torch.nonzero(t), id="torch.nonzero"),
    pytest.param(lambda t: torch.argwhere(t), id="argwhere"),
    pytest.param(lambda t: torch.where(t > 0), id="where-condition-only"),
    pytest.param(lambda t: t.masked_select(t > 0), id="masked_select"),
    pytest.param(lambda t: torch.unique(t), id="unique"),
    pytest.param(lambda t: t.unique_consecutive(), id="unique_consecutive"),
    pytest.param(lambda t: torch.equal(t, t), id="equal"),
    pytest.param(lambda t: torch.allclose(t, t), id="allclose"),
    pytest.param(lambda t: t[:1].is_nonzero(), id="is_nonzero"),
    pytest.param(lambda t: t.repeat_interleave(t.abs().long()), id="repeat_interleave-tensor-repeats"),
    pytest.param(lambda t: torch.repeat_interleave(t.abs().long()), id="torch.repeat_interleave-repeats-only"),
])
def test_sync_guard_rejects_ops_whose_result_size_or_value_is_read_back(backend, size_read):
    """A replay path with a boolean-mask index, nonzero() or torch.equal() passed the CPU guard, while on CUDA each
    reads a device-computed size or value back (the sync debug mode rejects it, and capturing it fails)."""
    tensor = torch.tensor([1.0, -1.0, 2.0])
    with backend.sync_guard(), pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a device-to-host"):
        size_read(tensor)
    size_read(tensor)  # allowed again once the guard ends


def test_sync_guard_allows_the_same_ops_where_nothing_is_read_back(backend):
    tensor = torch.tensor([1.0, -1.0, 2.0])
    with backend.sync_guard():
        kept = [torch.where(tensor > 0, tensor, 0.0), tensor[torch.tensor([0, 2])], tensor[1:], tensor[None, 0],
                tensor.repeat_interleave(2), torch.repeat_interleave(tensor, torch.tensor([1, 1, 2]), output_size=4),
                tensor.masked_fill(tensor > 0, 0.0)]
    assert [tuple(t.shape) for t in kept] == [(3,), (2,), (2,), (1,), (6,), (4,), (3,)]


def test_sync_guard_names_the_host_copy_and_the_index_it_rejected(backend):
    tensor = torch.ones(3)
    with backend.sync_guard():
        with pytest.raises(HostSyncError, match=r"^\.to\('cpu'\) on a tensor inside sync_guard\(\)"):
            tensor.to(torch.device("cpu"))
        with pytest.raises(HostSyncError, match=r"^operator\.index\(\) \(a tensor as a Python int: range\(\), "
                                                r"a list subscript\) on a tensor inside sync_guard\(\)"):
            range(tensor.sum().long())


@pytest.mark.parametrize("device_work", [
    pytest.param(lambda t: t.to(torch.float16), id="to-dtype"),
    pytest.param(lambda t: t.to(torch.ones(1, dtype=torch.float64)), id="to-like-a-tensor"),
    # queued without waiting: how host metadata reaches its device (VisionMetadata.to)
    pytest.param(lambda t: t.to("cpu", non_blocking=True), id="to-non-blocking"),
    pytest.param(lambda t: torch.zeros(4)[t.long()], id="tensor-index"),
    # the device a tensor reports is the one it is on, and the emulated device's too: a no-op on CUDA (or a copy or a
    # cast there), not the host that "cpu" names
    pytest.param(lambda t: t.to(t.device), id="to-its-own-device"),
    pytest.param(lambda t: t.to(device=torch.zeros(1).device), id="to-another-tensors-device"),
    pytest.param(lambda t: t.to(t.device, torch.float16, copy=True), id="to-its-own-device-a-cast-and-a-copy"),
])
def test_sync_guard_allows_casts_non_blocking_copies_and_tensor_indexing(backend, device_work):
    tensor = torch.ones(3)
    with backend.sync_guard():
        out = device_work(tensor)
    assert out.shape[0] == 3


def test_sync_guard_tells_the_device_a_tensor_reports_from_the_host_it_names_until_it_ends(backend):
    """x.to(x.device) was rejected as a copy to the host: on the emulated device it names "cpu" as .to("cpu") does.
    Inside the guard a CPU tensor reports its device as one object, which .to() tells from the host by identity."""
    tensor, reported = torch.ones(3), torch.zeros(1).device
    with backend.sync_guard():
        device = tensor.device
        assert device == torch.device("cpu") and device is torch.zeros(2).device and device.type == "cpu"
        assert tensor.to(device) is tensor
        for host in (torch.device("cpu"), str(device), reported):  # the host, or a device reported before the guard
            with pytest.raises(HostSyncError, match=r"^\.to\('cpu'\) on a tensor inside sync_guard\(\)"):
                tensor.to(host)
    assert "device" not in vars(torch.Tensor) and tensor.device == torch.device("cpu")


def test_sync_guard_lets_numpy_read_a_host_tensor_and_still_rejects_a_copy_to_the_host(backend):
    # .numpy() never synchronises: torch refuses it for a device tensor (TypeError), so on the host it reads host
    # memory, such as a grid_thw tensor the caller made there
    grid = torch.tensor([[1, 8, 8], [2, 4, 4]])
    with backend.sync_guard():
        assert grid.numpy().tolist() == [[1, 8, 8], [2, 4, 4]]
        with pytest.raises(HostSyncError, match=r"\.cpu\(\)"):
            grid.cpu().numpy()
        with pytest.raises(HostSyncError, match=r"\.tolist\(\)"):
            grid.tolist()


def test_sync_guard_allows_device_work_and_ends_with_the_block(backend):
    tensor = torch.ones(3)
    with backend.sync_guard():
        doubled = tensor * 2 + 1
    assert doubled.sum().item() == 9.0


def test_memory_in_use_drops_after_release(backend, static_input):
    graph, _ = captured_affine(backend, static_input)
    held = backend.memory_in_use()
    assert held > 0
    graph.release()
    assert backend.memory_in_use() < held
    with pytest.raises(RuntimeError, match="released"):
        graph.replay()


def test_graphs_share_a_pool(backend, static_input):
    pool = backend.new_pool()
    one = backend.capture(lambda: static_input * 2, pool)
    two = backend.capture(lambda: static_input + 1, pool)
    assert set(pool.graphs) == {one, two}


def test_nested_sync_guards_keep_rejecting_until_the_outermost_ends(backend):
    tensor = torch.ones(3)
    with backend.sync_guard():
        with backend.sync_guard():
            pass
        with pytest.raises(HostSyncError):  # the inner guard ended, the outer one still holds
            tensor.sum().item()
    assert tensor.sum().item() == 3.0 and tensor.tolist() == [1.0, 1.0, 1.0] and bool(tensor.any())


def test_a_mode_the_backend_does_not_have_is_refused_naming_its_modes():
    assert CpuGraphBackend(mode="emulated").mode == CpuGraphBackend().mode == "emulated"
    with pytest.raises(ValueError, match=r"graph backend 'cpu' has modes \['emulated'\], got mode='full'"):
        CpuGraphBackend(mode="full")


@pytest.mark.parametrize("mode, error, match", [
    ("", ValueError, r"graph backend 'cpu' has modes \['emulated'\], got mode=''"),
    (0, TypeError, r"graph backend 'cpu' takes a mode name \(one of \['emulated'\]\), got mode=0"),
    (b"emulated", TypeError, r"takes a mode name \(one of \['emulated'\]\), got mode=b'emulated'"),
])
def test_only_none_means_the_first_mode_and_an_empty_or_non_str_mode_is_refused(mode, error, match):
    assert CpuGraphBackend(mode=None).mode == "emulated"
    with pytest.raises(error, match=match):
        CpuGraphBackend(mode=mode)


def test_a_replay_whose_outputs_differ_from_the_captured_ones_raises(backend):
    # a device graph cannot change its output shapes or count: the emulation refuses instead of broadcasting
    shape = [4]
    graph = backend.capture(lambda: torch.ones(shape[0]))
    shape[0] = 1
    with pytest.raises(CaptureError, match=r"replay produced shape \(1,\), captured \(4,\)"):
        graph.replay()
    count = [1]
    graph = backend.capture(lambda: tuple(torch.ones(2) for _ in range(count[0])))
    count[0] = 2
    with pytest.raises(CaptureError, match="different number of outputs"):
        graph.replay()


@pytest.fixture
def tensor_methods_restored():
    """Puts back any tensor method a failed guard test left replaced, so that later tests read tensors normally."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in GUARDED_METHODS}
    yield saved
    for name, original in saved.items():
        if torch.Tensor.__dict__.get(name) is not original:
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
            RejectHostReads.switch.depth = 0


def test_sync_guards_entered_and_left_by_many_threads_at_once_leave_every_method_as_it_was(tensor_methods_restored):
    originals = {name: getattr(torch.Tensor, name) for name in GUARDED_METHODS}
    functions = {name: getattr(torch, name) for name in GUARDED_FUNCTIONS}
    errors = []

    def enter_and_leave():
        try:
            for _ in range(500):
                with RejectHostReads():
                    pass
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's name
            errors.append(f"{threading.current_thread().name}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=enter_and_leave, name=f"guard-{i}") for i in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: between any two guard steps
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, f"entering or leaving the guard raised: {errors[:3]}"
    replaced = [name for name in GUARDED_METHODS if getattr(torch.Tensor, name) is not originals[name]]
    assert not replaced, f"after every guard ended, torch.Tensor still has replaced {replaced}"
    replaced = [name for name in GUARDED_FUNCTIONS if getattr(torch, name) is not functions[name]]
    assert not replaced, f"after every guard ended, torch still has replaced {replaced}"
    assert torch.tensor(1.5).item() == 1.5 and torch.ones(2).tolist() == [1.0, 1.0]


def test_a_guard_another_thread_holds_keeps_rejecting_after_this_thread_enters_and_leaves_one(backend):
    entered, leave = threading.Event(), threading.Event()

    def hold_a_guard():
        with backend.sync_guard():
            entered.set()
            leave.wait(timeout=30)

    holder = threading.Thread(target=hold_a_guard)
    holder.start()
    try:
        assert entered.wait(timeout=30), "the other thread never entered its guard"
        with backend.sync_guard():
            pass
        with pytest.raises(HostSyncError, match=r"\.item\(\)"):  # process-wide: the other thread's guard holds
            torch.ones(1).item()
    finally:
        leave.set()
        holder.join()
    assert torch.ones(1).item() == 1.0


def test_a_pool_is_dropped_once_its_owner_and_its_graphs_are():
    """The backend kept every pool it made or captured into for its own life: a long-lived backend (a manager's, each
    capture without a pool making one) grew a list of empty pools. A graph keeps its pool, as a device graph keeps
    its pool's memory, so what it holds is counted until it goes."""
    backend, x = CpuGraphBackend(), torch.ones(1000)
    pool = backend.new_pool()
    graph = backend.capture(lambda: x * 2, pool)
    held, pool_ref = backend.memory_in_use(), weakref.ref(pool)
    del pool
    gc.collect()
    assert held == 4000 and pool_ref() is not None and backend.memory_in_use() == held
    graph.release()
    del graph
    gc.collect()
    assert pool_ref() is None, "the backend still holds a pool whose owner and graphs are gone"
    refs = [weakref.ref(backend.capture(lambda: x * 2).pool) for _ in range(20)]
    gc.collect()
    assert not [ref for ref in refs if ref() is not None] and backend.memory_in_use() == 0


@pytest.mark.parametrize("failing_run, match", [
    (1, r"^warm-up before capture failed: RuntimeError: shape '\[3\]' is invalid"),
    (2, r"^capture failed: RuntimeError: shape '\[3\]' is invalid"),
])
def test_a_callable_that_fails_in_capture_is_a_capture_error_as_on_a_device(backend, failing_run, match):
    """The device backends turn a failure of the warm-up or the captured run into ``CaptureError`` (the error a failed
    capture is documented to raise); the reference backend let the callable's own exception through."""
    x, runs = torch.ones(2), []

    def fn():
        runs.append(1)
        return x.view(3) if len(runs) == failing_run else x + 1

    with pytest.raises(CaptureError, match=match) as failure:
        backend.capture(fn)
    assert isinstance(failure.value.__cause__, RuntimeError)


def test_a_callable_interrupted_in_capture_stays_interrupted(backend):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        backend.capture(interrupted)


def test_a_pool_that_is_not_the_backends_is_refused_naming_it_before_anything_runs(backend):
    """Another backend's pool (a CUDA pool handle, a MemPool) failed after the callable had run twice, with
    "'tuple' object has no attribute 'graphs'", naming neither the pool nor what was expected."""
    runs = []
    with pytest.raises(TypeError, match=r"^the cpu graph backend captures into a CpuPool \(from new_pool\(\)\), "
                                        r"got \('pool', 1\)$"):
        backend.capture(lambda: runs.append(1) or torch.ones(2), ("pool", 1))
    assert runs == []


def test_a_broadcast_output_replays_as_on_a_device(backend):
    """A device graph's expanded output is a view of memory its replay rewrites; the emulation's copy into it raised
    "more than one element of the written-to tensor refers to a single memory location"."""
    x = torch.ones(2)
    graph = backend.capture(lambda: ((x * 2).expand(3, 2), (x + 1)[:, None].expand(2, 4)))
    x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs[0], torch.full((3, 2), 6.0))
    torch.testing.assert_close(graph.outputs[1], torch.full((2, 4), 4.0))
