"""The rocm backend's replay check (``replay_disagreement``) row by row: rounding passes, stale rows do not."""

from __future__ import annotations

import re

import pytest
import torch
from hwgraph_rocm.graphs import RocmGraphBackend, replay_disagreement

from hwgraph.budget_capture import VERIFY_TOLERANCE, relative_error

ROWS, HIDDEN = 4096, 1152  # the tower's output: 4096 patch rows of the hidden size
BF16_ULP = 2.0 ** -8  # bf16 keeps 8 significant bits: one ulp is 2^-8 to 2^-7 of a value


def tower_output(image: int = 0, rows: int = ROWS, hidden: int = HIDDEN) -> torch.Tensor:
    """A float32 stand-in for the tower's output of ``image``: a large per-channel component every image shares (as a
    transformer's hidden states have) plus a per-row part of its own, so another image's row is close, not random."""
    shared = 2 * torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    return shared + torch.randn(rows, hidden, generator=torch.Generator().manual_seed(1 + image))


def rounding_noise(values: torch.Tensor, ulps: float, seed: int = 2) -> torch.Tensor:
    """``values`` with every element moved by about ``ulps`` bf16 ulps of itself, then rounded to bf16."""
    noise = torch.randn(values.shape, generator=torch.Generator().manual_seed(seed))
    return (values * (1 + ulps * BF16_ULP * noise)).bfloat16()


@pytest.mark.parametrize("ulps", [1e-4, 1, 3])
def test_bf16_rounding_on_every_element_passes(ulps):
    """The eager run computed in float32 and rounded; the replay's float32 sums in another order (a tiny relative
    change, which rounds some elements the other way) or a few ulps off everywhere: rounding, not a broken graph."""
    exact = tower_output()
    eager, replayed = exact.bfloat16(), rounding_noise(exact, ulps)
    assert not torch.equal(replayed, eager)
    assert replay_disagreement([replayed], [eager]) is None


@pytest.mark.parametrize("stale, count", [("another image's rows", 4), ("zeros", 2)])
def test_a_few_stale_rows_are_refused_naming_the_worst_row_its_error_and_the_bound(stale, count):
    """A replay that left ``count`` of 4096 rows as the previous image's (or never wrote them): the whole output's
    relative error stays within bf16's 3e-2, which was all the check judged, so the broken capture was kept."""
    exact = tower_output()
    eager, replayed = exact.bfloat16(), rounding_noise(exact, 1)
    rows = [1000, 2000, 3000, 4000][:count]
    replayed[rows] = tower_output(image=1)[rows].bfloat16() if stale == "another image's rows" else 0
    assert relative_error(replayed, eager) <= VERIFY_TOLERANCE[torch.bfloat16]  # what the check judged before
    reason = replay_disagreement([eager.clone(), replayed], [eager, eager])
    found = re.fullmatch(rf"output 1 of 2: row (\d+) of 4096 has relative error ([\d.]+), above the per-row bound "
                         rf"0\.12 for torch\.bfloat16 \({count} rows above it; .*", reason or "")
    assert found, reason
    assert int(found[1]) in rows and float(found[2]) > 0.5
    with pytest.raises(AssertionError, match=re.escape(reason)):
        RocmGraphBackend(device="cuda:0").compare_replay([eager.clone(), replayed], [eager, eager])


def test_a_stale_row_is_named_by_its_index_in_a_batched_output():
    exact = tower_output().reshape(2, ROWS // 2, HIDDEN)
    eager = exact.bfloat16()
    replayed = eager.clone()
    replayed[1, 5] = tower_output(image=1)[5].bfloat16()
    assert replay_disagreement([replayed], [eager]).startswith(
        "output 0 of 1: row (1, 5) of 4096 has relative error ")


def test_a_row_of_nan_is_refused_naming_the_row():
    eager = tower_output().bfloat16()
    replayed = eager.clone()
    replayed[7] = float("nan")
    assert replay_disagreement([replayed], [eager]) == (
        "output 0 of 1: NaN in other places: row 7 has 1152 NaN replayed, 0 from the eager run (1 of 4096 rows differ)")


def test_an_infinity_where_eager_is_finite_is_refused_naming_it_and_the_row():
    eager = tower_output().bfloat16()
    replayed = eager.clone()
    replayed[9, 3] = float("inf")
    assert replay_disagreement([replayed], [eager]) == (
        "output 0 of 1: +inf in other places: row 9 has 1 +inf replayed, 0 from the eager run (1 of 4096 rows differ)")


def test_a_near_zero_row_with_rounding_at_its_inputs_scale_passes():
    """A row that cancels to almost nothing (a residual add of two near-opposite rows) carries the rounding of its
    inputs, which is large against its own norm: judged against a floor of the typical row's norm, not its own."""
    exact = tower_output()
    exact[5] *= 1e-3
    eager = exact.bfloat16()
    typical = float(exact.pow(2).mean().sqrt())
    noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(3))
    replayed = (exact + 2 * BF16_ULP * typical * noise).bfloat16()  # two ulps of a typical element, everywhere
    row5 = float((replayed[5].float() - eager[5].float()).norm() / eager[5].float().norm())
    assert row5 > 1  # against its own norm the row is off by more than itself
    assert replay_disagreement([replayed], [eager]) is None
    replayed[5] = eager[6]  # but a typical row where the near-zero one belongs is stale
    assert replay_disagreement([replayed], [eager]).startswith("output 0 of 1: row 5 of 4096 has relative error ")


