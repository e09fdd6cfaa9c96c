"""Checks of the shipped conformance suite that could not fail: each is run against a deliberately broken kernel or
backend (it must fail) and against the CPU reference backend with the settings a vendor may override (it must pass).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hwgraph.graphs.cpu import CpuCapturedGraph
from hwgraph.testing import suite
from hwgraph.testing.cases import ConformanceCase
from hwgraph.testing.towers import suite_tower

CASE = ConformanceCase("cpu", "TORCH_SDPA", torch.float32, "cpu", "tiny")

VENDOR_MODULE = '''
import pytest
{patch}
from hwgraph.testing.suite import *  # noqa

HWGRAPH_BACKEND = "cpu"
HWGRAPH_ATTENTION = ("TORCH_SDPA",)
'''

BROKEN_KERNELS = {
    # every other check compares the manager with the tower's eager answer, which runs the same kernel
    "zeros": '''
import torch
import hwgraph.attention.sdpa as sdpa
sdpa.masked_sdpa = lambda q, k, v, cu_seqlens, scale: torch.zeros_like(q)
''',
    # the images of a group attend to each other (padding rows still apart): eager of the group does the same
    "one sequence": '''
import torch
import hwgraph.attention.sdpa as sdpa
real = sdpa.masked_sdpa
sdpa.masked_sdpa = lambda q, k, v, cu, scale: real(q, k, v, torch.stack([cu[0], cu[-1]]), scale)
''',
    # the scale it is given is ignored for the usual default, 1/sqrt(head_dim): the tower passes that same value
    "ignores scale": '''
import hwgraph.attention.sdpa as sdpa
real = sdpa.masked_sdpa
sdpa.masked_sdpa = lambda q, k, v, cu, scale: real(q, k, v, cu, q.shape[-1] ** -0.5)
''',
    # a tiled kernel whose loop over key blocks stops after the first 32 keys of each sequence: the check's sequences
    # were all shorter, and eager and replay run the same loop
    "first key block": '''
import torch
import torch.nn.functional as F
import hwgraph.attention.sdpa as sdpa


def first_key_block(q, k, v, cu, scale):
    seg = sdpa.segment_ids(cu, q.shape[0])
    first = torch.arange(q.shape[0], device=q.device) - cu.long()[seg] < 32
    mask = sdpa.block_diagonal_mask(seg) & first[None, :]  # padding rows: their own block, as the real kernel's
    real = sdpa.valid_rows(cu, q.shape[0])[:, None, None]  # and never read, as the real kernel's
    k, v = torch.where(real, k, 0), torch.where(real, v, 0)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).contiguous()


sdpa.masked_sdpa = first_key_block
''',
    # a grid of one 32-row query block per sequence: the rows past it are never written
    "first query block": '''
import torch
import hwgraph.attention.sdpa as sdpa
real = sdpa.masked_sdpa


def first_query_block(q, k, v, cu, scale):
    seg = sdpa.segment_ids(cu, q.shape[0])
    late = torch.arange(q.shape[0], device=q.device) - cu.long()[seg] >= 32
    return torch.where(late[:, None, None], 0, real(q, k, v, cu, scale))


sdpa.masked_sdpa = first_query_block
''',
    # a pointer kernel reading [T, H, D] as contiguous whatever the strides: the tower passes views (v a slice of the
    # qkv product), eager and replay alike, and the check gave it contiguous tensors
    "ignores strides": '''
import torch
import hwgraph.attention.sdpa as sdpa
real = sdpa.masked_sdpa


def dense(t):
    return torch.as_strided(t, t.shape, (t.shape[1] * t.shape[2], t.shape[2], 1))


sdpa.masked_sdpa = lambda q, k, v, cu, scale: real(dense(q), dense(k), dense(v), cu, scale)
''',
}


@pytest.mark.parametrize("broken", list(BROKEN_KERNELS))
def test_the_suite_fails_an_attention_kernel_that_is_wrong_in_eager_and_replay_alike(tmp_path, broken):
    (tmp_path / "test_vendor_conformance.py").write_text(VENDOR_MODULE.format(patch=BROKEN_KERNELS[broken]))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and all("TestAttentionMatchesReference" in line for line in failed), run.stdout[-4000:]


def test_the_kernel_check_also_checks_the_padding_unspecified_variant_the_tower_runs(monkeypatch):
    """The tower runs ``kernel.padding_unspecified``: one attending across sequences failed no check."""
    from hwgraph.attention import sdpa

    public = sdpa.sdpa_varlen
    real = public.padding_unspecified
    monkeypatch.setattr(public, "padding_unspecified", lambda q, k, v, cu, m, s: real(
        q, k, v, torch.stack([cu[0], cu[-1]]), m, s))
    with pytest.raises(AssertionError, match="padding_unspecified"):
        suite.TestAttentionMatchesReference().test_the_kernel_equals_the_float64_reference(CASE)
    monkeypatch.undo()
    suite.TestAttentionMatchesReference().test_the_kernel_equals_the_float64_reference(CASE)


def make(cls, monkeypatch, **settings):
    check = cls()
    for name, value in settings.items():
        monkeypatch.setattr(check, name, value)
    tower = suite_tower(CASE.preset, CASE.device, CASE.dtype)
    return check, tower, check.captured(check.make_manager(tower, CASE))


def stale_after_first_replay(monkeypatch):
    """Each graph replays once (the capture's own check), then hands back what that replay left."""
    replay = CpuCapturedGraph.replay

    def once(self):
        if not getattr(self, "replayed", False):
            replay(self)
            self.replayed = True

    monkeypatch.setattr(CpuCapturedGraph, "replay", once)


def test_the_deepstack_check_replays_with_fewer_images_per_graph(monkeypatch):
    """With ``max_images = 2`` its group of three images ran eagerly: a backend whose replays are all stale passed."""
    stale_after_first_replay(monkeypatch)
    check, tower, manager = make(suite.TestDeepStack, monkeypatch, max_images=2)
    try:
        with pytest.raises(AssertionError):
            check.test_every_deepstack_slice_of_every_image_equals_eager(manager, tower)
    finally:
        manager.close()


def test_the_new_pixels_check_replays_with_budgets_below_its_image(monkeypatch):
    """Its 12-token image fit no budget of ``budgets = (4, 8)``: three eager calls, and a stale backend passed."""
    stale_after_first_replay(monkeypatch)
    check, tower, manager = make(suite.TestBudgetChanges, monkeypatch, budgets=(4, 8))
    try:
        with pytest.raises(AssertionError):
            check.test_the_same_budget_with_new_pixels_gives_new_answers(manager, tower)
    finally:
        manager.close()


@pytest.mark.parametrize(("cls", "check"), [
    (suite.TestNoHostSync, "test_replay_and_fallback_read_nothing_back_from_the_device"),
    (suite.TestBudgetChanges, "test_consecutive_calls_switch_budgets_without_stale_inputs"),
    (suite.TestDeepStack, "test_every_deepstack_slice_of_every_image_equals_eager"),
])
@pytest.mark.parametrize("max_images", [1, 2])
def test_checks_pass_the_reference_backend_whose_graphs_take_fewer_images(monkeypatch, cls, check, max_images):
    """A vendor whose graphs take one image sets ``max_images = 1``: two checks failed the correct CPU backend, their
    two-image groups having run eagerly."""
    instance, tower, manager = make(cls, monkeypatch, max_images=max_images)
    try:
        getattr(instance, check)(manager, tower)
    finally:
        manager.close()



@pytest.mark.parametrize(("cls", "check"), [
    (suite.TestMultiImageGroups, "test_several_images_share_one_replay_in_caller_order"),
    (suite.TestMultiImageGroups, "test_each_slot_count_graph_of_a_budget_replays_its_own_groups"),
    # their groups of 16 and 12 tokens fit no budget of (4, 8): eager, and "must replay" failed a correct backend
    (suite.TestDeepStack, "test_every_deepstack_slice_of_every_image_equals_eager"),
    (suite.TestNoHostSync, "test_replay_and_fallback_read_nothing_back_from_the_device"),
])
def test_checks_pass_the_reference_backend_with_a_vendors_small_budgets(monkeypatch, cls, check):
    """With budgets of (4, 8) and four images a graph, the first crashed (its 23-token group fit no budget: TypeError)
    and the second asked for images of 0 tokens."""
    instance, tower, manager = make(cls, monkeypatch, budgets=(4, 8), max_images=4)
    try:
        if check == "test_each_slot_count_graph_of_a_budget_replays_its_own_groups":
            getattr(instance, check)(tower, CASE)
        else:
            getattr(instance, check)(manager, tower)
    finally:
        manager.close()


@pytest.mark.parametrize(("cls", "check", "fill"), [
    (suite.TestReplayEqualsEager, "test_single_image_replays_at_each_budget_and_equals_eager", "padded"),
    (suite.TestReplayEqualsEager, "test_single_image_replays_at_each_budget_and_equals_eager", "full"),
    (suite.TestBudgetChanges, "test_a_non_finite_request_leaves_later_requests_in_its_graph_unharmed", None),
])
def test_checks_pass_the_reference_backend_with_budgets_that_do_not_double(monkeypatch, cls, check, fill):
    """With budgets of (16, 24, 32), a padded image of 32 - 32 // 4 = 24 tokens, and a later call of 32 // 2 + 1 = 17
    tokens, fit the 24-token budget: the checks, expecting budget 32, failed a correct backend."""
    instance, tower, manager = make(cls, monkeypatch, budgets=(16, 24, 32))
    try:
        getattr(instance, check)(manager, tower, *([fill] if fill else []))
    finally:
        manager.close()


def test_the_static_outputs_check_passes_the_reference_backend_with_a_smallest_budget_of_three_or_less(monkeypatch):
    """A vendor whose graphs take one image may capture budgets (2, 4): the check's second image of budget - 3 tokens
    had -1 tokens, and its grid was refused, failing a correct backend."""
    instance, tower, manager = make(suite.TestReplayEqualsEager, monkeypatch, budgets=(2, 4), max_images=1)
    try:
        instance.test_replays_overwrite_the_output_tensors_capture_returned(manager, tower)
        assert manager.stats()["replays_per_budget"] == {2: 2}
    finally:
        manager.close()


def test_uneven_sizes_fit_the_tokens_they_are_given():
    assert suite.ConformanceSuite.uneven((4, 1, 16, 2), 23) == (4, 1, 16, 2)
    fitted = suite.ConformanceSuite.uneven((4, 1, 16, 2), 8)
    assert sum(fitted) <= 8 and min(fitted) >= 1 and len(set(fitted)) > 1
    with pytest.raises(ValueError, match="4 images of at least 1 token cannot share 3 tokens"):
        suite.ConformanceSuite.uneven((1, 1, 1, 1), 3)


def test_the_suite_checks_a_kernel_that_is_not_graph_safe_against_the_reference(tmp_path):
    """The manager runs such a kernel eagerly (NPU attention, given as ``attention="NPU"``), yet every case of it was
    one skip: a wrong one passed a vendor's run on its own hardware with nothing checked."""
    patch = BROKEN_KERNELS["zeros"] + '''
import dataclasses
from hwgraph.attention import registry
real_kernel_specs = registry.kernel_specs
registry.kernel_specs = lambda: (*real_kernel_specs(), dataclasses.replace(sdpa.TORCH_SDPA, name="EAGER_ONLY",
                                                                          graph_safe=False))
'''
    module = VENDOR_MODULE.format(patch=patch).replace('("TORCH_SDPA",)', '("EAGER_ONLY",)')
    (tmp_path / "test_vendor_conformance.py").write_text(module)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert [line.split(" - ")[0] for line in failed] == [
        "FAILED test_vendor_conformance.py::TestAttentionMatchesReference::"
        "test_the_kernel_equals_the_float64_reference[cpu-EAGER_ONLY-float32]"], run.stdout[-4000:]
    # the graph checks still skip it, saying why
    assert "attention kernel EAGER_ONLY is not graph-safe: the manager runs it eagerly" in run.stdout


def test_the_pool_release_check_closes_its_manager_when_it_fails(monkeypatch):
    """A failure before its own close() left the manager's graphs and pool held for the rest of the vendor's run."""
    from hwgraph.manager import EncoderGraphManager

    open_managers = set()
    make_manager, close = suite.ConformanceSuite.make_manager, EncoderGraphManager.close

    def tracked(self, tower, case):
        manager = make_manager(self, tower, case)
        open_managers.add(manager)
        return manager

    def closing(self):
        open_managers.discard(self)
        close(self)

    monkeypatch.setattr(suite.ConformanceSuite, "make_manager", tracked)
    monkeypatch.setattr(EncoderGraphManager, "close", closing)
    check = suite.TestPoolRelease()

    def wrong(*args, **kwargs):
        raise AssertionError("a wrong replay")

    monkeypatch.setattr(check, "encode_and_check", wrong)
    with pytest.raises(AssertionError, match="a wrong replay"):
        check.test_close_returns_the_graph_memory(suite_tower(CASE.preset, CASE.device, CASE.dtype), CASE)
    assert not open_managers


def outputs_overwritten_by_the_next_replay(monkeypatch):
    """The manager hands back, from each replay, the tensors it handed back from the last replay of that budget,
    overwritten: outputs that alias a buffer the next replay writes."""
    from hwgraph.manager import EncoderGraphManager

    real, handed = EncoderGraphManager._replay, {}

    def replay(self, entry, *args):
        out = real(self, entry, *args)
        earlier = handed.get(entry.budget)
        if earlier is not None and [o.embeds.shape for o in earlier] == [o.embeds.shape for o in out]:
            with torch.inference_mode():
                for e, o in zip(earlier, out, strict=True):
                    e.embeds.copy_(o.embeds)
                    for ed, od in zip(e.deepstack, o.deepstack, strict=True):
                        ed.copy_(od)
            out = earlier
        handed[entry.budget] = out
        return out

    monkeypatch.setattr(EncoderGraphManager, "_replay", replay)


@pytest.mark.parametrize("budgets", [(16, 32, 64), (4, 8), (16,)])
def test_the_retained_outputs_check_replays_and_fails_outputs_a_later_replay_overwrites(monkeypatch, budgets):
    """Its 16-token image fit no budget of a vendor's ``budgets = (4, 8)``: every call ran eagerly, and a manager
    whose outputs alias its graph's buffer passed. With one budget all three calls replay it."""
    tower = suite_tower(CASE.preset, CASE.device, CASE.dtype)

    def run():
        check = suite.TestRetainedOutputs()
        monkeypatch.setattr(check, "budgets", budgets)
        manager = check.captured(check.make_manager(tower, CASE))
        try:
            check.test_outputs_kept_from_one_call_are_unchanged_by_later_calls(manager, tower)
        finally:
            manager.close()

    run()  # the reference backend passes
    outputs_overwritten_by_the_next_replay(monkeypatch)
    with pytest.raises(AssertionError, match="changed after later calls"):
        run()


def test_the_two_thread_helper_fails_a_guard_that_never_lets_the_threads_overlap():
    """A guard holding a lock while a thread is inside never lets the second thread in before the first has left: the
    helper waited out its timeouts and returned what ``inside()`` saw then, as if the first had left while the second
    was inside, so the checks built on it passed a guard they never exercised."""
    import contextlib
    import threading

    from hwgraph.testing.threads import first_leaves_while_second_is_inside

    lock = threading.Lock()

    @contextlib.contextmanager
    def one_thread_at_a_time():
        with lock:
            yield

    with pytest.raises(TimeoutError, match="the second thread did not enter its guard"):
        first_leaves_while_second_is_inside(one_thread_at_a_time, lambda: "inside", timeout=0.5)
    assert first_leaves_while_second_is_inside(contextlib.nullcontext, lambda: "inside", timeout=5) == "inside"
