"""The CPU reference backend refuses a replay that would read a tensor put in place of one its capture read.

A device graph reads, at every replay, the buffers its capture read: a caller who replaces a tensor the captured
callable reads (``holder.x = new``) instead of copying into it (``holder.x.copy_(new)``) gets the old buffer's values
on a device (or freed memory), while the CPU backend's rerun read the new tensor and passed. The check must not fail
what works without it: captures of higher-order ops (``torch.cond``, ``flex_attention``), replays of a callable that
puts the captured tensor back itself, overlapping captures (the compiler stance they force and put back).
"""

from __future__ import annotations

import functools
import types
from collections import deque

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwgraph.graphs import CaptureError, HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.graphs.read_recording import ReadRecorder, storage_key
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.testing.towers import grid_of, pixels_for

REPLACED = r"a device graph would read the captured buffer instead"


@pytest.fixture
def backend():
    return CpuGraphBackend()


def test_a_replay_refuses_a_tensor_put_in_place_of_a_captured_input_before_writing_its_outputs(backend):
    holder, weight = types.SimpleNamespace(x=torch.zeros(4, 8)), torch.ones(8, 3)
    graph = backend.capture(lambda: holder.x @ weight)
    holder.x.copy_(torch.full((4, 8), 2.0))  # the way a device graph sees new inputs
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4, 3), 16.0))
    captured = holder.x.data_ptr()
    holder.x = torch.full((4, 8), 3.0)  # a device graph keeps reading the old, now freed, buffer
    with pytest.raises(CaptureError) as refused:
        graph.replay()
    message = str(refused.value)
    assert message.startswith("replay of test_a_replay_refuses_a_tensor_put_in_place_of_a_captured_input_before_"
                              "writing_its_outputs.<locals>.<lambda> would read holder.x, now a tensor of shape (4, "
                              f"8), torch.float32, at {hex(holder.x.data_ptr())}, which existed before the replay but "
                              f"was not read by the capture: the capture read a tensor of shape (4, 8), torch.float32, "
                              f"at {hex(captured)} there, freed since"), message
    assert REPLACED in message.lower() and "(freed memory)" in message and "copy_" in message
    torch.testing.assert_close(graph.outputs, torch.full((4, 3), 16.0))  # refused before the replay wrote them


def test_a_replaced_tensor_that_is_still_alive_is_refused_as_stale_values(backend):
    holder = types.SimpleNamespace(x=torch.zeros(4))
    graph = backend.capture(lambda: holder.x * 2)
    kept = holder.x  # alive: a device graph would read its stale values
    holder.x = torch.ones(4)
    with pytest.raises(CaptureError, match=r"would read holder\.x, .* at 0x[0-9a-f]+ there\. A device graph would "
                                           r"read the captured buffer instead \(stale values\)"):
        graph.replay()
    holder.x = kept  # put back: what the capture read, so the replay reads it again
    kept.fill_(5.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4,), 10.0))


@pytest.mark.parametrize("replace", [
    pytest.param(lambda lin: setattr(lin, "weight", torch.nn.Parameter(torch.randn(3, 8))), id="new-parameter"),
    pytest.param(lambda lin: setattr(lin.weight, "data", torch.randn(3, 8)), id="new-data"),
    pytest.param(lambda lin: lin.load_state_dict({"weight": torch.randn(3, 8), "bias": torch.randn(3)}, assign=True),
                 id="load_state_dict-assign"),
])
def test_a_parameter_given_a_new_tensor_is_refused_naming_it(backend, replace):
    lin, x = torch.nn.Linear(8, 3), torch.ones(2, 8)
    graph = backend.capture(lambda: lin(x))
    replace(lin)
    with pytest.raises(CaptureError, match=r"would read lin\.(weight|bias), now a tensor of shape \((3, 8|3,)\), "
                                           r"torch\.float32"):
        graph.replay()


