"""The tower's fused kernels (rotary on q/k, residual add + LayerNorm, position embedding) equal their unfused torch
computations.

The Triton kernels run on CPU under the Triton interpreter (``TRITON_INTERPRET=1``, which Triton reads when it is
first imported), so these checks run in a child process; the `cuda` tests run them on the GPU for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

from hwgraph.attention.triton_attn import interpreter_enabled
from hwgraph.models.qwen3_omni import Qwen3OmniVisionTower, fused

CHILD = textwrap.dedent("""
    import torch
    from hwgraph.models.qwen3_omni import fused

    assert fused.use_triton(torch.empty(1)), "the interpreter path must be active in this child"
    torch.set_grad_enabled(False)  # the kernels run only without autograd recording (the norms' weights want grads)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, heads, dim in ((7, 3, 8), (33, 4, 72), (1, 16, 72), (0, 2, 16)):
            qkv = torch.randn(tokens, 3 * heads * dim).to(dtype).view(tokens, 3, heads, dim)
            angles = torch.randn(tokens, dim // 2)
            cos = torch.cat((angles.cos(), angles.cos()), -1)
            sin = torch.cat((-angles.sin(), angles.sin()), -1)
            got = fused.rotary_qk(qkv, cos, sin)
            want = fused.rotary_qk_reference(qkv, cos, sin)
            for g, w in zip(got, want, strict=True):
                assert g.is_contiguous() and g.shape == (tokens, heads, dim)
                torch.testing.assert_close(g, w)
        for rows, width in ((5, 64), (17, 1152), (3, 100), (0, 32)):
            norm = torch.nn.LayerNorm(width, eps=1e-6)
            torch.nn.init.normal_(norm.weight); torch.nn.init.normal_(norm.bias)
            norm = norm.to(dtype)
            x, delta = torch.randn(rows, width).to(dtype), torch.randn(rows, width).to(dtype)
            got = fused.add_layer_norm(x, delta, norm)
            want = fused.add_layer_norm_reference(x, delta, norm)
            # The interpreter casts float32 to bf16 by truncation (the GPU rounds to nearest): one ulp apart.
            exact = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0}
            torch.testing.assert_close(got[0], want[0], **exact)
            # ... so the LayerNorm is checked against the sum the kernel actually normalised.
            torch.testing.assert_close(got[1], fused.add_layer_norm_reference(got[0], torch.zeros_like(x), norm)[1])
            # Written into rows 2 .. 2 + rows of larger planes: the same values there, nothing around them touched.
            planes = torch.full((2, rows + 4, width), 7.0).to(dtype)
            rows_of = planes[:, 2:2 + rows]
            assert fused.add_layer_norm_launch(x, delta, norm.weight, norm.bias, norm.eps, rows_of) is rows_of
            for plane, part in zip(rows_of, got, strict=True):
                torch.testing.assert_close(plane, part, rtol=0, atol=0)
            assert (planes[:, :2] == 7).all() and (planes[:, 2 + rows:] == 7).all()
        for rows, width, table_rows in ((9, 64, 36), (33, 1152, 2304), (0, 32, 4)):
            table = torch.randn(table_rows, width).to(dtype)
            x = torch.randn(rows, width).to(dtype)
            indices = torch.randint(0, table_rows, (4, rows))
            weights = torch.rand(4, rows)
            weights[:, rows // 2:] = 0  # padding rows: weight 0 (metadata.pad)
            got = fused.add_position_embedding(x, table, indices, weights)
            want = fused.add_position_embedding_reference(x, table, indices, weights)
            assert got.shape == want.shape and got.dtype == dtype
            # float32: bit for bit. bf16: the interpreter truncates where the GPU rounds (twice here): two ulps.
            close = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
            torch.testing.assert_close(got, want, **close)
    print("fused kernels ok")
""")


def run_interpreted(child: str, done_line: str, timeout: int = 600) -> None:
    """Run ``child`` in a Python process with the Triton interpreter and the fused kernels on (the interpreter must
    be set before triton is imported); it must exit 0 having printed ``done_line``."""
    pytest.importorskip("triton", reason="the fused kernels need triton")
    env = dict(os.environ, TRITON_INTERPRET="1", HWGRAPH_FUSED="1")
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done_line in done.stdout


def test_triton_fused_kernels_equal_the_unfused_computation_under_the_interpreter():
    run_interpreted(CHILD, "fused kernels ok")


FP16_POSITION_CHILD = textwrap.dedent("""
    import os, sys, types
    import torch
    import hwgraph.models

    # The kernels without the package's __init__ (it imports transformers: most of this child's start-up time).
    package = types.ModuleType("hwgraph.models.qwen3_omni")
    package.__path__ = [os.path.join(os.path.dirname(hwgraph.models.__file__), "qwen3_omni")]
    sys.modules[package.__name__] = package
    from hwgraph.models.qwen3_omni import fused

    assert fused.use_triton(torch.empty(1)), "the interpreter path must be active in this child"
    torch.manual_seed(0)
    table, x = torch.randn(16, 32).half(), torch.randn(9, 32).half()
    indices, weights = torch.randint(0, 16, (4, 9)), torch.rand(4, 9)
    got = fused.add_position_embedding(x, table, indices, weights)
    torch.testing.assert_close(got, fused.add_position_embedding_reference(x, table, indices, weights),
                               rtol=0, atol=0)
    print("fp16 position ok")
""")


def test_the_position_embedding_kernel_rounds_the_blend_before_the_add_in_float16():
    """The interpreter converts float32 to float16 by rounding (as the GPU does; bf16 it truncates), so fp16 checks
    the kernel bit for bit on the CPU: the blend is rounded to the activation dtype before the add, as unfused."""
    run_interpreted(FP16_POSITION_CHILD, "fp16 position ok", timeout=300)


STRIDED_NORM_CHILD = textwrap.dedent("""
    import os, sys, types
    import torch
    import hwgraph.models

    # The kernels without the package's __init__ (it imports transformers: most of this child's start-up time).
    package = types.ModuleType("hwgraph.models.qwen3_omni")
    package.__path__ = [os.path.join(os.path.dirname(hwgraph.models.__file__), "qwen3_omni")]
    sys.modules[package.__name__] = package
    from hwgraph.models.qwen3_omni import fused

    assert fused.use_triton(torch.empty(1)), "the interpreter path must be active in this child"
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    rows, width = 5, 64
    norm = torch.nn.LayerNorm(width, eps=1e-6)
    # Parameters assigned strided views (load_state_dict(assign=True) of such tensors does the same).
    norm.weight = torch.nn.Parameter(torch.randn(width, 2)[:, 0])
    norm.bias = torch.nn.Parameter(torch.randn(width, 2)[:, 1])
    x, delta = torch.randn(rows, width), torch.randn(rows, width)
    got = fused.add_layer_norm(x, delta, norm)
    want = fused.add_layer_norm_reference(x, delta, norm)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    print("strided norm ok")
""")


def test_add_layer_norm_with_strided_norm_weights_equals_the_reference():
    """The fused kernel read the LayerNorm's weight and bias as contiguous rows: with a strided weight (a parameter
    assigned a view) the normalised rows were off by up to 10 while the CPU reference was right."""
    run_interpreted(STRIDED_NORM_CHILD, "strided norm ok", timeout=300)


GRAD_CHILD = textwrap.dedent("""
    import os, sys, types
    import torch
    import hwgraph.models

    package = types.ModuleType("hwgraph.models.qwen3_omni")  # the kernels without transformers (start-up time)
    package.__path__ = [os.path.join(os.path.dirname(hwgraph.models.__file__), "qwen3_omni")]
    sys.modules[package.__name__] = package
    from hwgraph.models.qwen3_omni import fused

    assert fused.use_triton(torch.empty(1)), "the interpreter path must be active in this child"
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(16, eps=1e-6)
    torch.nn.init.normal_(norm.weight); torch.nn.init.normal_(norm.bias)
    qkv, x, delta = torch.randn(5, 3, 2, 8), torch.randn(5, 16), torch.randn(5, 16)
    angles = torch.randn(5, 4)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    table, indices, weights = torch.randn(9, 16), torch.randint(0, 9, (4, 5)), torch.rand(4, 5)

    def forward(rotary, add_norm, position, qkv, x, table):
        q, k = rotary(qkv, cos, sin)
        total, normed = add_norm(position(x, table, indices, weights), delta, norm)
        return (q * k).sum() + (total * normed).sum()

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in (qkv, x, table)]
        norm.zero_grad(set_to_none=True)
        fn(*leaves).backward()
        return [t.grad for t in leaves] + [norm.weight.grad, norm.bias.grad]

    fused_ops = (fused.rotary_qk, fused.add_layer_norm, fused.add_position_embedding)
    unfused = (fused.rotary_qk_reference, fused.add_layer_norm_reference, fused.add_position_embedding_reference)
    want = grads(lambda *t: forward(*unfused, *t))
    for label, fn in (("eager", lambda *t: forward(*fused_ops, *t)),
                      ("compiled", torch.compile(lambda *t: forward(*fused_ops, *t), backend="aot_eager",
                                                 fullgraph=True))):
        got = grads(fn)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g is not None, f"{label}: gradient {i} is missing"
            torch.testing.assert_close(g, w, msg=lambda m: f"{label}: gradient {i}: {m}")
    # Without autograd recording the kernels still run.
    launched = []
    for name in ("rotary_qk_launch", "add_layer_norm_launch", "add_position_embedding_launch"):
        setattr(fused, name, (lambda f, name: lambda *a: launched.append(name) or f(*a))(getattr(fused, name), name))
    with torch.no_grad():
        forward(*fused_ops, qkv, x, table)
    assert len(launched) == 3, launched
    print("fused gradients ok")
