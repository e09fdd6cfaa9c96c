"""The cache of measured product choices between processes (``hwgraph_cuda.product_cache``): where it lives, its
entries per setting, and what it does with files it cannot read or write and with processes writing at once."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from hwgraph_cuda import cublaslt, product_cache, products


def test_the_cache_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("HWGRAPH_CACHE_DIR", str(tmp_path / "c"))
    assert product_cache.cache_path() == tmp_path / "c" / "cublaslt-products.json"
    monkeypatch.setenv("HWGRAPH_CACHE_DIR", "")
    assert product_cache.cache_path() is None
    monkeypatch.delenv("HWGRAPH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert product_cache.cache_path() == tmp_path / "xdg" / "hwgraph" / "cublaslt-products.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert product_cache.cache_path() == tmp_path / "home" / ".cache" / "hwgraph" / "cublaslt-products.json"


def test_the_cache_keeps_choices_per_setting_and_survives_bad_files(tmp_path, caplog):
    path = tmp_path / "sub" / "cublaslt-products.json"
    h200 = product_cache.ChoiceCache(path, "H200, cuBLASLt 1")
    other = product_cache.ChoiceCache(path, "H200, cuBLASLt 2")
    assert h200.get("256 x 1152 -> 1152") is None  # no file yet
    algo = cublaslt.Algo()
    algo.data[:] = [66, 20, 1, 0, 0, 0, 35, 3]
    chosen = products.Choice(algo, "algorithm 66, tile 20", 5.0, 4.0).entry()
    h200.put("256 x 1152 -> 1152", chosen)
    other.put("256 x 1152 -> 1152", products.Choice(None, None, 5.1, 5.1).entry())
    assert h200.get("256 x 1152 -> 1152") == chosen
    assert bytes(cublaslt.Algo.from_buffer_copy(bytes.fromhex(chosen["algo"]))) == bytes(algo)  # the bytes round-trip
    assert other.get("256 x 1152 -> 1152") == {"algo": None, "config": None, "aten_us": 5.1, "chosen_us": 5.1}
    assert product_cache.ChoiceCache(None, "H200").get("256 x 1152 -> 1152") is None
    product_cache.ChoiceCache(None, "H200").put("x", chosen)  # nowhere to write: nothing happens
    path.write_text("{not json")
    assert h200.get("256 x 1152 -> 1152") is None
    assert f"ignoring the measured-products cache {path}" in caplog.text
    blocked = product_cache.ChoiceCache(tmp_path / "file" / "cublaslt-products.json", "H200")
    (tmp_path / "file").write_text("a file where the folder should be")
    blocked.put("x", chosen)
    assert "could not write the measured-products cache" in caplog.text


def test_a_cache_write_that_fails_leaves_the_file_as_it_was_and_no_temporary_file(tmp_path, caplog, monkeypatch):
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    cache.put("a", entry)
    before = path.read_text()
    cache.put("b", {"algo": object()})  # JSON cannot write it
    assert "could not write the measured-products cache" in caplog.text
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == [path.name]

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    # the temporary file is written, then cannot take its place
    monkeypatch.setattr(product_cache.os, "replace", full_disk)
    caplog.clear()
    cache.put("c", entry)
    assert "No space left on device" in caplog.text
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_cache_folder_is_expanded_and_absolute_and_no_home_folder_means_no_cache(monkeypatch, tmp_path, caplog):
    """"~" was taken literally (a folder named "~" in the working directory), a relative folder moved with the working
    directory, and a process with neither $HOME nor a passwd entry raised out of ``capture()``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HWGRAPH_CACHE_DIR", "~/c")
    assert product_cache.cache_path() == tmp_path / "home" / "c" / "cublaslt-products.json"
    monkeypatch.setenv("HWGRAPH_CACHE_DIR", "rel")
    assert product_cache.cache_path() == tmp_path / "rel" / "cublaslt-products.json"
    monkeypatch.delenv("HWGRAPH_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("HOME")

    def no_entry(uid):
        raise KeyError(uid)

    monkeypatch.setattr("pwd.getpwuid", no_entry)
    assert product_cache.cache_path() is None
    assert "measured products are not cached between processes: " in caplog.text


@pytest.mark.parametrize("named", ["~nosuchuser-hwgraph/cache", "~"])
def test_a_cache_folder_naming_a_home_that_cannot_be_found_is_named_in_the_warning(monkeypatch, caplog, named):
    """The warning said "Could not determine home directory.; set HWGRAPH_CACHE_DIR" to a user who had set it: the
    value at fault was neither named nor blamed."""
    monkeypatch.setenv("HWGRAPH_CACHE_DIR", named)
    monkeypatch.delenv("HOME", raising=False)

    def no_entry(name):
        raise KeyError(name)

    monkeypatch.setattr("pwd.getpwnam", no_entry)
    monkeypatch.setattr("pwd.getpwuid", no_entry)
    assert product_cache.cache_path() is None
    assert f"HWGRAPH_CACHE_DIR={named!r} names a home folder that cannot be found" in caplog.text
    assert "; set HWGRAPH_CACHE_DIR" not in caplog.text


CACHE_WRITER = """
import sys
from pathlib import Path
from hwgraph_cuda.product_cache import ChoiceCache
cache = ChoiceCache(Path(sys.argv[1]), "H200")
for i in range(int(sys.argv[3])):
    cache.put(f"{sys.argv[2]}-{i}", {"algo": None, "config": None, "aten_us": 5.0, "chosen_us": 5.0})
"""


def test_processes_writing_the_cache_at_once_lose_no_entry(tmp_path):
    """Each write reads the file, adds its entry and replaces the file: without a lock, another process's entry
    written in between was lost (86 of 200 kept by four processes)."""
    path = tmp_path / "cublaslt-products.json"
    writers = [subprocess.Popen([sys.executable, "-c", CACHE_WRITER, str(path), str(w), "40"]) for w in range(4)]
    assert [w.wait(timeout=300) for w in writers] == [0] * 4
    assert len(json.loads(path.read_text())) == 160
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK], ids=errno.errorcode.get)
def test_a_folder_whose_file_system_takes_no_locks_still_gets_the_cache_written(tmp_path, caplog, monkeypatch, code):
    """flock fails on a file system without locks (Lustre mounted without flock: ENOSYS): every write was refused
    with a warning, so no choice was ever kept between processes. Now such a folder is written unlocked, as where
    there is no fcntl; any other failure to lock still refuses the write."""
    import fcntl

    def no_locks(fd, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    cache.put("a", entry)
    assert cache.get("a") == entry
    assert "could not write the measured-products cache" not in caplog.text

    def interrupted(fd, operation):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", interrupted)
    cache.put("b", entry)
    assert "could not write the measured-products cache" in caplog.text and cache.get("b") is None


def test_a_folder_on_nfs_locks_a_lock_file_beside_the_cache(tmp_path, caplog, monkeypatch):
    """NFS emulates flock with a byte-range lock, which is exclusive only on a descriptor open for writing: the
    folder's read-only descriptor got EBADF and every write was refused, so an NFS home folder kept no choice."""
    import fcntl

    real_flock, locked = fcntl.flock, []

    def nfs_flock(fd, operation):
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        locked.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    cache.put("a", entry)
    assert "could not write the measured-products cache" not in caplog.text
    assert cache.get("a") == entry
    assert locked == [str(tmp_path / ".cublaslt-products.json.lock")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cublaslt-products.json.lock", path.name]


def test_a_cache_file_that_cannot_be_read_is_left_alone(tmp_path, caplog, monkeypatch):
    """Replacing it dropped all its entries (another user's file in a shared folder, an I/O error)."""
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    for i in range(5):
        cache.put(f"shape {i}", entry)
    before, read_text = path.read_text(), type(path).read_text

    def denied(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", denied)
    cache.put("new", entry)
    assert "could not write the measured-products cache" in caplog.text and "cannot be read" in caplog.text
    monkeypatch.undo()
    assert path.read_text() == before


def test_the_cache_file_takes_the_umasks_mode(tmp_path):
    """It was always 0600 (``mkstemp``'s), which locked other users out of a shared cache folder."""
    old = os.umask(0o002)
    try:
        path = tmp_path / "cublaslt-products.json"
        product_cache.ChoiceCache(path, "H200").put("x", products.Choice(None, None, 5.0, 5.0).entry())
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o664


@pytest.mark.parametrize("content", ["[]", "1", '"x"', "null"])
def test_a_cache_file_that_is_not_an_object_is_ignored_and_replaced(tmp_path, caplog, content):
    path = tmp_path / "cublaslt-products.json"
    path.write_text(content)
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    assert cache.get("256 x 1152 -> 1152") is None
    assert f"ignoring the measured-products cache {path}: it holds a JSON" in caplog.text
    cache.put("256 x 1152 -> 1152", entry)
    assert cache.get("256 x 1152 -> 1152") == entry
    assert cache.entries() == {cache.key("256 x 1152 -> 1152"): entry}


def test_a_cache_entry_that_is_not_an_object_is_a_miss_and_an_entry_json_cannot_write_is_logged(tmp_path, caplog):
    path = tmp_path / "cublaslt-products.json"
    cache = product_cache.ChoiceCache(path, "H200")
    path.write_text(json.dumps({cache.key("a"): [1, 2], cache.key("b"): "x"}))
    assert cache.get("a") is None and cache.get("b") is None
    assert "ignoring the measured-products cache's entry for a" in caplog.text
    cache.put("c", {"algo": object()})  # not JSON: logged, the file left as it was
    assert "could not write the measured-products cache" in caplog.text
    assert json.loads(path.read_text()) == {cache.key("a"): [1, 2], cache.key("b"): "x"}


def test_a_cache_file_nested_deeper_than_json_reads_is_ignored_and_replaced(tmp_path, caplog):
    """json.loads raises RecursionError there, neither OSError nor ValueError: it escaped put() (and measure())."""
    path = tmp_path / "cublaslt-products.json"
    path.write_text("[" * 100_000)
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    assert cache.get("a") is None
    assert f"ignoring the measured-products cache {path}" in caplog.text
    cache.put("a", entry)
    assert cache.entries() == {cache.key("a"): entry}


def test_a_lock_file_that_cannot_be_opened_is_named_and_no_descriptor_is_closed_twice(tmp_path, caplog, monkeypatch):
    """On NFS (the folder's lock refused with EBADF) the folder's descriptor was closed before the lock file was
    opened; when that open failed (a folder others may write but not this user, a read-only mount) the clean-up
    closed the folder's descriptor number again: the warning named "Bad file descriptor" instead of the lock file's
    error, and a descriptor number another thread had been handed meanwhile would have been closed under it."""
    import fcntl

    real_open, real_close, opened, closed = os.open, os.close, [], []

    def nfs_flock(fd, operation):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def lock_file_denied(path, flags, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        fd = real_open(path, flags, *args, **kwargs)
        opened.append(fd)
        return fd

    def recorded_close(fd):
        closed.append(fd)
        return real_close(fd)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    monkeypatch.setattr(product_cache.os, "open", lock_file_denied)
    monkeypatch.setattr(product_cache.os, "close", recorded_close)
    path = tmp_path / "cublaslt-products.json"
    product_cache.ChoiceCache(path, "H200").put("a", products.Choice(None, None, 5.0, 5.0).entry())
    monkeypatch.undo()
    assert "could not write the measured-products cache" in caplog.text
    assert "Permission denied" in caplog.text and "Bad file descriptor" not in caplog.text
    assert sorted(closed) == sorted(opened)  # each descriptor closed once
    assert not path.exists()


def test_a_cache_file_removed_between_lookups_is_written_anew(tmp_path, caplog, monkeypatch):
    """The file was checked for existence, then read: removed in between (a user clearing the cache while another
    process writes), the read's FileNotFoundError counted as a file that exists but cannot be read, and the write was
    refused as if it would drop entries."""
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    cache.put("a", entry)
    read_text = type(path).read_text

    def removed_meanwhile(self, *args, **kwargs):
        if self == path and self.exists():
            self.unlink()  # after any existence check the cache made
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", removed_meanwhile)
    cache.put("b", entry)
    monkeypatch.undo()
    assert "could not write the measured-products cache" not in caplog.text
    assert cache.entries() == {cache.key("b"): entry}


def test_a_cache_folder_that_cannot_be_searched_is_logged_not_raised(tmp_path, caplog, monkeypatch):
    """``Path.exists`` raises PermissionError where the folder cannot be searched (EACCES from stat): ``entries()`` and
    ``get()`` raised, against the cache's promise that reading failures are logged, never raised."""
    path = tmp_path / "cublaslt-products.json"
    path.write_text("{}")

    def denied(real):
        def call(self, *args, **kwargs):
            if self == path:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real(self, *args, **kwargs)
        return call

    for name in ("exists", "stat", "read_text", "read_bytes", "is_file", "open"):
        monkeypatch.setattr(type(path), name, denied(getattr(type(path), name)))
    cache = product_cache.ChoiceCache(path, "H200")
    try:
        assert cache.entries() == {} and cache.get("a") is None
    finally:
        monkeypatch.undo()
    assert f"ignoring the measured-products cache {path}" in caplog.text and "Permission denied" in caplog.text


def test_a_relative_xdg_cache_home_is_ignored_as_the_xdg_specification_says(monkeypatch, tmp_path):
    """A relative $XDG_CACHE_HOME was taken against the working directory: each process started elsewhere kept its own
    cache (and made a folder there). The XDG Base Directory specification: such a path is invalid and ignored."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HWGRAPH_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert product_cache.cache_path() == tmp_path / "home" / ".cache" / "hwgraph" / "cublaslt-products.json"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert product_cache.cache_path() == tmp_path / "xdg" / "hwgraph" / "cublaslt-products.json"


def counted_parses(monkeypatch) -> list[str]:
    """Each text the cache parses as JSON, in order."""
    parsed, loads = [], json.loads

    def counting(text, *args, **kwargs):
        parsed.append(text)
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(product_cache.json, "loads", counting)
    return parsed


def test_a_lookup_of_many_shapes_parses_the_cache_file_once(tmp_path, monkeypatch):
    """Every ``get`` read and parsed the whole file again: a tower's dozens of shapes, each recalled from a file of
    every shape measured on the machine, parsed it once per shape. A file unchanged since the last read is not."""
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    path.write_text(json.dumps({cache.key(f"shape {i}"): entry for i in range(50)}))
    parsed = counted_parses(monkeypatch)
    assert all(cache.get(f"shape {i}") == entry for i in range(50))
    assert cache.get("a shape never measured") is None and len(cache.entries()) == 50
    assert len(parsed) == 1


def test_a_damaged_cache_file_is_warned_about_once_not_at_every_lookup(tmp_path, caplog, monkeypatch):
    path = tmp_path / "cublaslt-products.json"
    path.write_text("{not json")
    cache = product_cache.ChoiceCache(path, "H200")
    parsed = counted_parses(monkeypatch)
    assert all(cache.get(f"shape {i}") is None for i in range(10))
    assert len(parsed) == 1 and caplog.text.count("ignoring the measured-products cache") == 1
    cache.put("a", products.Choice(None, None, 5.0, 5.0).entry())  # a damaged file is still replaced
    assert cache.get("a") is not None


def test_a_cache_file_another_writer_replaced_or_rewrote_is_read_again(tmp_path, monkeypatch):
    """Parsed once, the file is still read again when another process has written it since: replaced (``put``'s
    atomic rename: another file), or rewritten in place to another length or time."""
    path = tmp_path / "cublaslt-products.json"
    cache, entry = product_cache.ChoiceCache(path, "H200"), products.Choice(None, None, 5.0, 5.0).entry()
    cache.put("a", entry)
    assert cache.get("a") == entry and cache.get("b") is None
    parsed = counted_parses(monkeypatch)
    # another process's put: a new file renamed over this one
    done = subprocess.run([sys.executable, "-c", CACHE_WRITER, str(path), "b", "1"], timeout=300)
    assert done.returncode == 0
    assert cache.get("b-0") == entry and cache.get("a") == entry and len(parsed) == 1
    # another instance in this process (its own parse)
    product_cache.ChoiceCache(path, "H200").put("c", entry)
    assert cache.get("c") == entry and len(parsed) == 3
    # rewritten in place, keeping the inode: another length, then the same length at another time
    path.write_text(json.dumps({cache.key("d"): entry}))
    assert cache.get("d") == entry and cache.get("a") is None
    before = path.stat()
    path.write_text(json.dumps({cache.key("e"): entry}))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == before.st_size and path.stat().st_ino == before.st_ino
    assert cache.get("e") == entry and cache.get("d") is None
    path.unlink()  # removed (a user clearing the cache): nothing cached, nothing remembered
    assert cache.get("e") is None and cache.entries() == {}


def test_a_write_reads_the_file_afresh_though_its_signature_matches_the_kept_one(tmp_path, monkeypatch):
    """With coarse file times another writer's file can match the kept (mtime, size, inode): a lookup may take the
    kept entries then, but a write must not rewrite them and drop the other writer's."""
    path = tmp_path / "cublaslt-products.json"
    mine, other = product_cache.ChoiceCache(path, "H200"), product_cache.ChoiceCache(path, "H200")
    entry = products.Choice(None, None, 5.0, 5.0).entry()
    mine.put("a", entry)
    assert mine.get("a") is not None  # kept under the file's signature now
    real_stat = os.stat
    kept = real_stat(path)

    class SameSignature:  # every later file looks like the kept one, as on a file system with coarse times
        st_mtime_ns, st_size, st_ino = kept.st_mtime_ns, kept.st_size, kept.st_ino

    monkeypatch.setattr(product_cache.os, "stat", lambda p, *a, **k: SameSignature if p == path else real_stat(p))
    other.put("b", entry)
    mine.put("c", entry)
    assert set(json.loads(path.read_text())) == {"H200 | a", "H200 | b", "H200 | c"}
