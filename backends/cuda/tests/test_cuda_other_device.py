"""The tower, its kernels and its manager on a GPU that is not the current one (``cuda:1`` while ``cuda:0`` is
current), as a user who passes ``device="cuda:1"`` instead of calling ``torch.cuda.set_device`` runs them.

Triton launches on the current device whatever its arguments' device is, so each launcher has to switch to its
tensors' GPU; ATen's ops guard their device themselves. Every test leaves ``cuda:0`` current, allocates nothing
there, and compares with the same computation run with ``cuda:1`` current."""

from __future__ import annotations

import pytest
import torch

from hwgraph.attention.registry import list_kernels
from hwgraph.budget_capture import relative_error
from hwgraph.manager import EncoderGraphManager
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower
from hwgraph.platform import detect
from hwgraph.testing.reference import assert_matches_reference, random_packed_batch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs two CUDA GPUs, {torch.cuda.device_count()} visible"),
]

OTHER = torch.device("cuda", 1)
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}  # as test_cuda_manager's


def graph_safe_kernels() -> list[str]:
    if torch.cuda.device_count() < 2:
        return ["none"]  # collected, then skipped by the module's mark
    return [spec.name for spec, cap in list_kernels(detect(), torch.bfloat16, 72) if cap.ok and spec.graph_safe]


@pytest.fixture(autouse=True)
def first_gpu_current(request):
    """``cuda:0`` current throughout; nothing the test runs may leave another GPU current, nor allocate on
    ``cuda:0`` unless it has a tower there (``first_gpu_tower``)."""
    torch.cuda.set_device(0)
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    yield
    assert torch.cuda.current_device() == 0, "a launch left another GPU current"
    torch.cuda.synchronize(0)
    if "first_gpu_tower" not in request.fixturenames:
        # at most what an earlier test's garbage, freed meanwhile, gave back
        assert torch.cuda.memory_allocated(0) <= before, "memory was allocated on cuda:0, not on the tensors' GPU"


@pytest.fixture(scope="module")
def tower():
    torch.manual_seed(0)
    # Real widths (hidden 1152, 16 heads of 72), two blocks: every kernel of a block, quick to compile and capture.
    return Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", depth=2, deepstack_visual_indexes=[0, 1]).to(
        OTHER, torch.bfloat16).eval()


@pytest.fixture
def first_gpu_tower():
    torch.manual_seed(1)
    return Qwen3OmniVisionTower.from_preset("qwen3-omni-30b-a3b", depth=2, deepstack_visual_indexes=[0, 1]).to(
        "cuda:0", torch.bfloat16).eval()


def pixels(grid, seed: int, device: torch.device = OTHER) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grid)
    return torch.randn(rows, 1536, device=device, dtype=torch.bfloat16, generator=g)


def forward_with_its_gpu_current(tower, pix, grid) -> tuple[torch.Tensor, ...]:
    """The eager forward with ``pix``'s GPU current: what each run with ``cuda:0`` current must equal."""
    with torch.cuda.device(pix.device), torch.inference_mode():
        return tuple(t.clone() for t in tower.forward(pix, grid).tensors())


@pytest.mark.parametrize(("max_seqlen", "use_gluon", "use_tma"),
                         [(300, False, False), (300, False, True), (300, True, None), (4096, True, None)],
                         ids=["pointer", "tma", "gluon", "pingpong-fixed-shift"])
def test_each_triton_attention_kernel_runs_on_its_tensors_gpu(max_seqlen, use_gluon, use_tma):
    from hwgraph.attention.triton_kernel import launch_varlen_attention

    lengths = [300, 49, 1] if max_seqlen == 300 else [4096]
    batch = random_packed_batch(lengths, 16, 72, zero_length=1, padding_rows=7 if max_seqlen == 300 else 0,
                                max_seqlen=max_seqlen, dtype=torch.bfloat16, device=OTHER, seed=max_seqlen)
    out = launch_varlen_attention(*batch.args(), use_gluon=use_gluon, use_tma=use_tma)
    assert out.device == OTHER
    assert_matches_reference(out, batch)


