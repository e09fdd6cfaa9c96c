"""`bench --json` through a link to a file not made yet, and to the process's own standard error."""

from __future__ import annotations

import json
import subprocess
import sys

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
