"""The streams the DeepStack mergers of Qwen3-Omni towers run on beside the blocks
(``Qwen3OmniVisionTower.merge_stream``)."""

from __future__ import annotations

import threading

import torch

#: (device, thread id) -> the stream the DeepStack mergers of every tower run on in that thread there
#: (``merge_stream``). Not one per device: a stream that waits on a capturing stream joins that capture until it
#: ends, so another thread's eager forward put its mergers into the graph instead of running them (or invalidated
#: the capture). Not one per tower: cuBLAS keeps workspaces per (handle, stream) for the process (34 MiB on the
#: H200), so a stream per tower left that behind each tower made, and a tower holding a stream could not be
#: deep-copied. torch's cuBLAS handles are per thread already, so a stream per thread adds no workspaces while the
#: threads live; a new thread takes over an ended thread's stream, so threads that come and go add no streams.
MERGE_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
_merge_streams_lock = threading.Lock()  # held while a thread looks up, adds or takes over a stream


def thread_merge_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's DeepStack merger stream on ``device`` (``MERGE_STREAMS``): made on its first call, or
    taken over from a thread that has ended (whose work there is queued ahead of the new thread's)."""
    key = (device, threading.current_thread().ident)  # current_thread() also lists a thread torch or C started
    # Looked up under the lock too: thread ids are reused, so a thread that listed the live threads before this one
    # began may be taking over the stream kept under this one's id (an ended thread's): read meanwhile, both got it.
    with _merge_streams_lock:
        stream = MERGE_STREAMS.get(key)
        if stream is None:
            alive = {thread.ident for thread in threading.enumerate()}
            ended = [k for k in MERGE_STREAMS if k[0] == device and k[1] not in alive]
            stream = MERGE_STREAMS.pop(ended[0]) if ended else torch.cuda.Stream(device)
            MERGE_STREAMS[key] = stream
    return stream
