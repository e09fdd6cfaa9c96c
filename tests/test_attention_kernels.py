"""The varlen attention kernels on CPU against the float64 reference.

TORCH_SDPA runs here directly. TRITON_ATTN runs under the Triton interpreter, which triton only enables when
TRITON_INTERPRET=1 is set before triton itself is imported, and which, once set, would make TRITON_ATTN the
automatic choice for every other test in the process. So the ``interpreted`` tests run in a child pytest with
TRITON_INTERPRET=1 (``test_triton_attn_cases_pass_under_the_interpreter``), and skip in a process without it.
The plugin adapters (FLASH_ATTN, ROCM_AITER_FA, NPU) run with fake vendor modules that compute the reference.
TRITON_ATTN's launch choices are checked with its Triton kernels recording instead of launching (the ``triton_kernel``
fixture of conftest.py), and the float64 reference's own checks come last.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from hwgraph.attention.base import KernelSpec
from hwgraph.attention.sdpa import masked_sdpa, sdpa_varlen, sdpa_varlen_op
from hwgraph.attention.triton_attn import interpreter_enabled, triton_varlen, triton_varlen_op
from hwgraph.attention.varlen_inputs import launches_on_tensor_device, register_varlen_kernel
from hwgraph.graphs.base import HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend
from hwgraph.testing.reference import (
    ATTENTION_TOLERANCES,
    PackedBatch,
    assert_matches_reference,
    random_packed_batch,
    random_seqlens,
    varlen_reference,
)
from hwgraph.testing.simulate import DeviceProperties, simulate_gpu

INTERPRETED = interpreter_enabled()
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="runs in a child pytest with TRITON_INTERPRET=1 "
                            "(test_triton_attn_cases_pass_under_the_interpreter)")


def random_batch(seed: int, head_dim: int, dtype: torch.dtype, max_seqs: int, max_len: int) -> PackedBatch:
    """1..max_seqs sequences, 0..2 zero-length ones at the end and 0..17 padding rows past the last."""
    rng = random.Random(seed)
    seqlens = random_seqlens(rng, max_seqs=max_seqs, max_len=max_len)
    return random_packed_batch(seqlens, heads=2, head_dim=head_dim, zero_length=rng.randint(0, 2),
                               padding_rows=rng.randint(0, 17), dtype=dtype, seed=seed)


# ---------------------------------------------------------------- TORCH_SDPA


@pytest.mark.parametrize("head_dim", [72, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_sdpa_matches_reference_on_random_packed_batches(seed, dtype, head_dim):
    batch = random_batch(seed, head_dim, dtype, max_seqs=6, max_len=700)
    assert_matches_reference(sdpa_varlen(*batch.args()), batch)


def test_sdpa_treats_every_row_as_padding_when_all_sequences_are_empty():
    batch = random_packed_batch([], heads=2, head_dim=72, zero_length=3, padding_rows=5)
    out = sdpa_varlen(*batch.args())
    assert torch.equal(out, torch.zeros_like(out))


def test_sdpa_keeps_single_token_sequences_apart():
    batch = random_packed_batch([1, 1, 1, 2], heads=3, head_dim=16, padding_rows=2, max_seqlen=64)
    out = sdpa_varlen(*batch.args())
    assert_matches_reference(out, batch)
    torch.testing.assert_close(out[:3], batch.v[:3])  # a one-token sequence attends only to itself


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_sdpa_keeps_non_finite_padding_rows_out_of_real_rows(poison):
    """A graph's padding rows keep what an earlier, larger call left there; a masked key's softmax weight is 0, and
    0 times NaN or inf is NaN, so the kernel must not multiply them at all (as the CUDA kernels' tests demand)."""
    batch = random_packed_batch([20, 3], heads=2, head_dim=72, zero_length=1, padding_rows=5, max_seqlen=32)
    clean = sdpa_varlen(*batch.args())
    real = int(batch.cu_seqlens[-1])
    for t in (batch.q, batch.k, batch.v):
        t[real:] = poison
    with CpuGraphBackend().sync_guard():
        poisoned = sdpa_varlen(*batch.args())
        raw = sdpa_varlen.padding_unspecified(*batch.args())
    assert torch.equal(poisoned, clean)
    assert torch.equal(raw[:real], clean[:real])



@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("which", [1, 2])  # k, v
def test_sdpa_keeps_a_sequences_non_finite_k_or_v_out_of_the_other_sequences(poison, which):
    """As for padding rows, between real sequences: one image's non-finite k or v reached every image packed in the
    same call (a masked key's weight is 0, and 0 times NaN is NaN), as it does not with TRITON_ATTN. The sequence
    that holds it comes out NaN in that head, as it would attending alone."""
    batch = random_packed_batch([20, 3, 5], heads=2, head_dim=72, padding_rows=2, max_seqlen=32)
    clean = sdpa_varlen(*batch.args())
    batch.args()[which][20:23, 1] = poison  # the second sequence, head 1
    with CpuGraphBackend().sync_guard():
        out = sdpa_varlen(*batch.args())
    others = torch.cat([torch.arange(20), torch.arange(23, 30)])
    assert torch.equal(out[others], clean[others])
    assert torch.equal(out[20:23, 0], clean[20:23, 0]) and torch.isnan(out[20:23, 1]).all()


# ---------------------------------------------------------------- TRITON_ATTN under the interpreter


# A loop bounded by a loaded, clamped value: what TRITON_ATTN's key loop does. triton 3.6's interpreter fails on it
# under numpy 2.5 ("only 0-dimensional arrays can be converted to Python scalars"; the H200 device's environment).
INTERPRETER_PROBE = """
import numpy, torch, triton, triton.language as tl

@triton.jit
def probe(X, Out):
    n = tl.load(X)
    end = tl.where(0 < n, n, 0) // 2 * 2
    total = 0
    for _ in range(0, end, 2):
        total += 1
    tl.store(Out, total)

out = torch.zeros(1, dtype=torch.int32)
probe[(1,)](torch.tensor([5], dtype=torch.int32), out)
assert out.item() == 2, out
"""


def interpreter_problem(env: dict) -> str | None:
    """Why this environment's Triton interpreter cannot run a loop bounded by a loaded value, or None."""
    done = subprocess.run([sys.executable, "-c", INTERPRETER_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    if done.returncode == 0:
        return None
    import numpy
    import triton

    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"triton {triton.__version__}'s interpreter cannot run a loop bounded by a loaded value with numpy "
            f"{numpy.__version__} here (a vendor incompatibility, not TRITON_ATTN's code): {last}")


def test_triton_attn_cases_pass_under_the_interpreter():
    """Runs this file's ``interpreted`` tests in a child pytest with TRITON_INTERPRET=1 set from the start."""
    if INTERPRETED:
        pytest.skip("already under TRITON_INTERPRET=1: the interpreted tests run in this process")
    pytest.importorskip("triton", reason="TRITON_ATTN needs the triton package")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["TRITON_INTERPRET"] = "1"
    problem = interpreter_problem(env)
    if problem:
        pytest.skip(problem)
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-k", "interpreted",
           "-p", "no:cacheprovider", "-p", "no:xdist"]
    done = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                          timeout=600)
    report = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"interpreted TRITON_ATTN tests failed:\n{report}"
    summary = [line for line in done.stdout.splitlines() if line.strip()][-1]
    assert "passed" in summary and "skipped" not in summary, report