@pytest.mark.parametrize("kernel", graph_safe_kernels())
def test_eager_tower_runs_on_its_gpu_with_every_kernel(tower, kernel):
    tower.set_attention(kernel)
    grid = [(1, 14, 14), (1, 8, 16)]
    pix = pixels(grid, 1)
    want = forward_with_its_gpu_current(tower, pix, grid)
    with torch.inference_mode():
        got = tower.forward(pix, grid).tensors()
    for g, w in zip(got, want, strict=True):
        assert g.device == OTHER
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same kernels on the same GPU


MANAGER_CASES = [(kernel, False, False) for kernel in graph_safe_kernels()] + [("TRITON_ATTN", True, True)]


@pytest.mark.parametrize(("kernel", "compiled", "measured"), MANAGER_CASES,
                         ids=[f"{k}-{'compiled-measured' if c else 'plain'}" for k, c, _ in MANAGER_CASES])
def test_manager_captures_replays_and_falls_back_on_its_gpu(tower, kernel, compiled, measured):
    if kernel not in graph_safe_kernels():
        pytest.skip(f"{kernel} is not available here")
    groups = [[(1, 14, 14)], [(1, 14, 14), (1, 8, 8)], [(1, 32, 32)], [(1, 64, 64)]]  # the last is over budget
    tower.set_attention(kernel)
    wants = [forward_with_its_gpu_current(tower, pixels(g, i), g) for i, g in enumerate(groups)]
    with EncoderGraphManager(tower, budgets=[64, 256], max_images_per_graph=2, attention=kernel, compile=compiled,
                             measure_products=measured, device=OTHER) as m:
        m.capture()
        stats = m.stats()
        assert sorted(m.graphs) == [64, 256], stats["capture_failures"]
        assert not stats["compile_failures"] and stats["compile_skipped"] is None
        for i, grid in enumerate(groups):
            got = m.encode(pixels(grid, i), grid)
            for image, want in zip(got, split(wants[i], grid), strict=True):
                for g, w in zip(image.tensors(), want, strict=True):
                    assert g.device == OTHER
                    torch.testing.assert_close(g, w, **BF16)
                    assert relative_error(g, w) < 1e-2
        with m.backend.sync_guard():  # the replay path reads nothing back on this GPU either
            m.encode(pixels(groups[0], 0), groups[0])
        stats = m.stats()
        assert (stats["hits"], stats["misses"]) == (5, 1) and stats["eager_reasons"] == {"over budget": 1}
        if measured:
            assert stats["products"].startswith("measured cuBLASLt algorithms"), stats["products"]


def test_managers_on_two_gpus_in_one_process_replay_side_by_side(tower, first_gpu_tower):
    """Each GPU has its own shared capture stream, graphs and pool: replays alternating between the two managers
    each equal their own tower's eager forward."""
    grid = [(1, 14, 14)]
    with EncoderGraphManager(first_gpu_tower, budgets=[64], max_images_per_graph=1, attention="auto") as first, \
            EncoderGraphManager(tower, budgets=[64], max_images_per_graph=1, attention="auto") as second:
        first.capture()
        second.capture()
        assert (first.device, second.device) == (torch.device("cuda", 0), OTHER)
        assert first.backend.capture_stream().device == torch.device("cuda", 0)
        assert second.backend.capture_stream().device == OTHER
        for i in range(3):
            for m in (first, second):
                pix = pixels(grid, i, m.device)
                want = forward_with_its_gpu_current(m.tower, pix, grid)
                for g, w in zip(m.encode(pix, grid)[0].tensors(), want, strict=True):
                    assert g.device == m.device
                    torch.testing.assert_close(g, w, **BF16)
                    assert relative_error(g, w) < 1e-2
        assert first.stats()["hits"] == second.stats()["hits"] == 3


def split(tensors: tuple[torch.Tensor, ...], grid) -> list[tuple[torch.Tensor, ...]]:
    """A group's output tensors (each ``[tokens, ...]`` for every image) cut into per-image tuples."""
    counts = [t * h * w // 4 for t, h, w in grid]
    return list(zip(*(t.split(counts) for t in tensors), strict=True))
