"""``hwgraph bench --json``: the file is written whole or not at all, and links and pipes are written through."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from hwgraph import cli


def test_a_json_report_the_disk_cannot_hold_leaves_the_earlier_results_whole(tmp_path, monkeypatch, capsys):
    """The disk filled while --json was written after the run: the file held half a JSON document (the earlier run's
    results at that path were gone too), beside the message that it could not be written."""
    path = tmp_path / "bench.json"
    path.write_text('{"earlier": true}')
    write_text = pathlib.Path.write_text

    def full_disk(self, text, *args, **kwargs):
        if text.startswith("{\n"):  # the results: half of them reach the disk
            write_text(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    assert cli.main(["bench", "--groups", "1x4", "--warmup", "0", "--samples", "1", "--budgets", "8",
                     "--no-transformers", "--json", str(path)]) == 1
    assert "could not write the results: [Errno 28] No space left on device" in capsys.readouterr().err
    assert json.loads(path.read_text()) == {"earlier": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no partial file left beside it


def test_the_json_report_is_written_in_place_where_no_file_can_be_made_beside_it(tmp_path, monkeypatch):
    from hwgraph.bench_command import write_json

    path = tmp_path / "bench.json"
    path.write_text("old")

    def refused(self, *args, **kwargs):  # a folder that takes no new file, the file itself writable
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "touch", refused)
    write_json(path, '{"rows": []}')
    assert json.loads(path.read_text()) == {"rows": []}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


def test_a_json_report_path_that_is_a_symlink_writes_its_target(tmp_path):
    from hwgraph.bench_command import write_json

    target = tmp_path / "runs" / "bench-1.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_json(link, '{"rows": []}')
    assert link.is_symlink() and json.loads(target.read_text()) == {"rows": []}


def test_a_json_path_that_names_a_folder_is_refused_not_written_as_a_file(tmp_path, monkeypatch, capsys):
    """'--json out/' wrote the results to a file named 'out' (Path drops the separator); 'x/..' made the folder x."""
    from hwgraph import bench_command

    monkeypatch.setattr(bench_command, "run_bench", lambda cfg: pytest.fail("refused before the run"))
    for spec in (f"{tmp_path}/out/", f"{tmp_path}/out/.", f"{tmp_path}/x/.."):
        assert cli.main(["bench", "--groups", "1x4", "--json", spec]) == 2
        assert capsys.readouterr().err.strip() == f"hwgraph bench: --json {spec!r} is a folder: expected a file path"
    assert list(tmp_path.iterdir()) == []


def test_a_json_path_that_is_a_named_pipe_reaches_its_reader_whole(tmp_path):
    """The check before the run opened the pipe and closed it: its reader took that for the end of the results and
    left, and the results written after the run then waited for a reader forever (with no reader yet, the check
    itself waited, before anything ran)."""
    from hwgraph.bench_command import writable_path, write_json

    fifo = tmp_path / "results"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    try:
        assert writable_path("--json", str(fifo)) == fifo
        reader.join(timeout=0.5)
        assert reader.is_alive() and received == [], "the reader was given an end of file before the results"
        write_json(fifo, '{"rows": []}')
        reader.join(timeout=10)
        assert received == ['{"rows": []}']
    finally:
        if reader.is_alive():  # release a reader still waiting for a writer
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_json_to_dev_stdout_redirected_to_a_file_is_followed_by_the_tables_not_overwritten_by_them(tmp_path):
    """'--json /dev/stdout > out.txt' opened the file again, from its start, for the results: the tables printed
    after them through the process's own standard output were written over the JSON, from the start too."""
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        code = subprocess.call([sys.executable, "-m", "hwgraph.cli", "bench", "--groups", "1x4", "--warmup", "0",
                                "--samples", "1", "--budgets", "8", "--no-transformers", "--json", "/dev/stdout"],
                               stdout=stdout, stderr=subprocess.DEVNULL)
    assert code == 0
    text = out.read_text()
    results, end = json.JSONDecoder().raw_decode(text)
    assert results["rows"][0]["group"] == "1x4"
    assert text[end:].lstrip().startswith("## hwgraph bench: tiny")
    assert text.rstrip().endswith("JSON report: /dev/stdout")