@interpreted
@pytest.mark.parametrize("head_dim", [20, 72, 96, 128])  # one padded part, 64+16 (8 used), 64+32, one exact part
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(2))
def test_interpreted_triton_matches_reference_on_random_packed_batches(seed, dtype, head_dim):
    batch = random_batch(100 + seed, head_dim, dtype, max_seqs=4, max_len=150)
    assert_matches_reference(triton_varlen(*batch.args()), batch)


@interpreted
@pytest.mark.parametrize("seqlens", [[64], [65], [1, 128, 63], [200]], ids=str)
def test_interpreted_triton_handles_block_edges_and_a_budget_max_seqlen(seqlens):
    # max_seqlen is the capture budget, larger than any real sequence: extra query blocks must do nothing.
    batch = random_packed_batch(seqlens, heads=2, head_dim=72, zero_length=2, padding_rows=70, max_seqlen=256,
                                dtype=torch.float16, seed=len(seqlens))
    assert_matches_reference(triton_varlen(*batch.args()), batch)


@interpreted
def test_interpreted_triton_zeroes_every_row_when_all_sequences_are_empty():
    batch = random_packed_batch([], heads=2, head_dim=72, zero_length=2, padding_rows=150, max_seqlen=64)
    out = triton_varlen(*batch.args())
    assert torch.equal(out, torch.zeros_like(out))


@interpreted
def test_interpreted_triton_reads_strided_qkv_views():
    # The tower splits q, k, v out of one fused projection: views with a token stride of 3 * heads * head_dim.
    batch = random_packed_batch([30, 9], heads=2, head_dim=72, padding_rows=4, max_seqlen=32)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)  # [T, 3, H, D]
    out = triton_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], batch.cu_seqlens, batch.max_seqlen, batch.scale)
    assert_matches_reference(out, batch)


@interpreted
@pytest.mark.parametrize("head_dim", [24, 64, 72, 128])  # 72: k in boxes of 64 + 16, the last 8 lanes read as zeros
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tiles", [None, (32, 32, 4, 3)], ids=["hopper-tiles", "small-tiles"])
def test_interpreted_triton_tma_kernel_matches_reference(tiles, dtype, head_dim):
    """The Hopper kernel (k and v through TMA descriptors), forced under the interpreter: several sequences, block
    edges, a zero-length slot, garbage padding rows, a budget-sized max_seqlen and the tower's strided qkv views."""
    from hwgraph.attention.triton_kernel import launch_varlen_attention

    batch = random_packed_batch([1, 64, 33, 129], heads=2, head_dim=head_dim, zero_length=1, padding_rows=40,
                                max_seqlen=256, dtype=dtype, seed=head_dim)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)  # [T, 3, H, D]
    out = launch_varlen_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], batch.cu_seqlens, batch.max_seqlen,
                                  batch.scale, tiles=tiles, use_tma=True)
    assert_matches_reference(out, batch)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_overflow_fixup_rewrites_exactly_the_flagged_query_blocks(dtype):
    """The ping-pong kernel's fallback (``launch_overflow_fixup``): the 64-row query blocks whose flag is set get the
    reference's values, every other row keeps what it held, and flags past a sequence's rows (or of an empty slot)
    are never acted on."""
    from hwgraph.attention.triton_kernel import launch_overflow_fixup
    from hwgraph.testing.reference import ATTENTION_TOLERANCES

    batch = random_packed_batch([130, 64, 1], heads=2, head_dim=72, zero_length=1, padding_rows=9, max_seqlen=256,
                                dtype=dtype, seed=11)
    blocks, slots, heads = 4, 4, 2  # 256 rows of budget in 64-row blocks; three sequences and an empty slot
    flags = torch.zeros(slots, heads, blocks, dtype=torch.int32)
    chosen = [(0, 0, 1), (0, 1, 2), (1, 1, 0), (2, 0, 0)]  # (slot, head, block): rows 64-127, 128-129, all, all
    for slot, head, block in chosen:
        flags[slot, head, block] = 1
    flags[2, 1, 3] = flags[3, 0, 0] = flags[1, 0, 2] = 1  # past the sequence's one row, the empty slot, past 64
    out = torch.full_like(batch.q, 7.0)
    launch_overflow_fixup(batch.q, batch.k, batch.v, out, batch.cu_seqlens, flags.flatten(), blocks, 64,
                          batch.scale)
    want = varlen_reference(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.scale)
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    rewritten = torch.zeros(out.shape[:2], dtype=torch.bool)
    bounds = batch.cu_seqlens.tolist()
    for slot, head, block in chosen:
        rows = slice(bounds[slot] + 64 * block, min(bounds[slot] + 64 * (block + 1), bounds[slot + 1]))
        rewritten[rows, head] = True
    got = out.to(torch.float64)
    torch.testing.assert_close(got[rewritten], want[rewritten], atol=atol, rtol=rtol)
    assert rewritten.sum() == 64 + 2 + 64 + 1
    assert torch.equal(out[~rewritten], torch.full_like(out[~rewritten], 7.0))


def test_overflow_fixup_rejects_flags_too_short_for_the_grid():
    launch_overflow_fixup = pytest.importorskip("hwgraph.attention.triton_kernel").launch_overflow_fixup
    batch = random_packed_batch([10, 3], heads=2, head_dim=72, max_seqlen=64)
    with pytest.raises(ValueError, match=r"at least blocks \* heads \* slots = 2 \* 2 \* 2 entries, got torch.int32 "
                                         r"with 7"):
        launch_overflow_fixup(batch.q, batch.k, batch.v, torch.empty_like(batch.q), batch.cu_seqlens,
                              torch.zeros(7, dtype=torch.int32), 2, 64, batch.scale)


