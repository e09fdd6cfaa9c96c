"""The gates of the CUDA plugin's measured products (``hwgraph_cuda.products``, ``hwgraph_cuda.cublaslt``) off the GPU:
the accuracy checks that keep a configuration out of the graphs, and finding the ``libcublasLt`` torch has loaded."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hwgraph_cuda import cublaslt, product_cache, products

GPU = torch.version.cuda is not None and not torch.version.hip and torch.cuda.is_available()


def operands():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 16, generator=g).bfloat16(), (torch.randn(4, 16, generator=g) / 4).bfloat16(),
            torch.randn(4, generator=g).bfloat16())


def algo(algo_id: int) -> cublaslt.Algo:
    made = cublaslt.Algo()
    made.data[0] = algo_id
    return made


class PartialWrites:
    """``LtProduct`` off the GPU: configuration 1 writes ATen's result, 2 writes nothing (cuBLASLt returned success,
    but its kernel left ``out`` as it was), 3 writes every row but the last."""

    def __init__(self, bias):
        self.bias = bias

    def accepts(self, algo):
        return True

    def run(self, algo, x, weight, out, workspace=None):
        result = F.linear(x, weight, self.bias)
        if algo.data[0] == 1:
            out.copy_(result)
        elif algo.data[0] == 3:
            out[:-1].copy_(result[:-1])
        return out


def test_a_configuration_that_leaves_its_output_unwritten_is_not_graded_on_the_previous_ones_result():
    """The errors of every configuration were computed in one buffer: one that wrote nothing, or only part of it,
    read the previous configuration's result and counted as accurate as it."""
    x, w, b = operands()
    exact, bound = products.MeasuredProducts.accuracy(x, w, b, gelu=False)
    out = x.new_empty(exact.shape)
    errors = products.MeasuredProducts.errors(PartialWrites(b), [algo(1), algo(2), algo(1), algo(3)], x, w, exact,
                                              out)
    assert [a.data[0] for a, _ in errors] == [1, 2, 1, 3]
    assert errors[0][1] == errors[2][1] <= bound
    assert math.isnan(errors[1][1]) and math.isnan(errors[3][1])
    assert [a.data[0] for a, e in errors if e <= bound] == [1, 1]  # as measure keeps them


def test_a_cached_configuration_that_leaves_its_output_unwritten_is_not_recalled(tmp_path, monkeypatch):
    """Recalling checked the cached configuration in a fresh block, which the CUDA allocator hands back from the one
    ATen's result in ``accuracy`` was just freed from: a configuration writing nothing read ATen's result."""
    x, w, b = operands()
    chooser = object.__new__(products.MeasuredProducts)
    chooser.lib = SimpleNamespace(cublasLtMatmulAlgoConfigGetAttribute=lambda *args: 7)  # describe_algo reads -1s
    chooser.device, chooser.cache = torch.device("cpu"), product_cache.ChoiceCache(tmp_path / "c.json", "H200")
    chooser.descriptors, chooser.choices, chooser.seconds = {}, {}, 0.0
    chooser.phases = dict.fromkeys(products.PHASES, 0.0)
    chooser.descriptor = lambda weight, bias, rows, gelu: PartialWrites(b)
    stale = F.linear(x, w, b)
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *args, **kwargs: stale.clone())
    for written in (2, 3):
        chooser.cache.put(chooser.label(x, w, False), products.Choice(algo(written), "x", 5.0, 4.0).entry())
        assert chooser.recall(x, w, b, gelu=False) is None
    chooser.cache.put(chooser.label(x, w, False), products.Choice(algo(1), "x", 5.0, 4.0).entry())
    assert chooser.recall(x, w, b, gelu=False).recalled  # one that writes its result still is