""")


def test_fused_ops_take_the_differentiable_path_while_autograd_records_and_compile_with_gradients():
    """The Triton kernels have no backward: with autograd recording, an eager call returned outputs without a history
    (the norm's, the table's and the inputs' gradients were None) and torch.compile failed ("no autograd formula was
    registered"). They now run the unfused computations then, and the kernels only without autograd."""
    run_interpreted(GRAD_CHILD, "fused gradients ok")


def test_fc1_with_tanh_gelu_takes_the_unfused_pair_while_autograd_records(monkeypatch):
    """On CUDA the GELU is the matmul's epilogue (``torch._addmm_activation``), which has no derivative: backward
    raised "derivative for aten::_addmm_activation is not implemented". Recording autograd takes the unfused pair."""
    from hwgraph import products

    calls = []

    def epilogue(x, weight, bias):  # as on CUDA: the right values, no autograd history
        calls.append(x.shape)
        with torch.no_grad():
            return torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias), approximate="tanh")

    monkeypatch.setattr(products, "linear_gelu_tanh", epilogue)
    torch.manual_seed(0)
    fc1, x = torch.nn.Linear(8, 6), torch.randn(3, 8)
    out = fused.linear_gelu_tanh(x, fc1)
    out.sum().backward()
    assert not calls and fc1.weight.grad is not None
    want = fc1.weight.grad.clone()
    fc1.zero_grad()
    torch.nn.functional.gelu(fc1(x), approximate="tanh").sum().backward()
    torch.testing.assert_close(fc1.weight.grad, want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(fused.linear_gelu_tanh(x, fc1), out, rtol=0, atol=0)
    assert len(calls) == 1  # without autograd: the epilogue


def test_the_rotary_kernel_refuses_an_odd_head_dim_by_name():
    pytest.importorskip("triton", reason="the rotary kernel's launcher imports triton")
    qkv = torch.zeros(2, 3, 2, 7)
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        fused.rotary_qk_launch(qkv, torch.zeros(2, 7), torch.zeros(2, 7))


def test_the_rotary_kernel_takes_a_warp_per_128_elements_of_its_tile_from_1_to_8():
    # the tile is [next_pow2(heads), next_pow2(head_dim / 2)]
    assert fused.rotary_warps(16, 72) == 8  # 16 x 64: measured 17-18% faster than 4 warps on the H200
    assert fused.rotary_warps(8, 64) == 2  # 8 x 32
    assert fused.rotary_warps(2, 16) == 1  # 2 x 8: at least one
    assert fused.rotary_warps(32, 128) == 8  # 32 x 64: at most eight


def test_add_layer_norm_into_planes_of_another_shape_names_the_shape_it_needs():
    pytest.importorskip("triton", reason="the add + LayerNorm kernel's launcher imports triton")
    x, norm = torch.zeros(5, 8), torch.nn.LayerNorm(8)
    with pytest.raises(ValueError, match=r"out must be \[2, 5, 8\] with contiguous rows, got shape \(2, 5, 4\)"):
        fused.add_layer_norm_launch(x, x, norm.weight, norm.bias, norm.eps, torch.empty(2, 5, 8)[:, :, :4])


def test_the_position_embedding_takes_the_kernel_only_for_its_layout(monkeypatch):
    """int64 indices and float32 weights go to the kernel; int32 indices or float16 weights are not its layout,
    so the exact unfused computation runs."""
    calls = []
    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "add_position_embedding_launch", lambda *args: calls.append(args) or args[0])
    x, table = torch.randn(3, 8), torch.randn(5, 8)
    indices, weights = torch.randint(0, 5, (4, 3)), torch.rand(4, 3)
    assert fused.add_position_embedding(x, table, indices, weights) is x and len(calls) == 1
    for i, w in ((indices.int(), weights), (indices, weights.half())):
        torch.testing.assert_close(fused.add_position_embedding(x, table, i, w),
                                   fused.add_position_embedding_reference(x, table, i, w), rtol=0, atol=0)
    assert len(calls) == 1