def test_triton_attn_takes_the_tma_kernel_only_on_nvidia_hopper_with_aligned_k_and_v(monkeypatch):
    """Simulated: torch reports a GPU of the given compute capability and ``q`` stands in for a tensor on it
    (``uses_tma`` reads only its device, dtype and shape); k and v are CPU tensors with the layouts TMA must read."""
    pytest.importorskip("triton.tools.tensor_descriptor")  # Triton 3.4+: the TMA kernel's host descriptors
    triton_kernel = pytest.importorskip("hwgraph.attention.triton_kernel")
    monkeypatch.setattr(triton_kernel, "has_tma", triton_kernel.has_tma.__wrapped__)  # uncached: the GPU changes
    monkeypatch.setattr(triton_kernel, "is_interpreted", lambda: False)  # the compiled kernel's choice
    batch = random_packed_batch([5], heads=2, head_dim=72, dtype=torch.bfloat16)

    def takes_tma(q=batch.q, k=batch.k, v=batch.v, *, major=9, hip=None):
        simulate_gpu(monkeypatch, cuda="12.8", hip=hip, props=DeviceProperties("simulated GPU", major, 0))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (major, 0))
        on_gpu = types.SimpleNamespace(is_cuda=True, dtype=q.dtype, shape=q.shape, element_size=q.element_size,
                                       device=torch.device("cuda", 0))
        return triton_kernel.uses_tma(on_gpu, k, v)

    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)  # the tower's views of one fused projection
    assert takes_tma() and takes_tma(*qkv.unbind(1)) and takes_tma(batch.q.half(), batch.k.half(), batch.v.half())
    assert takes_tma(major=10)  # Blackwell has TMA too
    assert not triton_kernel.uses_tma(batch.q, batch.k, batch.v)  # CPU tensors
    assert not takes_tma(major=8)  # Ampere: no TMA
    assert not takes_tma(hip="6.2.41133")  # a ROCm build: its devices answer to torch.cuda too
    assert not takes_tma(batch.q.float(), batch.k.float(), batch.v.float())
    wide = random_packed_batch([5], heads=2, head_dim=200, dtype=torch.bfloat16)
    assert not takes_tma(wide.q, wide.k, wide.v)  # padded to 256 lanes: the tiles do not fit shared memory
    misaligned = torch.zeros(batch.k.numel() + 1, dtype=torch.bfloat16)[1:].view(batch.k.shape)  # base + 2 bytes
    odd_rows = torch.zeros(5, 2 * 72 + 4, dtype=torch.bfloat16)[:, :144].unflatten(1, (2, 72))  # 296-byte rows
    heads_apart = torch.zeros(5, 2, 2 * 72, dtype=torch.bfloat16)[..., :72]
    for bad in (misaligned, odd_rows, heads_apart):
        assert not takes_tma(k=bad) and not takes_tma(v=bad)


def test_the_tma_kernel_serves_heads_of_32_to_128_lanes_in_16_byte_multiples(monkeypatch):
    """128 lanes is the widest head whose TMA tiles fit shared memory (``uses_tma``); 200 (256 lanes) is not. A head
    narrower than 32 lanes, or whose bytes are not a multiple of 16, takes the pointer kernel."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    monkeypatch.setattr(module, "has_tma", module.has_tma.__wrapped__)
    monkeypatch.setattr(module, "is_interpreted", lambda: False)
    simulate_gpu(monkeypatch, cuda="12.8", props=DeviceProperties("simulated H200", 9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    # A head of 4, 12, 20 or 36 lanes is not a multiple of 16 bytes: the TMA and Gluon kernels crashed the H100 there;
    # at 24 lanes the ping-pong kernel gave wrong outputs. Below 32 lanes every head takes the pointer kernel.
    for head_dim, tma in ((128, True), (200, False), (4, False), (12, False), (20, False), (36, False), (8, False),
                          (16, False), (24, False), (32, True), (40, True), (72, True)):
        batch = random_packed_batch([5], heads=2, head_dim=head_dim, dtype=torch.bfloat16)
        on_gpu = types.SimpleNamespace(is_cuda=True, dtype=batch.q.dtype, shape=batch.q.shape,
                                       element_size=batch.q.element_size, device=torch.device("cuda", 0))
        assert module.uses_tma(on_gpu, batch.k, batch.v) is tma, head_dim


def test_tile_choices_follow_the_documented_thresholds():
    module = pytest.importorskip("hwgraph.attention.triton_kernel")
    gluon_kernel = pytest.importorskip("hwgraph.attention.gluon_kernel")
    # TMA tiles: 128x128 with 8 warps from max_seqlen 1024 (one sequence of 1024: 0.0226 against 0.0261 ms)
    assert module.tma_tiles(1024) == (128, 128, 8, 3) and module.tma_tiles(1023) == (64, 64, 4, 3)
    # fp32 and wide heads shrink their tiles to fit shared memory
    assert module.block_sizes(72, torch.float32) == (64, 32, 64, 16)
    assert module.block_sizes(72, torch.bfloat16) == (64, 64, 64, 16)
    assert module.block_sizes(64, torch.float32) == (64, 64, 64, 0)
    assert module.block_sizes(200, torch.float32) == (32, 16, 256, 0)
    assert module.block_sizes(200, torch.bfloat16) == (32, 32, 256, 0)
    # the ping-pong kernel's fixed shifts: bf16 from FIXED_SHIFT_FROM rows, never fp16
    assert gluon_kernel.uses_fixed_shift(torch.bfloat16, 2048)
    assert not gluon_kernel.uses_fixed_shift(torch.bfloat16, 2047)
    assert not gluon_kernel.uses_fixed_shift(torch.float16, 4096)


@interpreted
def test_interpreted_triton_op_passes_opcheck():
    batch = random_packed_batch([5, 7], heads=2, head_dim=72, zero_length=1, padding_rows=3)
    torch.library.opcheck(triton_varlen_op, batch.args())


@interpreted
def test_interpreted_triton_eager_output_is_contiguous_for_a_transposed_q():
    # A [H, T, D] q seen as [T, H, D] is dense, and the launcher allocated its output like it: in eager the public
    # function returned that layout (``view(tokens, -1)`` raised), compiled the op's contiguous one.
    batch = random_packed_batch([5, 7], heads=2, head_dim=72, zero_length=1, padding_rows=3)
    q = batch.q.transpose(0, 1).contiguous().transpose(0, 1)
    out = triton_varlen(q, *batch.args()[1:])
    assert out.is_contiguous(), f"strides {out.stride()}"
    assert_matches_reference(out, batch)


@interpreted
def test_interpreted_triton_op_output_has_its_fakes_strides_for_a_q_without_unit_stride_on_d():
    # The launcher copies such a q to unit stride on D and allocates its output like the copy.
    batch = random_packed_batch([5, 7], heads=2, head_dim=72, zero_length=1, padding_rows=3)
    q = batch.q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.library.opcheck(triton_varlen_op, (q, *batch.args()[1:]), test_utils=("test_faketensor",))


@interpreted
def test_interpreted_triton_replays_in_the_cpu_graph_backend_with_new_cu_seqlens():
    replay_with_new_cu_seqlens(triton_varlen)


@interpreted
def test_interpreted_triton_reads_no_device_memory_on_the_host():
    batch = random_packed_batch([20, 3], heads=2, head_dim=72, zero_length=1, padding_rows=5)
    with CpuGraphBackend().sync_guard():
        out = triton_varlen(*batch.args())
    assert_matches_reference(out, batch)


@pytest.mark.parametrize(("head_dim", "split"), [(8, (16, 0)), (20, (32, 0)), (64, (64, 0)), (72, (64, 16)),
                                                (80, (64, 16)), (96, (64, 32)), (128, (128, 0)), (200, (256, 0))])
def test_triton_attn_splits_the_head_into_two_power_of_two_parts_when_narrower(head_dim, split):
    triton_kernel = pytest.importorskip("hwgraph.attention.triton_kernel")
    assert triton_kernel.head_split(head_dim) == split


def test_triton_attn_launch_grid_depends_only_on_host_values(triton_kernel):
    """The launch is sized by max_seqlen, heads and the number of sequences: no device value reaches the host."""
    batch = random_packed_batch([300, 2], heads=3, head_dim=72, zero_length=2, padding_rows=5, max_seqlen=512)
    with CpuGraphBackend().sync_guard():
        triton_varlen(*batch.args())
    (grid, _, meta), = triton_kernel.varlen_attention_kernel.calls
    assert grid == (512 // meta["BLOCK_M"], 3, 5)  # 4 sequence slots (2 real, 2 empty) + 1 padding slot
    assert (meta["HEAD_DIM"], meta["D_A"], meta["D_B"], meta["HAS_B"], meta["D_V"]) == (72, 64, 16, True, 128)


def test_an_all_empty_call_with_max_seqlen_zero_still_runs_the_padding_slot(triton_kernel):
    """The padding slot zeroes the rows past cu_seqlens[-1]: a grid with no m program would leave them unwritten."""
    batch = random_packed_batch([], heads=2, head_dim=72, zero_length=2, padding_rows=5)
    assert batch.max_seqlen == 0
    triton_varlen(*batch.args())
    ((grid, _, _),) = triton_kernel.varlen_attention_kernel.calls
    assert grid == (1, 2, 3)  # one m program, 2 heads, 2 empty slots + the padding slot


def test_inputs_without_unit_stride_on_d_reach_the_kernel_as_unit_stride_copies(triton_kernel):
    """The pointer kernel addresses lanes as ``base + lane``: a view with another stride on D (a transpose, every
    other lane) must be copied first, or it reads the wrong lanes."""
    batch = random_packed_batch([5, 3], heads=2, head_dim=16, padding_rows=2)
    lanes_apart = [torch.stack([t, torch.full_like(t, 9.0)], dim=-1)[..., 0] for t in (batch.q, batch.k, batch.v)]
    transposed = batch.q.transpose(1, 2).contiguous().transpose(1, 2)
    for q, k, v in ((*lanes_apart,), (transposed, batch.k, batch.v)):
        assert q.stride(-1) != 1
        triton_varlen(q, k, v, batch.cu_seqlens, batch.max_seqlen, batch.scale)
        (_, args, _), = triton_kernel.varlen_attention_kernel.calls[-1:]
        for given, original in zip(args[:3], (batch.q, batch.k, batch.v), strict=True):
            assert given.stride(-1) == 1 and torch.equal(given, original)


@pytest.mark.parametrize("value", ["1", "TRUE", "Yes", "on", "y", " yes ", "true ", "0", "", "off", "false", "no"])
def test_triton_interpret_is_read_as_triton_reads_it(monkeypatch, value):
    """The gate must agree with Triton, or TRITON_ATTN is refused on CPU while Triton interprets (``y``), or chosen
    while it does not (`` yes ``), and its first call fails."""
    knobs = pytest.importorskip("triton.knobs", reason="a Triton with knobs reads TRITON_INTERPRET itself")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreter_enabled() is bool(knobs.runtime.interpret)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter_enabled() is False



class OnAnotherGpu:
    """Stands in for a tensor on ``cuda:1``: what the launchers' device switch reads, nothing a kernel could use."""
    is_cuda = True
    device = torch.device("cuda", 1)