def test_values_copied_into_captured_tensors_replay_without_error(backend):
    """What a device graph reads too: new values in the captured inputs and weights (``copy_``,
    ``load_state_dict`` without ``assign``), views of them, tensors the callable makes (factories, ``torch.tensor``,
    a scratch tensor it keeps) and a cache it filled in its warm-up."""
    lin = torch.nn.Linear(8, 3)
    holder = types.SimpleNamespace(x=torch.zeros(4, 8), scratch=None)
    inputs, cache = {"offset": torch.zeros(3)}, {}

    def fn():
        if "scale" not in cache:
            cache["scale"] = torch.full((3,), 2.0)  # made in the warm-up, read by the capture
        holder.scratch = torch.zeros(4, 3)  # made in every run, then read
        holder.scratch += lin(holder.x[1:].repeat(2, 1)[:4])
        return holder.scratch * cache["scale"] + inputs["offset"] + torch.tensor([1.0, 0.0, 0.0]) + torch.ones(3)

    graph = backend.capture(fn)
    for step in range(3):
        holder.x.copy_(torch.randn(4, 8))
        inputs["offset"].fill_(step)
        lin.load_state_dict({"weight": torch.randn(3, 8), "bias": torch.randn(3)})
        graph.replay()
        with torch.inference_mode():
            want = lin(holder.x[1:].repeat(2, 1)[:4]) * 2 + step + torch.tensor([2.0, 1.0, 1.0])
        torch.testing.assert_close(graph.outputs, want)


def test_a_tensor_the_callable_replaced_in_its_previous_run_is_refused(backend):
    """The capture read what the warm-up left in ``state.prev``; a device graph reads that buffer at every replay,
    while the rerun reads what the capture's run left there."""
    state = types.SimpleNamespace(prev=torch.zeros(2))

    def fn():
        state.prev = state.prev + 1
        return state.prev

    graph = backend.capture(fn)
    with pytest.raises(CaptureError, match=r"would read state\.prev, now a tensor of shape \(2,\), torch\.float32"):
        graph.replay()