def test_cpu_tensors_take_the_exact_unfused_path():
    qkv = torch.randn(4, 3, 2, 8)
    assert not fused.use_triton(qkv) or interpreter_enabled()
    norm = torch.nn.LayerNorm(8)
    x, d = torch.randn(4, 8), torch.randn(4, 8)
    total, normed = fused.add_layer_norm(x, d, norm)
    torch.testing.assert_close(total, x + d, rtol=0, atol=0)
    torch.testing.assert_close(normed, norm(x + d), rtol=0, atol=0)


def test_fused_paths_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("HWGRAPH_FUSED", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fused.use_triton(torch.empty(1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()  # the kernels run only without autograd recording (the norm's and fc1's weights want grads)
def test_fused_kernels_on_the_gpu_equal_the_unfused_computation(dtype):
    torch.manual_seed(0)
    for tokens in (1, 196, 4096):
        qkv = torch.randn(tokens, 3 * 1152, device="cuda", dtype=dtype).view(tokens, 3, 16, 72)
        angles = torch.randn(tokens, 36, device="cuda")
        cos = torch.cat((angles.cos(), angles.cos()), -1)
        sin = torch.cat((-angles.sin(), angles.sin()), -1)
        for g, w in zip(fused.rotary_qk(qkv, cos, sin), fused.rotary_qk_reference(qkv, cos, sin), strict=True):
            torch.testing.assert_close(g, w)
        norm = torch.nn.LayerNorm(1152, eps=1e-6, device="cuda", dtype=dtype)
        torch.nn.init.normal_(norm.weight)
        x, d = torch.randn(tokens, 1152, device="cuda", dtype=dtype), torch.randn(tokens, 1152, device="cuda",
                                                                               dtype=dtype)
        got, want = fused.add_layer_norm(x, d, norm), fused.add_layer_norm_reference(x, d, norm)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1])
        fc1 = torch.nn.Linear(1152, 4304, device="cuda", dtype=dtype)
        # The epilogue applies GELU to the float32 accumulator; the unfused pair rounds the matmul to 16 bits first,
        # so a few elements differ by one ulp (seen: 15 of 843,584 in bf16, up to 7e-4): tolerances of one ulp.
        ulp = {"rtol": 2**-7, "atol": 2e-3} if dtype == torch.bfloat16 else {"rtol": 2**-10, "atol": 1e-3}
        torch.testing.assert_close(fused.linear_gelu_tanh(x, fc1),
                                   torch.nn.functional.gelu(fc1(x), approximate="tanh"), **ulp)
        # Position embedding: products and their sum in float32, in the corners' order, no contraction: bit for bit.
        table = torch.randn(2304, 1152, device="cuda", dtype=dtype)
        indices = torch.randint(0, 2304, (4, tokens), device="cuda")
        weights = torch.rand(4, tokens, device="cuda")
        torch.testing.assert_close(fused.add_position_embedding(x, table, indices, weights),
                                   fused.add_position_embedding_reference(x, table, indices, weights), rtol=0, atol=0)


def test_rotary_tables_of_another_shape_than_tokens_by_head_dim_take_the_reference(monkeypatch):
    """The kernel reads ``cos``/``sin`` as ``[T, D]`` rows: a contiguous ``[1, D]`` table (one angle row for every
    token, which the reference broadcasts) or a ``[T, 1]`` one went to it, and it read past the table (under the
    interpreter: values up to 2.5e38 where the reference gave the rotation)."""
    launched = []
    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "rotary_qk_launch",
                        lambda qkv, *a: launched.append(qkv.shape) or qkv[:, :2].movedim(1, 0))
    torch.manual_seed(0)
    qkv = torch.randn(4, 3, 2, 8)
    angles = torch.randn(4, 4)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    fused.rotary_qk(qkv, cos, sin)
    assert len(launched) == 1  # [T, D]: the kernel
    for c, s in ((cos[:1], sin[:1]), (cos[:, :1].contiguous(), sin[:, :1].contiguous()), (cos, sin[:1])):
        for g, w in zip(fused.rotary_qk(qkv, c, s), fused.rotary_qk_reference(qkv, c, s), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert len(launched) == 1


def test_position_indices_of_other_than_two_dimensions_take_the_reference(monkeypatch):
    """``[4, R, 1]`` indices went to the kernel, which returned ``[R, hidden]`` where the reference broadcasts to
    ``[R, R, hidden]``; 1-D ones failed in the test for the kernel's layout ("tuple index out of range")."""
    launched = []
    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "add_position_embedding_launch", lambda x, *a: launched.append(x.shape) or x)
    torch.manual_seed(0)
    x, table = torch.randn(3, 8), torch.randn(5, 8)
    indices, weights = torch.randint(0, 5, (4, 3, 1)), torch.rand(4, 3, 1)
    got = fused.add_position_embedding(x, table, indices, weights)
    torch.testing.assert_close(got, fused.add_position_embedding_reference(x, table, indices, weights), rtol=0, atol=0)
    with pytest.raises(IndexError, match="too many indices"):  # the reference's own: weights[:, :, None] of 1-D weights
        fused.add_position_embedding(x, table, indices[0, :, 0], weights[0, :, 0])
    assert not launched