@pytest.mark.parametrize("launcher", [
    "hwgraph.attention.triton_kernel:launch_varlen_attention",
    "hwgraph.attention.triton_kernel:launch_overflow_fixup",
    "hwgraph.attention.gluon_kernel:launch_gluon_attention",
    "hwgraph.models.qwen3_omni.fused:rotary_qk_launch",
    "hwgraph.models.qwen3_omni.fused:add_layer_norm_launch",
    "hwgraph.models.qwen3_omni.fused:add_position_embedding_launch",
])
def test_every_triton_launcher_switches_to_its_tensors_gpu_first(monkeypatch, launcher):
    """Triton launches on the current GPU, not on its arguments': with ``cuda:0`` current, a launcher given
    ``cuda:1`` tensors must make ``cuda:1`` current before anything else (the H200 pair checks the results:
    ``backends/cuda/tests/test_cuda_other_device.py``)."""
    pytest.importorskip("triton", reason="the launchers import triton")
    module, name = launcher.split(":")
    launch = getattr(importlib.import_module(module), name)

    class Switched(Exception):
        pass

    def switch(device):
        raise Switched(device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", switch)
    with pytest.raises(Switched) as switched:
        launch(OnAnotherGpu())
    assert switched.value.args == (torch.device("cuda", 1),)


def test_the_launch_device_switch_wraps_the_launch_and_is_skipped_where_it_is_not_needed(monkeypatch):
    events = []

    @contextlib.contextmanager
    def switch(device):
        events.append(("enter", device))
        yield
        events.append("exit")

    launch = launches_on_tensor_device(lambda tensor, value: events.append(("launch", value)) or value)
    monkeypatch.setattr(torch.cuda, "device", switch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert launch(OnAnotherGpu(), 1) == 1
    assert events == [("enter", torch.device("cuda", 1)), ("launch", 1), "exit"]
    events.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # already current: no switch
    assert launch(OnAnotherGpu(), 2) == 2
    assert launch(torch.zeros(1), 3) == 3  # CPU tensors (the Triton interpreter): never a GPU switch
    assert events == [("launch", 2), ("launch", 3)]

# ---------------------------------------------------------------- graph discipline, host reads, custom ops


def replay_with_new_cu_seqlens(kernel) -> None:
    """Capture with one batch in static buffers, refill them with another (new boundaries), replay, compare."""
    first = random_packed_batch([40, 3, 17], heads=2, head_dim=72, zero_length=1, padding_rows=4, max_seqlen=64)
    second = random_packed_batch([64], heads=2, head_dim=72, zero_length=3, padding_rows=0, max_seqlen=64, seed=7)
    static = [t.clone() for t in (first.q, first.k, first.v, first.cu_seqlens)]
    backend = CpuGraphBackend()
    graph = backend.capture(lambda: kernel(*static, 64, first.scale))
    assert_matches_reference(graph.outputs, first)
    for buffer, fresh in zip(static, (second.q, second.k, second.v, second.cu_seqlens), strict=True):
        buffer.copy_(fresh)
    graph.replay()
    assert_matches_reference(graph.outputs, second)


def test_sdpa_replays_in_the_cpu_graph_backend_with_new_cu_seqlens():
    replay_with_new_cu_seqlens(sdpa_varlen)


def test_sdpa_reads_no_device_memory_on_the_host():
    batch = random_packed_batch([20, 3], heads=2, head_dim=72, zero_length=1, padding_rows=5)
    with CpuGraphBackend().sync_guard():
        out = sdpa_varlen(*batch.args())
        body = masked_sdpa(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.scale)  # the op body, unwrapped
    assert_matches_reference(out, batch)
    real = int(batch.cu_seqlens[-1])
    assert torch.equal(out[:real], body[:real])  # the body leaves padding rows to the public function


def test_padding_unspecified_variant_differs_from_the_public_kernel_only_in_padding_rows():
    batch = random_packed_batch([20, 3], heads=2, head_dim=72, zero_length=1, padding_rows=5)
    real = int(batch.cu_seqlens[-1])
    with CpuGraphBackend().sync_guard():
        public = sdpa_varlen(*batch.args())
        raw = sdpa_varlen.padding_unspecified(*batch.args())
    assert torch.equal(public[:real], raw[:real])
    assert torch.equal(public[real:], torch.zeros_like(public[real:]))
    with pytest.raises(ValueError, match="TORCH_SDPA: cu_seqlens must be int32"):
        sdpa_varlen.padding_unspecified(batch.q, batch.k, batch.v, batch.cu_seqlens.long(), batch.max_seqlen,
                                        batch.scale)


def test_sdpa_op_passes_opcheck():
    batch = random_packed_batch([5, 7], heads=2, head_dim=72, zero_length=1, padding_rows=3)
    torch.library.opcheck(sdpa_varlen_op, batch.args())


def test_sdpa_op_output_has_its_fakes_strides_for_a_transposed_q():
    # A [H, T, D] q seen as [T, H, D] is dense: empty_like keeps its layout, the body returns a contiguous one, and
    # torch.compile (which takes strides from the fake; Inductor asserts them) failed on the difference.
    batch = random_packed_batch([5, 7], heads=2, head_dim=72, zero_length=1, padding_rows=3)
    q = batch.q.transpose(0, 1).contiguous().transpose(0, 1)
    torch.library.opcheck(sdpa_varlen_op, (q, *batch.args()[1:]), test_utils=("test_faketensor",))


def plugin_ops():
    from hwgraph_cuda.attention import flash_varlen_op
    from hwgraph_npu.attention import npu_varlen_op
    from hwgraph_rocm.attention import aiter_varlen_op

    return {"sdpa": sdpa_varlen_op, "triton": triton_varlen_op, "flash": flash_varlen_op, "aiter": aiter_varlen_op,
            "npu": npu_varlen_op}


@pytest.mark.parametrize("name", ["sdpa", "triton", "flash", "aiter", "npu"])
def test_every_kernel_op_has_a_fake_impl_returning_q_shaped_output(name):
    op = plugin_ops()[name]
    with FakeTensorMode():
        q = torch.empty(50, 16, 72, dtype=torch.bfloat16)
        cu = torch.empty(5, dtype=torch.int32)
        extra = ([10, 50],) if name == "npu" else ()
        out = op(q, q, q, cu, 64, 0.1, *extra)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.__class__.__name__ == "FakeTensor"


@pytest.mark.parametrize("spec_name", ["TORCH_SDPA", "TRITON_ATTN", "FLASH_ATTN", "ROCM_AITER_FA", "NPU"])
def test_every_kernel_spec_names_a_loadable_function(spec_name):
    from hwgraph_cuda.attention import FLASH_ATTN
    from hwgraph_npu.attention import NPU
    from hwgraph_rocm.attention import ROCM_AITER_FA

    from hwgraph.attention.sdpa import TORCH_SDPA
    from hwgraph.attention.triton_attn import TRITON_ATTN

    spec = {s.name: s for s in (TORCH_SDPA, TRITON_ATTN, FLASH_ATTN, ROCM_AITER_FA, NPU)}[spec_name]
    assert isinstance(spec, KernelSpec) and callable(spec.load())
    # NPU's captured call would keep its host sequence lengths (hwgraph_npu.attention's docstring)
    assert spec.graph_safe is (spec_name != "NPU")


def test_importing_triton_attn_does_not_import_triton():
    code = ("import sys; import hwgraph.attention.triton_attn as m; m.TRITON_ATTN; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- input validation


def valid_args():
    return random_packed_batch([3, 4], heads=2, head_dim=8, padding_rows=1).args()


@pytest.mark.parametrize("kernel", [sdpa_varlen, triton_varlen], ids=["sdpa", "triton"])
@pytest.mark.parametrize("index,value,message", [
    (1, torch.zeros(8, 2, 4), r"one shape, got q \(8, 2, 8\), k \(8, 2, 4\)"),
    (0, torch.zeros(8, 16), r"q must be \[tokens, heads, head_dim\], got shape \(8, 16\)"),
    (2, torch.zeros(8, 2, 8, dtype=torch.float64), r"one dtype.*v torch.float64"),
    (3, torch.tensor([0, 3, 7]), r"cu_seqlens must be int32, got torch.int64"),
    (3, torch.tensor([0], dtype=torch.int32), r"at least 2 entries.*\(1,\)"),
    (4, torch.tensor(7), r"max_seqlen must be a non-negative host int.*Tensor"),
    (4, 7.0, r"max_seqlen must be a non-negative host int.*7\.0"),
    (5, float("nan"), r"scale must be a finite host float, got nan"),
    (1, torch.zeros(8, 3, 8), r"one shape, got q \(8, 2, 8\), k \(8, 3, 8\)"),  # another head count
    (2, torch.zeros(8, 2, 4), r"one shape, got .* v \(8, 2, 4\)"),
    (1, torch.zeros(8, 2, 8, device="meta"), r"one device, got q cpu, k meta"),
    (2, torch.zeros(8, 2, 8, device="meta"), r"one device, got q cpu, k cpu, v meta"),
    (3, torch.tensor([[0, 3, 7]], dtype=torch.int32), r"cu_seqlens must be 1-D .*\(1, 3\)"),
    (4, -1, r"max_seqlen must be a non-negative host int.*-1"),
    (4, True, r"max_seqlen must be a non-negative host int.*True \(bool\)"),
    (5, float("inf"), r"scale must be a finite host float, got inf"),
    (5, -float("inf"), r"scale must be a finite host float, got -inf"),
    (5, torch.tensor(0.35), r"scale must be a finite host float.*\(Tensor\)"),  # float() of it reads the device
    (5, True, r"scale must be a finite host float, got True"),
    (3, torch.tensor([0, 99, 3, 99, 7, 99], dtype=torch.int32)[::2], r"cu_seqlens must be contiguous, got stride "
                                                                     r"\(2,\)"),  # read by pointer: 99 a boundary
])
def test_kernels_reject_bad_inputs_naming_the_value(kernel, index, value, message):
    args = list(valid_args())
    args[index] = value
    with pytest.raises(ValueError, match=message):
        kernel(*args)


@pytest.mark.parametrize("kernel, dtype, message", [
    # a bare KeyError: torch.float64 from the Triton launcher, and SDPA's "value cannot be converted to type int"
    (triton_varlen, torch.float64, r"TRITON_ATTN: q, k, v must be float16, bfloat16, float32, got torch\.float64"),
    (triton_varlen, torch.int32, r"TRITON_ATTN: q, k, v must be float16, bfloat16, float32, got torch\.int32"),
    (sdpa_varlen, torch.int32, r"TORCH_SDPA: q, k, v must be float32, float16, bfloat16, float64, got torch\.int32"),
], ids=["triton-float64", "triton-int32", "sdpa-int32"])
def test_kernels_reject_a_dtype_outside_their_spec_naming_the_ones_they_take(kernel, dtype, message):
    q, k, v, cu, max_seqlen, scale = valid_args()
    with pytest.raises(ValueError, match=message):
        kernel(q.to(dtype), k.to(dtype), v.to(dtype), cu, max_seqlen, scale)


def test_kernels_take_numpy_host_scalars_as_python_ones():
    # np.int64 max_seqlen and np.float32 scale were refused as "not a host int / float"
    args = valid_args()
    q, k, v, cu, max_seqlen, scale = args
    torch.testing.assert_close(sdpa_varlen(q, k, v, cu, np.int64(max_seqlen), np.float32(scale)),
                               sdpa_varlen(q, k, v, cu, max_seqlen, float(np.float32(scale))), rtol=0, atol=0)


def test_kernels_reject_cu_seqlens_on_another_device():
    q, k, v, cu, max_seqlen, scale = valid_args()
    with pytest.raises(ValueError, match=r"one device.*cu_seqlens meta"):
        sdpa_varlen(q, k, v, cu.to("meta"), max_seqlen, scale)


# ---------------------------------------------------------------- plugin adapters with fake vendor modules


def reference_like(q, k, v, cu_seqlens, scale, garbage=float("nan")):
    """What a vendor varlen kernel returns: the reference for real rows, garbage in rows it never writes."""
    out = varlen_reference(q, k, v, cu_seqlens, scale).to(q.dtype)
    out[int(cu_seqlens[-1]):] = garbage
    return out


def test_aiter_adapter_calls_by_keyword_and_zeroes_padding(monkeypatch):
    from hwgraph_rocm.attention import aiter_varlen

    calls = []

    def flash_attn_varlen_func(**kwargs):  # keyword-only: a positional call would fail here
        calls.append(kwargs)
        assert kwargs["cu_seqlens_q"] is kwargs["cu_seqlens_k"] and kwargs["causal"] is False
        return reference_like(kwargs["q"], kwargs["k"], kwargs["v"], kwargs["cu_seqlens_q"],
                              kwargs["softmax_scale"]), None

    monkeypatch.setitem(sys.modules, "aiter", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    batch = random_packed_batch([9, 4], heads=2, head_dim=72, zero_length=1, padding_rows=6, dtype=torch.float16)
    assert_matches_reference(aiter_varlen(*batch.args()), batch)
    assert calls[0]["max_seqlen_q"] == calls[0]["max_seqlen_k"] == 9


@pytest.mark.parametrize("provider", ["flash_attn", "aten", "torch"])
def test_flash_adapter_uses_either_provider_and_zeroes_padding(monkeypatch, provider):
    import torch.nn.attention.varlen as torch_varlen
    from hwgraph_cuda import attention

    ran = []  # which provider's fake computed each call, and the head dim it was given

    def flash_attn_varlen_func(*, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal):
        ran.append(("flash_attn", q.shape[-1]))
        return reference_like(q, k, v, cu_seqlens_q, softmax_scale)

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        ran.append(("torch", query.shape[-1]))
        return reference_like(query, key, value, cu_seq_q, scale)

    def aten_flash(q, k, v, cu, max_seqlen, scale):
        ran.append(("aten", q.shape[-1]))
        return reference_like(q, k, v, cu, scale)

    monkeypatch.setattr(attention, "flash_provider", lambda: (provider, ()))
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    monkeypatch.setattr(attention, "aten_flash", aten_flash)
    for head_dim in (72, 36):  # 36 is padded to 40 for the flash kernels and sliced back
        batch = random_packed_batch([9, 4], heads=2, head_dim=head_dim, zero_length=1, padding_rows=6,
                                    dtype=torch.bfloat16)
        assert_matches_reference(attention.flash_varlen(*batch.args()), batch)
    assert ran == [(provider, 72), (provider, 40)]


def test_flash_op_output_has_its_fakes_strides_for_a_padded_head(monkeypatch):
    # A head of 36 lanes runs padded to 40 and comes back as a slice: the op must still return the fake's layout.
    from hwgraph_cuda import attention

    monkeypatch.setattr(attention, "flash_provider", lambda: ("aten", ()))
    monkeypatch.setattr(attention, "aten_flash", lambda q, k, v, cu, max_seqlen, scale: reference_like(q, k, v, cu,
                                                                                                       scale))
    batch = random_packed_batch([9, 4], heads=2, head_dim=36, zero_length=1, padding_rows=6, dtype=torch.bfloat16)
    torch.library.opcheck(attention.flash_varlen_op, batch.args(), test_utils=("test_faketensor",))


def test_flash_eager_output_of_a_padded_head_is_contiguous_as_the_ops(monkeypatch):
    """A head of 36 lanes runs padded to 40: in eager the public function handed back the kernel's slice of the
    padded output, so ``out.view(tokens, -1)`` raised ("view size is not compatible") where TORCH_SDPA's output and
    the compiled op's (the fake's layout) take it."""
    from hwgraph_cuda import attention

    monkeypatch.setattr(attention, "flash_provider", lambda: ("aten", ()))
    monkeypatch.setattr(attention, "aten_flash", lambda q, k, v, cu, max_seqlen, scale: reference_like(q, k, v, cu,
                                                                                                       scale))
    batch = random_packed_batch([9, 4], heads=2, head_dim=36, zero_length=1, padding_rows=6, dtype=torch.bfloat16)
    for kernel in (attention.flash_varlen, attention.flash_varlen.padding_unspecified):
        out = kernel(*batch.args())
        assert out.is_contiguous(), f"{kernel.__name__}: strides {out.stride()}"
        assert out.view(out.shape[0], -1).shape == (out.shape[0], 72)
    assert_matches_reference(attention.flash_varlen(*batch.args()), batch)


def test_flash_adapter_hands_the_kernel_unit_stride_on_d(monkeypatch):
    # ATen's flash kernel (and flash_attn's C++ API) refuse q, k, v whose last dimension is not contiguous.
    from hwgraph_cuda import attention

    def aten_flash(q, k, v, cu, max_seqlen, scale):
        for t in (q, k, v):
            if t.stride(-1) != 1:
                raise RuntimeError("Input tensor must have contiguous last dimension")
        return reference_like(q, k, v, cu, scale)

    monkeypatch.setattr(attention, "flash_provider", lambda: ("aten", ()))
    monkeypatch.setattr(attention, "aten_flash", aten_flash)
    batch = random_packed_batch([9, 4], heads=2, head_dim=72, zero_length=1, padding_rows=6, dtype=torch.bfloat16)
    k = batch.k.transpose(1, 2).contiguous().transpose(1, 2)
    assert_matches_reference(attention.flash_varlen(batch.q, k, *batch.args()[2:]), batch)


def test_flash_provider_takes_the_flash_attn_package_when_it_has_the_varlen_function(monkeypatch):
    attention = pytest.importorskip("hwgraph_cuda.attention")

    provider = attention.flash_provider.__wrapped__  # uncached: the fake modules change
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=lambda **kw: None))
    assert provider() == ("flash_attn", ())
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace())
    name, missing = provider()
    assert name != "flash_attn" and missing[0] == "flash_attn has no flash_attn_varlen_func"
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    name, missing = provider()
    assert name != "flash_attn" and missing[0].startswith("flash_attn does not import (")


def test_flash_gets_max_seqlen_of_at_least_one_for_an_all_padding_call(monkeypatch):
    attention = pytest.importorskip("hwgraph_cuda.attention")

    seen = []

    def aten_flash(q, k, v, cu, max_seqlen, scale):
        seen.append(max_seqlen)
        return torch.full_like(q, float("nan"))  # rows the kernel never writes

    monkeypatch.setattr(attention, "flash_provider", lambda: ("aten", ()))
    monkeypatch.setattr(attention, "aten_flash", aten_flash)
    batch = random_packed_batch([], heads=2, head_dim=72, zero_length=1, padding_rows=4, dtype=torch.bfloat16)
    out = attention.flash_varlen(*batch.args())
    assert seen == [1] and torch.equal(out, torch.zeros_like(out))


def test_torch_varlen_attn_without_a_scale_argument_gets_the_scale_folded_into_q(monkeypatch):
    """torch 2.10's ``varlen_attn`` scales by the (padded) head dim's ``** -0.5``: the adapter folds the ratio into
    q, with the padded width (36 lanes are padded to 40)."""
    import torch.nn.attention.varlen as torch_varlen
    attention = pytest.importorskip("hwgraph_cuda.attention")

    widths = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        widths.append(query.shape[-1])
        return varlen_reference(query, key, value, cu_seq_q, query.shape[-1] ** -0.5).to(query.dtype)

    monkeypatch.setattr(attention, "flash_provider", lambda: ("torch", ()))
    monkeypatch.setattr(attention, "varlen_attn_takes_scale", lambda: False)
    monkeypatch.setattr(torch_varlen, "varlen_attn", varlen_attn)
    for head_dim in (36, 72):
        batch = random_packed_batch([9, 4], heads=2, head_dim=head_dim, zero_length=1, padding_rows=3,
                                    dtype=torch.bfloat16, scale=0.3)  # FLASH_ATTN's dtypes: fp16, bf16
        assert_matches_reference(attention.flash_varlen(*batch.args()), batch)
    assert widths == [40, 72]


class FakeTorchNpu(types.ModuleType):
    """``npu_fused_infer_attention_score`` in TND layout, computed by the reference; records its calls."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.contiguous = []

    def npu_fused_infer_attention_score(self, q, k, v, *, num_heads, input_layout, actual_seq_lengths,
                                        actual_seq_lengths_kv, scale):
        assert input_layout == "TND" and num_heads == q.shape[1]
        assert actual_seq_lengths == actual_seq_lengths_kv and actual_seq_lengths[-1] == q.shape[0]
        self.calls.append({"ends": list(actual_seq_lengths), "head_dim": q.shape[-1]})
        self.contiguous.append(all(t.is_contiguous() for t in (q, k, v)))
        return varlen_reference(q, k, v, [0, *actual_seq_lengths], scale).to(q.dtype), torch.empty(0)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    from hwgraph_npu import attention

    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(attention, "scale_keyword", lambda: "scale")
    return fake


def test_npu_adapter_takes_host_boundaries_and_pads_head_dim_to_128(fake_torch_npu):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen

    batch = random_packed_batch([9, 4], heads=2, head_dim=72, zero_length=2, padding_rows=6, dtype=torch.float16)
    with CpuGraphBackend().sync_guard(), host_cu_seqlens([0, 9, 13, 13, 13]):
        out = npu_varlen(*batch.args())
    assert_matches_reference(out, batch)
    # Empty sequences dropped; the padding rows become one trailing sequence ending at the token count.
    assert fake_torch_npu.calls == [{"ends": [9, 13, 19], "head_dim": 128}]


@pytest.mark.parametrize("head_dim", [16, 72, 128])
def test_npu_adapter_hands_the_kernel_contiguous_tensors(fake_torch_npu, head_dim):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen

    batch = random_packed_batch([5, 3], heads=2, head_dim=head_dim, dtype=torch.float16)
    qkv = torch.stack([batch.q, batch.k, batch.v], dim=1)  # the tower's layout: q, k, v are strided views
    q, k, v = qkv.unbind(1)
    assert not v.is_contiguous()
    with host_cu_seqlens([0, 5, 8]):
        out = npu_varlen(q, k, v, batch.cu_seqlens, batch.max_seqlen, batch.scale)
    assert_matches_reference(out, batch)
    assert fake_torch_npu.contiguous == [True]


def test_npu_padding_unspecified_variant_skips_only_the_zeroing(fake_torch_npu):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen

    batch = random_packed_batch([9, 4], heads=2, head_dim=72, zero_length=1, padding_rows=6, dtype=torch.bfloat16)
    with CpuGraphBackend().sync_guard(), host_cu_seqlens([0, 9, 13, 13]):
        public = npu_varlen(*batch.args())
        raw = npu_varlen.padding_unspecified(*batch.args())
    assert torch.equal(public[:13], raw[:13])
    assert torch.equal(public[13:], torch.zeros_like(public[13:]))
    # The kernel attends the 6 padding rows among themselves (one trailing sequence): the variant leaves that.
    want = varlen_reference(batch.q[13:], batch.k[13:], batch.v[13:], [0, 6], batch.scale)
    torch.testing.assert_close(raw[13:], want.to(raw.dtype))


def test_npu_adapter_without_host_boundaries_reads_cu_seqlens_back(fake_torch_npu):
    from hwgraph_npu.attention import npu_varlen

    batch = random_packed_batch([5, 8], heads=2, head_dim=64, dtype=torch.bfloat16)
    with CpuGraphBackend().sync_guard(), pytest.raises(HostSyncError):
        npu_varlen(*batch.args())  # the documented last resort is a host read, and the guard sees it
    assert_matches_reference(npu_varlen(*batch.args()), batch)
    assert fake_torch_npu.calls[-1] == {"ends": [5, 13], "head_dim": 64}


def test_npu_adapter_rejects_host_boundaries_that_disagree_in_length(fake_torch_npu):
    from hwgraph_npu.attention import host_cu_seqlens, npu_varlen

    batch = random_packed_batch([5, 8], heads=2, head_dim=64, dtype=torch.float16)
    with host_cu_seqlens([0, 13]), pytest.raises(ValueError, match="host cu_seqlens has 2 entries.* 3"):
        npu_varlen(*batch.args())


# ---------------------------------------------------------------- the float64 reference's own checks


def test_the_reference_check_rejects_non_zero_padding_rows_and_a_five_percent_error():
    batch = random_packed_batch([1, 2, 3], heads=2, head_dim=16, padding_rows=3, dtype=torch.bfloat16, seed=3)
    exact = varlen_reference(*batch.args()[:4], batch.scale).to(torch.bfloat16)
    assert_matches_reference(exact, batch)
    leaked = exact.clone()
    leaked[batch.total] = 1.0
    with pytest.raises(AssertionError, match="3 padding rows must be zero"):
        assert_matches_reference(leaked, batch)
    with pytest.raises(AssertionError):
        assert_matches_reference(exact * 1.05, batch)
    assert ATTENTION_TOLERANCES[torch.bfloat16] == (1.6e-2, 1.6e-2)


def test_random_batches_fill_padding_rows_with_large_garbage():
    """So that a kernel reading padding keys or values, or copying padding rows out, fails the comparison."""
    batch = random_packed_batch([4, 2], heads=2, head_dim=8, zero_length=1, padding_rows=3, dtype=torch.float16)
    for t in (batch.q, batch.k, batch.v):
        assert torch.equal(t[6:], torch.full_like(t[6:], 1e3)) and t[:6].abs().max() < 100
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 6] and batch.max_seqlen == 4
    assert math.isclose(batch.scale, 8 ** -0.5)


def nograd_body(q, k, v, cu_seqlens, max_seqlen, scale):
    """A varlen kernel as a vendor's is to autograd: the right values, no history."""
    with torch.no_grad():
        return masked_sdpa(q, k, v, cu_seqlens, scale)


NOGRAD_VARLEN, _ = register_varlen_kernel("NOGRAD_TEST", "nograd_test_varlen", nograd_body)


def attention_grads(fn, batch: PackedBatch):
    leaves = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    out = fn(*leaves, batch.cu_seqlens, batch.max_seqlen, batch.scale)
    valid = int(batch.cu_seqlens[-1])
    (out[:valid].float() * torch.linspace(-1, 1, out[:valid].numel()).view_as(out[:valid])).sum().backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kernel", ["kernel-without-backward", "TORCH_SDPA"])
def test_varlen_kernels_give_gradients_while_autograd_records(kernel, compiled):
    """A kernel without a backward (TRITON_ATTN, FLASH_ATTN's op, aiter's, the NPU's) returned outputs without a
    history: everything before attention silently got no gradient. And under torch.compile every kernel, TORCH_SDPA's
    included, is its custom op, which has no autograd formula ("Trying to backward through hwgraph.sdpa_varlen").
    While autograd records they all run TORCH_SDPA's differentiable body, whose gradients equal a per-sequence
    reference's; without recording, the kernel itself runs."""
    fn = NOGRAD_VARLEN.padding_unspecified if kernel == "kernel-without-backward" else sdpa_varlen.padding_unspecified
    batch = random_packed_batch((5, 9), heads=2, head_dim=8, zero_length=1, padding_rows=3, seed=3)
    run = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False) if compiled else fn
    out, grads = attention_grads(run, batch)

    def per_sequence(q, k, v, cu_seqlens, max_seqlen, scale):  # plain SDPA on each sequence alone
        ends = cu_seqlens.tolist()
        rows = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale)
                .transpose(0, 1) for a, b in zip(ends, ends[1:], strict=False)]
        return torch.cat(rows + [torch.zeros_like(q[ends[-1]:])])

    want_out, want = attention_grads(per_sequence, batch)
    valid = int(batch.cu_seqlens[-1])
    torch.testing.assert_close(out[:valid], want_out[:valid])
    if kernel == "kernel-without-backward":
        assert torch.count_nonzero(out[valid:]) == 0  # the stand-in's padding rows come back zero
    for name, got, expected in zip("qkv", grads, want, strict=True):
        assert got is not None, f"{kernel}: no gradient reached {name}"
        torch.testing.assert_close(got, expected, msg=lambda m, name=name: f"{kernel}: d{name}: {m}")
    with torch.no_grad():  # without recording: the kernel's own body
        plain = fn(batch.q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen, batch.scale)
    torch.testing.assert_close(plain[:valid], want_out[:valid])