MAPS = """\
7f0000000000-7f0000100000 r-xp 00000000 fd:01 11 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1000000000-7f1000100000 r-xp 00000000 fd:01 12 /home/ann/My Projects/venv/lib/nvidia/cublas/lib/libcublasLt.so.12
7f1000100000-7f1000200000 r--p 00100000 fd:01 12 /home/ann/My Projects/venv/lib/nvidia/cublas/lib/libcublasLt.so.12
7f2000000000-7f2000001000 rw-p 00000000 00:00 0
7f3000000000-7f3000100000 r-xp 00000000 fd:01 13 /opt/old/libcublas.so.12 (deleted)
"""


def test_the_mapped_library_is_found_by_its_whole_path_with_spaces_or_replaced_on_disk(monkeypatch):
    """The path was the line's last word: a venv under a folder with a space gave a relative path, which ctypes
    could not load ('... does not provide the cuBLASLt matmul API'), and a replaced file gave '(deleted)'."""
    monkeypatch.setattr(cublaslt, "open", lambda path: io.StringIO(MAPS), raising=False)
    assert cublaslt.mapped_library("libcublasLt.so") == \
        "/home/ann/My Projects/venv/lib/nvidia/cublas/lib/libcublasLt.so.12"
    assert cublaslt.mapped_library("libcublas.so") == "/opt/old/libcublas.so.12"
    assert cublaslt.mapped_library("libcudart.so") is None


@pytest.mark.cuda
@pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU with a CUDA build of torch")
@pytest.mark.parametrize("gelu", [False, True])
def test_every_configuration_that_runs_writes_its_whole_output_over_the_nan_set_before_it(gelu):
    """``errors`` sets the output to NaN before each run (beta is 0: cuBLASLt does not read it): every configuration
    cuBLASLt offers that runs is graded on what it wrote, and is finite; some are as accurate as ATen's call."""
    lib, reason = cublaslt.cublaslt()
    assert lib is not None, reason
    chooser = products.MeasuredProducts(lib, torch.device("cuda", 0), None)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, k, n = 1024, 1152, 4304
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    descriptor = chooser.descriptor(w, b, rows, gelu)
    candidates = descriptor.candidates()
    algos = [c.algo for c in candidates] + descriptor.configurations(candidates)
    exact, bound = chooser.accuracy(x, w, b, gelu)
    errors = chooser.errors(descriptor, algos, x, w, exact, x.new_empty(exact.shape))
    assert errors and all(math.isfinite(e) for _, e in errors)
    assert any(e <= bound for _, e in errors)


def test_a_device_that_cannot_run_the_probing_product_is_a_reason_not_a_raise(monkeypatch):
    """Where torch has not mapped cuBLASLt yet, the gate runs a product to load it; a device that cannot (busy in
    exclusive mode, no kernel for its architecture) raised out of ``products_support`` and the manager's capture."""
    cublaslt.cublaslt.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cublaslt, "mapped_library", lambda stem: None)

    def busy(*args, **kwargs):
        raise RuntimeError("CUDA error: CUDA-capable device(s) is/are busy or unavailable")

    monkeypatch.setattr(torch, "ones", busy)
    try:
        support = products.products_support(torch.device("cuda", 0))
    finally:
        cublaslt.cublaslt.cache_clear()
    assert support.reasons == ("a bf16 addmm on CUDA, run to load cuBLASLt, failed: RuntimeError: CUDA error: "
                               "CUDA-capable device(s) is/are busy or unavailable",)


def test_a_workspace_is_given_to_cublaslt_in_bytes(monkeypatch):
    """``run`` told cuBLASLt the workspace's element count as its size in bytes: a float32 workspace was taken for a
    quarter of what it holds."""
    seen = {}

    def matmul(*args):
        seen["bytes"] = args[-2]
        return 0

    product = object.__new__(cublaslt.LtProduct)
    product.lib, product.handle, product.desc = SimpleNamespace(cublasLtMatmul=matmul), None, None
    product.layouts, product.alpha, product.beta = [None] * 3, 1.0, 0.0
    monkeypatch.setattr(cublaslt.ctypes, "byref", lambda value: value)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=0))
    x, w, _ = operands()
    product.run(algo(1), x, w, x.new_empty(8, 4), workspace=torch.empty(256, dtype=torch.float32))
    assert seen["bytes"] == 1024
