"""The tower against transformers at merge sizes other than 2, a tower that has run saved whole (pickled), and the
DeepStack mergers' side stream each thread gets."""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch

from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, merge_streams, preset_config
from hwgraph.models.qwen3_omni.reference import reference_encoder, run_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def module_level_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    from hwgraph.attention.sdpa import sdpa_varlen

    return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scale)


def perturbed(tower: Qwen3OmniVisionTower) -> Qwen3OmniVisionTower:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tower.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return tower.eval()


def pixels_for(tower, grid):
    g = torch.Generator().manual_seed(1)
    return torch.randn(sum(t * h * w for t, h, w in grid), tower.patch_row_width, generator=g)


@pytest.mark.parametrize("merge", [1, 3])
def test_merge_sizes_other_than_two_equal_transformers_down_to_a_single_merge_group(merge):
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower(preset_config("tiny", spatial_merge_size=merge), attention="TORCH_SDPA"))
    reference = reference_encoder(tower)
    for grid in ([(1, merge, merge)], [(2, merge, merge)], [(1, merge, 4 * merge), (3, 2 * merge, merge)]):
        pixels = pixels_for(tower, grid)
        with torch.no_grad():
            got, want = tower(pixels, grid), run_reference(reference, pixels, grid)
        assert got.embeds.shape == (sum(t * h * w for t, h, w in grid) // merge**2, tower.out_hidden_size)
        torch.testing.assert_close(got.embeds, want.embeds)
        assert len(got.deepstack) == len(want.deepstack) == tower.num_deepstack
        for g, w in zip(got.deepstack, want.deepstack, strict=True):
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("attention", ["TORCH_SDPA", None, module_level_attention])
def test_a_tower_that_has_run_pickles_and_gives_the_same_output(attention):
    """The chosen kernel's spec holds a gate lambda: after the first forward, ``torch.save(tower)`` (and any pickling,
    e.g. to a process pool) raised ``PicklingError: Can't pickle <function <lambda>``. The copy chooses again."""
    torch.manual_seed(0)
    tower = perturbed(Qwen3OmniVisionTower("tiny", attention=attention))
    grid = [(1, 4, 6), (2, 2, 2)]
    pixels = pixels_for(tower, grid)
    with torch.no_grad():
        want = tower(pixels, grid)
    buffer = io.BytesIO()
    torch.save(tower, buffer)
    buffer.seek(0)
    for copy in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(tower))):
        assert copy.attention_kernel == tower.attention_kernel
        with torch.no_grad():
            got = copy(pixels, grid)
        torch.testing.assert_close(got.embeds, want.embeds, rtol=0, atol=0)
        for g, w in zip(got.deepstack, want.deepstack, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert tower.attention_kernel  # the original keeps its kernel


def test_tensors_assigned_in_another_dtype_choose_the_attention_kernel_again(monkeypatch):
    """After ``load_state_dict(..., assign=True)`` with tensors of another dtype on the same device, the kernel chosen
    for the old dtype stayed (on a GPU: FLASH_ATTN, chosen for bf16, fed fp32)."""
    from hwgraph.attention import registry
    from hwgraph.attention.base import KernelSpec
    from hwgraph.capability import Capability
    from hwgraph.registry import BackendSpec

    fp32_only = KernelSpec(name="TOY_FP32", impl_path="hwgraph.attention.sdpa:sdpa_varlen", kinds=("cpu",),
                           dtypes=(torch.float32,), head_dims=(1, 256), graph_safe=True,
                           gate=lambda p: Capability.available(), priority=50)
    specs = (BackendSpec(name="toy", class_path="unused:Backend", kinds=("cpu",),
                         gate=lambda p: Capability.available(), attention=(fp32_only,)),)
    monkeypatch.setattr(registry, "backend_specs", lambda: specs)
    torch.manual_seed(0)
    tower = Qwen3OmniVisionTower.from_preset("tiny", depth=2, deepstack_visual_indexes=[0]).eval()
    assert tower.attention_kernel == "TOY_FP32"
    tower.load_state_dict({k: v.to(torch.bfloat16) for k, v in tower.state_dict().items()}, assign=True)
    assert tower.patch_embed.proj.weight.dtype == torch.bfloat16
    assert tower.attention_kernel == "TORCH_SDPA"


class FakeStream:
    """torch.cuda.Stream's stand-in on a machine without CUDA; ``made`` lists every one made."""
    made: list[FakeStream] = []

    def __init__(self, device):
        self.device = device
        FakeStream.made.append(self)

    def __reduce_ex__(self, protocol):  # like torch.cuda.Stream: a tower holding one could not be deep-copied
        raise TypeError("cannot pickle 'Stream' object")


def merge_stream_of_a_thread(tower, device, hold: threading.Event | None = None):
    """``tower.merge_stream(device, 196)`` as a new thread sees it; that thread lives on until ``hold`` is set, or
    has ended when this returns (``hold`` None)."""
    got, asked = [], threading.Event()

    def run():
        try:
            got.append(tower.merge_stream(device, 196))
        finally:
            asked.set()
            if hold is not None:
                hold.wait(10)

    thread = threading.Thread(target=run)
    thread.start()
    assert asked.wait(10)
    if hold is None:
        thread.join(10)
        assert not thread.is_alive()
    return got[0]


def test_each_thread_gets_its_own_merge_stream_and_a_new_thread_takes_over_an_ended_threads(monkeypatch):
    """A stream that waits on a capturing stream joins that capture until it ends: with one merge stream per device
    for the process, another thread's eager forward put its DeepStack mergers into that thread's graph instead of
    running them. Threads that come and go take over ended threads' streams: each new stream costs cuBLAS workspaces
    that are kept for the process (34 MiB on the H200)."""
    import copy

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(FakeStream, "made", [])
    monkeypatch.setattr(merge_streams, "MERGE_STREAMS", {})
    tower, gpu0, gpu1 = Qwen3OmniVisionTower.from_preset("tiny"), torch.device("cuda", 0), torch.device("cuda", 1)
    mine = tower.merge_stream(gpu0, 196)
    assert isinstance(mine, FakeStream) and mine.device == gpu0
    assert Qwen3OmniVisionTower.from_preset("tiny").merge_stream(gpu0, 196) is mine  # every tower of this thread
    assert copy.deepcopy(tower).merge_stream(gpu0, 196) is mine

    hold = threading.Event()
    try:
        first = merge_stream_of_a_thread(tower, gpu0, hold)  # still alive while the next threads ask
        second = merge_stream_of_a_thread(tower, gpu0)
        assert first is not mine and second is not mine and first is not second
        assert first.device == second.device == gpu0
    finally:
        hold.set()
    for _ in range(3):  # both have ended (or will): one is taken over each time, and no stream is made
        assert merge_stream_of_a_thread(tower, gpu0) in (first, second)
    assert FakeStream.made == [mine, first, second]
    other_device = merge_stream_of_a_thread(tower, gpu1)  # an ended thread's stream on another device is not one
    assert other_device.device == gpu1 and FakeStream.made == [mine, first, second, other_device]
    assert tower.merge_stream(gpu0, 196) is mine


def test_a_thread_never_gets_the_stream_another_takes_over_from_an_ended_thread_of_its_id(monkeypatch):
    """Thread ids are reused (on Linux, the address of the thread's structure): an ended thread's stream still kept
    under its id is the new thread's of that id, unless a third thread, which listed the live threads before that one
    began, takes it over. That takeover and the new thread's look-up ran at the same time (the look-up took no lock):
    both threads got the same stream, so one's eager mergers could join the other's capture."""
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(FakeStream, "made", [])
    monkeypatch.setattr(merge_streams, "MERGE_STREAMS", {})
    gpu0 = torch.device("cuda", 0)
    go, looked_up, got = threading.Event(), threading.Event(), {}

    def new_thread():
        go.wait(10)
        got["new"] = merge_streams.thread_merge_stream(gpu0)
        looked_up.set()

    thread = threading.Thread(target=new_thread)
    thread.start()
    ended = FakeStream(gpu0)  # the stream of an ended thread whose id the new thread has
    merge_streams.MERGE_STREAMS[(gpu0, thread.ident)] = ended
    real_enumerate = threading.enumerate

    def enumerate_before_it_began():  # the live threads as listed just before the new thread began
        live = [t for t in real_enumerate() if t is not thread]
        go.set()
        looked_up.wait(1)  # its look-up runs now, unless it waits for the lock this thread holds
        return live

    monkeypatch.setattr(threading, "enumerate", enumerate_before_it_began)
    try:
        mine = merge_streams.thread_merge_stream(gpu0)
    finally:
        monkeypatch.setattr(threading, "enumerate", real_enumerate)
        go.set()
        thread.join(10)
    assert mine is ended  # taken over
    assert got["new"] is not mine