def test_a_kernel_traces_whole_under_torch_compile_with_a_scale_from_a_dynamic_head_dim():
    """The inputs' scale check called ``math.isfinite``, which torch.compile cannot trace on a symbolic float: with
    dynamic shapes, a scale of ``q.shape[-1] ** -0.5`` broke the graph in every kernel's check (``fullgraph=True``:
    "Unsupported: torch.* op returned non-Tensor ... isfinite"), and so did a scale that changed between calls."""

    def attention(q, k, v, cu_seqlens, max_seqlen):
        return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, q.shape[-1] ** -0.5)

    run = torch.compile(attention, backend="eager", fullgraph=True, dynamic=True)
    for seqlens, head_dim in (((5, 9), 8), ((3, 4, 2), 12)):
        batch = random_packed_batch(seqlens, heads=2, head_dim=head_dim, padding_rows=3, seed=5)
        args = (batch.q, batch.k, batch.v, batch.cu_seqlens, batch.max_seqlen)
        torch.testing.assert_close(run(*args), attention(*args))
    for bad in (math.nan, math.inf):  # the check still refuses a non-finite scale in eager
        with pytest.raises(ValueError, match=r"scale must be a finite host float, got (nan|inf)"):
            sdpa_varlen(*args, bad)


def test_the_differentiable_stand_in_is_logged_once_naming_the_kernel(monkeypatch, caplog):
    """A caller who only forgot ``torch.inference_mode()`` learns why attention got slower, once per kernel."""
    from hwgraph.attention import varlen_inputs

    monkeypatch.setattr(varlen_inputs, "_RECORDING_LOGGED", set())
    batch = random_packed_batch((5, 9), heads=2, head_dim=8, padding_rows=3, seed=4)
    with caplog.at_level(logging.WARNING, logger="hwgraph.attention.varlen_inputs"):
        for _ in range(2):
            attention_grads(NOGRAD_VARLEN.padding_unspecified, batch)
        attention_grads(sdpa_varlen.padding_unspecified, batch)  # differentiable itself: nothing to say
    (record,) = caplog.records
    assert "NOGRAD_TEST attention, which has no backward" in record.getMessage()
    assert "torch.inference_mode()" in record.getMessage()
