"""``hwgraph validate`` and its plot, from a review: the verdict credits a kernel named by --attention only with its own
checks, the reports are never left half-written, and a matplotlib that is installed but broken is not called missing."""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import pytest

from hwgraph.validate import verdict


class NamedKernel:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("requested, results, ok", [
    # "FA" skipped here, "FA-2" passed: FA's own checks never ran
    (["FA"], [("TestA::t[cpu-FA-2-float32]", "passed"), ("TestA::t[cpu-FA-float32]", "skipped")], False),
    (["FA-2"], [("TestA::t[cpu-FA-2-float32]", "passed"), ("TestA::t[cpu-FA-float32]", "skipped")], True),
    # a name holding regex characters is a name, not a pattern
    (["FA+"], [("TestA::t[cpu-emulated-FA+-bfloat16-padded]", "passed")], True),
    (["CK(3)"], [("TestA::t[cpu-CK(3)-float16]", "passed")], True),
], ids=["prefix kernel skipped", "longer kernel passed", "plus in name", "parenthesis in name"])
def test_the_verdict_credits_a_requested_kernel_only_with_its_own_cases(monkeypatch, requested, results, ok):
    from hwgraph.attention import registry

    monkeypatch.setattr(registry, "kernel_named", NamedKernel)  # plugin kernels with such names
    rows = [{"check": check, "outcome": outcome, "message": "unavailable" if outcome == "skipped" else ""}
            for check, outcome in results]
    counts = {"passed": sum(o == "passed" for _, o in results), "failed": 0, "error": 0,
              "skipped": sum(o == "skipped" for _, o in results)}
    passed, summary = verdict({"exit_code": 0, "counts": counts, "results": rows}, requested)
    assert passed is ok, summary
    if not ok:
        assert summary == (f"FAIL: attention kernel {requested[0]} was asked for and none of its checks ran "
                           f"(unavailable)")


def passing_conformance(*args, **kwargs) -> dict:
    return {"exit_code": 0, "counts": {"passed": 1, "failed": 0, "error": 0, "skipped": 0}, "log": "",
            "results": [{"check": "TestCapture::test_x[cpu-TORCH_SDPA-float32]", "outcome": "passed", "message": "",
                         "seconds": 0.1}]}


def test_a_report_that_cannot_be_written_leaves_no_half_pass_and_exits_1(monkeypatch, tmp_path, capsys):
    """The disk filled while report.md was written: report.json (a whole PASS) and half a report.md stayed, and a
    traceback ended the run."""
    from hwgraph import cli
    from hwgraph.testing import results

    monkeypatch.delenv("HWGRAPH_GRAPH_BACKEND", raising=False)
    monkeypatch.setattr(results, "run_conformance", passing_conformance)
    write_text = Path.write_text

    def full_disk(path, text, *args, **kwargs):
        if "report.md" in path.name:
            write_text(path, text[: len(text) // 2], *args, **kwargs)  # what was written before the disk filled
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    out = tmp_path / "report"
    assert cli.main(["validate", "--backend", "cpu", "--report", str(out), "--no-bench"]) == 1
    assert sorted(p.name for p in out.iterdir()) == []  # the suite is faked: no conformance.log either
    captured = capsys.readouterr()
    assert captured.out.startswith("PASS: 1 checks passed, 0 skipped\n") and "report:" not in captured.out
    assert (f"hwgraph validate: --report {str(out)!r}: could not write report.json and report.md: No space left on "
            f"device") in captured.err


def test_the_reports_are_written_whole_and_replace_an_earlier_pair(tmp_path):
    from hwgraph.validate import write_reports

    (tmp_path / "report.json").write_text('{"ok": true}')
    write_reports(tmp_path, {"report.json": json.dumps({"ok": False}), "report.md": "**FAIL**\n"})
    assert json.loads((tmp_path / "report.json").read_text()) == {"ok": False}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]



def test_another_runs_partial_report_in_the_same_folder_is_left_alone(tmp_path):
    """Every run wrote ``.report.md.partial``: a second validate into the same folder overwrote the first one's, and
    deleted it before the first could rename it into place."""
    from hwgraph.validate import write_reports

    other = {name: tmp_path / f".{name}.partial" for name in ("report.json", "report.md")}
    other |= {f"{name} (pid 1)": tmp_path / f".{name}.1.partial" for name in ("report.json", "report.md")}
    for path in other.values():
        path.write_text("another run's, mid-write")
    write_reports(tmp_path, {"report.json": json.dumps({"ok": True}), "report.md": "**PASS** µs\n"})
    assert all(path.read_text() == "another run's, mid-write" for path in other.values())
    assert (tmp_path / "report.md").read_text(encoding="utf-8") == "**PASS** µs\n"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["report.json", "report.md"]

class BrokenMatplotlib:
    """A finder that makes ``import matplotlib`` fail as a matplotlib built for another numpy does."""

    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib":
            raise ImportError("numpy.core.multiarray failed to import")
        return None


def test_a_matplotlib_that_is_installed_but_broken_is_not_called_missing(monkeypatch):
    from hwgraph.plot import matplotlib_missing

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BrokenMatplotlib(), *sys.meta_path])
    note = matplotlib_missing()
    assert note == "matplotlib is installed but failed to import (ImportError: numpy.core.multiarray failed to import)"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: the extra that brings it is named
    assert matplotlib_missing() == ("matplotlib is not installed (ModuleNotFoundError: import of matplotlib halted; "
                                    "None in sys.modules); pip install 'hwgraph[plot]'")
