"""The shipped conformance suite against the CPU reference backend with a vendor's smallest budgets (3 tokens or
fewer): every check runs, or skips saying why its case cannot be formed at those budgets; none fails the correct
backend. The suite runs in a pytest subprocess, as a vendor's CI runs it, and reports through JUnit XML."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

VENDOR_MODULE = '''
from hwgraph.testing import suite
from hwgraph.testing.suite import *  # noqa: F401,F403

HWGRAPH_BACKEND = "cpu"
HWGRAPH_ATTENTION = ("TORCH_SDPA",)

for _name in suite.__all__:  # every shipped check with the vendor's budgets (and the default max_images)
    if _name.startswith("Test"):
        globals()[_name] = type(_name, (getattr(suite, _name),), {{"budgets": {budgets!r}}})
'''

# Budget-independent checks, left out to keep the four runs short: they run in test_conformance_cpu.py.
UNAFFECTED = "not TestAttentionMatchesReference and not TestDeclaration"

CASE = "cpu-TORCH_SDPA-float32"
# the checks whose case a budget of 1, or budgets each one token above the one below, cannot form, and why
NO_PADDED_IMAGE = ("TestReplayEqualsEager::test_single_image_replays_at_each_budget_and_equals_eager"
                   f"[{CASE}-padded]", "holds a padded image")
NO_SEVERAL_IMAGES = (f"TestMultiImageGroups::test_several_images_share_one_replay_in_caller_order[{CASE}]",
                     "a graph takes one image here (max_images=4, smallest budget 1)")
NO_SMALLER_REQUEST = ("TestBudgetChanges::test_a_non_finite_request_leaves_later_requests_in_its_graph_unharmed"
                      f"[{CASE}]", "holds a request smaller than another in its graph")
ONE_TOKEN_APART = dict([NO_PADDED_IMAGE, NO_SEVERAL_IMAGES, NO_SMALLER_REQUEST])


def run_suite(tmp_path, budgets) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    """The suite's outcome per check, ``{"Class::test[id]": (outcome, message)}``, from a vendor module whose every
    check has ``budgets``."""
    (tmp_path / "test_vendor_conformance.py").write_text(VENDOR_MODULE.format(budgets=budgets))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", UNAFFECTED,
                          f"--junitxml={junit}", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, child.get("message") or ""
        outcomes[name] = (outcome, message)
    return run, outcomes


@pytest.mark.parametrize(("budgets", "unformable"), [
    ((1, 2, 3), ONE_TOKEN_APART),
    ((1,), ONE_TOKEN_APART),
    ((2,), {}),  # two images of one token share a graph; one token pads it
    ((3,), {}),
], ids=["1,2,3", "1", "2", "3"])
def test_the_suite_passes_the_reference_backend_with_budgets_of_three_tokens_or_fewer(tmp_path, budgets, unformable):
    """With budgets of (1, 2, 3) every check erred at setup (the default max_images of 4 was above the smallest
    budget, which the manager refuses), and with any budget of 3 or less the budget-switching check asked for images
    of 0 tokens; the checks whose case such budgets cannot form passed, checking nothing of what they name."""
    run, outcomes = run_suite(tmp_path, budgets)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    ours = {name: result for name, result in outcomes.items() if f"[{CASE}" in name}
    assert len(ours) >= 15, f"too few checks of {CASE} ran: {sorted(ours)}"
    bad = {name: result for name, result in ours.items() if result[0] in ("failure", "error")}
    assert not bad, bad
    skipped = {name: message for name, (outcome, message) in ours.items() if outcome == "skipped"}
    assert sorted(skipped) == sorted(unformable), skipped
    for name, why in unformable.items():
        assert why in skipped[name], f"{name} skipped saying {skipped[name]!r}, expected it to say {why!r}"
    # the other kernels' cases say why they have none
    assert all(message for outcome, message in outcomes.values() if outcome == "skipped"), outcomes


def checked_with(cls, monkeypatch, **settings):
    """An instance of the shipped check ``cls`` with ``settings`` (budgets, max_images), as a vendor's subclass sets
    them, and the case and tower it runs on."""
    import torch

    from hwgraph.testing.cases import ConformanceCase
    from hwgraph.testing.towers import suite_tower

    check = cls()
    for name, value in settings.items():
        monkeypatch.setattr(check, name, value)
    case = ConformanceCase("cpu", "TORCH_SDPA", torch.float32, "cpu", "tiny")
    return check, case, suite_tower(case.preset, case.device, case.dtype)


def test_the_full_group_check_fills_the_largest_budget_when_its_images_do_not_divide_it(monkeypatch):
    """With budgets of (2, 3) and two images a graph, its images of 3 // 2 tokens each made a group of 2, which
    replayed budget 2, and "must replay the largest budget" failed the correct backend."""
    from hwgraph.testing import suite

    check, case, tower = checked_with(suite.TestMultiImageGroups, monkeypatch, budgets=(2, 3), max_images=2)
    manager = check.captured(check.make_manager(tower, case))
    try:
        check.test_the_largest_budget_holds_a_full_group(manager, tower)
        assert manager.stats()["replays_per_budget"] == {3: 1} and manager.stats()["hits"] == 2
    finally:
        manager.close()


def test_the_pool_release_check_replays_before_close_with_budgets_below_its_image(monkeypatch):
    """Its 8-token image fit no budget of (1, 2, 3): the call before close() ran eagerly, checking no replay."""
    from hwgraph.testing import suite

    check, case, tower = checked_with(suite.TestPoolRelease, monkeypatch, budgets=(1, 2, 3), max_images=1)
    replays = []
    real = suite.ConformanceSuite.encode_and_check

    def counted(self, manager, *args, **kwargs):
        out = real(self, manager, *args, **kwargs)
        replays.append(manager.stats()["replays"])
        return out

    monkeypatch.setattr(suite.ConformanceSuite, "encode_and_check", counted)
    check.test_close_returns_the_graph_memory(tower, case)
    assert replays == [1], f"replays after the call before close(): {replays}"