def test_a_compiled_callable_captures_replays_compiled_and_refuses_a_replaced_input(backend):
    """Dynamo runs no compiled frame under a dispatch mode ("non-infra torch dispatch mode present"; with fullgraph a
    RuntimeError): the capture's reads are noted with compiled code running eagerly, and a replay adds no mode, so it
    runs the compiled graph."""
    graphs_run = []

    def counting_backend(gm, example_inputs):
        def run(*args):
            graphs_run.append(1)
            return gm.forward(*args)
        return run

    holder = types.SimpleNamespace(x=torch.ones(4))
    compiled = torch.compile(lambda: holder.x * 3 + 1, backend=counting_backend, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        graph = backend.capture(compiled)
    holder.x.fill_(2.0)
    before = len(graphs_run)
    graph.replay()
    assert len(graphs_run) == before + 1, "the replay did not run the compiled graph"
    torch.testing.assert_close(graph.outputs, torch.full((4,), 7.0))
    holder.x = torch.zeros(4)
    with pytest.raises(CaptureError, match=r"would read holder\.x, now a tensor of shape \(4,\)"):
        graph.replay()


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.x = torch.nn.Linear(4, 4), torch.ones(2, 4)

    def forward(self):
        return self.lin(self.x)


def scaled_first(scale, buffers):
    return buffers["a"][0] * scale


@pytest.mark.parametrize("make, replace, where", [
    pytest.param(Scaled, lambda m: setattr(m.lin, "bias", torch.nn.Parameter(torch.ones(4))), r"self\.lin\.bias",
                 id="a-module"),
    pytest.param(lambda: Scaled().forward, lambda f: setattr(f.__self__, "x", torch.ones(2, 4)), r"self\.x",
                 id="a-bound-method"),
    pytest.param(lambda: functools.partial(scaled_first, 2.0, {"a": [torch.ones(3)]}),
                 lambda f: f.args[1]["a"].__setitem__(0, torch.zeros(3)), r"partial\.args\[1\]\['a'\]\[0\]",
                 id="a-partial-list-in-a-dict"),
])
def test_the_refusal_names_the_replaced_tensor_as_the_caller_reaches_it(backend, make, replace, where):
    fn = make()
    graph = backend.capture(fn)
    replace(fn)
    with pytest.raises(CaptureError, match=rf" would read {where}, now a tensor of shape"):
        graph.replay()


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_the_read_check_composes_with_the_sync_guard_a_callers_dispatch_mode_and_inference_mode(backend):
    holder = types.SimpleNamespace(x=torch.ones(3))
    counter = OpCounter()
    with counter, torch.inference_mode(), backend.sync_guard():  # the guard's replaced methods serve the capture too
        graph = backend.capture(lambda: (holder.x * 2).sum(0, keepdim=True))
        graph.replay()
    # the warm-up, the capture and the replay: a product and a sum each; the replay copies its result out too
    assert counter.ops == 2 + 2 + 3, "the caller's mode did not see each op"
    torch.testing.assert_close(graph.outputs, torch.tensor([6.0]))
    holder.x = torch.zeros(3)
    with backend.sync_guard(), pytest.raises(CaptureError, match=r"would read holder\.x"):
        graph.replay()
    with pytest.raises(HostSyncError):  # the guard still rejects host reads around the check
        with backend.sync_guard():
            graph.outputs.item()


def test_a_manager_replay_refuses_weights_given_new_data_that_its_own_check_misses():
    """A middle parameter given new data (``.data = ...``) escapes the manager's key read before each call
    (``Qwen3OmniVisionTower.weights_key``; its look at every weight comes after the replay): its graphs would read
    the old weights on a device, and the CPU backend's replay says so first."""
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny").eval()
    manager = EncoderGraphManager(tower, budgets=[16], max_images_per_graph=2, graph_backend="cpu")
    manager.capture()
    grid = [grid_of(16, tower.spatial_merge_size)]
    pixels = pixels_for(tower, grid, seed=1)
    manager.encode(pixels, grid)
    assert manager.stats()["hits"] == 1
    weight = tower.blocks[0].mlp.linear_fc1.weight
    weight.data = weight.data.clone()
    with pytest.raises(CaptureError, match=r"would read tower\.blocks\.0\.mlp\.linear_fc1\.weight, now a tensor of "
                                           r"shape \(\d+, \d+\), torch\.float32"):
        manager.encode(pixels, grid)


# ---------------------------------------------------------------- higher-order ops
def flex_attention_of(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("op", [
    pytest.param("cond", id="torch.cond"),
    pytest.param("flex", id="flex_attention"),
    pytest.param("compiled-flex", id="torch.compile(flex_attention)"),
])
def test_a_higher_order_op_captures_replays_as_eager_and_refuses_a_replaced_operand(backend, op):
    """A higher-order op comes to the recorder whole (torch refused it under a mode without
    ``supports_higher_order_operators``, failing the capture): its operands are its reads, at any depth of its
    arguments. A compiled flex_attention runs eagerly while the capture records, and compiled at replay."""
    torch.manual_seed(0)
    holder = types.SimpleNamespace(q=torch.randn(1, 2, 16, 8), k=torch.randn(1, 2, 16, 8), v=torch.randn(1, 2, 16, 8))
    if op == "cond":
        def fn():
            return torch.cond(holder.q.sum() > 0, lambda q, k: q * 2 + k, lambda q, k: q - k, (holder.q, holder.k))

        def eager():
            return holder.q * 2 + holder.k if holder.q.sum() > 0 else holder.q - holder.k
    else:
        flex = flex_attention_of(op == "compiled-flex")

        def fn():
            return flex(holder.q, holder.k, holder.v)

        def eager():
            return flex_attention_of(False)(holder.q, holder.k, holder.v)

    with torch.inference_mode():
        graph = backend.capture(fn)
    assert graph.reads is not None and len(graph.reads.reads) >= 2, "the capture noted none of the op's operands"
    for sign in (1.0, -1.0):  # both branches of the cond: the captured graph's is the one its predicate picks now
        for name in ("q", "k", "v"):
            getattr(holder, name).copy_(sign * torch.randn(1, 2, 16, 8).abs())
        graph.replay()
        with torch.inference_mode():
            torch.testing.assert_close(graph.outputs, eager(), atol=1e-5, rtol=1e-5)
    holder.k = torch.randn(1, 2, 16, 8)
    with pytest.raises(CaptureError, match=r"would read holder\.k, now a tensor of shape \(1, 2, 16, 8\)"):
        graph.replay()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_tensors_of_a_block_mask_are_reads_of_flex_attention():
    """flex_attention takes its block mask as a tuple of tensors, among its other arguments: each is a read."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q = torch.randn(1, 1, 128, 8)
    mask = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 128, 128, device="cpu")
    recorder = ReadRecorder()
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"), recorder:  # as a capture records
        flex_attention(q, q, q, block_mask=mask)
    for name in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"):
        assert storage_key(getattr(mask, name)) in recorder.read, name
    assert storage_key(q) in recorder.read


def test_a_failure_the_recording_causes_leaves_the_replay_unchecked_instead_of_failing_the_capture(
        backend, monkeypatch, caplog):
    """Under the recording torch takes other paths: a mode it refuses (here: the recorder without higher-order-op
    support), ``torch.cond``'s eager path, which refuses nested operands that its compiled path (the warm-up's) takes.
    The callable runs again without the recording, and its replays go unchecked."""
    from hwgraph.graphs import read_recording

    holder = types.SimpleNamespace(x=torch.ones(4), y=torch.ones(4))

    def nested():
        operands = ((holder.x, {"y": [holder.y]}),)
        return torch.cond(holder.x.sum() > 0, lambda t: t[0] + t[1]["y"][0], lambda t: t[0] - t[1]["y"][0], operands)

    def flat():
        return torch.cond(holder.x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (holder.x,))

    with caplog.at_level("DEBUG", logger="hwgraph.graphs.capture_reads"):
        graph = backend.capture(nested)
    assert graph.reads is None
    assert "not checked" in caplog.text and "AssertionError" in caplog.text
    holder.y.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4,), 3.0))

    monkeypatch.setattr(read_recording.ReadRecorder, "supports_higher_order_operators", False)
    caplog.clear()
    with caplog.at_level("DEBUG", logger="hwgraph.graphs.capture_reads"):
        graph = backend.capture(flat)
    assert graph.reads is None and "no rule registered for HigherOrderOperator cond" in caplog.text
    monkeypatch.undo()

    monkeypatch.setattr(read_recording, "tensors_in", read_recording.storage_key)  # raises in our recorder
    graph = backend.capture(lambda: holder.x * 2)
    assert graph.reads is None
    holder.x.fill_(3.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs, torch.full((4,), 6.0))


def raises_boom(x):
    raise ValueError("boom")


@pytest.mark.parametrize("fails", [pytest.param(raises_boom, id="its-own-code"),
                                   pytest.param(lambda x: x.view(3), id="an-op")])
def test_a_callable_that_fails_only_in_the_recorded_run_fails_the_capture_without_another_run(backend, fails):
    """As a device backend's capture fails on it: the callable's own error, or an op's, is no failure of the
    recording, and the callable gets no second run that might pass."""
    x, calls = torch.ones(2), []

    def fn():
        calls.append(1)
        return fails(x) if len(calls) == 2 else x * 2  # the capture's run; the first is the warm-up

    with pytest.raises(CaptureError, match=r"^capture failed: (ValueError: boom|RuntimeError: shape '\[3\]')"):
        backend.capture(fn)
    assert len(calls) == 2, "the callable ran again after the recorded run failed"


# ---------------------------------------------------------------- a callable that puts the captured tensor back itself
@functools.lru_cache(maxsize=8)
def position_table(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, cols).contiguous()


class CachedTable(torch.nn.Module):
    def forward(self, x):
        self.table = position_table(*x.shape)  # set on every call, before it is read
        return x * self.table


class TupleKeyedTables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = {}  # (rows, cols) -> table: keys the search does not follow

    def forward(self, x):
        key = tuple(x.shape)
        if key not in self.tables:
            self.tables[key] = torch.arange(key[0], dtype=torch.float32)[:, None].expand(*key).contiguous()
        self.current = self.tables[key]
        return x * self.current


@pytest.mark.parametrize("make", [CachedTable, TupleKeyedTables])
def test_a_callable_that_sets_an_attribute_before_reading_it_replays_though_another_call_changed_it(backend, make):
    """An eager call of another shape leaves another table in the attribute; the rerun sets the captured one back
    before reading it, as a device graph reads it: the replay goes on."""
    module, x = make(), torch.ones(4, 8)
    with torch.inference_mode():
        graph = backend.capture(lambda: module(x))
        module(torch.ones(6, 8))
    x.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(graph.outputs[:, 0], torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_graphs_whose_callables_point_a_shared_holder_at_their_own_buffers_replay_in_any_order(backend):
    weight = torch.randn(8, 3)
    holder = types.SimpleNamespace(buffers={(16, 1): torch.zeros(4, 8), (32, 2): torch.zeros(6, 8)}, current=None)

    def forward_for(key):
        def forward():
            holder.current = holder.buffers[key]
            return holder.current @ weight
        return forward

    with torch.inference_mode():
        a = backend.capture(forward_for((16, 1)))
        b = backend.capture(forward_for((32, 2)))
    holder.buffers[16, 1].copy_(torch.ones(4, 8))
    holder.buffers[32, 2].copy_(torch.full((6, 8), 2.0))
    for graph in (a, b, a, a, b):
        graph.replay()
    torch.testing.assert_close(a.outputs, torch.ones(4, 8) @ weight)
    torch.testing.assert_close(b.outputs, torch.full((6, 8), 2.0) @ weight)
    holder.buffers[16, 1] = torch.ones(4, 8)  # replaced where the callable finds it: stale after the rerun too
    with pytest.raises(CaptureError, match=r"would read holder\.current, now a tensor of shape \(6, 8\)"):
        a.replay()


def test_a_replaced_tensor_of_another_shape_is_refused_though_the_rerun_fails_on_it(backend):
    """The rerun runs before the refusal now: where it fails on the tensor put in place, the refusal is the error."""
    holder, weight = types.SimpleNamespace(x=torch.zeros(4, 8)), torch.ones(8, 3)
    graph = backend.capture(lambda: holder.x @ weight)
    holder.x = torch.ones(4, 5)
    with pytest.raises(CaptureError, match=r"would read holder\.x, now a tensor of shape \(4, 5\)") as refused:
        graph.replay()
    assert isinstance(refused.value.__context__, RuntimeError)  # the rerun's own error, kept
    torch.testing.assert_close(graph.outputs, torch.zeros(4, 3))


# ---------------------------------------------------------------- captures overlapping in two threads
@pytest.mark.parametrize("fails, stance", [(None, "default"), ("first", "default"), ("second", "default"),
                                           (None, "eager_on_recompile")])
def test_overlapping_captures_in_two_threads_put_the_compiler_stance_back_when_the_last_one_ends(fails, stance):
    """The first capture in sets ``force_eager`` and the last one out puts back the stance it found: each putting back
    what it found would leave ``force_eager`` for good (the second found the first's), or end it under the other."""
    import threading

    import torch._dynamo  # noqa: F401 - the stance is set only where dynamo is loaded
    from torch._dynamo import eval_frame

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, {}

    def make(name):
        calls = []

        def fn():
            calls.append(1)
            if len(calls) == 2:  # the capture's run; the first is the warm-up
                if name == "first":
                    first_in.set()
                    assert second_in.wait(10)
                else:
                    second_in.set()
                    assert first_out.wait(10)
                seen[name] = eval_frame._stance.stance  # the first one has left: still forced for the second
                if fails == name:
                    raise ValueError(f"{name} failed")
            return torch.ones(2) * 2
        return fn

    def capture(name):
        try:
            CpuGraphBackend().capture(make(name))
        except CaptureError as exc:
            errors[name] = str(exc)
        finally:
            if name == "first":
                first_out.set()

    threads = {name: threading.Thread(target=capture, args=(name,)) for name in ("first", "second")}
    with torch.compiler.set_stance(stance):
        threads["first"].start()
        assert first_in.wait(10)
        threads["second"].start()
        for thread in threads.values():
            thread.join(20)
        assert seen == {"first": "force_eager", "second": "force_eager"}
        assert errors == ({} if fails is None else {fails: f"capture failed: ValueError: {fails} failed"})
        assert eval_frame._stance.stance == stance
    assert eval_frame._stance.stance == "default"
    from hwgraph.graphs.read_recording import FORCED_EAGER

    assert FORCED_EAGER.depth == 0


class Slotted:
    __slots__ = ("__x", "y")

    def __init__(self, x):
        self.__x, self.y = x, None

    def read(self):
        return self.__x * 2


def hooked():
    """A module whose inner linear's forward hook adds a vector its closure holds."""
    module, shift = Scaled(), {"v": torch.ones(4)}
    module.lin.register_forward_hook(lambda lin, args, out: out + shift["v"])
    return module, shift


@pytest.mark.parametrize("make, replace, message", [
    # another view of the same storage (a ring buffer's next slot), and the same storage moved by resize_
    pytest.param(lambda: (types.SimpleNamespace(ring=None, x=None),),
                 None, r"would read holder\.x, now a tensor of shape \(4,\), torch\.float32, at 0x", id="view"),
    pytest.param(lambda: (Scaled(),), lambda m: resized(m.lin.weight),
                 r"would read self\.lin\.weight, now a tensor of shape \(4, 4\)", id="storage-resized"),
    pytest.param(lambda: (Scaled(),), lambda m: setattr(m.lin, "bias", None),
                 r"would find self\.lin\.bias now None: the capture read a tensor of shape \(4,\)", id="bias-removed"),
    pytest.param(lambda: (Slotted(torch.ones(3)).read,), lambda f: setattr(f.__self__, "_Slotted__x", torch.ones(3)),
                 r"would read self\._Slotted__x, now", id="a-private-slot"),
    pytest.param(lambda: (functools.partial(lambda d: d[1, "a"] + 1, {(1, "a"): torch.ones(3)}),),
                 lambda f: f.args[0].__setitem__((1, "a"), torch.ones(3)),
                 r"would read partial\.args\[0\]\[\(1, 'a'\)\]", id="a-tuple-key"),
    pytest.param(lambda: (functools.partial(lambda q: q[0] + 1, deque([torch.ones(3)])),),
                 lambda f: f.args[0].__setitem__(0, torch.ones(3)), r"would read partial\.args\[0\]\[0\]",
                 id="a-deque"),
    pytest.param(hooked, lambda m, shift: shift.__setitem__("v", torch.zeros(4)),
                 r"would read self\.lin\._forward_hooks\[\d+\]\.<closure>\.shift\['v'\]",
                 id="a-forward-hooks-closure"),
])
def test_replaced_views_moved_storages_removed_tensors_and_holders_the_search_skipped_are_refused(backend, make,
                                                                                                  replace, message):
    """A device graph reads the captured view's address at every replay: another view of the same storage, the same
    storage resized elsewhere (FSDP's free and re-make), a tensor removed (``lin.bias = None``) all replayed on the
    CPU backend, which compared storages only and took a way to None for no read; and tensors held in ``__slots__``,
    under a tuple key, in a deque or in a forward hook's closure were not searched at all."""
    made = make()
    if replace is None:  # the view case: the holder points at slot 0 of a ring, then at slot 1
        holder = made[0]
        holder.ring = torch.zeros(2, 4)
        holder.x = holder.ring[0]
        graph = backend.capture(lambda: holder.x * 2)
        holder.ring[1].fill_(7.0)
        holder.x = holder.ring[1]
    else:
        graph = backend.capture(made[0])
        replace(*made)
    with pytest.raises(CaptureError, match=message):
        graph.replay()


def resized(tensor):
    """``tensor``'s storage freed and made again in place, its values put back: the same storage object elsewhere."""
    values, address = tensor.detach().clone(), tensor.data_ptr()
    with torch.no_grad():
        tensor.untyped_storage().resize_(0)
        squatter = torch.empty_like(values)  # takes the freed memory: the storage comes back elsewhere
        tensor.untyped_storage().resize_(values.numel() * values.element_size())
        tensor.copy_(values)
    assert tensor.data_ptr() != address, squatter.data_ptr()


def test_a_builtin_callables_own_error_is_raised_not_taken_for_the_recordings(backend):
    """A callable with no Python frame of its own raising only in the recorded run: the innermost frame was the
    capture's own call of it, taken for the recording's, and the callable ran a third time, unchecked."""
    values = map(torch.as_tensor, [1.0, "x", 2.0, 3.0])
    with pytest.raises(CaptureError, match="capture failed: TypeError"):
        backend.capture(functools.partial(next, values))  # the warm-up takes 1.0, the recorded run fails on "x"
    assert next(values).item() == 2.0  # no third run took it


def test_a_search_stopped_at_its_bound_says_how_many_reads_go_unchecked(backend, monkeypatch, caplog):
    from hwgraph.graphs import capture_reads, read_ways

    monkeypatch.setattr(read_ways, "MAX_OBJECTS", 3)
    monkeypatch.setattr(capture_reads, "MAX_OBJECTS", 3)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    with caplog.at_level("INFO", logger="hwgraph.graphs.capture_reads"):
        backend.capture(lambda: model(torch.ones(4)))
    assert "stopped at 3 objects: 8 of the 8 storages it read are not checked" in caplog.text


STEER = torch.ones(4)


def steer(module, args, out):
    return out + STEER


@pytest.mark.parametrize("move", [
    pytest.param(lambda m: m.lin.register_forward_hook(steer), id="a-hook-registered-again"),
    pytest.param(lambda m: m.register_buffer("x", m.__dict__.pop("x")), id="an-attribute-made-a-buffer"),
    pytest.param(lambda m: m.lin.register_buffer("bias", m.lin._parameters.pop("bias").detach()),
                 id="a-parameter-made-a-buffer"),
])
def test_a_tensor_read_where_the_capture_read_it_but_reached_another_way_replays(backend, move):
    """A way that now leads nowhere says nothing: the same tensor may be read where the search did not go. A hook
    removed and registered again (a new handle, a new key in ``_forward_hooks``) or a tensor moved into a module's
    buffers was refused as if it were gone, on every replay."""
    module = Scaled()
    handle = module.lin.register_forward_hook(steer)
    graph = backend.capture(module)
    handle.remove()
    move(module)
    graph.replay()
    torch.testing.assert_close(graph.outputs, module())


def test_another_view_of_the_storage_read_is_named_as_such_with_its_strides(backend):
    holder = types.SimpleNamespace(x=torch.ones(3, 3))
    graph = backend.capture(lambda: holder.x * 2)
    holder.x = holder.x.t()
    with pytest.raises(CaptureError, match=r"would read holder\.x, now a tensor of shape \(3, 3\), torch\.float32, at "
                                           r"0x[0-9a-f]+, strides \(1, 3\): the storage the capture read, but another "
                                           r"view of it or moved to another address"):
        graph.replay()
    column = torch.ones(4, 1)
    holder.x = column.t()  # (1, 4), strides (1, 1): read as column.view(1, 4) reads it
    graph = backend.capture(lambda: holder.x * 2)
    holder.x = column.view(1, 4)
    graph.replay()