def test_add_layer_norm_with_a_wider_delta_takes_the_reference(monkeypatch):
    """The kernel rounds ``x + delta`` to ``x``'s dtype: with fp16 ``x`` and a float32 ``delta`` it returned a float16
    sum and LayerNorm where the unfused computation promotes both to float32."""
    launched = []
    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "add_layer_norm_launch",
                        lambda x, *a: launched.append(x.dtype) or torch.stack((x, x)))
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():
        x, delta = torch.randn(3, 8).half(), torch.randn(3, 8)
        got = fused.add_layer_norm(x, delta, norm)
        for g, w in zip(got, fused.add_layer_norm_reference(x, delta, norm), strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert not launched
        fused.add_layer_norm(x, delta.half(), norm.half())
    assert launched == [torch.float16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_towers_own_forward_takes_every_fused_kernel(monkeypatch, dtype):
    """The conditions that send an input to a kernel's reference must let the tower's own inputs through: each block
    runs the rotary kernel once and add + LayerNorm twice (the last block's second as its merger's input, or the
    next block's first norm), and the position embedding runs its kernel once. Launches are recorded, and answer as
    the references do, so this runs on the CPU."""
    calls = {"rotary": 0, "add_layer_norm": 0, "position": 0}

    def counted(name, reference):
        def launch(*args, **kwargs):
            calls[name] += 1
            return reference(*args)
        return launch

    def rotary(qkv, cos, sin, *rest):
        return torch.stack(fused.rotary_qk_reference(qkv, cos, sin))

    def add_norm(x, delta, weight, bias, eps, *rest):
        total = x + delta
        return torch.stack((total, F.layer_norm(total, total.shape[-1:], weight, bias, eps)))

    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    monkeypatch.setattr(fused, "rotary_qk_launch", counted("rotary", rotary))
    monkeypatch.setattr(fused, "add_layer_norm_launch", counted("add_layer_norm", add_norm))
    monkeypatch.setattr(fused, "add_position_embedding_launch",
                        counted("position", lambda x, t, i, w: fused.add_position_embedding_reference(x, t, i, w)))
    tower = Qwen3OmniVisionTower.from_preset("tiny", attention="TORCH_SDPA").eval().to(dtype)
    grid = [(1, 8, 8), (1, 4, 4)]
    pixels = torch.randn(80, tower.patch_row_width, dtype=dtype)
    with torch.inference_mode():
        got = tower(pixels, grid)
    depth = len(tower.blocks)
    assert calls["rotary"] == depth and calls["position"] == 1, calls
    assert calls["add_layer_norm"] >= 2 * depth - 1, calls
    monkeypatch.setattr(fused, "use_triton", lambda t: False)
    with torch.inference_mode():
        want = tower(pixels, grid)
    torch.testing.assert_close(got.embeds, want.embeds)


@pytest.mark.parametrize("capability, hip, runs", [((6, 1), None, False), ((6, 0), None, False),
                                                   ((7, 0), None, True), ((9, 0), None, True), ((6, 1), "6.4", True)])
def test_fused_kernels_run_only_on_gpus_triton_compiles_for(monkeypatch, capability, hip, runs):
    """Below compute capability 7.0 (a P100, a GTX 1080) Triton builds no kernels: the tower takes the unfused path
    there instead of failing at the first launch. Every ROCm GPU torch runs on is one Triton builds for."""
    monkeypatch.setattr(fused, "TRITON_FOUND", True)
    monkeypatch.delenv("HWGRAPH_FUSED", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    fused.triton_compiles_for.cache_clear()
    try:
        gpu_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # what use_triton reads
        assert fused.use_triton(gpu_tensor) is runs
    finally:
        fused.triton_compiles_for.cache_clear()  # the patched answers must not outlive the test


@pytest.mark.parametrize("hip", [None, "6.4"])
def test_gpu_tensors_take_the_unfused_path_under_the_triton_interpreter(monkeypatch, hip):
    """Under TRITON_INTERPRET the kernels run on the host (Triton copies CUDA/ROCm tensors there and back), which
    graph capture cannot record: the tower took the fused kernels on GPUs all the same. The interpreter is read as
    TRITON_ATTN's gate reads it (Triton's knobs: "true" counts, "0" does not)."""
    pytest.importorskip("triton", reason="the interpreter is read through triton's knobs")
    monkeypatch.setattr(fused, "TRITON_FOUND", True)
    monkeypatch.delenv("HWGRAPH_FUSED", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", hip)
    fused.triton_compiles_for.cache_clear()
    try:
        gpu_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # what use_triton reads
        for value, runs in (("1", False), ("true", False), ("0", True)):
            monkeypatch.setenv("TRITON_INTERPRET", value)
            assert fused.use_triton(gpu_tensor) is runs, value
        monkeypatch.delenv("TRITON_INTERPRET")
        assert fused.use_triton(gpu_tensor)
    finally:
        fused.triton_compiles_for.cache_clear()  # the patched answers must not outlive the test


def test_cpu_tensors_take_the_kernels_when_triton_and_the_gate_see_the_interpreter(monkeypatch):
    """TRITON_INTERPRET=true turns Triton's interpreter on (its knobs), and TRITON_ATTN's gate says so; the fused
    kernels read only "1" and took the unfused path. The check also traces under torch.compile (fullgraph), where
    Triton's knobs, read in C, cannot be called."""
    pytest.importorskip("triton", reason="the interpreter is read through triton's knobs")
    monkeypatch.setattr(fused, "TRITON_FOUND", True)
    monkeypatch.delenv("HWGRAPH_FUSED", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert interpreter_enabled() and fused.use_triton(torch.empty(1))

    def fused_or_not(x):
        return x + 1 if fused.use_triton(x) else x - 1

    assert torch.compile(fused_or_not, backend="eager", fullgraph=True)(torch.zeros(1)).item() == 1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fused.use_triton(torch.empty(1))