def test_all_zero_outputs_must_be_replayed_as_zeros():
    zeros = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    assert replay_disagreement([zeros.clone()], [zeros]) is None
    assert "relative error" in replay_disagreement([zeros + 1], [zeros])


def test_an_output_of_another_shape_or_dtype_is_refused_naming_both():
    eager = tower_output(rows=8).bfloat16()
    assert replay_disagreement([eager[:4]], [eager]) == (
        "output 0 of 1 is (4, 1152) torch.bfloat16 replayed, (8, 1152) torch.bfloat16 from the eager run")
    assert replay_disagreement([eager.float()], [eager]) == (
        "output 0 of 1 is (8, 1152) torch.float32 replayed, (8, 1152) torch.bfloat16 from the eager run")


def test_float64_outputs_are_compared_in_float64():
    """Compared in float32, a float64 replay off by 1e-8 rounded to the eager values and passed float64's 1e-10."""
    eager = tower_output(rows=8).double()
    assert replay_disagreement([eager * (1 + 1e-14)], [eager]) is None
    assert replay_disagreement([eager * (1 + 1e-8)], [eager]).startswith("output 0 of 1: relative error 1e-08 above")


def test_zero_dimensional_and_empty_outputs():
    scalar = torch.tensor(2.5)
    assert replay_disagreement([scalar.clone(), torch.empty(0, 3)], [scalar, torch.empty(0, 3)]) is None
    assert replay_disagreement([scalar + 1], [scalar]).startswith("output 0 of 1: relative error 0.4 above")


@pytest.mark.parametrize("hidden, refused", [(1, False), (2, False), (63, False), (64, True), (1152, True)])
def test_rows_narrower_than_min_row_width_are_judged_as_a_whole_output(hidden, refused):
    """In a row of one or two elements the row's relative error is one element's: a bf16 product to one column after
    54 blocks summed in another order had a row 0.21 off (bound 0.12) while the whole output was at 0.016, and the
    capture was refused as stale. One element 0.2 off stays within the whole output's bound at every width here."""
    eager = tower_output(rows=ROWS, hidden=hidden).bfloat16()
    replayed = eager.clone()
    replayed[7, 0] = eager[7, 0] + 0.2 * eager[7].float().norm()  # row 7 at 0.2 of its norm
    assert relative_error(replayed, eager) <= VERIFY_TOLERANCE[torch.bfloat16]
    reason = replay_disagreement([replayed], [eager])
    assert (reason is not None) == refused, reason
    if refused:
        assert reason.startswith(f"output 0 of 1: row 7 of {ROWS} has relative error 0.2"), reason


def test_values_whose_squares_leave_float32s_range_are_judged_as_others():
    """The norms were taken in float32: bf16 values near 1e20 (squares past float32's range) made the norm inf and
    one-ulp rounding a NaN error, refused; float32 values near 1e-25 (squares below it) made it 0, and a replay of
    zeros passed."""
    exact = tower_output(rows=64)
    assert replay_disagreement([rounding_noise(exact * 1e20, 1)], [(exact * 1e20).bfloat16()]) is None
    tiny = exact * 1e-25
    assert replay_disagreement([torch.zeros_like(tiny)], [tiny]).startswith(
        "output 0 of 1: relative error 1 above 0.0001 for torch.float32")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_outputs_are_compared_not_raised_on(dtype):
    """torch has no isposinf (nor isfinite, for e4m3fn) for float8: the check raised NotImplementedError, which the
    capture reported as a replay that differs from eager."""
    eager = tower_output(rows=8).to(dtype)
    assert replay_disagreement([eager.clone()], [eager]) is None
    replayed = eager.clone()
    replayed[3] = float("nan")
    assert replay_disagreement([replayed], [eager]).startswith("output 0 of 1: NaN in other places: row 3 has")
