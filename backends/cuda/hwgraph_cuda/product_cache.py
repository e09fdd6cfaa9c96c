"""The on-disk cache of the CUDA plugin's measured product choices (``hwgraph_cuda.products``): one JSON file
(``cache_path()``) of choices by setting (GPU, cuBLASLt and torch versions) and shape, so that a later process recalls
what an earlier one measured instead of measuring it again. Writes are atomic, and locked where the file system takes
locks; what cannot be read or written is logged and costs only a measurement.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

#: ``flock``'s errors where the file system takes no locks (ENOLCK: NFS without its lock daemon).
UNLOCKABLE = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK})


def cache_path() -> Path | None:
    """Where choices persist between processes: ``$HWGRAPH_CACHE_DIR`` (set empty: nowhere), else
    ``$XDG_CACHE_HOME/hwgraph`` (if absolute: the XDG specification has a relative one ignored, as it would differ
    with each process's working directory), else ``~/.cache/hwgraph``; the file is ``cublaslt-products.json``."""
    named = os.environ.get("HWGRAPH_CACHE_DIR")
    if named == "":
        return None
    try:
        folder = named
        if folder is None:
            xdg = os.environ.get("XDG_CACHE_HOME")
            folder = Path(xdg if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "hwgraph"
        # "~" is the shell's to expand (not done in Docker's ENV, systemd units or .env files), and a relative
        # folder would move with the working directory between reads and writes
        return Path(folder).expanduser().absolute() / "cublaslt-products.json"
    except RuntimeError as exc:  # no $HOME and no passwd entry (a container's arbitrary user), or "~nosuchuser"
        if named is None:
            log.warning("measured products are not cached between processes: %s; set HWGRAPH_CACHE_DIR", exc)
        else:  # the variable is the bad value: telling the user to set it would send them in a circle
            log.warning("measured products are not cached between processes: HWGRAPH_CACHE_DIR=%r names a home "
                        "folder that cannot be found (%s); set it to a folder path without '~', or to '' for no "
                        "cache", named, exc)
        return None


class ChoiceCache:
    """Measured choices by shape and setting (GPU, cuBLASLt and torch versions), in a JSON file of their records
    (``hwgraph_cuda.products.Choice.entry``). Reading or writing failures only cost a measurement: they are logged,
    never raised."""

    def __init__(self, path: Path | None, setting: str):
        self.path, self.setting = path, setting
        # The last file read: its (st_mtime_ns, st_size, st_ino) and its entries. A lookup of each shape re-read and
        # re-parsed the whole file; one stat now tells whether another process has replaced or changed it since.
        self.parsed: tuple[tuple[int, int, int], dict] | None = None

    def key(self, label: str) -> str:
        return f"{self.setting} | {label}"

    def entries(self) -> dict:
        """The file's entries by key; {} if there is no file, or it cannot be read or is not a JSON object (logged).
        Parsed again only when the file changed since the last read (shared between calls: not to be changed)."""
        return self.read()[0]

    def read(self) -> tuple[dict, bool]:
        """``entries()``, and whether a write may replace the file: not one that exists but cannot be read (another
        user's file, an I/O error), whose entries replacing it would drop. A damaged file is replaced. (Read without a
        check for its existence first: a file removed in between, by a user clearing the cache, is none.)"""
        if self.path is None:
            return {}, True
        signature = None  # stays so where stat refuses the path itself (ValueError: a NUL in it)
        try:
            # stat before the read: what is read is then at least as new as the signature it is kept under, so a
            # file replaced in between is only parsed again at the next lookup, never taken for the older one
            stat = os.stat(self.path)
            signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if self.parsed is not None and self.parsed[0] == signature:
                return self.parsed[1], True
            entries = json.loads(self.path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # no file (or a file where a folder on its path should be)
            return {}, True
        except OSError as exc:
            log.warning("ignoring the measured-products cache %s: %s", self.path, exc)
            return {}, False
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested deeper than json can read
            log.warning("ignoring the measured-products cache %s: %s", self.path, exc)
            entries = {}
        if not isinstance(entries, dict):
            log.warning("ignoring the measured-products cache %s: it holds a JSON %s, not an object",
                        self.path, type(entries).__name__)
            entries = {}
        if signature is not None:
            self.parsed = signature, entries  # a damaged file too: warned about once, not at every lookup
        return entries, True

    @contextlib.contextmanager
    def locked(self):
        """An exclusive lock on the cache's folder for a read, add and replace: another process's ``put`` between
        this one's read and its replace would otherwise be lost (one process per GPU, parallel jobs); on NFS, which
        locks no folder exclusively, a hidden lock file beside the cache instead. Where there
        is no ``fcntl`` (Windows), or the folder's file system takes no locks (Lustre mounted without flock), no
        lock: at worst an entry written at the same moment is lost and measured again, where refusing to write
        would lose them all."""
        try:
            import fcntl
        except ImportError:
            yield
            return
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError as exc:
                    if exc.errno != errno.EBADF:
                        raise
                    # NFS emulates flock with a byte-range lock, which takes an exclusive lock only on a descriptor
                    # open for writing, and a folder cannot be opened so: every write was refused. A lock file
                    # beside the cache (left there, hidden) serves instead.
                    folder, fd = fd, None  # closed once: the clean-up below skips it if the lock file fails to open
                    os.close(folder)
                    fd = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno not in UNLOCKABLE:
                    raise
                log.debug("writing the measured-products cache %s without a lock: %s", self.path, exc)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def get(self, label: str) -> dict | None:
        entry = self.entries().get(self.key(label))
        if entry is not None and not isinstance(entry, dict):
            log.warning("ignoring the measured-products cache's entry for %s in %s: a JSON %s, not an object",
                        label, self.path, type(entry).__name__)
            return None
        return entry

    def put(self, label: str, entry: dict) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.locked():
                # read afresh: on a file system with coarse times another writer's file can match the kept signature
                # (mtime, size and a reused inode), and rewriting the kept entries would drop that writer's
                self.parsed = None
                entries, replaceable = self.read()
                if not replaceable:
                    raise OSError("it exists but cannot be read, so replacing it would drop its entries")
                # TypeError, ValueError: an entry JSON cannot write; raised here, before any file is made
                text = json.dumps(entries | {self.key(label): entry}, indent=1, sort_keys=True)
                # created with the umask's mode, as the file itself would be (mkstemp's 0600 would lock other users
                # out of a shared folder); a unique name, since the lock may be missing
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                try:
                    with os.fdopen(fd, "w") as file:
                        file.write(text)
                    os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)  # a failed write (a full disk) leaves no temporary file behind
                    raise
        except (OSError, TypeError, ValueError) as exc:
            log.warning("could not write the measured-products cache %s: %s", self.path, exc)
