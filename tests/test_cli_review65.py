"""Review 65: each test failed on the code before its fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hwgraph import cli


def test_a_json_path_that_is_a_link_to_a_file_not_yet_made_is_taken_and_written_through(tmp_path, capsys):
    """'--json latest.json', a link to this run's file that does not exist yet, was refused before the run with
    "cannot write there: File exists" (the check made the file with O_EXCL, which refuses any link)."""
    from hwgraph.bench_command import writable_path

    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "bench-2.json"
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert writable_path("--json", str(link)) == link
    assert link.is_symlink() and not target.exists()  # the check left the link, and made no file behind it
    assert cli.main(["bench", "--groups", "1x4", "--warmup", "0", "--samples", "1", "--budgets", "8",
                     "--no-transformers", "--json", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and json.loads(target.read_text())["rows"][0]["group"] == "1x4"


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


@pytest.mark.parametrize("budgets", [(16, 32, 64), (4, 8)])
def test_the_retained_outputs_check_replays_and_fails_outputs_a_later_replay_overwrites(monkeypatch, budgets):
    """Its 16-token image fit no budget of a vendor's ``budgets = (4, 8)``: every call ran eagerly, and a manager
    whose outputs alias its graph's buffer passed."""
    from hwgraph.testing import suite
    from hwgraph.testing.cases import ConformanceCase
    from hwgraph.testing.towers import suite_tower

    case = ConformanceCase("cpu", "TORCH_SDPA", torch.float32, "cpu", "tiny")
    tower = suite_tower(case.preset, case.device, case.dtype)

    def run():
        check = suite.TestRetainedOutputs()
        monkeypatch.setattr(check, "budgets", budgets)
        manager = check.captured(check.make_manager(tower, case))
        try:
            check.test_outputs_kept_from_one_call_are_unchanged_by_later_calls(manager, tower)
        finally:
            manager.close()

    run()  # the reference backend passes
    outputs_overwritten_by_the_next_replay(monkeypatch)
    with pytest.raises(AssertionError, match="changed after later calls"):
        run()


def test_json_to_dev_stderr_redirected_to_a_file_keeps_what_was_logged_before_it(tmp_path):
    """'--json /dev/stderr 2> err.txt' opened the file again, truncating it: the run's log lines (-v) were lost, and
    anything logged after the results would have been written over them from the process's own offset."""
    err = tmp_path / "err.txt"
    with open(err, "w") as stderr:
        code = subprocess.call([sys.executable, "-m", "hwgraph.cli", "-v", "bench", "--groups", "1x4", "--warmup",
                                "0", "--samples", "1", "--budgets", "8", "--no-transformers", "--json", "/dev/stderr"],
                               stdout=subprocess.DEVNULL, stderr=stderr)
    assert code == 0
    text = err.read_text()
    start = text.index("{\n")
    assert "INFO hwgraph" in text[:start]  # the log lines before the results are kept
    results, end = json.JSONDecoder().raw_decode(text, start)
    assert results["rows"][0]["group"] == "1x4"
