"""The CPU sync guard's sizes, dimensions and numbers, judged against torch's own argument parser.

Where a tensor method or a ``torch`` function wants a size, a dimension or a number, torch's Python argument parser
reads a one-element tensor given there with ``Tensor::item()``, which runs ``aten::_local_scalar_dense``, where a
``TorchDispatchMode`` sees it. Each call here runs twice outside the guard under such a mode: as given, and with its
one-element tensor arguments replaced by their Python numbers (taken beforehand). A read that only the first run shows
is the parser's (CPU kernels read host values too: ``var()`` its own result, ``masked_fill_`` a wrapped number). Inside
the guard, the call must raise ``HostSyncError`` where the parser read a tensor, and must not be refused by the
size-and-number rule where it read none and the call works. The calls come from torch's OpInfo database (the samples of
every method variant and of every public function variant that torch's argument parser binds, ``torch.name``, and the
same with each int or float argument a 0-dim tensor, given positionally, in a list or by keyword) and from the kinds of
call those samples never make: torch's deprecated argument orders, overloads a Python number rules out, a list of sizes
where an overload takes a tensor.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import types
import unittest
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwgraph.graphs import HostSyncError
from hwgraph.graphs.cpu import CpuGraphBackend

SCHEMA_RULE = "with a tensor where a size, a dimension or a number is expected"
LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
# Methods whose reads of a 0-dim tensor the guard lets through, and why: no schema says a number is read there
READS_OF_A_0_DIM_TENSOR_LET_THROUGH = {
    "tensor_split": "its tensor overload takes it, and its kernel (composite, so the mode sees it) reads the value "
                    "of a 0-dim one; on a device that kernel refuses a device tensor (it must be on the CPU), so no "
                    "replay path can rely on it",
}


class ReadCounter(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` calls (``Tensor::item()``, a device-to-host read on a device)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is LOCAL_SCALAR_DENSE
        return func(*args, **(kwargs or {}))


def fresh(value):
    """A copy of the tensors in ``value`` (in-place methods must not change a sample that is run again)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if value.layout == torch.strided else value
    if isinstance(value, (list, tuple)):
        return type(value)(fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    return value


def as_numbers(value):
    """``value`` with each one-element tensor among the arguments replaced by its Python number."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 and value.layout == torch.strided else value
    if isinstance(value, (list, tuple)):
        return type(value)(as_numbers(v) for v in value)
    if isinstance(value, dict):
        return {k: as_numbers(v) for k, v in value.items()}
    return value


def invoke(name, self, args, kwargs):
    """The method ``name`` of ``self``, or the function ``torch.<name>`` where ``name`` says so."""
    # looked up now, not kept: the guard replaces the methods on torch.Tensor and the functions in torch
    owner, name = (torch, name.removeprefix("torch.")) if name.startswith("torch.") else (torch.Tensor, name)
    return getattr(owner, name)(fresh(self), *fresh(args), **fresh(kwargs))


def parser_reads(name, self, args, kwargs) -> tuple[bool, bool]:
    """(whether the parser read a tensor of the call, whether the call works) outside the guard."""
    counts = []
    for given_args, given_kwargs in ((args, kwargs), (as_numbers(args), as_numbers(kwargs))):
        counter = ReadCounter()
        try:
            with counter:
                invoke(name, self, given_args, given_kwargs)
            works = True
        except Exception:  # noqa: BLE001 - a refused call is judged too (it must not be a read the guard misses)
            works = False
        counts.append((counter.reads, works))
    (with_tensors, works), (with_numbers, _) = counts
    return with_tensors > with_numbers, works


def guard_refusal(name, self, args, kwargs) -> str | None:
    """The ``HostSyncError`` message the call raises inside the guard, or None."""
    try:
        with CpuGraphBackend().sync_guard():
            invoke(name, self, args, kwargs)
    except HostSyncError as error:
        return str(error)
    except Exception:  # noqa: BLE001 - torch's own refusal, not the guard's
        return None
    return None


def described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.item()!r})" if value.numel() == 1 else f"<{value.dtype} tensor {tuple(value.shape)}>"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(described(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return ", ".join(f"{k}={described(v)}" for k, v in value.items())
    return repr(value)


def call_text(name, args, kwargs) -> str:
    given = ", ".join(filter(None, (described(tuple(args))[1:-1].rstrip(","), described(kwargs))))
    return f"{name}(x{', ' if given else ''}{given})" if name.startswith("torch.") else f"x.{name}({given})"


def verdict(name, self, args, kwargs) -> tuple[str, str | None]:
    """("read", "not read" or "ignored", the discrepancy or None) for one call, judged against the oracle."""
    if guard_refusal(name, self, as_numbers(args), as_numbers(kwargs)) is not None:
        return "ignored", None  # another of the guard's rules refuses it given numbers (nonzero(), a mask index...)
    read, works = parser_reads(name, self, args, kwargs)
    refusal = guard_refusal(name, self, args, kwargs)
    if read:
        return "read", None if refusal is not None else f"{call_text(name, args, kwargs)}: the parser reads a " \
                                                          f"tensor back, the guard let it through"
    if refusal is not None and SCHEMA_RULE in refusal and works:
        return "not read", f"{call_text(name, args, kwargs)}: reads nothing back and works, the guard refused it"
    return "not read", None


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_tensor(number):
    return torch.tensor(number, dtype=torch.int64 if isinstance(number, int) else torch.float32)


def with_number_tensors(args: tuple, kwargs: dict):
    """Each (args, kwargs) with one int or float of the sample made a 0-dim tensor: itself, or an item of its list."""
    def replaced(value):
        if is_number(value):
            yield as_tensor(value)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if is_number(item):
                    yield type(value)((*value[:i], as_tensor(item), *value[i + 1:]))

    for position, value in enumerate(args):
        for new in replaced(value):
            yield (*args[:position], new, *args[position + 1:]), kwargs
    for key, value in kwargs.items():
        for new in replaced(value):
            yield args, {**kwargs, key: new}


def known_let_through(name, args, kwargs) -> bool:
    return name.removeprefix("torch.") in READS_OF_A_0_DIM_TENSOR_LET_THROUGH and \
        any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in (*args, *kwargs.values()))


def import_op_db():
    """torch's OpInfo database, or None and why it cannot be imported. Its test helpers import ``expecttest`` only for
    a TestCase base class, which this module's use never runs, so a stand-in serves where that package is absent."""
    stand_in = importlib.util.find_spec("expecttest") is None
    if stand_in:
        sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except Exception as error:  # noqa: BLE001 - any failure of torch's internal test modules is a skip
        return None, f"torch.testing._internal cannot be imported here: {type(error).__name__}: {error}"
    finally:
        if stand_in:
            sys.modules.pop("expecttest", None)
    return op_db, None


def variants(op) -> list[str]:
    """The names ``invoke`` takes for an OpInfo's method variant and its function variant (``torch.name``), each where
    it is the method or the function of that name that torch's argument parser binds (not a lambda around one, nor an
    alias op_db keeps for another name)."""
    names = []
    method = op.method_variant
    name = getattr(method, "__name__", None)
    if method is not None and name is not None and getattr(torch.Tensor, name, None) is method:
        names.append(name)
    name = getattr(op.op, "__name__", "_")
    bound = getattr(torch._C._VariableFunctions, name, None)
    if not name.startswith("_") and getattr(torch, name, None) is op.op is bound:
        names.append(f"torch.{name}")
    return names


def opinfo_calls(op_db, samples_per_op: int, seed: int):
    """(method name or "torch." and function name, self, args, kwargs): a seeded choice of each method and function
    variant's float32 CPU samples, then each of those with its ints and floats made 0-dim tensors one at a time."""
    chooser = random.Random(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in op_db:
            names = variants(op)
            if not names:
                continue
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                try:
                    samples = [s for s in op.sample_inputs("cpu", torch.float32) if isinstance(s.input, torch.Tensor)]
                except Exception:  # noqa: BLE001 - a sample generator this torch cannot run is not ours to judge
                    continue
            for sample in chooser.sample(samples, min(samples_per_op, len(samples))):
                args, kwargs = tuple(sample.args), dict(sample.kwargs)
                for name in names:
                    yield name, sample.input, args, kwargs
                    for new_args, new_kwargs in with_number_tensors(args, kwargs):
                        yield name, sample.input, new_args, new_kwargs


def opinfo_findings(samples_per_op: int = 3, seed: int = 0) -> dict:
    """{"tallies": calls of each kind, "wrong": the calls judged wrongly}, or {"skip": why} without the database."""
    op_db, why = import_op_db()
    if op_db is None:
        return {"skip": why}
    tallies = {"read": 0, "not read": 0, "ignored": 0, "function read": 0, "function not read": 0}
    wrong = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, self, args, kwargs in opinfo_calls(op_db, samples_per_op, seed):
            kind, discrepancy = verdict(name, self, args, kwargs)
            tallies[kind] += 1
            if name.startswith("torch.") and kind != "ignored":
                tallies[f"function {kind}"] += 1
            if discrepancy is not None and not (kind == "read" and known_let_through(name, args, kwargs)):
                wrong.append(discrepancy)
    return {"tallies": tallies, "wrong": sorted(set(wrong))}


def test_the_guard_refuses_exactly_the_opinfo_calls_whose_tensor_the_argument_parser_reads():
    """Every method variant and public function variant of torch's OpInfo database, on a seeded choice of its samples
    (the functions passed the guard, which judged methods only): each call the parser reads a tensor of is refused
    inside the guard, and none that reads nothing and works is refused by the size-and-number rule.
    In a child process: importing torch.testing._internal freezes torch.backends' flags (disable_global_flags) and
    patches TorchScript's calls for the rest of the process, which the tests after this one would run under."""
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    found = json.loads(child.stdout.splitlines()[-1])
    if "skip" in found:
        pytest.skip(found["skip"])
    tallies, wrong = found["tallies"], found["wrong"]
    # the choice reached the calls it is meant to judge: a few hundred of each kind, functions among them
    assert tallies["read"] >= 300 and tallies["not read"] >= 300, tallies
    assert tallies["function read"] >= 300 and tallies["function not read"] >= 300, tallies
    assert not wrong, f"{len(wrong)} calls judged wrongly (of {tallies}):\n" + "\n".join(wrong[:40])


x, y, v, b = (torch.rand(3, 3), torch.rand(3, 3), torch.rand(3), torch.rand(2, 3, 3))
one, half, two = torch.tensor(1), torch.tensor(0.5), torch.tensor(2.0)

# name, self, args, kwargs: calls OpInfo's samples never make, where the parser reads a tensor
READS = {
    "add-deprecated-alpha-first": ("add", x, (two, y), {}),
    "sub_-deprecated-alpha-first": ("sub_", x, (two, y), {}),
    "addcmul-deprecated-value-first": ("addcmul", x, (two, y, y), {}),
    "addcdiv_-deprecated-value-first": ("addcdiv_", x, (two, y, y), {}),
    "addmm-deprecated-beta-first": ("addmm", x, (two, y, y), {}),
    "addmm-deprecated-alpha-second": ("addmm", x, (0.5, two, y, y), {}),
    "addmv-deprecated-beta-first": ("addmv", v, (two, y, v), {}),
    "addr-deprecated-beta-first": ("addr", x, (two, v, v), {}),
    "baddbmm-deprecated-beta-first": ("baddbmm", b, (two, b, b), {}),
    "addbmm-deprecated-beta-and-alpha": ("addbmm", x, (two, half, b, b), {}),
    "max-dim-and-keepdim": ("max", x, (one, True), {}),
    "clamp-tensor-min-number-max": ("clamp", x, (half, 1.0), {}),
    "clamp-number-min-tensor-max": ("clamp", x, (0.0, half), {}),
    "clamp-keywords": ("clamp", x, (), {"min": half, "max": 1.0}),
    "clamp-positional-and-keyword": ("clamp", x, (half,), {"max": 1.0}),
    "clip_-tensor-max": ("clip_", x, (0.0, half), {}),
    "tensor_split-list-of-indices": ("tensor_split", x, ((one, 2),), {}),
    "tensor_split-list-of-indices-keyword": ("tensor_split", x, ([one],), {"dim": 1}),
    "repeat_interleave-dim": ("repeat_interleave", x, (2, one), {}),
    "repeat_interleave-output_size": ("repeat_interleave", x, (torch.tensor([1, 1, 1]), 0), {"output_size": 3 * one}),
    # the functions of torch, judged as their methods where those take the call, else from their own schemas
    "torch.add-deprecated-alpha-first": ("torch.add", x, (two, y), {}),
    "torch.addmm-alpha-keyword": ("torch.addmm", x, (y, y), {"alpha": two}),
    "torch.clamp-tensor-min-number-max": ("torch.clamp", x, (half, 1.0), {}),
    "torch.histogramdd-a-list-of-bins-is-no-list-of-tensors": ("torch.histogramdd", x, ((3, 2, one),), {}),
    "torch.full_like-value": ("torch.full_like", x, (two,), {}),
    "torch.sum-dim": ("torch.sum", x, (one,), {}),
}
# and calls where it reads none: each one-element tensor is an operand of an overload that takes a tensor there
OPERANDS = {
    "add-deprecated-tensor-other": ("add", x, (2.0, two), {}),
    "add-0-dim-other": ("add", x, (two,), {"alpha": 2}),
    "addmm-deprecated-numbers": ("addmm", x, (0.5, 2.0, y, y), {}),
    "max-0-dim-other": ("max", x, (two,), {}),
    "clamp-tensor-min-no-max": ("clamp", x, (half, None), {}),
    "clamp-tensor-min-tensor-max": ("clamp", x, (half, y), {}),
    "clamp-tensor-max": ("clamp", x, (), {"max": half}),
    "lerp-0-dim-weight": ("lerp", x, (y, half), {}),
    "index_fill-0-dim-value": ("index_fill", x, (1, torch.tensor([0, 2]), two), {}),
    "scatter-one-element-src": ("scatter", x, (1, torch.tensor([[1]]), torch.tensor([[2.0]])), {}),
    "repeat_interleave-0-dim-repeats-output_size": ("repeat_interleave", x, (one,), {"output_size": 9}),
    "quantile-0-dim-q": ("quantile", x, (half,), {}),
    "pow-0-dim-exponent": ("pow", x, (), {"exponent": two}),
    "div-0-dim-other-rounding": ("div", x, (two,), {"rounding_mode": "floor"}),
    "torch.clamp-tensor-max": ("torch.clamp", x, (), {"max": half}),
    "torch.where-0-dim-other": ("torch.where", x > 0.5, (x, two), {}),
    "torch.add-0-dim-other": ("torch.add", x, (two,), {}),
    "torch.pow-0-dim-self": ("torch.pow", two, (x,), {}),
    "torch.histogramdd-a-list-of-tensors": ("torch.histogramdd", x, ([torch.linspace(0, 1, 3)] * 3,), {}),
}


@pytest.mark.filterwarnings("ignore:This overload of")
@pytest.mark.parametrize("call", READS.values(), ids=READS.keys())
def test_the_guard_refuses_a_tensor_the_argument_parser_reads_in_calls_opinfo_never_makes(call):
    """torch's deprecated orders put numbers before the tensors (x.add(n, y), x.addmm(beta, m1, m2)); a Python number
    given to clamp rules out its tensor overload, so its other bound is read too; a list of sizes is never the tensor of
    tensor_split's tensor overload; and repeat_interleave judged only its repeats. All but x.max(n, True) and
    x.repeat_interleave(2, n) (which operator.index() gave away) passed the guard, and every torch function (the guard
    judged methods only), whose calls are judged as their methods' where those take them (torch.add(x, n, y))."""
    name, self, args, kwargs = call
    read, works = parser_reads(name, self, args, kwargs)
    assert read and works, f"{call_text(name, args, kwargs)}: torch no longer reads a tensor back here"
    with pytest.raises(HostSyncError, match=r"inside sync_guard\(\): a device-to-host synchronisation"):
        with CpuGraphBackend().sync_guard():
            invoke(name, self, args, kwargs)


@pytest.mark.filterwarnings("ignore:This overload of")
@pytest.mark.parametrize("call", OPERANDS.values(), ids=OPERANDS.keys())
def test_the_guard_allows_one_element_tensors_given_as_operands(call):
    name, self, args, kwargs = call
    read, works = parser_reads(name, self, args, kwargs)
    assert not read and works, f"{call_text(name, args, kwargs)}: torch now reads a tensor back here"
    expected = invoke(name, self, args, kwargs)
    with CpuGraphBackend().sync_guard():
        got = invoke(name, self, args, kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# a tensor where a method wants a dtype, a layout or a memory format (which the schemas write as int)
NOT_NUMBERS = {
    "sum-dtype": ("sum", x, (), {"dtype": one}),
    "is_contiguous-memory_format": ("is_contiguous", x, (), {"memory_format": one}),
    "clone-memory_format": ("clone", x, (), {"memory_format": one}),
    "bmm-out_dtype": ("bmm", b, (b, one), {}),
}


@pytest.mark.parametrize("call", NOT_NUMBERS.values(), ids=NOT_NUMBERS.keys())
def test_a_tensor_given_as_a_dtype_or_a_memory_format_gets_torchs_type_error_inside_the_guard(call):
    """The schemas write a dtype, a layout and a memory format as int, so the guard took a tensor there for a number
    read back and named the call a device-to-host synchronisation; torch reads nothing, and refuses it."""
    name, self, args, kwargs = call
    read, works = parser_reads(name, self, args, kwargs)
    assert not read and not works
    with pytest.raises(TypeError) as outside:
        invoke(name, self, args, kwargs)
    with CpuGraphBackend().sync_guard(), pytest.raises(TypeError) as inside:
        invoke(name, self, args, kwargs)
    assert str(inside.value) == str(outside.value)


if __name__ == "__main__":  # the child process of the OpInfo test
    print(json.dumps(opinfo_findings()))
