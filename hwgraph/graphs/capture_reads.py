"""Which tensors from outside itself a captured callable reads, and whether a replay would still read those.

A device graph reads, at every replay, the buffers its capture read. Where the caller replaces a tensor the callable
reads (``holder.x = torch.randn(...)``, a parameter given a new tensor or new ``.data``) instead of copying new values
into it (``copy_``), a device graph keeps reading the old buffer (stale values, or freed memory), while the CPU
reference backend's replay, which reruns the callable, read the new tensor and passed. ``captured_reads`` and
``ReadPaths`` let that replay refuse instead.

Before the capture's run, the objects the callable reaches are searched for tensors, keeping the way to each
(``holder.x``, ``tower.blocks.0.attn.qkv.weight``; ``read_ways``). The run goes under a recording that notes the
storages it reads from outside, and the views of them it read (``read_recording``: ``ReadRecorder``, under the
``force_eager`` stance). Where the recorded run fails and a run without the recording does not (torch takes other
paths under a mode), the capture goes on unchecked (``captured_reads``). Where the search stops at its bound
(``MAX_OBJECTS``) with reads left without a way, it logs how many go unchecked.

A replay follows the ways to the views read again before it reruns the callable (``ReadPaths.stale``): where every way
to one now leads elsewhere (another tensor, another view of the same storage, the same storage moved by ``resize_`` or
``share_memory_``, or ``None``), the callable would not read what a device graph reads: the captured buffer. A way
that leads nowhere (an entry or an attribute gone: a hook registered again under a new handle, a tensor made a
buffer) says nothing, as the tensor may now be read where the search does not go. As the callable may itself put the
captured tensor back before reading it (``self.table = cached(...)``, a holder that another graph's callable pointed
at its own buffer), the replay reruns it and follows the ways again, and raises ``CaptureError`` naming both, before
it writes any output, only for a read stale both times (``ReadPaths.check(before=...)``); a replay that finds nothing
stale follows the ways once.

Checking every op of every replay under such a mode would see every read, but the mode alone costs about 15 us an op
(the tiny tower's replay: 290 ops, 2.7 ms without a mode, 7 ms under one that does nothing), and dynamo runs no
compiled frame under it; following the ways costs about 110 us a replay. What the ways miss: a tensor reached
otherwise (through a class, a C++ object, an object of torch's such as a ``BlockMask``, the module of a method the
callable calls, a ``threading.local``, a ``WeakValueDictionary``, or the table a ``functools.lru_cache`` function
returns), a tensor whose every way leads nowhere (``del holder.x``), a replaced view whose old one is still reached
by another way (a second reference left unchanged), a
tensor that a higher-order op's functions read other than as its operands (a ``torch.cond`` branch's closure: its
dense kernel refuses a mode), and a replaced tensor read by a callable that then puts the captured one back itself.
And one false refusal: a way to a view equal to one the capture read (the same address and layout), where the callable
read that view otherwise (through a ``functools.lru_cache``), counts as the way to it, so replacing it is refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hwgraph.graphs import read_recording
from hwgraph.graphs.base import CaptureError
from hwgraph.graphs.read_recording import ReadRecorder, forced_eager, storage_key, tensor_facts
from hwgraph.graphs.read_ways import FOLLOW, GONE, MAX_OBJECTS, MAX_WAYS, describe, described, way_text, ways_to_tensors

log = logging.getLogger(__name__)


def captured_reads(fn: Callable) -> tuple[object, ReadPaths | None]:
    """``fn()`` under a ``ReadRecorder``: its result, and the ways from ``fn`` to the tensors it read from outside,
    searched before it runs (a tensor it reads may be one it replaces: ``state.prev = state.prev + 1``).

    Compiled code (``fn`` itself or a ``torch.compile``'d function it calls) runs eagerly here, under the
    ``force_eager`` stance (``forced_eager``), for the whole process while any capture records (other threads'
    compiled code runs eagerly meanwhile): dynamo runs no compiled frame under a dispatch mode, and the eager code
    reads the same tensors.

    Where the run fails in a way the recording may cause (``failed_for_the_recording``: in our code, in
    torch's code that runs otherwise under a mode and the eager stance, or torch refusing the recorder), ``fn`` runs
    once more, without the recording, as a capture without the check would: if that succeeds, the result comes with
    no ways (None: its replays are not checked; logged at debug); if it fails, that failure is raised. Any other error
    (the callable's own, an op's) is raised at once, as a device backend's capture fails on it: a callable that fails
    only in the capture's run is not given another."""
    ways, complete = ways_to_tensors(fn)
    recorder = ReadRecorder()
    try:
        with forced_eager(), recorder:
            out = fn()
    except Exception as exc:
        if not failed_for_the_recording(exc):
            raise
        out = fn()
        log.debug("recording the reads of %s failed where a run without it did not, so its replays are not checked "
                  "for replaced tensors", callable_name(fn), exc_info=exc)
        return out, None
    unchecked = [] if complete else [key for key in recorder.read if key not in ways]
    if unchecked:
        log.info("the search for the tensors %s reads stopped at %d objects: %d of the %d storages it read are not "
                 "checked at its replays for replaced tensors", callable_name(fn), MAX_OBJECTS, len(unchecked),
                 len(recorder.read))
    return out, ReadPaths.of(fn, ways, recorder.read, recorder.views)


#: torch's code that runs otherwise under a dispatch mode and the ``force_eager`` stance than in a plain run: a
#: higher-order op's eager path (``torch.cond``'s refuses nested operands, which its compiled path takes), dynamo
RECORDING_PATHS = tuple(os.path.join(os.path.dirname(torch.__file__), name) + os.sep
                        for name in ("_higher_order_ops", "_dynamo"))
#: our code that runs in the recorded run: the recorder's (here, only ``captured_reads``'s call of the callable, whose
#: frame is innermost where a builtin callable raises its own error)
RECORDING_FILES = (read_recording.__file__,)


def failed_for_the_recording(exc: BaseException) -> bool:
    """Whether ``exc`` may come from the recording rather than from the callable: its innermost frame is in
    ``RECORDING_FILES`` or ``RECORDING_PATHS``, or it names the recorder (torch refusing a mode names it). Not an op's
    error (raised where torch calls the op, ``torch/_ops.py``) nor one the callable's own code raises."""
    if ReadRecorder.__name__ in str(exc):
        return True
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame, tb.tb_next
    return last is not None and (last.f_code.co_filename in RECORDING_FILES
                                 or last.f_code.co_filename.startswith(RECORDING_PATHS))


@dataclass
class Read:
    """One storage the capture read from outside, the ways from the callable to it, and the tensor each led to."""

    storage: StorageWeakRef
    ways: tuple[tuple, ...]
    captured: tuple[tuple, ...]  # tensor_facts: (shape, dtype, address, strides)
    exact: bool = True  # the ways lead to views the capture read: a way leads to it where it finds that view


@dataclass
class ReadPaths:
    """The ways from a captured callable to the tensors its capture read from outside (``captured_reads``);
    ``stale()`` lists the reads a replay would find another tensor in place of, and ``check()`` raises ``CaptureError``
    for them (after a rerun: for those that were stale before it too)."""

    fn: Callable
    reads: list[Read]
    tree: dict  # the ways as a tree: step -> (subtree, [(read index, way index, storage address, the view's
    # tensor_facts or None: any view of the storage) ending here])

    @classmethod
    def of(cls, fn: Callable, ways: dict[int, list], read: dict[int, StorageWeakRef],
           views: dict[int, set]) -> ReadPaths:
        """The ways (``ways_to_tensors(fn)``) to the storages ``fn`` read (``ReadRecorder.read``): to the views of
        them it read (``ReadRecorder.views``), where any way leads to one. A way to another view of a storage read
        (``holder.ring`` where ``holder.x = holder.ring[0]`` was read) would find the storage unchanged after
        ``holder.x = holder.ring[1]``."""
        kept = []
        for key, ref in read.items():
            found = ways.get(key, [])
            to_views = [way for way in found if way[1] in views.get(key, ())]
            if found:  # no way to a view read (a view made where the search does not go): a way to the storage does
                kept.append(Read(ref, *zip(*(to_views or found)[:MAX_WAYS], strict=True), exact=bool(to_views)))
        tree: dict = {}
        for i, r in enumerate(kept):
            for j, way in enumerate(r.ways):
                node = tree
                for step in way[:-1]:
                    node = node.setdefault(plain(step), ({}, []))[0]
                node.setdefault(plain(way[-1]), ({}, []))[1].append(
                    (i, j, r.storage.cdata, r.captured[j] if r.exact else None))
        return cls(fn, kept, tree)

    def stale(self) -> dict[int, tuple[int, object]]:
        """The reads every way to which now leads elsewhere: read index -> (way index, what it leads to: another
        tensor, another view of the storage or the storage moved (``resize_``), or ``None``). A way that leads nowhere
        (an entry or an attribute gone: a hook registered again, a tensor made a buffer) says nothing: the tensor may
        be read where the search did not go. Empty where the callable would read what its capture read."""
        same = [False] * len(self.reads)  # a way still leads to the storage read
        other: dict[int, tuple[int, torch.Tensor]] = {}  # read -> (way, the other tensor it leads to)
        self._follow(self.fn, self.tree, same, other)
        return {i: found for i, found in other.items() if not same[i]}

    def check(self, before: dict[int, tuple[int, object]] | None = None) -> None:
        """Raise ``CaptureError`` where every way to a storage the capture read now leads to another tensor: the
        callable would read it, where a device graph reads the captured buffer.

        ``before``: what ``stale()`` found before a rerun of the callable; then only a read stale both before and now
        is refused, named by the tensor found before (what the rerun found there). A read the rerun made agree again is
        one the callable put back itself before reading it (``self.table = cached(...)``), as it does on a device."""
        now = self.stale()
        if before is not None:
            now = {i: before[i] for i in now if i in before}
        for i, (j, tensor) in now.items():
            r = self.reads[i]
            raise CaptureError(stale_read_message(self.fn, way_text(r.ways[j]), tensor, r.captured[j], r.storage))

    def _follow(self, obj, tree: dict, same: list, other: dict) -> None:
        for step, (subtree, ends) in tree.items():
            try:
                value = FOLLOW[step[0]](obj, step[1])
            except Exception:  # noqa: BLE001 - a way that no longer leads anywhere says nothing
                continue
            if value is GONE:
                continue
            if ends:
                # Our weak reference keeps a storage's address from being reused: the same address is the same
                # storage; and the same view of it where the tensor's own address and layout are the ones captured
                key = storage_key(value) if isinstance(value, torch.Tensor) else None
                for i, j, storage, captured in ends:
                    if key == storage and (captured is None or tensor_facts(value) == captured):
                        same[i] = True
                    elif i not in other:
                        other[i] = (j, value)
            if subtree:
                self._follow(value, subtree, same, other)


def plain(step: tuple) -> tuple:
    """A step as a replay follows it: by kind and key (the name is only for the message)."""
    return step[0], step[1]


def callable_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def stale_read_message(fn: Callable, where: str, found, captured: tuple, storage: StorageWeakRef) -> str:
    """Why a replay is refused: ``where`` (a way) now leads to ``found`` instead of the tensor ``captured`` (of
    ``storage``)."""
    name = callable_name(fn)
    alive = not storage.expired()
    since = "" if alive else ", freed since"
    view = isinstance(found, torch.Tensor) and storage_key(found) == storage.cdata  # strides tell two views apart
    if not isinstance(found, torch.Tensor):
        now = f"would find {where} now {describe(found)}"
    elif view:
        now = (f"would read {where}, now {describe(found, strides=True)}: the storage the capture read, but another "
               f"view of it or moved to another address (resize_, share_memory_)")
    else:
        now = (f"would read {where}, now {describe(found)}, which existed before the replay but was not read by the "
               f"capture")
    return (f"replay of {name} {now}: the capture read {described(captured, strides=view)} there{since}. A device "
            f"graph would read the captured buffer instead ({'stale values' if alive else 'freed memory'}). Copy new "
            f"values into the captured tensor (copy_) instead of replacing or removing it, or capture again")
