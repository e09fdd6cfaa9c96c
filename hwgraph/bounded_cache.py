"""A memoising cache bounded by entry count *and* bytes, for host tables that a long-running server rebuilds.

``functools.lru_cache`` bounds the number of entries only. The tower's metadata caches hold a few hundred bytes for
a small image but megabytes for a long video, so a server that meets many distinct image groups (a hit rate of 0)
kept 110-125 MiB of image tables, and about 600 MiB of video tables, for nothing. This cache keeps the
least-recently-used entries within both limits and does not keep a result larger than ``max_entry_bytes`` at all:
rebuilding such a table costs far less than the forward that needs it.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple


class CacheInfo(NamedTuple):
    """``lru_cache``'s fields, plus the bytes held and the byte limits."""

    hits: int
    misses: int
    maxsize: int
    currsize: int
    nbytes: int
    max_bytes: int
    max_entry_bytes: int


def bounded_cache(maxsize: int, max_bytes: int, max_entry_bytes: int, size_of: Callable[[Any], int]):
    """Decorator: memoise a function of hashable positional arguments, least-recently-used first out, holding at
    most ``maxsize`` results and ``max_bytes`` bytes (``size_of(result)``); a result over ``max_entry_bytes`` is
    returned but not kept. Thread-safe (one lock around the bookkeeping; two threads missing the same key both
    compute it, as with ``lru_cache``). The wrapper has ``cache_info()`` and ``cache_clear()``."""
    for name, value in (("maxsize", maxsize), ("max_bytes", max_bytes), ("max_entry_bytes", max_entry_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_entry_bytes > max_bytes:
        raise ValueError(f"max_entry_bytes={max_entry_bytes} exceeds max_bytes={max_bytes}: such an entry could "
                         f"never be kept")

    def decorate(fn):
        entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        lock = threading.Lock()
        counts = {"hits": 0, "misses": 0, "nbytes": 0}

        @functools.wraps(fn)
        def wrapper(*args):
            with lock:
                found = entries.get(args)
                if found is not None:
                    entries.move_to_end(args)
                    counts["hits"] += 1
                    return found[0]
                counts["misses"] += 1
            result = fn(*args)
            nbytes = size_of(result)
            if nbytes > max_entry_bytes:
                return result
            with lock:
                if args in entries:  # another thread stored it meanwhile: keep one copy
                    return entries[args][0]
                entries[args] = (result, nbytes)
                counts["nbytes"] += nbytes
                while len(entries) > maxsize or counts["nbytes"] > max_bytes:
                    _, (_, dropped) = entries.popitem(last=False)
                    counts["nbytes"] -= dropped
            return result

        def cache_info() -> CacheInfo:
            with lock:
                return CacheInfo(counts["hits"], counts["misses"], maxsize, len(entries), counts["nbytes"], max_bytes,
                                 max_entry_bytes)

        def cache_clear() -> None:
            with lock:
                entries.clear()
                counts.update(hits=0, misses=0, nbytes=0)

        wrapper.cache_info = cache_info
        wrapper.cache_clear = cache_clear
        return wrapper

    return decorate
