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


def test_two_writers_with_one_pid_keep_their_own_partial_files(tmp_path, monkeypatch):
    """Two containers writing into one mounted folder are both pid 1 (and two threads share a pid): the second
    writer's partial file, named for the pid alone, truncated the first one's mid-write, and the report that was
    renamed into place came out corrupt."""
    from hwgraph import report

    monkeypatch.setattr(report.os, "getpid", lambda: 1)
    assert report.partial_path(tmp_path / "report.json") != report.partial_path(tmp_path / "report.json")
    other = tmp_path / ".report.json.1.partial"  # the first writer's, as the pid alone named it
    other.write_text("the other writer's, mid-write")
    report.write_reports(tmp_path, {"report.json": '{"ok": true}'})
    assert other.read_text() == "the other writer's, mid-write"
    assert json.loads((tmp_path / "report.json").read_text()) == {"ok": True}


@pytest.mark.parametrize("mode", [0o600, 0o664])
def test_a_report_written_again_keeps_its_permissions(tmp_path, mode):
    """The new file came from the partial, with the umask's permissions: a private report became world-readable."""
    from hwgraph.bench_command import write_json

    path = tmp_path / "bench.json"
    path.write_text("old")
    path.chmod(mode)
    write_json(path, '{"rows": []}')
    assert json.loads(path.read_text()) == {"rows": []} and path.stat().st_mode & 0o777 == mode


def test_a_json_path_whose_name_is_too_long_is_refused_naming_it_and_leaves_no_folders(tmp_path):
    """``Path.is_dir`` raises ENAMETOOLONG (it swallows only a few errors): a traceback instead of the option's
    error, and the folders made for the path were left behind."""
    from hwgraph.bench_command import writable_path

    spec = str(tmp_path / "new" / "deeper" / ("x" * 300 + ".json"))
    with pytest.raises(ValueError, match=r"^--json '.*x\.json': cannot write there: File name too long$"):
        writable_path("--json", spec)
    assert list(tmp_path.iterdir()) == []


def test_every_folder_made_for_a_refused_path_is_removed(tmp_path, monkeypatch):
    """Removing the folders made for a refused path stopped at the first it could not remove (the one whose name is
    too long, never made), and left the ones above it."""
    from hwgraph.bench_command import writable_path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="File name too long"):
        writable_path("--json", f"new1/{'y' * 300}/bench.json")
    assert list(tmp_path.iterdir()) == []


def test_a_partial_name_another_write_took_is_left_to_it(tmp_path, monkeypatch):
    from hwgraph import report

    taken = tmp_path / ".report.json.taken.partial"
    taken.write_text("the other write's")
    monkeypatch.setattr(report, "partial_path", lambda path: taken)
    with pytest.raises(FileExistsError):
        report.write_reports(tmp_path, {"report.json": "{}"})
    assert taken.read_text() == "the other write's" and not (tmp_path / "report.json").exists()
